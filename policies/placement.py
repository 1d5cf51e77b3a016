"""Where a prefix lives, decided over time: requests follow their prefix's placement, and a placement changes only
when the move pays for what it costs later.

A choice made per request weighs the holder's queue against one miss for the request in hand, and so moves too
often: the move also writes the prefix into the target's cache, evicting other groups' blocks that will miss there
next; the group's later requests now find it on two replicas, each holding it less surely; and the holder's queue is
made of cache hits that drain fast. Each move makes the next likelier, and near saturation a pool that moves per
request serves no more than round robin (loadtests/bench/prefix_load.py). So:

- a request goes to its **home**: the replica of its session, else the least-queued replica holding its longest
  cached prefix (a prefix held by several replicas, a hot one, spreads over those, and only those);
- it leaves home only when home is **persistently** more queued than another replica, now and averaged over the
  last `window_s`, by more than the move costs: recomputing the uncached part there now, plus the same again for
  what it displaces (a cache under load is full, so each block written evicts one someone will miss), times
  `move_cost_factor`, plus the recompute's delay to every request the target is sent while its backlog lasts
  (near saturation a backlog lasts, and a move there costs many times its own recompute). The target then holds
  the prefix too: that is a second home, and the group's later requests
  follow it by the same rule, so a hot prefix is replicated onto as many replicas as its load needs and no more;
- a prefix no replica holds founds a new group: among the replicas that would serve it about as fast, it goes to
  those sent the fewest requests lately (`DispatchRate`), since the groups already homed on a replica keep coming
  back to it; hashing its first block picks among those, so its repeats meet.

Pure: time is passed in; each pool's PrefixAffinity (policies/replica_choice.py) owns one `QueueWindow`; the
tunables are `routing.placement` (ChoiceParams.placement_window_s, move_cost_factor).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["DispatchRate", "QueueWindow", "move_cost_s", "should_move"]


class QueueWindow:
    """Per replica, the queue wait ahead of a new request averaged over time with an exponential window of
    `window_s`: what persists, not one Poisson burst. Bounded (least recently seen go first)."""

    __slots__ = ("window_s", "max_replicas", "_state")

    def __init__(self, window_s: float, max_replicas: int = 4096) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self.max_replicas = max_replicas
        self._state: OrderedDict[str, list[float]] = OrderedDict()  # url → [last seen, wait average]

    def observe(self, replica: str, wait_s: float, now: float) -> float:
        """Take the replica's wait as seen now; returns its average (a first sight is its own average)."""
        state = self._state.get(replica)
        if state is None:
            self._state[replica] = [now, wait_s]
            if len(self._state) > self.max_replicas:
                self._state.popitem(last=False)
            return wait_s
        self._state.move_to_end(replica)
        elapsed = now - state[0]
        if elapsed > 0.0:
            state[1] = wait_s + math.exp(-elapsed / self.window_s) * (state[1] - wait_s)
            state[0] = now
        return state[1]

    def average(self, replica: str) -> float | None:
        """The wait average as last observed, or None for a replica not seen."""
        state = self._state.get(replica)
        return None if state is None else state[1]

    def forget(self, replica: str) -> None:
        self._state.pop(replica, None)

    def __len__(self) -> int:
        return len(self._state)


def move_cost_s(extra_prefill_s: float, factor: float) -> float:
    """What leaving home costs beyond this request's own longer prefill: the KV it displaces on the target, about as
    much recompute again, times `factor`."""
    return factor * max(extra_prefill_s, 0.0)


def should_move(home_wait_s: tuple[float, float], other_wait_s: tuple[float, float], extra_prefill_s: float,
                factor: float, later_requests: float = 0.0, delayed_requests: float = 0.0) -> bool:
    """Leave home for `other` only if it saves more than the move costs both now and over the window.

    `*_wait_s`: (queue wait now, its windowed average) on each replica; `extra_prefill_s`: the prefill `other` adds
    for this request (its uncached tokens beyond home's) — paid once, on top of the displacement `move_cost_s`.
    `delayed_requests`: the target's requests that will wait behind that extra prefill (those it is sent while its
    backlog lasts): each pays it too. A queue near saturation lasts, so there a move costs many times its own
    recompute, while a replica with room pays it about once.
    `later_requests`: the group's requests expected within the window after this one; the move gives the group a
    second home, so they save the wait too while the cost is paid once (a hot prefix spreads sooner than a rare one)."""
    if math.isinf(factor):
        return False
    extra = max(extra_prefill_s, 0.0)
    threshold = (extra * (1.0 + max(delayed_requests, 0.0)) + move_cost_s(extra_prefill_s, factor)) \
        / (1.0 + max(later_requests, 0.0))
    return (home_wait_s[0] - other_wait_s[0] > threshold) and (home_wait_s[1] - other_wait_s[1] > threshold)


class DispatchRate:
    """Requests per second, per key, averaged over `window_s` (each one adds 1/window_s to a value that decays as
    exp(-t/window_s)): per replica, how much traffic the prefixes homed there bring back; per prefix, how often its
    group comes. Bounded (least recently seen keys go first)."""

    __slots__ = ("window_s", "max_replicas", "_state")

    def __init__(self, window_s: float = 30.0, max_replicas: int = 4096) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self.max_replicas = max_replicas
        self._state: OrderedDict[Hashable, list[float]] = OrderedDict()  # key → [last update, rate]

    def sent(self, replica: Hashable, now: float) -> float:
        """Count one send at `now`; returns the rate with it (what `rate(replica, now)` reads next)."""
        state = self._state.get(replica)
        if state is None:
            rate = 1.0 / self.window_s
            self._state[replica] = [now, rate]
            if len(self._state) > self.max_replicas:
                self._state.popitem(last=False)
            return rate
        self._state.move_to_end(replica)
        state[1] = state[1] * math.exp(-max(now - state[0], 0.0) / self.window_s) + 1.0 / self.window_s
        state[0] = max(state[0], now)
        return state[1]

    def rate(self, replica: Hashable, now: float) -> float:
        state = self._state.get(replica)
        if state is None:
            return 0.0
        return state[1] * math.exp(-max(now - state[0], 0.0) / self.window_s)

    def least_used(self, replicas: list[str], now: float, band: float = 0.25) -> list[str]:
        """The replicas whose rate is within `band` (relative) or two sends of the lowest: interchangeable for a new
        prefix's home."""
        rates = [self.rate(r, now) for r in replicas]
        limit = min(rates) * (1.0 + band) + 2.0 / self.window_s
        return [r for r, rate in zip(replicas, rates, strict=True) if rate <= limit]

"""The multi-gateway bench's own accounting (loadtests/bench/gateways.py): never-evicting caches count a request's
leading blocks a worker has served before, a conversation's later turns extend its earlier ones, and the kill
figure counts only conversations whose last turn before the kill went through the killed gateway."""

from __future__ import annotations

from loadtests.bench.gateways import Cache, Run, Turn, block_hashes, conversation


def test_a_later_turn_hits_its_earlier_turns_blocks_on_the_same_worker_only() -> None:
    turns = conversation(3, 3, systems=2)
    first, second = block_hashes(turns[0]), block_hashes(turns[1])
    assert second[:len(first)] == first and len(second) > len(first)  # the history grows by whole turns
    cache = Cache()
    assert cache.serve("a", first) == 0
    assert cache.serve("a", second) == len(first)  # the first turn's blocks, no more
    assert cache.serve("b", second) == 0  # another worker holds none of it
    other = block_hashes(conversation(5, 1, systems=2)[0])  # same system prompt (5 % 2 == 3 % 2), other question
    shared = next(i for i, (x, y) in enumerate(zip(first, other)) if x != y)
    assert shared > 0 and cache.serve("a", other) == shared  # the system prompt's blocks


def _turn(session: int, turn: int, gateway: int, worker: str, after: bool) -> Turn:
    return Turn(session, turn, gateway, worker, 10, 5, ok=True, after_kill=after)


def test_the_kill_figure_counts_the_killed_gateways_conversations_on_their_next_turn() -> None:
    run = Run("shared", killed=0)
    run.turns = [
        _turn(1, 0, 0, "w1", False), _turn(1, 1, 2, "w1", True),  # through gateway 0, kept its worker
        _turn(2, 0, 0, "w2", False), _turn(2, 1, 3, "w9", True),  # through gateway 0, lost it
        _turn(3, 0, 1, "w3", False), _turn(3, 1, 2, "w8", True),  # another gateway's: not counted
        _turn(4, 0, 0, "w4", True),  # began after the kill: not counted
    ]
    assert run.kept_after_kill() == (1, 2)
    assert run.stayed() == 1 / 3
    assert run.hit_rate() == 0.5

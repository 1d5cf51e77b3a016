"""The stall watch (gateway/migration/) cuts a stream whose replica went silent, and only then: time the relay
spends waiting on a slow client is not the replica's silence, and one failed health probe (a busy replica's slow
/health) is no sign of a dead replica. Its check runs on a clock passed in."""

from __future__ import annotations

from typing import Any

from gateway.migration import StallWatch
from gateway.relay import Held, SseFilter
from pools.replicas import Replica


class _Response:
    """What the watch closes: the relay's read of the replica's stream."""

    closed = False

    def close(self) -> None:
        self.closed = True


def _entry(watch: StallWatch, replica: Replica, timeout: float = 10.0) -> tuple[list[Any], SseFilter, Held]:
    filt, held = SseFilter(False), Held(replica.guard(1))
    held.response = _Response()  # type: ignore[assignment]
    return [filt, held, replica, timeout, filt.events, 0.0, 0.0], filt, held


def test_a_relay_waiting_on_a_slow_client_is_not_cut_however_long() -> None:
    watch = StallWatch(probe_interval_s=1.0)
    entry, filt, held = _entry(watch, Replica(url="http://a", pool="p"), timeout=1.5)
    filt.waiting = True  # the relay is inside `send`: the client reads slowly
    for now in (1.0, 5.0, 60.0):
        watch.check(entry, now)
    assert not held.response.closed and filt.failure is None  # type: ignore[union-attr]
    filt.waiting = False  # the client took it: the silence counts from here
    watch.check(entry, 61.0)
    assert not held.response.closed  # type: ignore[union-attr]
    watch.check(entry, 62.6)
    assert held.response.closed and filt.failure == "stall"  # type: ignore[union-attr]


def test_one_failed_health_probe_cuts_nothing_two_in_a_row_do() -> None:
    replica = Replica(url="http://a", pool="p")
    watch = StallWatch(probe_interval_s=2.0)
    entry, filt, held = _entry(watch, replica)
    replica.healthy = False  # one /health probe timed out
    watch.check(entry, 1.5)
    watch.check(entry, 3.0)
    assert not held.response.closed  # type: ignore[union-attr]
    watch.check(entry, 3.6)  # unhealthy for longer than a probe interval: the next probe failed too
    assert held.response.closed and filt.failure == "stall"  # type: ignore[union-attr]


def test_a_probe_that_passes_again_restarts_the_count() -> None:
    replica = Replica(url="http://a", pool="p")
    watch = StallWatch(probe_interval_s=2.0)
    entry, _, held = _entry(watch, replica)
    replica.healthy = False
    watch.check(entry, 1.5)
    replica.healthy = True
    watch.check(entry, 2.0)
    replica.healthy = False
    watch.check(entry, 3.0)
    watch.check(entry, 4.5)
    assert not held.response.closed  # type: ignore[union-attr]


def test_an_ejected_replica_s_silent_stream_is_cut_at_once() -> None:
    replica = Replica(url="http://a", pool="p")
    replica.ejected_until = 100.0
    watch = StallWatch(probe_interval_s=2.0)
    entry, filt, held = _entry(watch, replica)
    watch.check(entry, 1.2)
    assert held.response.closed and filt.failure == "stall"  # type: ignore[union-attr]


def test_a_relay_blocked_on_a_slow_client_is_not_cut_by_the_stall_watch() -> None:
    """End to end in-process: a replica on loopback streams 6 events; the client takes 2.5 s to accept the first
    write. With a 1 s stall timeout the stream must still complete, unresumed: the relay was waiting on the client,
    not the replica."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from gateway.migration import IdFilter
    from gateway.record import RequestRecord
    from gateway.relay import StreamRelay

    event = (b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
             b'"text":" w","logprobs":null,"finish_reason":null,"token_ids":[5]}]}\n\n')

    async def replica_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(6):
            await resp.write(event)
            await asyncio.sleep(0.02)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run() -> tuple[list[str], bytes]:
        app = web.Application()
        app.router.add_post("/v1/completions", replica_stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        watch, resumed, got = StallWatch(probe_interval_s=2.0), [], []
        watch.start()
        try:
            async with aiohttp.ClientSession() as session:
                replica = Replica(url=f"http://127.0.0.1:{port}", pool="p")
                held = Held(replica.guard(1))
                held.response = await session.post(replica.url + "/v1/completions", data=b"{}")
                filt = IdFilter(False, chat=False)
                watch.add(filt, held, replica, 1.0)

                async def resume(send: Any, f: Any, failure: str) -> None:
                    resumed.append(failure)
                    await send({"type": "http.response.body", "body": b"", "more_body": False})

                async def send(message: dict[str, Any]) -> None:
                    if message["type"] == "http.response.body" and message["body"] and not any(got):
                        await asyncio.sleep(2.5)  # a slow client: the first write waits on it
                    got.append(message.get("body", b""))

                async def receive() -> dict[str, Any]:
                    await asyncio.sleep(60)
                    return {"type": "http.disconnect"}

                relay = StreamRelay(held, 200, [], RequestRecord(api="completions", stream=True, t_arrival=0.0),
                                    False, lambda record: None, filt=filt, resume=resume)
                await relay({"type": "http"}, receive, send)
        finally:
            await watch.stop()
            await runner.cleanup()
        return resumed, b"".join(got)

    resumed, body = asyncio.run(run())
    assert resumed == [] and body.count(b'"text":" w"') == 6 and body.endswith(b"data: [DONE]\n\n")

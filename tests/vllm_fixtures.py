"""Real vLLM CPU servers for the whole test session (pytest plugin, registered in tests/conftest.py).

Three servers with --max-model-len 2048, 4096 and 8192 stand in for the 32K / 128K / 1M pools. They take about two
minutes to start on two cores, so they are started ONCE per session, and as soon as collection shows that some
selected test needs them: they boot in a background thread while the tests that do not need them run.

Tests that use them are marked `@pytest.mark.vllm`. With `M3GATE_SKIP_VLLM=1` those tests are skipped; otherwise a
server that fails to start makes each such test an ERROR carrying the server's log tail, never a skip.
With `M3GATE_VLLM_URLS=http://127.0.0.1:A,http://127.0.0.1:B` the session uses servers already running (e.g. from
`make vllm-up`) instead of starting its own: quick iterations on the contract suite.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pools.vllm_local.launcher import VllmServer, kv_events_args, start_servers, stop_all
from pools.vllm_local.tiny_model import ensure_tiny_model, ensure_tiny_tokenizer

VLLM_MAX_MODEL_LENS = (2048, 4096, 8192)
# KV events on (ports in `server.ports["kv_port"]` / `["kv_replay_port"]`), hashed with sha256_cbor so that the
# gateway can recompute block hashes from /tokenize output (see the contract, section 6).
SESSION_SERVER_ARGS = (*kv_events_args(), "--prefix-caching-hash-algo", "sha256_cbor")
SKIP_ENV = "M3GATE_SKIP_VLLM"
EXTERNAL_ENV = "M3GATE_VLLM_URLS"
_FIXTURES_NEEDING_SERVERS = {"vllm_servers"}
_early_start_key = pytest.StashKey["_EarlyStart"]()


def vllm_skipped() -> bool:
    return os.environ.get(SKIP_ENV) == "1"


@dataclass(frozen=True)
class ExternalVllm:
    """A server someone else started; described by its own /v1/models card."""

    url: str
    max_model_len: int
    model_dir: Path
    ports: dict[str, int]


def external_servers(urls: str) -> list[ExternalVllm]:
    servers = []
    for url in filter(None, (u.strip().rstrip("/") for u in urls.split(","))):
        card = httpx.get(f"{url}/v1/models", timeout=10.0).raise_for_status().json()["data"][0]
        ports = {"port": int(url.rsplit(":", 1)[1])}
        sources = httpx.get(f"{url}/kv_event_sources", timeout=10.0)
        if sources.status_code == 200 and sources.json():
            rank0 = sources.json().get("0") or {}
            for name, key in (("kv_port", "endpoint"), ("kv_replay_port", "replay_endpoint")):
                if rank0.get(key):
                    ports[name] = int(str(rank0[key]).rsplit(":", 1)[1])
        servers.append(ExternalVllm(url, int(card["max_model_len"]), Path(card["root"]), ports))
    return sorted(servers, key=lambda s: s.max_model_len)


class _EarlyStart:
    """The session's servers, started in a worker thread; `servers()` waits for them and re-raises a failure."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-start")
        self._future: concurrent.futures.Future[list[VllmServer]] | None = None
        self._cancel = threading.Event()

    def begin(self) -> None:
        if self._future is None:
            self._future = self._pool.submit(self._start)

    def _start(self) -> list[VllmServer]:
        return start_servers(
            VLLM_MAX_MODEL_LENS, model_dir=ensure_tiny_model(), extra_args=SESSION_SERVER_ARGS, cancel=self._cancel
        )

    def servers(self) -> list[VllmServer]:
        self.begin()
        assert self._future is not None
        return self._future.result()

    def stop(self) -> None:
        """Stop the servers whether or not a test ever got them (also after Ctrl-C during the start)."""
        if self._future is None:
            return
        self._cancel.set()  # a start still in progress gives up (and stops its servers) instead of finishing
        try:
            servers = self._future.result()
        except BaseException:  # the start failed: start_servers already stopped what it had spawned
            servers = []
        stop_all(servers)
        self._pool.shutdown(wait=False)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_early_start_key] = _EarlyStart()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if vllm_skipped():
        skip = pytest.mark.skip(reason=f"{SKIP_ENV}=1: real vLLM servers are not started")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Boot the servers now if any selected test will ask for them, so the boot overlaps the other tests."""
    if vllm_skipped() or os.environ.get(EXTERNAL_ENV) or session.config.option.collectonly:
        return
    if any(_needs_servers(item) for item in session.items):
        session.config.stash[_early_start_key].begin()


def _needs_servers(item: pytest.Item) -> bool:
    """Asks for the fixture, or is marked `vllm` (parametrized backends reach the fixture only at run time). The
    `vllm_pd` tests start their own prefill/decode pair: booting the session's three servers beside it for nothing
    put five vLLM servers on two cores and starved the pair (and a gateway started beside it). So do the `vllm_own`
    tests, which start (and kill) their own servers."""
    return bool(_FIXTURES_NEEDING_SERVERS & set(getattr(item, "fixturenames", ()))) or (
        item.get_closest_marker("vllm") is not None and item.get_closest_marker("skip") is None
        and item.get_closest_marker("vllm_pd") is None and item.get_closest_marker("vllm_own") is None
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    early = config.stash.get(_early_start_key, None)
    if early is not None:
        early.stop()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny random-weight model (built once with the vLLM virtualenv's torch); served by `vllm_servers`."""
    if vllm_skipped():
        pytest.skip(f"{SKIP_ENV}=1: the tiny model needs the vLLM virtualenv")
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir() -> Path:
    """The tiny model's tokenizer files alone (identical bytes), built without torch: for `sim --tokenizer`."""
    return ensure_tiny_tokenizer()


@pytest.fixture(scope="session")
def vllm_servers(request: pytest.FixtureRequest) -> Iterator[list[VllmServer] | list[ExternalVllm]]:
    """Three real servers, smallest context first; each has `.url`, `.max_model_len`, `.model_dir`, `.ports`."""
    if vllm_skipped():
        pytest.skip(f"{SKIP_ENV}=1")
    if os.environ.get(EXTERNAL_ENV):
        yield external_servers(os.environ[EXTERNAL_ENV])
        return
    yield request.config.stash[_early_start_key].servers()
    # Stopped in pytest_unconfigure: a session fixture's teardown would not run if the start thread is still busy.

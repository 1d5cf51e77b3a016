"""The local vLLM launcher retries a server whose port was taken before it bound it. vLLM logs the bind error and then
~100 lines of shutdown tracebacks, so the clash must be found in the attempt's whole log, not in the tail shown."""

from __future__ import annotations

from pathlib import Path

from pools.vllm_local.processes import port_clash, tail


def test_a_bind_error_buried_under_shutdown_tracebacks_is_still_a_port_clash(tmp_path: Path) -> None:
    log = tmp_path / "vllm-2048-22023.log"
    lines = ["INFO starting"] * 50 + ["zmq.error.ZMQError: Address already in use (addr='tcp://*:22023')"]
    lines += [f"  File \"multiprocessing/process.py\", line {i}, in _bootstrap" for i in range(100)]
    log.write_text("\n".join(lines))
    assert "Address already in use" not in tail(log, 60)  # what the error message shows
    assert port_clash(log)


def test_other_failures_and_missing_logs_are_not_port_clashes(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("api_server.py: error: unrecognized arguments: --no-such-flag\n")
    assert not port_clash(log)
    assert not port_clash(tmp_path / "missing.log")

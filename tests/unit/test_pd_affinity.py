"""`spread_affinity`: the threads of a server's processes that vLLM pinned to one core get every core back."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from pools.vllm_local.pd import spread_affinity

CORES = os.sched_getaffinity(0)
# A parent and a child, each with a second thread, everything pinned to one core (as vLLM's NIXL worker pins its
# main thread); both stay up until killed.
PINNED = """
import os, subprocess, sys, threading, time
core = int(sys.argv[1])
os.sched_setaffinity(0, {core})
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
if sys.argv[2] == "parent":
    subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1], "child", ""])
time.sleep(60)
"""


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to pin to one")
def test_every_thread_of_the_tree_gets_every_core_back() -> None:
    core = min(CORES)
    proc = subprocess.Popen([sys.executable, "-c", PINNED, str(core), "parent", PINNED])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            if len(tree) == 2 and all(p.num_threads() >= 2 for p in tree):
                break
            time.sleep(0.1)
        tids = [t.id for p in tree for t in p.threads()]
        assert len(tids) >= 4
        assert all(os.sched_getaffinity(tid) == {core} for tid in tids)

        assert spread_affinity(proc.pid) == len(tids)

        assert all(os.sched_getaffinity(tid) == CORES for tid in tids)
        assert spread_affinity(proc.pid) == 0  # nothing left to move
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait()


def test_a_process_that_is_gone_moves_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert spread_affinity(proc.pid) == 0

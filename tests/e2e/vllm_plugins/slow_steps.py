"""A vLLM logits processor that only waits: each engine step takes STEP_S longer, logits untouched.

The tiny model decodes a token in about 2 ms on CPU, so a 60-token answer is out before a client that has read a
few chunks can kill its server. Loaded into the servers of tests/e2e/test_migration_real_vllm.py
(`--logits-processors slow_steps:SlowSteps`, this folder on PYTHONPATH); runs inside the vLLM virtualenv only.
Not argmax-invariant on purpose: vLLM skips argmax-invariant processors for greedy requests.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.sample.logits_processor import LogitsProcessor

STEP_S = 0.05


class SlowSteps(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        pass

    def apply(self, logits: Any) -> Any:
        time.sleep(STEP_S)
        return logits

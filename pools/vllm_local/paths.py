"""Where the local vLLM install, the tiny model and the server logs live.

All of it sits in one cache folder outside the clone (`$M3GATE_CACHE`, default `~/.cache/m3gate`) so that a
`make clean` or a fresh checkout does not throw away a 3.5 GB install or rebuild the model.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    """The cache folder; the Makefile exports the same default as `M3GATE_CACHE`."""
    configured = os.environ.get("M3GATE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "m3gate"


def vllm_python() -> Path:
    """The interpreter of the separate vLLM virtualenv made by `scripts/install-vllm.sh`."""
    return cache_dir() / "vllm-venv" / "bin" / "python"


def vllm_install_stamp() -> Path:
    """Written by the install script only after vLLM imported successfully."""
    return cache_dir() / "vllm-venv" / ".m3gate-vllm-ok"


def tiny_model_dir() -> Path:
    return cache_dir() / "tiny-minimax"


def tiny_tokenizer_dir() -> Path:
    """The same tokenizer files without weights, buildable without torch (for the simulator's --tokenizer)."""
    return cache_dir() / "tiny-minimax-tokenizer"


def log_dir() -> Path:
    return cache_dir() / "logs"

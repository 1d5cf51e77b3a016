"""Another checkout's code beside this one's, for same-run A/B benchmarks (`--against DIR`, e.g. a `git worktree`
of the commit before): the machine's noise hits both sides alike, so a small change shows.

In process, `token_counter(DIR)` loads DIR's policies/tokens.py under a private module name; its own imports
(`policies.config`, ...) resolve to this checkout, so the counters compared differ in tokens.py alone. Out of
process, a gateway started with `cwd=DIR` runs DIR's whole `gateway` package (replicas.GatewayProc)."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from policies.tokens import TokenCount


def checkout(path: str | Path) -> Path:
    """A checkout's root (it holds gateway/ and policies/), resolved; a clear error otherwise."""
    root = Path(path).resolve()
    if not (root / "policies" / "tokens.py").is_file() or not (root / "gateway").is_dir():
        raise SystemExit(f"--against {path}: not a checkout of m3gate (no policies/tokens.py, gateway/)")
    return root


def token_counter(root: Path) -> Any:
    """The TokenCounter class of the checkout at `root` (policies/tokens.py loaded under a private name)."""
    name = "m3gate_against_" + hashlib.sha1(str(root).encode()).hexdigest()[:12] + "_tokens"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, root / "policies" / "tokens.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    cls = module.TokenCounter
    if "precise" in inspect.signature(cls.measure_pieces).parameters:
        return cls

    class OnePass(cls):  # type: ignore[misc, valid-type]
        """A checkout whose counter samples once: `precise` asks nothing more of it."""

        def measure(self, text: str, precise: bool = False) -> TokenCount:
            return self.measure_pieces((text,))

        def measure_pieces(self, pieces: Any, precise: bool = False) -> TokenCount:
            count = super().measure_pieces(pieces)
            return TokenCount(count.tokens, count.exact, count.error)

    return OnePass

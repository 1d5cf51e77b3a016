"""Build a tiny random-weight model that real vLLM can serve as a stand-in for MiniMax-M3.

Why: the contract tests and the gateway tests need a real vLLM server, and nothing can be downloaded here. The
model is a 2-layer Llama (hidden 128, 2 heads, 1 KV head, head_dim 64 — the CPU attention kernel rejects smaller
heads) with seeded random weights, and a byte-level BPE tokenizer (~1k tokens) trained on text generated here.
Its chat template speaks the MiniMax-M3 conventions the gateway cares about: `<mm:think>` reasoning,
`thinking_mode`, tools and tool messages, so vLLM's `minimax_m3` parsers can be switched on.

The weights need torch and transformers, which only the vLLM virtualenv has: run
`$VLLM_PY -m pools.vllm_local.tiny_model` from the repository root, or call `ensure_tiny_model()` from anywhere
(it does that in a subprocess). The tokenizer alone needs only `tokenizers`, so `ensure_tiny_tokenizer()` builds
byte-identical tokenizer files in the gateway's own virtualenv, for the simulator's `--tokenizer`.
Importing this module needs none of them.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pools.vllm_local import paths

# Bump when anything below changes what gets written; a stale model is then rebuilt.
TINY_MODEL_VERSION = "tiny-minimax-v2"
STAMP_NAME = ".m3gate-tiny-model"
SEED = 20240601

BOS = "]~!b["
EOS = "[e~["
ROLE_START = "]~b]"
THINK_START = "<mm:think>"
THINK_END = "</mm:think>"
TOOL_NAMESPACE = "]<]minimax[>["
# Whole-token entries, as in the real M3 tokenizer: the reasoning parser looks the think tags up in the vocabulary.
SPECIAL_TOKENS = [BOS, EOS, ROLE_START]
MARKER_TOKENS = [THINK_START, THINK_END, TOOL_NAMESPACE]
BPE_VOCAB_SIZE = 1024 - len(SPECIAL_TOKENS) - len(MARKER_TOKENS)

CHAT_TEMPLATE_PATH = Path(__file__).with_name("tiny_chat_template.jinja")

_SYLLABLES = "ka ri to me lo sa nu vi de pa gor tem lin qua zo bel fin rus mon tal ver cho sti ple dra".split()
_COMMON = (
    "the of and to in is that for it as with was on be by this are or from at an which have not but all they "
    "model token request pool replica cache prefix block route stream context length thinking tool call answer "
    "user system assistant function arguments weather city json value error message result think reason"
).split()


def is_built(target: Path | None = None, *, weights: bool = True) -> bool:
    """True when `target` holds a complete model (or, without `weights`, tokenizer) of the current version."""
    stamp = (target or paths.tiny_model_dir()) / STAMP_NAME
    return stamp.is_file() and stamp.read_text().strip() == _stamp_text(weights)


def training_corpus(seed: int = SEED, lines: int = 4000) -> list[str]:
    """Deterministic text that covers words, numbers, JSON, code and the chat markup, so BPE merges look natural."""
    rng = random.Random(seed)
    invented = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    words = _COMMON + invented
    corpus: list[str] = []
    for i in range(lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 18)))
        kind = i % 6
        if kind == 0:
            corpus.append(sentence.capitalize() + ".")
        elif kind == 1:
            corpus.append(f"{ROLE_START}user\n{sentence}?{EOS}\n{ROLE_START}ai\n{THINK_START}{sentence}{THINK_END}\n")
        elif kind == 2:
            args = {rng.choice(words): rng.randint(0, 10_000), "city": rng.choice(invented)}
            corpus.append(json.dumps({"name": rng.choice(words), "arguments": args}))
        elif kind == 3:
            corpus.append(f"def {rng.choice(invented)}(x, y):\n    return x * {rng.randint(2, 99)} + y  # {sentence}")
        elif kind == 4:
            corpus.append(f'{TOOL_NAMESPACE}<invoke name="{rng.choice(invented)}">{rng.random():.4f}</invoke>')
        else:
            corpus.append(" ".join(str(rng.randint(0, 99999)) for _ in range(8)) + " " + sentence.upper())
    return corpus


def _train_tokenizer(corpus: list[str]):  # -> tokenizers.Tokenizer (imported lazily: vLLM venv only)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    # Not "special": they must survive detokenization (skip_special_tokens) so the parsers can see them in text.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    return tokenizer


def write_tokenizer(model_dir: Path) -> int:
    """Write `tokenizer.json` and `tokenizer_config.json` (with the chat template); return the vocabulary size.

    Needs only the `tokenizers` library, which both virtualenvs have, so the simulator's tests can get the very
    same tokenizer without torch (see `ensure_tiny_tokenizer`).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raw = _train_tokenizer(training_corpus())
    raw.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # a name every transformers version (and so vLLM) loads
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,  # the chat template writes BOS itself, as MiniMax's does
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE_PATH.read_text(),
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return int(raw.get_vocab_size(with_added_tokens=True))


def _write_weights(model_dir: Path, vocab_size: int, *, bos_id: int, eos_id: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,  # exactly the tokenizer's size: a sampled id must always decode
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1 << 17,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)


def build(target: Path, *, weights: bool = True) -> Path:
    """Write the tokenizer (and, with `weights`, config and weights) into `target`, atomically: built aside, renamed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=target.parent))
    try:
        vocab_size = write_tokenizer(work)
        if weights:
            vocab = json.loads((work / "tokenizer.json").read_text())
            ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
            _write_weights(work, vocab_size, bos_id=ids[BOS], eos_id=ids[EOS])
        (work / STAMP_NAME).write_text(_stamp_text(weights) + "\n")
        work.chmod(0o755)  # mkdtemp makes it private
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return target


def _stamp_text(weights: bool) -> str:
    return TINY_MODEL_VERSION if weights else TINY_MODEL_VERSION + "-tokenizer-only"


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Parallel test sessions must not build the same folder at once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_tiny_model(target: Path | None = None, *, python: Path | None = None, timeout: float = 300.0) -> Path:
    """Return the model folder, building it first (with the vLLM venv's python) when missing or stale.

    Blocking: call it from a fixture or a CLI, not from an event loop.
    """
    target = target or paths.tiny_model_dir()
    if is_built(target):
        return target
    python = python or paths.vllm_python()
    if not python.exists():
        raise FileNotFoundError(f"{python} is missing: run `make vllm-env` first")
    proc = subprocess.run(
        [str(python), "-m", "pools.vllm_local.tiny_model", "--out", str(target)],
        cwd=paths.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT), "HF_HUB_OFFLINE": "1"},
    )
    if proc.returncode != 0 or not is_built(target):
        raise RuntimeError(f"building the tiny model failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return target


def ensure_tiny_tokenizer(target: Path | None = None) -> Path:
    """The tiny model's tokenizer alone (same files), built in this process: for the simulator's `--tokenizer`.

    Works without the vLLM virtualenv (only `tokenizers` is needed). Blocking; takes about two seconds once.
    """
    target = target or paths.tiny_tokenizer_dir()
    if not is_built(target, weights=False):
        with _build_lock(target):
            if not is_built(target, weights=False):
                build(target, weights=False)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=paths.tiny_model_dir(), help="model folder (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the stamp is current")
    parser.add_argument("--tokenizer-only", action="store_true", help="no weights (needs only `tokenizers`)")
    args = parser.parse_args(argv)
    weights = not args.tokenizer_only
    with _build_lock(args.out):
        if args.force or not is_built(args.out, weights=weights):
            build(args.out, weights=weights)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

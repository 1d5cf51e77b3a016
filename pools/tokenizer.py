"""Gateway-side exact tokenization: a request's prompt token ids as the replicas compute them, then vLLM block hashes.

Precise prefix routing (pools/kv_events/, pools/exact_index.py) compares the blocks a replica says it holds with the
blocks of the request. Both must come from the same token ids, so the gateway tokenizes the prompt exactly as vLLM's
frontend does, by one of two sources (`precise.tokenizer` in the pool config):

- `local`: the model's own `tokenizer.json` and chat template, loaded offline from a model folder with the
  `tokenizers` library and jinja2. Messages are normalised and the template rendered by the same code the simulator
  uses (pools/sim/tokenizer.py), which the contract suite checks token for token against a real vLLM; tool schemas
  are first reshaped as vLLM's pydantic models dump them. The text is encoded with `encode_batch`, which releases the
  GIL (plain `encode` holds it for the whole call: a 128K-token prompt froze an event loop for 0.4 s even from a
  worker thread).
- `replica`: `POST /tokenize` with `messages` (or `prompt`) on a replica of the pool: exact by construction, for
  templates the local renderer cannot follow, at the cost of a round trip and replica CPU.

Requests whose hash vLLM mixes more into than token ids and `cache_salt` (images and other media, prompt embeddings)
get no exact hashes: they are routed approximately (policies/prefix.py). The same goes for the Responses and
Anthropic Messages APIs, whose conversion to a chat vLLM does internally.

Cost, measured on this machine with the tiny test tokenizer (a 1k-token vocabulary: ~1.2 bytes per token, so more
tokens per byte than a real one): 8K tokens ~12 ms, 128K tokens ~0.3 s, 1M tokens ~5 s to render, encode and hash.
So the text is cut at `max_chars` (at a line break, then the last, possibly split, block is dropped): routing needs
only the leading blocks, and two prompts sharing a prefix longer than the cut are cut identically.

None of it runs on the event loop. Requests up to `process_above_bytes` are hashed in the hasher's small thread
pool; larger ones in a child process, because some of the work holds the GIL however it is called: freeing a 1M-token
`Encoding` alone holds it for ~130 ms, which from a thread would stall the gateway's event loop as long.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson

from policies.vllm_hash import block_hashes
from policies.vllm_wire import tokenize_body
from pools.replica_tokenize import post_tokenize

__all__ = [
    "LocalTokenizer",
    "PromptHasher",
    "ReplicaTokenizer",
    "TokenizeSource",
    "cut_text",
    "exact_eligible",
    "vllm_tool_dicts",
]

_MEDIA_TYPES = frozenset({
    "image_url", "input_image", "image", "image_pil", "image_embeds", "video_url", "video", "input_video",
    "input_audio", "audio_url", "audio", "file", "input_file",
})  # fmt: skip


def exact_eligible(body: Mapping[str, Any], api: str) -> bool:
    """Whether vLLM's block hashes for this request depend on token ids and cache_salt only (no media, no embeds)."""
    if api == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return False
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") in _MEDIA_TYPES:
                        return False
        return True
    if api == "completions":
        return "prompt_embeds" not in body and body.get("prompt") is not None
    return False


def vllm_tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """Tool schemas as vLLM hands them to the chat template: `ChatCompletionToolsParam.model_dump()` (function fields
    in name, description, parameters order; a missing description is null; strict/defer_loading only when set)."""
    if not isinstance(tools, list) or not tools:
        return None if tools is None else []
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else {}
        function: dict[str, Any] = {
            "name": fn.get("name"), "description": fn.get("description"), "parameters": fn.get("parameters"),
        }
        defer = tool.get("defer_loading")
        for key in ("strict", "defer_loading"):
            if fn.get(key) is not None:
                function[key] = fn[key]
        if defer is not None and function.get("defer_loading") is None:
            function["defer_loading"] = defer
        out.append({"type": tool.get("type", "function"), "function": function, "defer_loading": defer})
    return out


def cut_text(text: str, max_chars: int | None) -> tuple[str, bool]:
    """`text`, or its head up to the last line break before `max_chars` (True when cut).

    BPE never merges across the pre-tokenizer's word boundaries, so tokens of the head equal the full text's tokens
    except near the cut; the caller drops the last block of a cut prompt to stay clear of it."""
    if max_chars is None or len(text) <= max_chars:
        return text, False
    cut = text.rfind("\n", 0, max_chars)
    return text[: cut if cut > max_chars // 2 else max_chars], True


class TokenizeSource(Protocol):
    """Where token ids come from; `None` means "cannot say exactly" (route approximately)."""

    async def token_ids(self, body: dict[str, Any], api: str, replica_url: str | None) -> tuple[list[int], bool] | None:
        """(token ids, whether the prompt was cut short) for a chat or completions body."""
        ...


class LocalTokenizer:
    """The model folder's tokenizer.json + chat template, used offline (no hub access, no torch)."""

    def __init__(self, model_dir: str | Path, max_chars: int | None = None) -> None:
        from tokenizers import Tokenizer

        from pools.sim.tokenizer import HFTokenizer

        path = Path(model_dir)
        self.model_dir = path
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path}/tokenizer.json not found: precise.model_dir must be the model folder")
        self._renderer = HFTokenizer(path)  # chat template + vLLM's message normalisation, checked against vLLM
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.max_chars = max_chars

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; encode_batch releases the GIL, so other threads (the event loop) keep running."""
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def render_chat(self, body: Mapping[str, Any]) -> str | None:
        """The prompt text vLLM's chat endpoint would tokenize, or None when the template cannot render it."""
        from pools.sim.tokenizer import ChatFormatError, normalize_messages

        try:
            chat = normalize_messages(  # as vLLM's chat endpoint: `reasoning_content` read as `reasoning`
                body.get("messages") or [], openai_parts=getattr(self._renderer, "content_format", "") == "openai",
                reasoning_alias=True,
            )
            add_generation_prompt = body.get("add_generation_prompt", True) is not False
            continue_final_message = body.get("continue_final_message") is True
            if chat.media or not chat.messages or (add_generation_prompt and continue_final_message):
                return None  # media hash into blocks; the others are refused by vLLM anyway
            kwargs = body.get("chat_template_kwargs")
            return self._renderer.render_chat(
                chat.messages,
                tools=vllm_tool_dicts(body.get("tools")),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=dict(kwargs) if isinstance(kwargs, dict) else {},
            )
        except (ChatFormatError, TypeError, ValueError, AttributeError):
            return None

    def token_ids_sync(self, body: Mapping[str, Any], api: str) -> tuple[list[int], bool] | None:
        """Blocking: render and encode (call from a worker thread)."""
        if api == "chat":
            text = self.render_chat(body)
            if text is None:
                return None
            text, cut = cut_text(text, self.max_chars)
            return self.encode(text, body.get("add_special_tokens") is True), cut
        if api == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, str):
                text, cut = cut_text(prompt, self.max_chars)
                return self.encode(text, body.get("add_special_tokens", True) is not False), cut
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return list(prompt), False
        return None

    async def token_ids(self, body: dict[str, Any], api: str, replica_url: str | None) -> tuple[list[int], bool] | None:
        return await asyncio.to_thread(self.token_ids_sync, body, api)


class ReplicaTokenizer:
    """`POST {replica}/tokenize`: the replica renders and tokenizes (exact, one round trip, replica CPU)."""

    def __init__(
        self, session: aiohttp.ClientSession, model: str, headers: Mapping[str, str] | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self._session = session
        self._model = model
        self._headers = dict(headers or {})
        self._timeout_s = timeout_s

    @staticmethod
    def payload(body: Mapping[str, Any], api: str, model: str) -> dict[str, Any] | None:
        """The /tokenize body that renders exactly what the generate request will (policies/vllm_wire.py)."""
        return tokenize_body(body, api, model)

    async def token_ids(self, body: dict[str, Any], api: str, replica_url: str | None) -> tuple[list[int], bool] | None:
        payload = self.payload(body, api, self._model)
        if payload is None or replica_url is None:
            return None
        answer = await post_tokenize(self._session, replica_url, orjson.dumps(payload), self._headers, self._timeout_s)
        tokens = answer.tokens()
        return (tokens, False) if tokens is not None else None


@dataclass(frozen=True, slots=True)
class HashSettings:
    """How the pool's replicas hash blocks (their --block-size, --prefix-caching-hash-algo, PYTHONHASHSEED)."""

    block_size: int = 128
    algo: str = "sha256_cbor"
    seed: str | None = None


_child_tokenizers: dict[tuple[str, int | None], LocalTokenizer] = {}
"""Only ever filled inside PromptHasher's worker process (ProcessPoolExecutor initializers keep state this way)."""


def _child_init(model_dir: str, max_chars: int | None) -> None:
    _child_tokenizers[(model_dir, max_chars)] = LocalTokenizer(model_dir, max_chars)


def _child_hash(
    model_dir: str, max_chars: int | None, settings: HashSettings, payload: bytes, api: str
) -> tuple[tuple[int, ...], bool] | None:
    """In the worker process: (hashes, cut) for a request body, or None."""
    tokenizer = _child_tokenizers.get((model_dir, max_chars)) or LocalTokenizer(model_dir, max_chars)
    body = orjson.loads(payload)
    if not isinstance(body, dict) or not exact_eligible(body, api):
        return None
    result = tokenizer.token_ids_sync(body, api)
    if result is None:
        return None
    ids, cut = result
    salt = body.get("cache_salt")
    hashes = block_hashes(ids, settings.block_size, algo=settings.algo, seed=settings.seed,
                          cache_salt=salt if isinstance(salt, str) and salt else None)
    return (hashes[:-1] if cut else hashes), cut


class PromptHasher:
    """Request body → the vLLM block hashes its replicas will publish, off the event loop.

    Owns a small thread pool (bounded: tokenizing long prompts is CPU work that must not crowd out the event loop's
    own thread) and, for local tokenizing of bodies over `process_above_bytes`, one worker process (started on first
    use); `close()` shuts both down."""

    def __init__(
        self, source: TokenizeSource, settings: HashSettings, threads: int = 2,
        process_above_bytes: int | None = 64 * 1024,
    ) -> None:
        self.source = source
        self.settings = settings
        self.process_above_bytes = process_above_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="m3gate-hash")
        self._process: concurrent.futures.ProcessPoolExecutor | None = None
        self.computed = 0  # requests hashed
        self.skipped = 0  # requests routed approximately (media, other APIs, tokenizer failure)
        self.cut = 0  # prompts longer than max_chars, hashed on their head only

    def _hash(self, ids: Sequence[int], cut: bool, cache_salt: Any) -> tuple[int, ...]:
        s = self.settings
        salt = cache_salt if isinstance(cache_salt, str) and cache_salt else None
        hashes = block_hashes(ids, s.block_size, algo=s.algo, seed=s.seed, cache_salt=salt)
        return hashes[:-1] if cut else hashes

    def _local(self, payload: bytes | dict[str, Any], api: str) -> tuple[int, ...] | None:
        body = orjson.loads(payload) if isinstance(payload, bytes) else payload
        if not isinstance(body, dict) or not exact_eligible(body, api):
            return None
        assert isinstance(self.source, LocalTokenizer)
        result = self.source.token_ids_sync(body, api)
        if result is None:
            return None
        if result[1]:
            self.cut += 1
        return self._hash(result[0], result[1], body.get("cache_salt"))

    def _worker(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._process is None:
            import multiprocessing

            assert isinstance(self.source, LocalTokenizer)
            self._process = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_child_init,
                initargs=(str(self.source.model_dir), self.source.max_chars),
            )
        return self._process

    async def _in_process(self, payload: bytes, api: str) -> tuple[int, ...] | None:
        assert isinstance(self.source, LocalTokenizer)
        got = await asyncio.get_running_loop().run_in_executor(
            self._worker(), _child_hash, str(self.source.model_dir), self.source.max_chars, self.settings, payload,
            api,
        )
        if got is None:
            return None
        if got[1]:
            self.cut += 1
        return got[0]

    async def hashes(
        self, payload: bytes | dict[str, Any], api: str, replica_url: str | None = None
    ) -> tuple[int, ...]:
        """The request's exact block hashes, () when it must be routed approximately. Never raises on odd input."""
        loop = asyncio.get_running_loop()
        try:
            big = self.process_above_bytes is not None and isinstance(payload, bytes) and \
                len(payload) > self.process_above_bytes
            if isinstance(self.source, LocalTokenizer) and big:
                assert isinstance(payload, bytes)
                result = await self._in_process(payload, api)
            elif isinstance(self.source, LocalTokenizer):
                result = await loop.run_in_executor(self._pool, self._local, payload, api)
            else:
                body = orjson.loads(payload) if isinstance(payload, bytes) else payload
                if not isinstance(body, dict) or not exact_eligible(body, api):
                    result = None
                else:
                    got = await self.source.token_ids(body, api, replica_url)
                    result = None if got is None else await loop.run_in_executor(
                        self._pool, self._hash, got[0], got[1], body.get("cache_salt")
                    )
        except Exception:  # noqa: BLE001 - exact hashes are an optimisation: routing falls back to approximate
            result = None
        if result is None:
            self.skipped += 1
            return ()
        self.computed += 1
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._process is not None:
            self._process.shutdown(wait=False, cancel_futures=True)
            self._process = None

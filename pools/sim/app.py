"""The simulated replica's HTTP surface: vLLM 0.32's routes, checks and errors, plus the `/sim/*` admin API.

`SimApp` owns everything one replica has (tokenizer, engine, metrics, faults, counters) and is itself the ASGI
callable, so several replicas can live in one process and nothing is global. Handlers validate and tokenize like
vLLM's frontend, hand a `SimRequest` to the engine, and answer through `GenerationResponse`, which follows the
engine token by token and aborts the request when the client goes away.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
import xxhash
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pools.sim import structured
from pools.sim.behaviour import check_tools, find_answer, plan_inputs, plan_output, tools_in_prompt
from pools.sim.disagg import NixlConnector
from pools.sim.engine import Engine, EngineBusy, RequestGroup, SimRequest
from pools.sim.faults import FaultUpdate, Faults
from pools.sim.metrics import CONTENT_TYPE, SimMetrics, cache_config_labels
from pools.sim.kv_events import SimEventPublisher, parse_kv_events_config, vllm_hashes
from pools.sim.tracing import TRACEPARENT, SimTracer, parse_traceparent
from pools.sim.prefix_cache import block_hashes
from pools.sim.protocol import (
    JSON,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    MessagesRequest,
    ResponsesRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    bad_request,
    check_sampling,
    not_found_model,
    parse_json,
    precheck_chat,
    precheck_completion,
    precheck_tokenize_chat,
    unsupported_media_type,
    validate,
    vllm_validation_error,
)
from pools.sim.settings import VLLM_VERSION, SimSettings
from pools.sim.shapes import (
    GENERATION_ERROR_MESSAGE,
    ChatShape,
    Choice,
    CompletionShape,
    Generation,
    MessagesShape,
    ResponsesShape,
    wait_finished,
)
from pools.sim.tokenizer import (
    ChatFormatError,
    ByteChunkTokenizer,
    IdTokens,
    MediaItem,
    Tokens,
    load_tokenizer,
    normalize_messages,
    placeholder_text,
)

AUTH_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


class Hang(Exception):
    """The `hang` fault: the request is accepted and will never be answered."""


class DropConnection(Exception):
    """Raised inside the ASGI call to make uvicorn close the TCP connection mid-response (fault injection)."""


class QuietDrops(logging.Filter):
    """Keeps uvicorn from logging a traceback for every deliberately cut connection."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], DropConnection))


class ListenerControl(Protocol):
    """Stops and restarts accepting TCP connections (the server layer implements it)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


@dataclass
class HttpCounters:
    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    bad_requests: int = 0
    injected_errors: int = 0
    dropped: int = 0
    hung: int = 0


@dataclass
class Prompt:
    tokens: Tokens
    hashes: list[int]
    fingerprint: int
    text_prompt: bool = True  # False when the client sent token ids (exact over-length message)

    def greedy(self) -> None:
        """Temperature 0: the answer is a function of the token ids (not the text), as a greedy model's is, so a
        text prompt and the same prompt sent as ids get the same answer."""
        self.fingerprint = ids_fingerprint(self.tokens.ids())


def ids_fingerprint(ids: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(array("q", ids).tobytes())


def _greedy(temperature: float | None) -> bool:
    return temperature is not None and temperature < 1e-5  # vLLM's _SAMPLING_EPS


class SimApp:
    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.tokenizer = load_tokenizer(settings.tokenizer_dir)
        self.served_name = settings.model_names[0]
        cache_labels = cache_config_labels(
            block_size=settings.block_size, num_gpu_blocks=settings.kv_blocks,
            enable_prefix_caching=settings.enable_prefix_caching,
            hash_algo=settings.prefix_caching_hash_algo or "sha256", max_model_len=settings.max_model_len)
        self.metrics = SimMetrics(self.served_name, settings.max_model_len, cache_labels,
                                  kv_connector=settings.kv_transfer.enabled)
        self.kv_events = _event_publisher(settings)  # None unless --kv-events-config turns events on
        self.tracer = SimTracer(settings.otlp_traces_endpoint) if settings.otlp_traces_endpoint else None
        self.engine = Engine(num_blocks=settings.kv_blocks, block_size=settings.block_size,
                             max_num_seqs=settings.max_num_seqs,
                             max_num_batched_tokens=settings.max_num_batched_tokens, cost=settings.cost,
                             metrics=self.metrics, enable_prefix_caching=settings.enable_prefix_caching,
                             max_num_queued_reqs=settings.max_num_queued_reqs,
                             max_num_queued_tokens=settings.max_num_queued_tokens, cache_sink=self.kv_events,
                             finish_sink=self.tracer.finished if self.tracer is not None else None)
        # --role prefill/decode: vLLM's NixlConnector (disagg.py); --role both: no connector, params ignored
        self.kv_connector = NixlConnector(settings, self.engine, self.metrics) if settings.kv_transfer.enabled else None
        self.engine.connector = self.kv_connector
        self.engine.recompute_load_failures = settings.kv_transfer.load_failure_policy == "recompute"
        self.faults = Faults(settings.faults, settings.seed)
        self.http = HttpCounters()
        self._mm_seen: collections.OrderedDict[str, None] = collections.OrderedDict()  # vLLM's mm processor cache
        self.listener: ListenerControl | None = None
        self._resume_timer: asyncio.TimerHandle | None = None
        self.started_at = int(time.time())
        self.fingerprint = f"vllm-{VLLM_VERSION}-" + xxhash.xxh32_hexdigest(settings.model.encode())
        self._router = Starlette(routes=self._routes(), lifespan=self._lifespan)
        self._router.add_exception_handler(404, _not_found)
        self._router.add_exception_handler(405, _method_not_allowed)

    # ---- ASGI ------------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            if self.tracer is not None:
                TRACEPARENT.set(next((v.decode("latin-1") for k, v in scope["headers"] if k == b"traceparent"), None))
            if not path.startswith("/sim/"):
                self.http.requests[path] += 1
            key = self.settings.api_key
            if key and path.startswith(AUTH_PREFIXES) and scope["method"] != "OPTIONS":
                auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
                if auth != b"Bearer " + key.encode():
                    await Response(b'{"error":"Unauthorized"}', 401, media_type=JSON)(scope, receive, send)
                    return
        await self._router(scope, receive, send)

    def _routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self._guarded(self.chat), methods=["POST"]),
            Route("/v1/completions", self._guarded(self.completions), methods=["POST"]),
            Route("/v1/responses", self._guarded(self.responses), methods=["POST"]),
            Route("/v1/messages", self._guarded(self.messages), methods=["POST"]),
            Route("/v1/models", self._guarded(self.models), methods=["GET"]),
            Route("/tokenize", self._guarded(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._guarded(self.detokenize), methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.health, methods=["GET", "POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/load", self.load, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
            Route("/kv_event_sources", self.kv_event_sources, methods=["GET"]),
            Route("/sim/faults", self.faults_route, methods=["GET", "POST"]),
            Route("/sim/stats", self.stats_route, methods=["GET"]),
            Route("/sim/reset", self.reset_route, methods=["POST"]),
            *(self.kv_connector.routes() if self.kv_connector is not None else ()),
        ]

    def _guarded(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except Hang:
                return HangResponse()
            except ApiError as exc:
                if self.kv_connector is not None:  # refused before the engine: the prefill side may free
                    self.kv_connector.rejected(getattr(request.state, "kv_transfer_params", None))
                if exc.status < 500:
                    self.http.bad_requests += 1
                if request.url.path == "/v1/messages":
                    return _anthropic_error(exc)
                return exc.response()

        return run

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.kv_events is not None:
            await self.kv_events.start()
        if self.tracer is not None:
            await self.tracer.start()
        self.engine.start()
        try:
            yield
        finally:
            await self.engine.stop()
            if self.kv_connector is not None:
                await self.kv_connector.stop()
            if self.tracer is not None:
                await self.tracer.stop()
            if self.kv_events is not None:
                await self.kv_events.stop()

    # ---- shared request handling -----------------------------------------------------------------------------

    async def _json(self, request: Request) -> Any:
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != JSON:
            raise unsupported_media_type()
        return parse_json(await request.body())

    def _check_model(self, name: str | None) -> str:
        if name is None:
            return self.served_name
        if name not in self.settings.model_names:
            raise not_found_model(name, self.settings.model_names)
        return name

    def _check_media(self, media: list[MediaItem]) -> None:
        if not media:
            return
        if not self.settings.multimodal:
            raise bad_request(f"{self.settings.model} is not a multimodal model")
        for kind in ("image", "video", "audio"):
            count = sum(1 for m in media if m.kind == kind)
            if count and kind not in self.settings.modalities:
                raise bad_request(f"At most 0 {kind}(s) may be provided in one prompt.")

    def _media_tokens(self, kind: str) -> int:
        return self.settings.video_tokens if kind == "video" else self.settings.image_tokens

    async def _prepare(self, text: str, *, add_special_tokens: bool, salt: str | None) -> Prompt:
        self._check_chars(text)

        def work() -> Prompt:
            tokens = self.tokenizer.encode(text, add_special_tokens)
            return Prompt(tokens, self._block_hashes(tokens, salt),
                          xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass")))

        if self.tokenizer.expensive(text):
            return await asyncio.to_thread(work)
        return work()

    def _prepare_ids(self, ids: list[int], salt: str | None) -> Prompt:
        tokens = IdTokens(ids)
        return Prompt(tokens, self._block_hashes(tokens, salt),
                      xxhash.xxh3_64_intdigest(tokens.span_bytes(0, len(ids))), text_prompt=False)

    def _block_hashes(self, tokens: Tokens, salt: str | None) -> list[int]:
        """vLLM's own hashes with --prefix-caching-hash-algo (what KV events publish), else the fast internal one."""
        algo = self.settings.prefix_caching_hash_algo
        if algo:
            hashes = vllm_hashes(tokens, self.settings.block_size, salt, algo, self.settings.hash_seed)
            if self.kv_events is not None:
                self.kv_events.remember_tokens(hashes, tokens)
            return hashes
        return block_hashes(tokens, self.settings.block_size, salt)

    def _render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     add_generation_prompt: bool, continue_final_message: bool,
                     template_kwargs: dict[str, Any], *, reasoning_alias: bool = False,
                     media_out: list[MediaItem] | None = None) -> str:
        """vLLM's chat rendering: messages parsed (media checked), then transformers' apply_chat_template checks
        and the template. `reasoning_alias`: the chat-completions request reads `reasoning_content` as
        `reasoning`; `media_out` collects the media items."""
        try:
            chat = normalize_messages(messages, openai_parts=self.tokenizer.content_format == "openai",
                                      placeholder=lambda m: placeholder_text(m, self._media_tokens(m.kind)),
                                      reasoning_alias=reasoning_alias)
        except ChatFormatError as exc:
            raise bad_request(str(exc)) from None
        self._check_media(chat.media)
        if media_out is not None:
            media_out.extend(chat.media)
            self._count_mm_cache(chat.media)
        if not chat.messages:
            raise bad_request("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
                "when you want the model to continue the final message, and add_generation_prompt when you want to "
                "add a header that will prompt it to start a new assistant message instead.")
        try:
            return self.tokenizer.render_chat(chat.messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                              continue_final_message=continue_final_message,
                                              template_kwargs=template_kwargs)
        except ChatFormatError as exc:
            raise bad_request(str(exc)) from None

    def _count_mm_cache(self, media: list[MediaItem]) -> None:
        """vllm:mm_cache_queries/hits: each media item of a generate request is looked up by its content."""
        if not media:
            return
        hits = 0
        for item in media:
            key = f"{item.kind}:{item.key}"
            if key in self._mm_seen:
                hits += 1
                self._mm_seen.move_to_end(key)
            else:
                self._mm_seen[key] = None
                if len(self._mm_seen) > 4096:
                    self._mm_seen.popitem(last=False)
        self.metrics.mm_cache_queries.inc(len(media))
        self.metrics.mm_cache_hits.inc(hits)

    def _check_chars(self, text: str) -> None:
        """vLLM's pre-tokenization check: more characters than max_model_len x the longest vocabulary entry cannot
        fit, whatever the tokenizer would say."""
        limit = self.settings.max_model_len
        bound = limit * self.tokenizer.max_chars_per_token
        if len(text) > bound:
            raise vllm_validation_error(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains {len(text)} "
                f"characters (more than {bound} characters, which is the upper bound for {limit} input tokens). "
                f"Please reduce the length of the input prompt.", "input_text", len(text))

    def _check_prompt(self, prompt: Prompt) -> int:
        n = prompt.tokens.count
        limit = self.settings.max_model_len
        if n == 0:
            raise bad_request("The decoder prompt cannot be empty")
        if n > limit:
            # Text is tokenized with truncation at max+1, so its count reads "at least max+1"; token ids are counted
            # exactly, and vLLM says "at least" whenever the count is max+1.
            shown = n if not prompt.text_prompt else limit + 1
            prefix = "at least " if shown == limit + 1 else ""
            raise vllm_validation_error(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains {prefix}"
                f"{shown} input tokens, which exceeds this limit even without any output tokens. Please reduce the "
                f"length of the input prompt.", "input_tokens", shown)
        return n

    def _check_max_tokens(self, requested: int | None, field_name: str) -> None:
        """TokenizeParams' check, before the prompt is rendered: no request may ask for more than max_model_len."""
        limit = self.settings.max_model_len
        if requested is not None and requested > limit:
            raise vllm_validation_error(f"{field_name}={requested} cannot be greater than max_model_len={limit}. "
                                        f"Please request fewer output tokens.", field_name, requested)

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """vLLM's get_max_tokens: what was asked for, clamped to what fits (may be < 1; SamplingParams refuses)."""
        fits = self.settings.max_model_len - prompt_len
        return fits if requested is None else min(requested, fits)

    def _check_output_budget(self, max_tokens: int) -> None:
        """SamplingParams' max_tokens check for the APIs without the other sampling checks."""
        if max_tokens < 1:
            raise vllm_validation_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)

    async def _pre_generate(self) -> None:
        """Faults that strike before any work: added latency, hangs, injected 500s."""
        if self.engine.draining:
            raise shutting_down()
        faults = self.faults.current
        if faults.added_latency_ms > 0:
            await asyncio.sleep(faults.added_latency_ms / 1000)
        if faults.hang:
            self.http.hung += 1
            raise Hang()
        if self.faults.should_error():
            self.http.injected_errors += 1
            raise ApiError(500, "Internal server error: the engine failed while processing the request (simulated "
                                "fault).", "InternalServerError")

    def _response_id(self, request: Request, body_id: str | None, prefix: str) -> str:
        return prefix + (request.headers.get("x-request-id") or body_id or uuid.uuid4().hex)

    def _kv_params(self, request: Request, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """The request's kv_transfer_params when a connector acts on them (vLLM ignores them without one).
        Kept on the request so a refusal before the engine can still free the prefill side's blocks."""
        if self.kv_connector is None or not params:
            return None
        params.pop("prompt_token_ids", None)  # forwarded ids for skipping tokenization; the sim tokenizes anyway
        request.state.kv_transfer_params = params
        return params

    def _generation(self, *, arrival: float, response_id: str, model: str, prompt: Prompt, max_tokens: int,
                    stream: bool, plan_kwargs: dict[str, Any], n: int = 1,
                    kv_transfer: dict[str, Any] | None = None, offset: int = 0, fingerprint: int | None = None,
                    **fields: Any) -> Generation:
        """Plan and submit the request's `n` samples. Like vLLM's parallel sampling, each is its own engine request
        (`{i}_{id}` when n > 1); they share one wake-up event so a stream follows all of them."""
        s = self.settings
        wake = asyncio.Event()
        group = RequestGroup(n=n, remaining=n) if n > 1 else None
        choices: list[Choice] = []
        for i in range(n):
            base = prompt.fingerprint if fingerprint is None else fingerprint
            sample = base if i == 0 else xxhash.xxh3_64_intdigest(f"{base}:{i}".encode())
            plan = plan_output(seed=s.seed, fingerprint=sample, max_tokens=max_tokens + offset,
                               mean_output_tokens=s.mean_output_tokens, tool_call_probability=s.tool_call_probability,
                               adaptive_thinking_probability=s.adaptive_thinking_probability, **plan_kwargs)
            sim = SimRequest(request_id=response_id if n == 1 else f"{i}_{response_id}",
                             prompt_tokens=prompt.tokens.count, block_hashes=prompt.hashes,
                             output_tokens=max(1, plan.total_tokens - offset), natural_finish=plan.engine_finish,
                             max_tokens=max_tokens,
                             arrival=arrival, group=group, wake=wake,
                             trace_parent=parse_traceparent(TRACEPARENT.get()) if self.tracer is not None else None)
            if self.kv_connector is not None:
                self.kv_connector.configure(sim, kv_transfer)
            try:
                self.engine.submit(sim)
            except EngineBusy as exc:
                for submitted in choices:
                    self.engine.abort(submitted.sim)
                raise ApiError(503, str(exc), "Service Unavailable") from None
            choices.append(Choice(i, sim, plan, offset))
        return Generation(response_id=response_id, created=int(time.time()), model=model, choices=choices,
                          system_fingerprint=self.fingerprint, stream=stream, **fields)

    def _continuation(self, prompt: Prompt, min_tokens: int,
                      tools_given: Any = None) -> tuple[int, int, dict[str, Any]] | None:
        """A greedy token-id prompt that ends in tokens this model generated (a stream resumed elsewhere): (how
        many, the fingerprint of the prompt they answered, the plan inputs of that answer). The plan inputs are
        read from the answer's first token and from the prompt itself (its tools), as a model reads its context.
        The built-in tokenizer can only read ids of text this replica has tokenized, so the request's own `tools`
        field, which vLLM ignores on /v1/completions, stands in for them when given."""
        ids = prompt.tokens.ids()
        found = find_answer(ids)
        if found is None:
            return None
        start, flags = found
        origin = ids[:start]
        tools = None
        if flags >> 3 & 1:
            given = tools_given if isinstance(tools_given, list) and all(isinstance(t, dict) for t in tools_given) \
                else None
            tools = given or tools_in_prompt(self.tokenizer.decode(origin))
        done = len(ids) - start
        return done, ids_fingerprint(origin), {**plan_inputs(flags, tools), "min_tokens": min_tokens + done}

    @staticmethod
    def _token_ids(wanted: bool | None, prompt: Prompt) -> dict[str, Any]:
        return {"return_token_ids": True, "prompt_ids": prompt.tokens.ids()} if wanted else {}

    def _respond(self, gen: Generation, shape: Any, request: Request) -> Response:
        """The generation's response, cut after some chunks when the faults say so, or when the request's own
        `x-sim-drop-after-chunks` header does (a test cutting one stream at an exact event)."""
        fixed = self.faults.current.drop_after_chunks
        drop_after = (2 + (gen.sim.prompt_tokens % 3) if fixed is None else fixed) if self.faults.should_drop() else None
        asked = request.headers.get("x-sim-drop-after-chunks")
        if asked is not None and asked.isdigit():
            drop_after = int(asked)
        return GenerationResponse(self, gen, shape, drop_after)

    # ---- generate routes -------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        arrival = self.engine.clock()  # vLLM's arrival time: before parsing and tokenizing
        body = await self._json(request)
        await self._pre_generate()
        precheck_chat(body)
        req: ChatCompletionRequest = validate(ChatCompletionRequest, body)
        structured.check_params(req.structured_outputs)
        kv_transfer = self._kv_params(request, req.kv_transfer_params)
        check_tools(req.tools)  # vLLM's model validation refuses such a tool, whatever tool_choice, before the model
        model = self._check_model(req.model)
        use_mct = req.max_completion_tokens is not None
        requested = req.max_completion_tokens if use_mct else req.max_tokens
        self._check_max_tokens(requested, "max_completion_tokens" if use_mct else "max_tokens")
        kwargs = dict(req.chat_template_kwargs or {})
        media: list[MediaItem] = []
        text = self._render_chat(req.messages, req.tools, req.add_generation_prompt, req.continue_final_message,
                                 kwargs, reasoning_alias=True, media_out=media)
        prompt = await self._prepare(text, add_special_tokens=False, salt=req.cache_salt)
        n = self._check_prompt(prompt)
        max_tokens = self._max_tokens(n, requested)
        constraint = structured.from_request(req.structured_outputs, req.response_format)
        check_sampling(req, max_tokens, vocab_size=self.tokenizer.vocab_size)
        structured.validate(constraint)
        tools = req.tools if req.tool_choice != "none" else None
        if _greedy(req.temperature):
            prompt.greedy()
            if req.tools and isinstance(self.tokenizer, ByteChunkTokenizer):
                self.tokenizer.learn(prompt.tokens)  # so a continuation sent here as ids can read the tools
        mm_tokens: dict[str, int] = {}
        for item in media:
            mm_tokens[item.kind] = mm_tokens.get(item.kind, 0) + self._media_tokens(item.kind)
        last_role = req.messages[-1].get("role") if req.messages and isinstance(req.messages[-1], dict) else None
        gen = self._generation(
            arrival=arrival, response_id=self._response_id(request, req.request_id, "chatcmpl-"), model=model,
            prompt=prompt, max_tokens=max_tokens, stream=bool(req.stream), n=req.num_choices, kv_transfer=kv_transfer,
            plan_kwargs={"chat": True, "thinking_mode": kwargs.get("thinking_mode"), "tools": tools,
                         "tool_choice": req.tool_choice, "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens,
                         "structured": constraint},
            include_reasoning=req.include_reasoning, include_usage=req.include_usage,
            continuous_usage=req.continuous_usage, logprobs=req.num_logprobs,
            role="assistant" if req.add_generation_prompt else str(last_role or "assistant"),
            cache_block_size=self.settings.block_size if self.settings.enable_prefix_caching else 0,
            multimodal_tokens=mm_tokens or None, **self._token_ids(req.return_token_ids, prompt))
        if tools:
            gen.tool_parsing = "chat_completions"
        return self._respond(gen, ChatShape, request)

    async def completions(self, request: Request) -> Response:
        arrival = self.engine.clock()  # vLLM's arrival time: before parsing and tokenizing
        body = await self._json(request)
        await self._pre_generate()
        body = precheck_completion(body)
        req: CompletionRequest = validate(CompletionRequest, body)
        structured.check_params(req.structured_outputs)
        kv_transfer = self._kv_params(request, req.kv_transfer_params)
        model = self._check_model(req.model)
        if req.stream and req.use_beam_search:
            raise bad_request("Streaming is not currently supported with beam search")
        self._check_max_tokens(req.max_tokens, "max_tokens")
        p = req.prompt
        if isinstance(p, list) and not p:
            raise bad_request("You must pass at least one prompt")
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request("The simulator serves one prompt per request.", "prompt")
            p = p[0]
        if isinstance(p, str):
            prompt = await self._prepare(p, add_special_tokens=True, salt=req.cache_salt)
        else:
            prompt = self._prepare_ids(list(p), req.cache_salt)
        n = self._check_prompt(prompt)
        max_tokens = self._max_tokens(n, req.max_tokens)
        constraint = structured.from_request(req.structured_outputs, req.response_format)
        check_sampling(req, max_tokens, vocab_size=self.tokenizer.vocab_size)
        structured.validate(constraint)
        plan_kwargs: dict[str, Any] = {"chat": False, "min_tokens": req.min_tokens, "structured": constraint}
        offset, fingerprint = 0, None
        if _greedy(req.temperature):
            prompt.greedy()
            resumed = (self._continuation(prompt, req.min_tokens, (req.model_extra or {}).get("tools"))
                       if not prompt.text_prompt else None)
            if resumed is not None:
                offset, fingerprint, plan_kwargs = resumed
        gen = self._generation(
            arrival=arrival, response_id=self._response_id(request, req.request_id, "cmpl-"), model=model,
            prompt=prompt, max_tokens=max_tokens, stream=bool(req.stream), n=req.num_choices, kv_transfer=kv_transfer,
            offset=offset, fingerprint=fingerprint, **self._token_ids(req.return_token_ids, prompt),
            plan_kwargs={**plan_kwargs, "ignore_eos": req.ignore_eos},
            include_usage=req.include_usage, continuous_usage=req.continuous_usage, logprobs=req.num_logprobs,
            echo_prompt=(p if isinstance(p, str) else self.tokenizer.decode(list(p))) if req.echo else None)
        return self._respond(gen, CompletionShape, request)

    async def _validated(self, request: Request, model_cls: type[Any]) -> tuple[float, Any, str]:
        """(arrival, the validated request, the model name) for the Responses and Messages routes: vLLM's arrival
        time is taken before parsing and tokenizing."""
        arrival = self.engine.clock()
        body = await self._json(request)
        await self._pre_generate()
        req = validate(model_cls, body)
        return arrival, req, self._check_model(req.model)

    async def responses(self, request: Request) -> Response:
        arrival, req, model = await self._validated(request, ResponsesRequest)
        structured.check_params(req.structured_outputs)
        messages = _responses_to_messages(req)
        tools = [_responses_tool(t) for t in req.tools or [] if t.get("type", "function") == "function"] or None
        extra = req.model_extra or {}
        kwargs = dict(extra.get("chat_template_kwargs") or {})
        self._check_max_tokens(req.max_output_tokens, "max_output_tokens")
        text = self._render_chat(messages, tools, True, False, kwargs, media_out=[])
        prompt = await self._prepare(text, add_special_tokens=False, salt=extra.get("cache_salt"))
        if _greedy(req.temperature):
            prompt.greedy()
        n = self._check_prompt(prompt)
        max_tokens = self._max_tokens(n, req.max_output_tokens)
        constraint = structured.from_responses(req.structured_outputs, req.text)
        self._check_output_budget(max_tokens)
        structured.validate(constraint)
        gen = self._generation(
            arrival=arrival, response_id=self._response_id(request, req.request_id, "resp_"), model=model, prompt=prompt,
            max_tokens=max_tokens, stream=bool(req.stream),
            plan_kwargs={"chat": True, "thinking_mode": kwargs.get("thinking_mode"), "tools": tools,
                         "tool_choice": req.tool_choice, "structured": constraint},
            echo={"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                  "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice,
                  "tools": req.tools, "text": req.text.model_dump(by_alias=True, exclude_unset=True) if req.text
                  else None})
        if tools:
            gen.tool_parsing = "responses"
        return self._respond(gen, ResponsesShape, request)

    async def messages(self, request: Request) -> Response:
        arrival, req, model = await self._validated(request, MessagesRequest)
        messages = _anthropic_to_messages(req)
        tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                   "parameters": t.get("input_schema") or {}}}
                 for t in req.tools or []] or None
        choice = req.tool_choice or {}
        tool_choice: Any = {"any": "required", "none": "none"}.get(choice.get("type", "auto"), "auto")
        if choice.get("type") == "tool":
            tool_choice = {"type": "function", "function": {"name": choice.get("name")}}
        thinking = (req.thinking or {}).get("type")
        mode = {"enabled": "enabled", "disabled": "disabled"}.get(thinking or "", None)
        self._check_max_tokens(req.max_tokens, "max_completion_tokens")  # converted to a chat request
        text = self._render_chat(messages, tools, True, False, {"thinking_mode": mode} if mode else {},
                                 media_out=[])
        prompt = await self._prepare(text, add_special_tokens=False, salt=None)
        if _greedy((req.model_extra or {}).get("temperature")):
            prompt.greedy()
        n = self._check_prompt(prompt)
        max_tokens = self._max_tokens(n, req.max_tokens)
        constraint = structured.from_messages((req.model_extra or {}).get("output_config"))
        self._check_output_budget(max_tokens)
        structured.validate(constraint)
        gen = self._generation(
            arrival=arrival, response_id=self._response_id(request, None, "chatcmpl-"),  # vLLM answers as a chat
            model=model, prompt=prompt, max_tokens=max_tokens, stream=bool(req.stream),
            plan_kwargs={"chat": True, "thinking_mode": mode, "tools": tools, "tool_choice": tool_choice,
                         "structured": constraint},
            cache_block_size=self.settings.block_size if self.settings.enable_prefix_caching else 0)
        return self._respond(gen, MessagesShape, request)

    # ---- other vLLM routes -----------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        cards = []
        for name in self.settings.model_names:
            cards.append({
                "id": name, "object": "model", "created": self.started_at, "owned_by": "vllm",
                "root": self.settings.model, "parent": None, "max_model_len": self.settings.max_model_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": self.started_at, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]})
        return Response(orjson.dumps({"object": "list", "data": cards}), media_type=JSON)

    async def tokenize(self, request: Request) -> Response:
        body = await self._json(request)
        if self.engine.draining:
            raise shutting_down()
        if isinstance(body, dict) and "messages" in body:
            precheck_tokenize_chat(body)
            chat: TokenizeChatRequest = validate(TokenizeChatRequest, body)
            self._check_model(chat.model)
            text = self._render_chat(chat.messages, chat.tools, chat.add_generation_prompt,
                                     chat.continue_final_message, dict(chat.chat_template_kwargs or {}))
            add_special, want_strs = chat.add_special_tokens, chat.return_token_strs
        else:
            plain: TokenizeCompletionRequest = validate(TokenizeCompletionRequest, body)
            self._check_model(plain.model)
            text, add_special, want_strs = plain.prompt, plain.add_special_tokens, plain.return_token_strs
        if self.tokenizer.expensive(text):
            tokens = await asyncio.to_thread(self.tokenizer.encode, text, add_special)
        else:
            tokens = self.tokenizer.encode(text, add_special)
        if isinstance(self.tokenizer, ByteChunkTokenizer):
            self.tokenizer.learn(tokens)  # so /detokenize can turn these ids back into text
        return Response(orjson.dumps({"count": tokens.count, "max_model_len": self.settings.max_model_len,
                                      "tokens": tokens.ids(), "token_strs": tokens.token_strs() if want_strs else None}),
                        media_type=JSON)

    async def detokenize(self, request: Request) -> Response:
        body = await self._json(request)
        req: DetokenizeRequest = validate(DetokenizeRequest, body)
        self._check_model(req.model)
        return Response(orjson.dumps({"prompt": self.tokenizer.decode(req.tokens)}), media_type=JSON)

    async def kv_event_sources(self, request: Request) -> Response:
        """vLLM's GET /kv_event_sources: each DP rank's resolved KV-events config ({} when events are off)."""
        return Response(orjson.dumps(self.kv_events.sources() if self.kv_events is not None else {}), media_type=JSON)

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.faults.current.unhealthy else 200)

    async def version(self, request: Request) -> Response:
        return Response(orjson.dumps({"version": VLLM_VERSION}), media_type=JSON)

    async def load(self, request: Request) -> Response:
        return Response(b'{"server_load":0}', media_type=JSON)

    async def metrics_route(self, request: Request) -> Response:
        e = self.engine
        return Response(self.metrics.render(len(e.running), len(e.waiting), e.kv.usage, deferred=len(e.loading),
                                            names=request.query_params.getlist("name[]")),
                        media_type=CONTENT_TYPE)

    # ---- shutdown (SIGTERM) -----------------------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> None:
        """vLLM's SIGTERM handling with --shutdown-timeout N (observed on vLLM 0.32): its frontend shuts its
        renderer down first, so every new generate or /tokenize request fails with a 500 while the server still
        listens and /health still answers 200 (the engine lives). With N = 0 the requests in flight are aborted at
        once (their streams end with finish_reason "abort") and the server stops listening; otherwise they run
        until done or until N seconds have passed, when the engine is killed: what is left gets no more tokens and
        no error, its stream stays open and silent until the client hangs up. Returns when nothing runs."""
        engine = self.engine
        engine.draining = True
        if timeout_s <= 0:
            if self.listener is not None:
                self.listener.pause()
            for req in engine.in_flight:
                engine.shutdown_abort(req)
            return
        deadline = engine.clock() + timeout_s
        while engine.in_flight and engine.clock() < deadline:
            await asyncio.sleep(0.01)
        for req in engine.in_flight:
            engine.kill(req)

    # ---- /sim admin ------------------------------------------------------------------------------------------

    async def faults_route(self, request: Request) -> Response:
        if request.method == "POST":
            try:
                patch: FaultUpdate = validate(FaultUpdate, parse_json(await request.body()))
            except ApiError as exc:
                return exc.response()
            before = self.faults.current
            after = self.faults.update(patch)
            self._apply_listener(before.refuse_connections, after)
        return Response(orjson.dumps(self.faults.as_json()), media_type=JSON)

    def apply_start_faults(self) -> None:
        """Called by the server once it listens, so faults given as flags take effect like run-time ones."""
        self._apply_listener(False, self.faults.current)

    def _apply_listener(self, was_refusing: bool, now: Any) -> None:
        if self._resume_timer is not None:
            self._resume_timer.cancel()
            self._resume_timer = None
        if self.listener is None:
            return
        if now.refuse_connections and not was_refusing:
            self.listener.pause()
        elif not now.refuse_connections and was_refusing:
            self.listener.resume()
        if now.refuse_connections and now.refuse_for_s:
            self._resume_timer = asyncio.get_running_loop().call_later(now.refuse_for_s, self._end_refusal)

    def _end_refusal(self) -> None:
        self._resume_timer = None
        self.faults.update(FaultUpdate(refuse_connections=False))
        if self.listener is not None:
            self.listener.resume()

    async def stats_route(self, request: Request) -> Response:
        return Response(orjson.dumps(self.stats()), media_type=JSON)

    def stats(self) -> dict[str, Any]:
        e, c, h = self.engine, self.engine.counters, self.http
        return {"requests": dict(h.requests), "completed": c.completed, "aborted": c.aborted,
                "rejected": c.rejected, "bad_requests": h.bad_requests, "injected_errors": h.injected_errors,
                "dropped": h.dropped, "hung": h.hung, "tokens_in": c.prompt_tokens, "tokens_out": c.generation_tokens,
                "cached_tokens": c.cached_tokens, "preemptions": c.preemptions, "steps": c.steps,
                "running": len(e.running), "waiting": len(e.waiting), "kv_usage": e.kv.usage,
                "kv_free_blocks": e.kv.num_free, "prefix_cached_blocks": len(e.prefix_cache or ()),
                "faults": self.faults.as_json(),
                "kv_transfer": self.kv_connector.stats() if self.kv_connector is not None else None}

    async def reset_route(self, request: Request) -> Response:
        self.engine.reset()
        self.http = HttpCounters()
        return Response(orjson.dumps(self.stats()), media_type=JSON)


# ---------------------------------------------------------------------------------------------------------------


class GenerationResponse(Response):
    """Streams or returns one generation; aborts it in the engine when the client disconnects."""

    def __init__(self, app: SimApp, gen: Generation, shape: Any, drop_after: int | None) -> None:
        self.app = app
        self.gen = gen
        self.shape = shape
        self.drop_after = drop_after
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine, gen = self.app.engine, self.gen

        def abort_all() -> None:
            for choice in gen.choices:
                engine.abort(choice.sim)

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            abort_all()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            if gen.stream:
                await self._stream(send)
            else:
                await self._unary(send)
            self._count_tool_parsing()
        finally:
            watcher.cancel()
            abort_all()

    def _count_tool_parsing(self) -> None:
        """vllm:tool_call_parser_invocations for requests that offered tools: once per choice unstreamed, once per
        delta after the reasoning when streamed."""
        gen, kind = self.gen, self.gen.tool_parsing
        if kind is None:
            return
        counters = self.app.metrics.tool_call_parser_invocations
        for choice in gen.choices:
            outcome = "tool_call" if choice.plan.tool_call is not None else "no_tool_call"
            if gen.stream:
                deltas = max(0, choice.sim.num_output - choice.plan.reasoning_tokens)
                if deltas:
                    counters[("streaming", outcome, kind)].inc(deltas)
            else:
                counters[("non_streaming", outcome, kind)].inc()

    def _drop(self) -> DropConnection:
        self.app.http.dropped += 1
        return DropConnection()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        if self.drop_after == 0:  # headers out, then the connection cut: a replica dying during prefill
            raise self._drop()
        sent = 0
        async for chunk in self.shape.events(self.gen):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent += 1
            if self.drop_after is not None and sent >= self.drop_after:
                raise self._drop()
        gen = self.gen
        if gen.client_gone or (gen.server_aborted and self.shape not in (ChatShape, CompletionShape)):
            raise DropConnection()  # Responses/Messages streams cut by a shutdown end with the connection
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _unary(self, send: Send) -> None:
        await wait_finished(self.gen)
        gen = self.gen
        if gen.client_gone or (gen.server_aborted and self.shape not in (ChatShape, CompletionShape)):
            raise DropConnection()  # chat and completions cut by a shutdown answer 200, finish_reason "abort"
        if self.gen.failed:  # finish_reason "error" (a failed KV load): vLLM's GenerationError → 500
            error = ApiError(500, GENERATION_ERROR_MESSAGE, "InternalServerError").body()
            await send({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", JSON.encode()), (b"content-length", str(len(error)).encode())]})
            await send({"type": "http.response.body", "body": error, "more_body": False})
            return
        body = self.shape.body(self.gen)
        headers = [(b"content-type", JSON.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if self.drop_after is not None:
            await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
            raise self._drop()
        await send({"type": "http.response.body", "body": body, "more_body": False})


class HangResponse(Response):
    """Never answers; when the client gives up, the connection is closed without a response."""

    def __init__(self) -> None:
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        raise DropConnection()


def shutting_down() -> ApiError:
    """What vLLM 0.32 answers a request that arrives after SIGTERM: its renderer's executor is already shut down."""
    return ApiError(500, "cannot schedule new futures after shutdown", "InternalServerError")


def _event_publisher(settings: SimSettings) -> SimEventPublisher | None:
    if settings.kv_events_config is None:
        return None
    config = parse_kv_events_config(settings.kv_events_config)
    if not config["enable_kv_cache_events"] or config["publisher"] != "zmq":
        return None
    return SimEventPublisher(config, settings.block_size, settings.host)


async def _not_found(request: Request, exc: Exception) -> Response:
    return Response(b'{"detail":"Not Found"}', 404, media_type=JSON)


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return Response(b'{"detail":"Method Not Allowed"}', 405, media_type=JSON)


def _anthropic_error(exc: ApiError) -> Response:
    """vLLM's `translate_error_response`: the Anthropic envelope around vLLM's own error type. Request validation
    errors never reach the handler, so they keep the OpenAI shape."""
    if exc.err_type == "Bad Request":
        return exc.response()
    return Response(orjson.dumps({"type": "error", "error": {"type": exc.err_type, "message": exc.message}}),
                    status_code=exc.status, media_type=JSON)


def _responses_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if "function" in tool:
        return tool
    return {"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description"),
                                             "parameters": tool.get("parameters") or {}}}


def _responses_to_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for item in req.input:
        kind = item.get("type", "message")
        if kind == "message" or "role" in item:
            messages.append({"role": item.get("role", "user"), "content": item.get("content", "")})
        elif kind == "function_call":
            messages.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output", "")})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"Unsupported input item type: {kind}")
    return messages


def _anthropic_to_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n".join(
            b.get("text", "") for b in req.system if isinstance(b, dict))
        messages.append({"role": "system", "content": system})
    for msg in req.messages:
        content = msg.get("content")
        if not isinstance(content, list):
            messages.append({"role": msg.get("role", "user"), "content": content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for block in content:
            kind = block.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": block.get("text", "")})
            elif kind == "image":
                source = block.get("source") or {}
                parts.append({"type": "image_url", "image_url": {"url": source.get("url") or source.get("data", "")}})
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"), "arguments": orjson.dumps(block.get("input", {})).decode()}})
            elif kind == "tool_result":
                result = block.get("content")
                if isinstance(result, list):
                    result = "\n".join(b.get("text", "") for b in result if isinstance(b, dict))
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result or ""})
        if parts or calls:
            entry: dict[str, Any] = {"role": msg.get("role", "user"), "content": parts or None}
            if calls:
                entry["tool_calls"] = calls
            messages.append(entry)
    return messages


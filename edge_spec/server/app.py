"""The routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, ``/tokenize``, ``/detokenize``,
``/metrics``, ``/health``, and the chat page (``/`` and its files under ``/static/``, :mod:`page`).

Every request is counted (:mod:`metrics`) and first passes the HTTP policy (:mod:`guard`: host, origin,
content type, body size).  It is then checked (body, fields, API key, model name, tools, grammar, prompt
length), the slow parts (decoding the body, counting the prompt's tokens, tokenizing) in worker threads so
that no request holds up the others, a grammar (``response_format``, a forced tool call) in a child process
ended at a time limit (``constrain.isolated``), and queued for the engine worker (:mod:`queue`).  While it waits or runs, a client that
disconnects cancels it: a watcher task for non-streamed answers and queued streams, Starlette's own
disconnect handling once a stream is under way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from dataclasses import dataclass, field, replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain import (
    COMPILE_SECONDS,
    CheckerBusy,
    Constraint,
    GrammarChecker,
    GrammarRefused,
    checker_for,
    schema_pattern_problem,
    self_reference,
)
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops import ConstraintUnsupported
from edge_spec.runtime.loops.config import TreeConfig
from edge_spec.server.body import read_request
from edge_spec.server.errors import ApiError, bad_request, shutting_down
from edge_spec.server.fim import FimTokens
from edge_spec.server.guard import Guard, GuardPolicy
from edge_spec.server.metrics import CONTENT_TYPE, RequestCounter, ServerMetrics
from edge_spec.server.openai_format import DONE, ResponseFormat, fingerprint, model_card, model_list, sse
from edge_spec.server.page import chat_page, page_file
from edge_spec.server.prompt_size import PromptFloor
from edge_spec.server.queue import EngineWorker, Job
from edge_spec.server.schemas import Sampling, ToolRequest, parse_chat, parse_completion
from edge_spec.server.tokens import (
    Tokenizers,
    TokenPieces,
    detokenize,
    parse_detokenize,
    parse_tokenize,
    tokenize,
)
from edge_spec.server.tool_calls import CallParser, ToolCall, ToolFormat
from edge_spec.server.tool_use import ToolUse, plan_tools

log = logging.getLogger("edge_spec.server")
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


ANY_MODEL = "*"  # the alias that makes any model name this server's model


@dataclass
class ServerState:
    worker: EngineWorker
    model: str  # the id clients see: the bundle directory's name
    created: int
    api_key: str | None = None  # None: any bearer token (or none) is accepted
    fim: FimTokens | None = None
    floor: PromptFloor | None = None  # None: prompts are only counted exactly
    aliases: tuple[str, ...] = ()  # other names requests may give the model (ANY_MODEL: any name)
    tool_format: ToolFormat | None = None  # how the model writes tool calls (None: it cannot, or unknown)
    metrics: ServerMetrics | None = None
    grammar_seconds: float = COMPILE_SECONDS  # the time a request's grammar may take to compile
    _pieces: TokenPieces | None = field(default=None, repr=False)
    _tokenizers: Tokenizers | None = field(default=None, repr=False)
    _checker: GrammarChecker | None = field(default=None, repr=False)
    _grammar_turn: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = field(default=None, repr=False)
    _vocab_size: int | None = field(default=None, repr=False)

    @property
    def names(self) -> list[str]:
        """The model's names, as ``/v1/models`` lists them."""
        return list(dict.fromkeys([self.model, *(a for a in self.aliases if a != ANY_MODEL)]))

    def knows(self, name: str) -> bool:
        return name in self.names or ANY_MODEL in self.aliases

    def check_model(self, name: str | None) -> None:
        """404 ``model_not_found`` for a name that is not this server's model (no name: this model)."""
        if name is not None and not self.knows(name):
            also = f" (also named {', '.join(repr(a) for a in self.names[1:])})" if len(self.names) > 1 else ""
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server has {self.model!r}{also}",
                param="model",
                code="model_not_found",
            )

    def grammar_checker(self) -> GrammarChecker:
        """The checker of this model's grammars (blocking the first time: the grammar engine reads the
        vocabulary, and the checker's process starts on the first check)."""
        if self._checker is None:
            self._checker = checker_for(self.worker.engine.grammar_vocabulary())
        return self._checker

    def prepare(self) -> None:
        """Build now what the first request of each kind would build while others are served: the grammar
        engine's vocabulary and the checker's child (the first constrained request), the tokenizers and
        piece table of ``/tokenize``, the vocabulary size ``/detokenize`` checks ids against.  Building each holds the GIL from start to end (reading a 150,000-token
        vocabulary: seconds), which would stall every other request, ``/health`` included.  Blocking: call
        it before the server accepts connections.  A tokenizer the grammar engine cannot read is no
        reason to stop: its requests are refused as before."""
        try:
            self.grammar_checker().start()
        except EdgeSpecError as exc:
            log.warning("constrained answers will be refused: %s", exc)
        self.tokenizers()
        self.pieces()
        self.vocab_size()

    def vocab_size(self) -> int:
        """The tokenizer's ids, added tokens included (counting them walks the whole vocabulary: a
        second or so for 150,000 tokens, holding the GIL, so it is counted once)."""
        if self._vocab_size is None:
            self._vocab_size = self.worker.engine.bundle.tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        return self._vocab_size

    def grammar_turn(self) -> asyncio.Lock:
        """The lock that lets one request at a time check its grammar (one per event loop)."""
        loop = asyncio.get_running_loop()
        if self._grammar_turn is None or self._grammar_turn[0] is not loop:
            self._grammar_turn = (loop, asyncio.Lock())
        return self._grammar_turn[1]

    def pieces(self) -> TokenPieces:
        if self._pieces is None:
            self._pieces = TokenPieces(self.worker.engine.bundle.tokenizer.tokenizer)
        return self._pieces

    def tokenizers(self) -> Tokenizers:
        """The tokenizers of ``/tokenize`` (built on its first request: blocking, run it in a thread)."""
        if self._tokenizers is None:
            self._tokenizers = Tokenizers(self.worker.engine.bundle.tokenizer)
        return self._tokenizers


def create_app(state: ServerState, policy: GuardPolicy | None = None) -> Starlette:
    """The app; ``policy`` (default: loopback only, no CORS, 4 MiB bodies) guards every request."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.worker.start()
        yield
        await asyncio.to_thread(state.worker.stop)

    if state.metrics is None:
        state.metrics = ServerMetrics(state.worker)
    state.worker.on_answered = state.metrics.answered
    routes = [
        Route("/", chat_page),
        Route("/static/{name}", page_file),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/models/{model:path}", model),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/detokenize", detokenize_route, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={ApiError: api_error, HTTPException: http_error},
        middleware=[
            Middleware(RequestCounter, metrics=state.metrics, routes=routes),
            Middleware(Guard, policy=policy or GuardPolicy()),
        ],
        lifespan=lifespan,
    )
    app.state.server = state
    return app


# -- routes ----------------------------------------------------------------------------------------


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    worker = state.worker
    body = {
        "status": "shutting_down" if worker.closing else "ok",
        "model": state.model,
        "mode": worker.engine.config.mode,
        "busy": worker.busy,
        "waiting": worker.waiting,
        "max_queue": worker.max_queue,
        "requests": dict(worker.counts),
    }
    return JSONResponse(body, status_code=503 if worker.closing else 200)


async def metrics(request: Request) -> Response:
    state = _authorized(request)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def models(request: Request) -> Response:
    state = _authorized(request)
    return JSONResponse(model_list(state.names, state.created))


async def model(request: Request) -> Response:
    state = _authorized(request)
    name = request.path_params["model"]
    state.check_model(name)
    return JSONResponse(model_card(name, state.created))


async def chat_completions(request: Request) -> Response:
    state = _authorized(request)
    chat = await read_request(request, parse_chat)
    state.check_model(chat.model)
    tool_use = await asyncio.to_thread(_plan_tools, state, chat.tools)
    sampling = chat.sampling
    if tool_use is not None and tool_use.grammar is not None:  # a forced call: the answer is the call
        forced = await _constraint(
            state, tool_use.response_format, None, "tool_choice", "tools", "cannot force a call to these tools"
        )
        sampling = replace(sampling, response_format=forced, grammar=None)
    elif sampling.response_format is not None:
        if tool_use is not None:
            raise bad_request(
                'response_format together with tools the model may call (tool_choice "auto") is '
                'not supported yet: send tool_choice "none" or "required", or no '
                "response_format",
                param="response_format",
            )
        sampling = await _constrained(state, sampling)
    if tool_use is not None and tool_use.stop:
        sampling = replace(sampling, stop=sampling.stop + tool_use.stop)
    return await _answer(
        request,
        state,
        "chat",
        chat.messages,
        sampling,
        chat.stream,
        chat.include_usage,
        tool_use=tool_use,
        provenance=chat.provenance,
        logprobs=chat.logprobs,
    )


async def completions(request: Request) -> Response:
    state = _authorized(request)
    req = await read_request(request, parse_completion)
    state.check_model(req.model)
    sampling = req.sampling
    if sampling.response_format is not None:
        sampling = await _constrained(state, sampling)
    prompt = req.prompt
    if req.suffix is not None:
        if state.fim is None:
            raise bad_request("'suffix' needs fill-in-the-middle tokens, and this model has none", param="suffix")
        prompt = state.fim.prompt(req.prompt, req.suffix)
    return await _answer(
        request,
        state,
        "completion",
        prompt,
        sampling,
        req.stream,
        req.include_usage,
        echo=req.prompt if req.echo else "",
        provenance=req.provenance,
        logprobs=req.logprobs,
    )


async def tokenize_route(request: Request) -> Response:
    state = _authorized(request)
    req = await read_request(request, parse_tokenize)
    tokenizers = await asyncio.to_thread(state.tokenizers)
    return Response(await asyncio.to_thread(tokenize, tokenizers, req, state.pieces), media_type="application/json")


async def detokenize_route(request: Request) -> Response:
    state = _authorized(request)
    size = await asyncio.to_thread(state.vocab_size)
    ids = await read_request(request, lambda body: parse_detokenize(body, size))
    return Response(
        await asyncio.to_thread(detokenize, state.worker.engine.bundle.tokenizer, ids), media_type="application/json"
    )


def _plan_tools(state: ServerState, request: ToolRequest | None) -> ToolUse | None:
    """What the request does with its tools (blocking: a forced call's grammar is built and read here);
    a 400 naming ``tools`` when a forced call would follow parameters no value matches."""
    if request is not None and request.choice == "required":
        for tool in request.tools:
            parameters = tool["function"].get("parameters") or {}
            problem = self_reference(parameters) or schema_pattern_problem(parameters)
            if problem:
                raise bad_request(f"cannot force a call to {tool['function']['name']}: {problem}", param="tools")
    text = state.worker.engine.bundle.tokenizer
    return plan_tools(request, state.tool_format, text.takes_tools, text.tokenizer.token_to_id)


async def _constrained(state: ServerState, sampling: Sampling) -> Sampling:
    """``sampling`` with its ``response_format`` compiled (:func:`_constraint`)."""
    response_format = await _constraint(
        state, sampling.response_format, sampling.grammar, "response_format", "response_format", "response_format"
    )
    return replace(sampling, response_format=response_format, grammar=None)


async def _constraint(
    state: ServerState, response_format: dict, grammar: str | None, needs: str, param: str, what: str
) -> Constraint | None:
    """``response_format`` compiled once (:func:`_compile_constraint`), one request at a time; a request
    that cannot start within ``state.grammar_seconds`` gets a 503."""
    seconds = state.grammar_seconds
    turn = state.grammar_turn()
    try:
        await asyncio.wait_for(turn.acquire(), seconds)
    except asyncio.TimeoutError:
        raise _checker_busy(seconds) from None
    try:
        return await asyncio.to_thread(_compile_constraint, state, response_format, grammar, needs, param, what)
    finally:
        turn.release()


def _compile_constraint(
    state: ServerState, response_format: dict, grammar: str | None, needs: str, param: str, what: str
) -> Constraint | None:
    """``response_format`` compiled once (``grammar``: its grammar, when read already), for the engine to
    follow as it is (blocking).  ``Engine.constraint_for`` decides whether the engine's loop can take a
    constraint (a 400 naming ``needs`` where it cannot), then the grammar is checked in a child process
    that is ended at ``state.grammar_seconds`` (:mod:`~edge_spec.runtime.constrain.isolated`): a 400
    naming ``param`` when llguidance cannot compile it, it passes a limit, accepts no text, or takes
    longer; a 503 when another request's grammar holds the checker."""
    seconds = state.grammar_seconds
    engine: Engine = state.worker.engine

    def vet(source: str) -> None:
        state.grammar_checker().check(source, seconds)

    try:
        return engine.constraint_for(response_format, grammar=grammar, vet=vet)
    except ConstraintUnsupported as exc:
        raise bad_request(f"'{needs}' needs constrained decoding: {exc}", param=needs) from None
    except GrammarRefused as exc:
        raise bad_request(f"{what}: {exc}", param=param) from None
    except CheckerBusy:
        raise _checker_busy(seconds) from None
    except EdgeSpecError as exc:  # the checker could not start
        raise ApiError(500, str(exc), type="server_error") from None


def _checker_busy(seconds: float) -> ApiError:
    return ApiError(
        503,
        f"the grammar checker is busy with another request's grammar for more than {seconds:g} s; retry",
        type="server_error",
        code="grammar_checker_busy",
        headers={"Retry-After": str(max(1, round(seconds)))},
    )


# -- answering -------------------------------------------------------------------------------------


async def _answer(
    request: Request,
    state: ServerState,
    kind: str,
    prompt: str | list[dict],
    sampling: Sampling,
    stream: bool,
    include_usage: bool,
    echo: str = "",
    tool_use: ToolUse | None = None,
    provenance: bool = False,
    logprobs: int | None = None,
) -> Response:
    if logprobs is not None and tool_use is not None:
        raise bad_request(
            "'logprobs' together with tools the model may call is not supported: a tool call's "
            'text is not the answer\'s content (send tool_choice "none" or no tools)',
            param="logprobs",
        )
    tools = tool_use.tools if tool_use is not None else None
    await _check_length(state, prompt, "messages" if kind == "chat" else "prompt", tools, sampling.response_format)
    engine = state.worker.engine
    sampling = sampling.resolved(coupled_available=not isinstance(engine.config, TreeConfig))
    form = ResponseFormat(
        kind,
        state.model,
        include_usage=include_usage and stream,
        fingerprint=fingerprint(engine.config.mode, sampling.sampler_name),
        sampler=sampling.sampler_name,
        pieces=await asyncio.to_thread(state.pieces) if logprobs is not None else None,
    )
    provenance = provenance and tool_use is None  # a tool-call parser rewrites the text: no pieces to match
    job = Job(
        prompt,
        sampling,
        label=f"{kind} {form.id}",
        loop=asyncio.get_running_loop(),
        tools=tools,
        provenance=provenance,
        logprobs=logprobs,
        marked_tokens=tool_use.marked_tokens if tool_use is not None else frozenset(),
    )
    state.worker.submit(job)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, state.worker, job))
    streaming = False
    try:
        if stream:
            first = await job.events.get()  # headers go out once the answer starts: errors before are statuses
            if first.kind == "error":
                raise first.error
            streaming = True
            parser = tool_use.parser() if tool_use is not None else None
            return _JobStream(
                _events(job, form, echo, parser),
                cancel=lambda: state.worker.cancel(job, "disconnect"),
                media_type="text/event-stream",
                headers=STREAM_HEADERS,
            )
        text, stats, sources, logged = await _collect(job)
        if tool_use is None:
            return JSONResponse(
                form.full(
                    echo + text,
                    stats,
                    job.queue_seconds,
                    sources=sources if provenance else None,
                    logprobs=logged if logprobs is not None else None,
                )
            )
        parser = tool_use.parser()
        pieces = parser.feed(text) + parser.finish()
        content = "".join(p for p in pieces if isinstance(p, str)) or None
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        return JSONResponse(form.full(content, stats, job.queue_seconds, tool_calls=calls))
    finally:
        watcher.cancel()
        if not streaming:  # this handler was cancelled or failed: the job must not run on (no-op once done)
            state.worker.cancel(job, "disconnect")


async def _check_length(
    state: ServerState,
    prompt: str | list[dict],
    param: str,
    tools: list[dict] | None = None,
    response_format: dict | None = None,
) -> None:
    """400 with the token counts when the prompt leaves no room for an answer (checked before queueing;
    the tokenizer is safe to use beside the worker thread).  Lower bounds come first (:mod:`prompt_size`),
    so a prompt far over the context is refused without the exact count, which holds the GIL."""
    capacity = state.worker.engine.bundle.target.capacity
    if state.floor is not None:
        floor = state.floor.by_characters(prompt)
        if floor < capacity:
            floor = await asyncio.to_thread(state.floor.by_tokenizing, prompt)
        if floor >= capacity:
            raise _too_long(capacity, floor, param, exact=False)
    count = await asyncio.to_thread(_count_tokens, state, prompt, param, tools, response_format)
    if count >= capacity:
        raise _too_long(capacity, count, param, exact=True)


def _count_tokens(
    state: ServerState, prompt: str | list[dict], param: str, tools: list[dict] | None, response_format: dict | None
) -> int:
    try:
        return len(
            state.worker.engine.prompt_ids(prompt, check_length=False, tools=tools, response_format=response_format)
        )
    except EdgeSpecError as exc:  # empty prompt, chat template refusing the messages
        raise bad_request(str(exc), param=param) from None


def _too_long(capacity: int, count: int, param: str, exact: bool) -> ApiError:
    return bad_request(
        f"this model's maximum context length is {capacity} tokens, but the prompt is "
        f"{'' if exact else 'at least '}{count} tokens: shorten the {param} by at least "
        f"{count - capacity + 1} tokens (one must remain for the answer)",
        param=param,
        code="context_length_exceeded",
    )


async def _collect(job: Job):
    """The answer's text, statistics and (when the job asked for them) its tokens' sources and
    log-probabilities."""
    chunks, sources, logprobs = [], [], []
    while True:
        event = await job.events.get()
        if event.kind == "text":
            chunks.append(event.text)
            sources.extend(event.sources or ())
            logprobs.extend(event.logprobs or ())
        elif event.kind == "done":
            if event.stats.stop_reason == "cancelled":
                raise shutting_down()  # (a client that went away reads no answer)
            sources.extend(event.sources or ())
            logprobs.extend(event.logprobs or ())
            return "".join(chunks), event.stats, sources, logprobs
        elif event.kind == "error":
            raise event.error


async def _events(job: Job, form: ResponseFormat, echo: str, parser: CallParser | None = None):
    """The SSE stream: content chunks (tool calls as OpenAI streams them, when ``parser`` reads them), a
    last chunk with the finish reason and ``x_edge_spec``, the usage chunk when asked for, ``[DONE]``; an
    error (the server shut down mid-answer) as an error event."""
    calls = 0

    def chunks(pieces):
        nonlocal calls
        for piece in pieces:
            if isinstance(piece, ToolCall):
                yield from form.call_chunks(piece, calls)
                calls += 1
            elif piece:
                yield form.chunk(piece)

    if form.kind == "chat" or echo:
        yield sse(form.chunk(echo, first=True))
    while True:
        event = await job.events.get()
        if event.kind == "text":
            if parser is None and (event.sources is not None or event.logprobs is not None):  # per-token extras
                yield sse(form.chunk(event.text, sources=event.sources, logprobs=event.logprobs))
                continue
            for chunk in chunks(parser.feed(event.text) if parser else [event.text]):
                yield sse(chunk)
        elif event.kind == "done":
            if event.stats.stop_reason == "cancelled":
                yield sse(shutting_down().body())
                return
            for chunk in chunks(parser.finish() if parser else []):
                yield sse(chunk)
            yield sse(
                form.chunk(
                    "",
                    stats=event.stats,
                    queue_seconds=job.queue_seconds,
                    called=calls > 0,
                    sources=event.sources if parser is None else None,
                    logprobs=event.logprobs or None,
                )
            )
            if form.include_usage:
                yield sse(form.usage_chunk(event.stats))
            yield DONE
            return
        elif event.kind == "error":
            yield sse(event.error.body())
            return


class _JobStream(StreamingResponse):
    """A streamed answer whose generation is cancelled when the response ends early (client gone)."""

    def __init__(self, content, *, cancel, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._cancel = cancel

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cancel()  # no-op when the answer is complete


async def _cancel_on_disconnect(request: Request, worker: EngineWorker, job: Job) -> None:
    while True:  # one message per wake-up; returns at the disconnect (or is cancelled once answered)
        message = await request.receive()
        if message["type"] == "http.disconnect":
            worker.cancel(job, "disconnect")
            return


# -- auth and errors -------------------------------------------------------------------------------


def _authorized(request: Request) -> ServerState:
    """The server state, once the API key (when one is set) matches ``Authorization: Bearer KEY``."""
    state: ServerState = request.app.state.server
    if state.api_key is None:
        return state
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header or scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401,
            "no API key given: send 'Authorization: Bearer KEY' with the key the server was started with (--api-key)",
            code="missing_api_key",
        )
    if not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
    return state


async def api_error(request: Request, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 / 405 in OpenAI's error shape."""
    error = ApiError(
        exc.status_code,
        f"{exc.detail}: {request.method} {request.url.path}",
        code="not_found" if exc.status_code == 404 else None,
    )
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

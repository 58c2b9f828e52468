"""The routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, ``/health``.

Every request first passes the HTTP policy (:mod:`guard`: host, origin, content type, body size).  It is
then checked (body, fields, API key, prompt length), the slow parts (decoding the body, counting the
prompt's tokens) in worker threads so that no request holds up the others, and queued for the engine
worker (:mod:`queue`).  While it waits or runs, a client that disconnects cancels it: a watcher
task for non-streamed answers and queued streams, Starlette's own disconnect handling once a stream
is under way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edge_spec.errors import EdgeSpecError
from edge_spec.server.body import read_request
from edge_spec.server.errors import ApiError, bad_request, shutting_down
from edge_spec.server.fim import FimTokens
from edge_spec.server.guard import Guard, GuardPolicy
from edge_spec.server.openai_format import DONE, ResponseFormat, model_card, model_list, sse
from edge_spec.server.prompt_size import PromptFloor
from edge_spec.server.queue import EngineWorker, Job
from edge_spec.server.schemas import Sampling, parse_chat, parse_completion

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerState:
    worker: EngineWorker
    model: str  # the id clients see: the bundle directory's name
    created: int
    api_key: str | None = None  # None: any bearer token (or none) is accepted
    fim: FimTokens | None = None
    floor: PromptFloor | None = None  # None: prompts are only counted exactly


def create_app(state: ServerState, policy: GuardPolicy | None = None) -> Starlette:
    """The app; ``policy`` (default: loopback only, no CORS, 4 MiB bodies) guards every request."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.worker.start()
        yield
        await asyncio.to_thread(state.worker.stop)

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/models/{model:path}", model),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error},
        middleware=[Middleware(Guard, policy=policy or GuardPolicy())],
        lifespan=lifespan,
    )
    app.state.server = state
    return app


# -- routes ----------------------------------------------------------------------------------------


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    worker = state.worker
    body = {"status": "shutting_down" if worker.closing else "ok", "model": state.model, "mode": worker.engine.mode,
            "busy": worker.busy, "waiting": worker.waiting, "max_queue": worker.max_queue,
            "requests": dict(worker.counts)}
    return JSONResponse(body, status_code=503 if worker.closing else 200)


async def models(request: Request) -> Response:
    state = _authorized(request)
    return JSONResponse(model_list(state.model, state.created))


async def model(request: Request) -> Response:
    state = _authorized(request)
    if request.path_params["model"] != state.model:
        raise ApiError(404, f"the model {request.path_params['model']!r} does not exist; this server has "
                            f"{state.model!r}", param="model", code="model_not_found")
    return JSONResponse(model_card(state.model, state.created))


async def chat_completions(request: Request) -> Response:
    state = _authorized(request)
    chat = await read_request(request, parse_chat)
    return await _answer(request, state, "chat", chat.messages, chat.sampling, chat.stream, chat.include_usage)


async def completions(request: Request) -> Response:
    state = _authorized(request)
    req = await read_request(request, parse_completion)
    prompt = req.prompt
    if req.suffix is not None:
        if state.fim is None:
            raise bad_request("'suffix' needs fill-in-the-middle tokens, and this model has none", param="suffix")
        prompt = state.fim.prompt(req.prompt, req.suffix)
    return await _answer(request, state, "completion", prompt, req.sampling, req.stream, req.include_usage,
                         echo=req.prompt if req.echo else "")


# -- answering -------------------------------------------------------------------------------------


async def _answer(request: Request, state: ServerState, kind: str, prompt: str | list[dict], sampling: Sampling,
                  stream: bool, include_usage: bool, echo: str = "") -> Response:
    await _check_length(state, prompt, "messages" if kind == "chat" else "prompt")
    form = ResponseFormat(kind, state.model, include_usage=include_usage and stream)
    job = Job(prompt, sampling, label=f"{kind} {form.id}", loop=asyncio.get_running_loop())
    state.worker.submit(job)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, state.worker, job))
    streaming = False
    try:
        if stream:
            first = await job.events.get()  # headers go out once the answer starts: errors before are statuses
            if first.kind == "error":
                raise first.error
            streaming = True
            return _JobStream(_events(job, form, echo), cancel=lambda: state.worker.cancel(job, "disconnect"),
                              media_type="text/event-stream", headers=STREAM_HEADERS)
        text, stats = await _collect(job)
        return JSONResponse(form.full(echo + text, stats, job.queue_seconds))
    finally:
        watcher.cancel()
        if not streaming:  # this handler was cancelled or failed: the job must not run on (no-op once done)
            state.worker.cancel(job, "disconnect")


async def _check_length(state: ServerState, prompt: str | list[dict], param: str) -> None:
    """400 with the token counts when the prompt leaves no room for an answer (checked before queueing;
    the tokenizer is safe to use beside the worker thread).  Lower bounds come first (:mod:`prompt_size`),
    so a prompt far over the context is refused without the exact count, which holds the GIL."""
    capacity = state.worker.engine.target.capacity
    if state.floor is not None:
        floor = state.floor.by_characters(prompt)
        if floor < capacity:
            floor = await asyncio.to_thread(state.floor.by_tokenizing, prompt)
        if floor >= capacity:
            raise _too_long(capacity, floor, param, exact=False)
    count = await asyncio.to_thread(_count_tokens, state, prompt, param)
    if count >= capacity:
        raise _too_long(capacity, count, param, exact=True)


def _count_tokens(state: ServerState, prompt: str | list[dict], param: str) -> int:
    try:
        return len(state.worker.engine.prompt_ids(prompt, check_length=False))
    except EdgeSpecError as exc:  # empty prompt, chat template refusing the messages
        raise bad_request(str(exc), param=param) from None


def _too_long(capacity: int, count: int, param: str, exact: bool) -> ApiError:
    return bad_request(f"this model's maximum context length is {capacity} tokens, but the prompt is "
                       f"{'' if exact else 'at least '}{count} tokens: shorten the {param} by at least "
                       f"{count - capacity + 1} tokens (one must remain for the answer)", param=param,
                       code="context_length_exceeded")


async def _collect(job: Job):
    chunks = []
    while True:
        event = await job.events.get()
        if event.kind == "text":
            chunks.append(event.text)
        elif event.kind == "done":
            if event.stats.stop_reason == "cancelled":
                raise shutting_down()  # (a client that went away reads no answer)
            return "".join(chunks), event.stats
        elif event.kind == "error":
            raise event.error


async def _events(job: Job, form: ResponseFormat, echo: str):
    """The SSE stream: content chunks, a last chunk with the finish reason and ``x_edge_spec``, the
    usage chunk when asked for, ``[DONE]``; an error (the server shut down mid-answer) as an error event."""
    if form.kind == "chat" or echo:
        yield sse(form.chunk(echo, first=True))
    while True:
        event = await job.events.get()
        if event.kind == "text":
            yield sse(form.chunk(event.text))
        elif event.kind == "done":
            if event.stats.stop_reason == "cancelled":
                yield sse(shutting_down().body())
                return
            yield sse(form.chunk("", stats=event.stats, queue_seconds=job.queue_seconds))
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
        raise ApiError(401, "no API key given: send 'Authorization: Bearer KEY' with the key the server was "
                            "started with (--api-key)", code="missing_api_key")
    if not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
    return state


async def api_error(request: Request, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 / 405 in OpenAI's error shape."""
    error = ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                     code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

"""``edge-spec serve``: the app under uvicorn, on a socket bound before the (slow) engine load.

Shutdown on SIGINT / SIGTERM: uvicorn stops accepting connections and waits for the open ones; the
worker refuses queued requests (503) and gives the answer in progress ``shutdown_grace`` seconds to
finish before stopping it at its next token (a stream then ends with an error event).  The process
exits 0, without a traceback.

Once it accepts connections, the server writes one JSON line to stdout: ``{"url", "api_key", "model"}``
(:mod:`sidecar`: what an application that started it as a child process reads); everything it logs goes
to stderr.  With a :class:`~edge_spec.server.sidecar.ParentWatch`, it stops when its parent process dies.

Connections are bounded too: request headers must be complete within ``HEADER_TIMEOUT`` seconds
(:mod:`protocol`), an idle keep-alive connection closes after ``KEEP_ALIVE_TIMEOUT``, headers are capped at
``MAX_HEADER_BYTES``, and past ``limit_concurrency`` connections uvicorn answers 503.  None of these cut an
answer that streams for minutes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import sys
import time

import uvicorn

from edge_spec.defaults import DEFAULT_HOST, DEFAULT_MAX_BODY, DEFAULT_MAX_QUEUE, DEFAULT_SHUTDOWN_GRACE
from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine
from edge_spec.server.guard import BODY_IDLE_TIMEOUT, make_policy
from edge_spec.server.http11 import HEADER_TIMEOUT, with_header_timeout
from edge_spec.server.sidecar import ParentWatch, announce, client_url, exit_now, ready_line, stop_soon

log = logging.getLogger("edge_spec.server")
KEEP_ALIVE_TIMEOUT = 5  # seconds an idle connection is kept between two requests
MAX_HEADER_BYTES = 32 * 1024  # request line + headers (an API key and a browser's headers fit many times)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening: connections are refused until the server runs)."""
    if not 0 <= port <= 65535:
        raise EdgeSpecError(f"--port must be 0 (any free port) to 65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError:
            sock.close()
            raise
    except OSError as exc:
        raise EdgeSpecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def check_aliases(aliases) -> tuple[str, ...]:
    """``--alias`` values: non-empty names without surrounding spaces (``*``: any name)."""
    for alias in aliases:
        if not alias or alias != alias.strip():
            raise EdgeSpecError(f"--alias must be a model name without surrounding spaces, got {alias!r}")
    return tuple(dict.fromkeys(aliases))


def build_app(
    engine: Engine,
    *,
    name: str,
    aliases=(),
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    bind_host: str = DEFAULT_HOST,
    allowed_hosts=(),
    cors_origins=(),
    max_body: str | int = DEFAULT_MAX_BODY,
    body_timeout: float = BODY_IDLE_TIMEOUT,
):
    """The Starlette app serving ``engine`` (its worker starts with the app's lifespan) and its state;
    requests name the model ``name`` or one of ``aliases`` (``*``: any name); ``bind_host`` and the rest are
    the HTTP policy's options (:func:`guard.make_policy`)."""
    from edge_spec.server.app import ServerState, create_app
    from edge_spec.server.fim import fim_tokens
    from edge_spec.server.prompt_size import PromptFloor
    from edge_spec.server.queue import EngineWorker
    from edge_spec.server.tool_calls import detect_format

    policy = make_policy(
        bind_host=bind_host,
        allowed_hosts=allowed_hosts,
        cors_origins=cors_origins,
        max_body=max_body,
        api_key=api_key,
        body_timeout=body_timeout,
    )
    text = engine.bundle.tokenizer
    tool_format = detect_format(text.chat_template, text.tokenizer.get_vocab(with_added_tokens=True))
    state = ServerState(
        worker=EngineWorker(engine, max_queue),
        model=name,
        created=int(time.time()),
        api_key=api_key,
        fim=fim_tokens(text),
        floor=PromptFloor(text.tokenizer),
        aliases=check_aliases(aliases),
        tool_format=tool_format,
    )
    log.info(
        "model %s: mode %s, context %d tokens, FIM %s, tool calls %s",
        name,
        engine.config.mode,
        engine.bundle.target.capacity,
        "yes" if state.fim else "no",
        tool_format.name if tool_format else "no",
    )
    return create_app(state, policy), state


def server_config(
    app,
    host: str,
    port: int,
    *,
    max_queue: int = DEFAULT_MAX_QUEUE,
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
    header_timeout: float = HEADER_TIMEOUT,
    keep_alive: int = KEEP_ALIVE_TIMEOUT,
    **options,
) -> uvicorn.Config:
    """uvicorn's settings for ``app``: the connection bounds of this module's docstring (``options``: more
    ``uvicorn.Config`` arguments)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=with_header_timeout(header_timeout),
        timeout_keep_alive=keep_alive,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        limit_concurrency=connection_limit(max_queue),
        timeout_graceful_shutdown=shutdown_grace + 5,
        **options,
    )


def connection_limit(max_queue: int) -> int:
    """Connections (and tasks) past which uvicorn answers 503.  Idle and half-open connections count too,
    so the limit leaves room for many of those (each is closed within the header or keep-alive deadline)
    beside every queued request and its stream, yet stays well below the usual 1024 file descriptors."""
    return max(256, 4 * (max_queue + 1))


def run(
    engine: Engine,
    sock: socket.socket,
    *,
    name: str,
    api_key: str | None,
    max_queue: int,
    shutdown_grace: float,
    allowed_hosts=(),
    cors_origins=(),
    max_body: str | int = DEFAULT_MAX_BODY,
    aliases=(),
    parent: ParentWatch | None = None,
) -> None:
    """Serve ``engine`` on ``sock`` until SIGINT / SIGTERM, or until the ``parent`` watched is gone."""
    if shutdown_grace < 0:
        raise EdgeSpecError("--shutdown-grace must not be negative")
    _configure_logging()
    host, port = sock.getsockname()[:2]
    app, state = build_app(
        engine,
        name=name,
        aliases=aliases,
        api_key=api_key,
        max_queue=max_queue,
        bind_host=host,
        allowed_hosts=allowed_hosts,
        cors_origins=cors_origins,
        max_body=max_body,
    )
    engine.complete("warm up", max_new_tokens=4)  # the first request is not the one paying for cold caches
    state.prepare()  # nor for the tables built on first use, which hold the GIL while they are built
    if not _is_loopback(host) and not api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", host)
    config = server_config(
        app, host, port, max_queue=max_queue, shutdown_grace=shutdown_grace, log_config=_log_config()
    )
    ready = ready_line(client_url(host, port), api_key, name)
    server = _Server(
        config, on_exit=lambda: state.worker.begin_shutdown(shutdown_grace), on_ready=lambda: announce(ready)
    )
    if parent is not None:  # nobody is left to wait for an answer in progress: stop it now
        parent.on_gone(lambda: stop_soon(lambda: _stop_now(server, state.worker)))
    previous = signal.signal(signal.SIGTERM, _exit_quietly)  # uvicorn re-raises the signal once it has shut down
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        state.worker.stop()
        sock.close()
    if not server.started:
        raise EdgeSpecError("the server did not start (see the log above)")
    log.info("stopped")
    if parent is not None and parent.gone:
        engine.close()  # what is kept across launches is saved (the suffix cache, calibrations)
        exit_now()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class _Stopped(Exception):
    pass


def _stop_now(server: uvicorn.Server, worker) -> None:
    """Stop serving (from any thread): the answer in progress stops at its next token."""
    server.should_exit = True
    worker.stop(timeout=DEFAULT_SHUTDOWN_GRACE)


def _log_config() -> dict:
    """uvicorn's logging, its access log on stderr too: stdout carries the ready line alone."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def _exit_quietly(signum, frame) -> None:
    raise _Stopped


class _Server(uvicorn.Server):
    """``uvicorn.Server`` that also tells the engine worker when a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, on_exit, on_ready=None) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._on_ready = on_ready  # called once the server accepts connections

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # uvicorn names the address only for sockets it bound itself
            host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
            log.info("serving on http://%s:%d (Ctrl-C stops)", host, self.config.port)
            if self._on_ready is not None:
                self._on_ready()

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        try:  # a signal handler must not take the worker's lock itself: let the event loop do it
            asyncio.get_running_loop().call_soon_threadsafe(self._on_exit)
        except RuntimeError:
            self._on_exit()


def _configure_logging() -> None:
    logger = logging.getLogger("edge_spec.server")
    if not logger.handlers:
        from uvicorn.logging import DefaultFormatter

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s", use_colors=None))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False

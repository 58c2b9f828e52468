"""``edge-spec serve``: the app under uvicorn, on a socket bound before the (slow) engine load.

Shutdown on SIGINT / SIGTERM: uvicorn stops accepting connections and waits for the open ones; the
worker refuses queued requests (503) and gives the answer in progress ``shutdown_grace`` seconds to
finish before stopping it at its next token (a stream then ends with an error event).  The process
exits 0, without a traceback.
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

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine

log = logging.getLogger("edge_spec.server")


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening: connections are refused until the server runs)."""
    if not 0 <= port <= 65535:
        raise EdgeSpecError(f"--port must be 0 (any free port) to 65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
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


def build_app(engine: Engine, *, name: str, api_key: str | None = None, max_queue: int = 16):
    """The Starlette app serving ``engine`` (its worker starts with the app's lifespan) and its state."""
    from edge_spec.server.app import ServerState, create_app
    from edge_spec.server.fim import fim_tokens
    from edge_spec.server.queue import EngineWorker

    state = ServerState(worker=EngineWorker(engine, max_queue), model=name, created=int(time.time()),
                        api_key=api_key, fim=fim_tokens(engine.tokenizer))
    log.info("model %s: mode %s, context %d tokens, FIM %s", name, engine.mode, engine.target.capacity,
             "yes" if state.fim else "no")
    return create_app(state), state


def run(engine: Engine, sock: socket.socket, *, name: str, api_key: str | None, max_queue: int,
        shutdown_grace: float) -> None:
    """Serve ``engine`` on ``sock`` until SIGINT / SIGTERM."""
    if shutdown_grace < 0:
        raise EdgeSpecError("--shutdown-grace must not be negative")
    _configure_logging()
    app, state = build_app(engine, name=name, api_key=api_key, max_queue=max_queue)
    engine.complete("warm up", max_new_tokens=4)  # the first request is not the one paying for cold caches
    host, port = sock.getsockname()[:2]
    if not _is_loopback(host) and not api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", host)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_grace + 5)
    server = _Server(config, on_exit=lambda: state.worker.begin_shutdown(shutdown_grace))
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


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class _Stopped(Exception):
    pass


def _exit_quietly(signum, frame) -> None:
    raise _Stopped


class _Server(uvicorn.Server):
    """``uvicorn.Server`` that also tells the engine worker when a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # uvicorn names the address only for sockets it bound itself
            host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
            log.info("serving on http://%s:%d (Ctrl-C stops)", host, self.config.port)

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

"""``serve``: the OpenAI-compatible HTTP server on one loaded engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from edge_spec.cli.groups import option, takes_groups
from edge_spec.cli.loading import engine_config, find_bundle, load_engine
from edge_spec.cli.options import BundleArg, EngineFlags
from edge_spec.defaults import (
    DEFAULT_HOST,
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PORT,
    DEFAULT_SHUTDOWN_GRACE,
    format_size,
)
from edge_spec.errors import EdgeSpecError


@dataclass(frozen=True)
class ServeFlags:
    """Where the server listens, whom it answers and how much it takes."""

    host: str = option(
        typer.Option(
            DEFAULT_HOST,
            help="Address to listen on (default: this machine only). On any other "
            "address (0.0.0.0: every interface) requests for localhost and for any IP address are "
            "answered; for a host name, add --allowed-host NAME.",
        )
    )
    port: int = option(typer.Option(DEFAULT_PORT, help="Port (0: any free port, printed at start)."))
    api_key: Optional[str] = option(
        typer.Option(
            None,
            "--api-key",
            envvar="EDGE_SPEC_API_KEY",
            help="Require 'Authorization: Bearer KEY' (default: any key or none). 'auto': a new random key "
            "for this launch, given in the JSON line the server prints on stdout once it listens.",
        )
    )
    max_queue: int = option(
        typer.Option(
            DEFAULT_MAX_QUEUE,
            help="Requests that may wait behind the one being answered; more get HTTP 429 with Retry-After.",
        )
    )
    shutdown_grace: float = option(
        typer.Option(
            DEFAULT_SHUTDOWN_GRACE,
            help="On SIGINT/SIGTERM, seconds the answer in progress gets to finish before it is stopped.",
        )
    )
    allowed_host: list[str] = option(
        typer.Option(
            [],
            "--allowed-host",
            help="Also answer requests whose Host header is "
            "NAME (repeatable; *.example.com: its subdomains; *: any host). "
            "Default: localhost names, loopback addresses and the --host address "
            "(any IP address when --host is not loopback), so a web page cannot "
            "reach the server by rebinding its own name to it.",
        )
    )
    cors_origin: list[str] = option(
        typer.Option(
            [],
            "--cors-origin",
            help="Let web pages from ORIGIN (such as "
            "http://localhost:3000) call the API from a browser (repeatable; * "
            "needs --api-key). Default: none, cross-origin requests get 403.",
        )
    )
    max_body: str = option(
        typer.Option(
            format_size(DEFAULT_MAX_BODY),
            "--max-body",
            help="Largest request body accepted (K, M, G suffixes); larger ones get HTTP 413.",
        )
    )
    alias: list[str] = option(
        typer.Option(
            [],
            "--alias",
            help="Another name requests may give the model, such as the "
            "one a client is configured with (repeatable; *: any name). Default: only the "
            "bundle's directory name; another name gets 404 model_not_found.",
        )
    )
    exit_with_parent: bool = option(
        typer.Option(
            False,
            "--exit-with-parent",
            help="Stop when the process that started this one dies or closes its stdin (a desktop "
            "application's sidecar; keep stdin a pipe to use it as a signal).",
        )
    )


@takes_groups
def serve(bundle: Optional[Path] = BundleArg, server: ServeFlags = ..., engine: EngineFlags = ...) -> None:
    """OpenAI-compatible HTTP server: /v1/chat/completions (tools too), /v1/completions (FIM too), /v1/models,
    /tokenize, /detokenize, /metrics, /health.  Once it listens it prints one JSON line on stdout:
    {"url", "api_key", "model"}; its log goes to stderr."""
    from edge_spec.server.guard import make_policy
    from edge_spec.server.serve import check_aliases, listen, run
    from edge_spec.server.sidecar import AUTO_KEY, ParentWatch, new_api_key

    parent = None
    if server.exit_with_parent:  # first: a parent that dies while the bundle loads is seen too
        parent = ParentWatch()
        parent.start()
    bundle = find_bundle(bundle)
    if server.max_queue < 0:
        raise EdgeSpecError("--max-queue must be 0 or more")
    if server.shutdown_grace < 0:
        raise EdgeSpecError("--shutdown-grace must not be negative")
    api_key = server.api_key
    if api_key is not None and not api_key.strip():
        raise EdgeSpecError("--api-key must not be empty")
    if api_key == AUTO_KEY:
        api_key = new_api_key()
    aliases = check_aliases(server.alias)
    config = engine_config(engine)
    sock = listen(server.host, server.port)  # a busy port fails before the (slow) load
    try:
        allowed_host = [*server.allowed_host, server.host]  # the name the server was started with is its own
        guard = dict(allowed_hosts=allowed_host, cors_origins=server.cors_origin, max_body=server.max_body)
        make_policy(bind_host=server.host, api_key=api_key, **guard)  # bad options fail before the (slow) load too
        loaded = load_engine(bundle, engine, config)
        run(
            loaded,
            sock,
            name=bundle.resolve().name,
            api_key=api_key,
            max_queue=server.max_queue,
            shutdown_grace=server.shutdown_grace,
            aliases=aliases,
            parent=parent,
            **guard,
        )
    finally:
        sock.close()

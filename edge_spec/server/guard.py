"""The HTTP policy in front of every route: who may talk to the server, and how much a request may send.

A server on loopback is still reachable from any web page its user opens, in two ways this module shuts:

* DNS rebinding: the page's own name is made to resolve to 127.0.0.1, so the browser sends the page's
  requests here as same-origin ones.  They carry ``Host: attacker.example``, so a request whose Host is not
  a loopback name, an IP address, or a name given with ``--allowed-host`` is refused (403).
* Cross-site requests: browsers send ``Origin`` with them.  One from an origin that is neither the server's
  own nor given with ``--cors-origin`` is refused (403) before anything runs, and CORS preflights are
  answered only for the configured origins.  POST bodies must be ``application/json``: a page can send that
  only after a preflight, so "simple" cross-site POSTs (``text/plain`` forms) never reach a route (415).

A single client must not freeze the server either: a body is read from the ASGI stream counting its bytes
and refused (413) as soon as it passes ``--max-body`` (or at once when Content-Length says it will), and a
body that stops arriving is refused (408) instead of holding its connection open.  Once a request with a
body of :data:`TRIM_BODY_BYTES` or more is answered (or refused for its size), the C allocator is asked to
return the pages it freed (:func:`edge_spec.runtime.heap.trim`, at most every :data:`TRIM_INTERVAL`
seconds): without that, each large body leaves the resident size higher.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response

from edge_spec.defaults import DEFAULT_HOST, DEFAULT_MAX_BODY, parse_size
from edge_spec.errors import EdgeSpecError
from edge_spec.runtime import heap
from edge_spec.server.errors import ApiError

BODY_IDLE_TIMEOUT = 30.0  # seconds a body may pause between two chunks
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
ALLOWED_METHODS = "GET, POST, OPTIONS"
DEFAULT_ALLOWED_HEADERS = "Authorization, Content-Type"
PREFLIGHT_MAX_AGE = "600"
_HEADER_LIST = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")
_DEFAULT_PORTS = {"http": 80, "https": 443}
TRIM_BODY_BYTES = 1 << 20  # a body this large: give the freed memory back once it is answered
TRIM_INTERVAL = 2.0  # seconds between two trims at least


@dataclass(frozen=True)
class GuardPolicy:
    """What :class:`Guard` lets through.  Build it with :func:`make_policy`, which checks the options."""

    bind_host: str = DEFAULT_HOST  # the address the server listens on
    allowed_hosts: tuple[str, ...] = ()  # lower-case names, "*.example.com" patterns, or "*"
    cors_origins: tuple[str, ...] = ()  # normalized "scheme://host[:port]", or "*"
    max_body: int = DEFAULT_MAX_BODY
    body_timeout: float = BODY_IDLE_TIMEOUT

    def host_allowed(self, host: str) -> bool:
        """Whether a request for ``host`` (the Host header without its port) is answered.

        Loopback names and addresses always are.  On a loopback bind no other address is; on any other bind
        (``--host 0.0.0.0``) every IP literal is, since clients reach such a server under addresses it may not
        know (a router's public address, a container's published port) and a literal cannot be rebound to
        another machine.  Names need ``--allowed-host``."""
        if "*" in self.allowed_hosts or host in self.allowed_hosts:
            return True
        if host == "localhost" or host.endswith(".localhost"):
            return True
        address = _ip(host)
        if address is not None:
            bind = _ip(self.bind_host)
            return address.is_loopback or address == bind or (bind is not None and not bind.is_loopback)
        return any(p.startswith("*.") and host.endswith(p[1:]) for p in self.allowed_hosts)

    def origin_allowed(self, origin: str) -> bool:
        """Whether cross-origin requests from ``origin`` (normalized) get CORS headers."""
        return "*" in self.cors_origins or origin in self.cors_origins


def make_policy(
    *,
    bind_host: str = DEFAULT_HOST,
    allowed_hosts=(),
    cors_origins=(),
    max_body: str | int = DEFAULT_MAX_BODY,
    api_key: str | None = None,
    body_timeout: float = BODY_IDLE_TIMEOUT,
) -> GuardPolicy:
    """The policy for these options, or an :class:`EdgeSpecError` naming the first bad one."""
    hosts = []
    for name in allowed_hosts:
        name = name.strip().lower().rstrip(".")
        if name.startswith("[") and name.endswith("]"):
            name = name[1:-1]
        if not name or any(c in name for c in "/ ") or (name.count(":") == 1 and _ip(name) is None):
            raise EdgeSpecError(f"--allowed-host takes a host name or address without scheme or port, got {name!r}")
        hosts.append(name)
    origins = []
    for value in cors_origins:
        origin = "*" if value.strip() == "*" else normalize_origin(value)
        if origin is None:
            raise EdgeSpecError(
                f"--cors-origin takes an origin such as https://app.example.com or "
                f"http://localhost:3000 (scheme, host, optional port; no path), got {value!r}"
            )
        origins.append(origin)
    if "*" in origins and not api_key:
        raise EdgeSpecError("--cors-origin '*' lets every web page use the model: it needs --api-key too")
    if body_timeout <= 0:
        raise EdgeSpecError("the body timeout must be positive")
    return GuardPolicy(
        bind_host=bind_host,
        allowed_hosts=tuple(hosts),
        cors_origins=tuple(origins),
        max_body=parse_size(max_body),
        body_timeout=body_timeout,
    )


def split_host(value: str) -> str | None:
    """The host of a Host header value (port dropped, IPv6 brackets removed, lower case), None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        host, bracket, port = value[1:].partition("]")
        if not bracket or (port and not (port.startswith(":") and port[1:].isdigit())):
            return None
    else:
        host, colon, port = value.partition(":")
        if colon and not port.isdigit():
            return None
    host = host.rstrip(".")
    return host or None


def normalize_origin(value: str) -> str | None:
    """``scheme://host[:port]`` in lower case with the scheme's default port dropped; None for anything that
    is not an http(s) origin (``null``, a URL with a path)."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").rstrip(".")
    if (
        scheme not in _DEFAULT_PORTS
        or not host
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        return None
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != _DEFAULT_PORTS[scheme] else "")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None


class Guard:
    """ASGI middleware applying a :class:`GuardPolicy` to every HTTP request before the app sees it."""

    def __init__(self, app, policy: GuardPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        method = scope["method"]
        raw_host = headers.get("host")
        refusal = self._host_refusal(raw_host)
        cors: dict[str, str] = {}
        if refusal is None:
            refusal, cors = self._cross_origin(headers, scope, raw_host)
        if refusal is None and cors and method == "OPTIONS" and "access-control-request-method" in headers:
            await _preflight(cors, headers)(scope, receive, send)
            return
        send = _with_headers(send, cors) if cors else send
        if refusal is None:
            refusal = self._body_header_refusal(headers, method)
        if refusal is not None:
            await _refuse(refusal, scope, receive, send, method)
            return
        if method in BODY_METHODS:
            await self._with_body(scope, receive, send, method)
            return
        await self.app(scope, receive, send)

    def _host_refusal(self, raw_host: str | None) -> ApiError | None:
        """A request for a name this server does not serve (DNS rebinding); HTTP/1.0 clients may send no
        ``Host``, browsers always do."""
        if raw_host is None:
            return None
        host = split_host(raw_host)
        if host is not None and self.policy.host_allowed(host):
            return None
        return ApiError(
            403,
            f"requests for the host {raw_host!r} are refused (a web page may have "
            "rebound its name to this server): start the server with "
            "--allowed-host NAME to serve a name",
            code="host_not_allowed",
        )

    def _cross_origin(self, headers: Headers, scope, raw_host: str | None) -> tuple[ApiError | None, dict[str, str]]:
        """(the refusal of a page of another origin, or None; the CORS headers an allowed one is answered
        with, none for a same-origin request)."""
        origin_header = headers.get("origin")
        if origin_header is None:
            return None, {}
        origin = normalize_origin(origin_header)
        own = normalize_origin(f"{scope.get('scheme', 'http')}://{raw_host}") if raw_host else None
        if origin is not None and origin == own:
            return None, {}
        if origin is None or not self.policy.origin_allowed(origin):
            return ApiError(
                403,
                f"cross-origin requests from {origin_header!r} are refused: start "
                "the server with --cors-origin ORIGIN to let a web page use it",
                code="origin_not_allowed",
            ), {}
        return None, {
            "Access-Control-Allow-Origin": origin_header.strip(),
            "Vary": "Origin",
            "Access-Control-Expose-Headers": "Retry-After",
        }

    def _body_header_refusal(self, headers: Headers, method: str) -> ApiError | None:
        """What the headers alone say of the body: a length that is not a number or over the limit, and
        for a body method anything but JSON."""
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                return ApiError(400, "the Content-Length header is not a number")
            if int(length) > self.policy.max_body:
                return _too_large(self.policy.max_body)
        if method not in BODY_METHODS:
            return None
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type == "application/json":
            return None
        sent = headers.get("content-type")
        got = "no Content-Type" if sent is None else repr(sent)
        return ApiError(
            415,
            f"the request body must be JSON sent with 'Content-Type: application/json', got {got}",
            code="unsupported_media_type",
        )

    async def _with_body(self, scope, receive, send, method: str) -> None:
        """The app, handed the body read within the limits (a large one's memory given back after)."""
        try:
            body = await _read_body(receive, self.policy)
        except ApiError as exc:
            await _refuse(exc, scope, receive, send, method)
            if exc.status == 413:
                await asyncio.to_thread(heap.trim, TRIM_INTERVAL)
            return
        if body is None:  # the client went away while sending
            return
        receive = _replay(body, receive)
        if len(body) < TRIM_BODY_BYTES:
            await self.app(scope, receive, send)
            return
        del body  # the replay holds it until the app has read it
        try:
            await self.app(scope, receive, send)
        finally:
            await asyncio.to_thread(heap.trim, TRIM_INTERVAL)


async def _read_body(receive, policy: GuardPolicy) -> bytes | None:
    """The whole body, counted as it arrives: 413 past the cap, 408 when it pauses too long, None when the
    client disconnects."""
    chunks, size = [], 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), policy.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(
                408, f"the request body stopped arriving for {policy.body_timeout:g} s", code="request_timeout"
            ) from None
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > policy.max_body:
            raise _too_large(policy.max_body)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive that hands the app the body already read, then the connection's own messages (disconnect)."""
    pending = [body]  # handed over once, then no longer held here

    async def replay():
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return replay


def _with_headers(send, extra: dict[str, str]):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            for name, value in extra.items():
                if name == "Vary" and "vary" in headers:
                    headers.add_vary_header(value)
                else:
                    headers[name] = value
        await send(message)

    return wrapped


def _preflight(cors: dict[str, str], headers: Headers) -> Response:
    requested = headers.get("access-control-request-headers", "").strip()
    allowed = requested if requested and _HEADER_LIST.fullmatch(requested) else DEFAULT_ALLOWED_HEADERS
    return Response(
        status_code=204,
        headers={
            **cors,
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": allowed,
            "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
        },
    )


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes (--max-body)",
        code="request_too_large",
    )


async def _refuse(error: ApiError, scope, receive, send, method: str) -> None:
    """The error in OpenAI's shape; the connection is closed after it when a body may be left unread, so
    the rest of that body is never read."""
    headers = dict(error.headers)
    if method in BODY_METHODS or error.status in (408, 413):
        headers["Connection"] = "close"
    await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)

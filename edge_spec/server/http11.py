"""uvicorn's h11 protocol with a deadline on reading a request's line and headers.

uvicorn's ``timeout_keep_alive`` only runs between two requests, from the end of an answer to the first
byte of the next request: a connection that opens and says nothing, or that sends a request line and
then one header byte a second (slowloris), stays open for ever, and a hundred of them fill the server's
connection limit.  This protocol closes a connection whose request line and headers are not complete
``header_timeout`` seconds after the connection opened (or after the first byte of a following request).
Once the headers are in, the deadline is off: reading the body is bounded by the app (:mod:`guard`), and
an answer may stream for as long as it takes.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0


class HeaderDeadlineProtocol(H11Protocol):
    """:class:`H11Protocol` closing connections that do not complete their request headers in time."""

    header_timeout: float = HEADER_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Arm the deadline while h11 still waits for a request's headers, drop it once they are in."""
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._header_deadline is None:
                self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)
        else:
            self._cancel_deadline()

    def _cancel_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug("closing a connection whose request headers took over %g s", self.header_timeout)
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with this header deadline."""
    if seconds <= 0:
        raise ValueError("the header timeout must be positive")
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": float(seconds)})

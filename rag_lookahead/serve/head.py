"""A deadline on the bytes a connection sends while no handler is reading them.

uvicorn's h11 protocol has none: it arms no timer when a connection opens, and the keep-alive
timer it arms after a response is cancelled by any byte received and not armed again. A client
that opens connections and sends nothing, or a request head one byte every few seconds, or a body
the server has already answered, held each connection for good (slowloris).

:func:`h11_with_head_timeout` is uvicorn's ``H11Protocol`` with a timer of ``head_timeout``
seconds, armed when a connection opens, when the first byte of a later request head arrives,
and when a response goes out while the client is still sending a body nobody reads; it is
cancelled once the head is in (the body then has ``body_timeout``). On expiry a partly received
head gets 408 and the connection closes; otherwise the connection just closes.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from rag_lookahead.serve.api_error import head_timed_out

__all__ = ["HeadTimeoutProtocol", "h11_with_head_timeout"]

log = logging.getLogger(__name__)


class HeadTimeoutProtocol(H11Protocol):
    """``H11Protocol`` with the deadline of the module docstring; :func:`h11_with_head_timeout`
    gives it its ``head_timeout``."""

    head_timeout: float = 30.0

    _head_timer: asyncio.TimerHandle | None = None
    _watching: str | None = None  # "head" (a request head is due) or "leftover" (an answered body)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Arm the timer when the client owes bytes no handler waits for, else disarm it."""
        kind = None if self.transport.is_closing() else self._owed()
        if kind != self._watching:
            self._disarm()
            if kind is not None:
                self._head_timer = self.loop.call_later(self.head_timeout, self._expired)
                self._watching = kind

    def _owed(self) -> str | None:
        theirs = self.conn.their_state
        if theirs is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            return "head"  # a fresh connection, or a later head begun (idle between: keep-alive timer)
        if theirs is h11.SEND_BODY and self.conn.our_state in (h11.DONE, h11.MUST_CLOSE):
            return "leftover"
        return None

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer, self._watching = None, None

    def _expired(self) -> None:
        kind = self._watching
        self._head_timer, self._watching = None, None
        if self.transport.is_closing():
            return
        log.debug("closing %s: no complete request within %g s (%s)", self.client, self.head_timeout, kind)
        if kind == "head" and self.conn.our_state is h11.IDLE and self.conn.trailing_data[0]:
            self._send_408()
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()

    def _send_408(self) -> None:
        body = json.dumps(head_timed_out(self.head_timeout).body()).encode()
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"), h11.Data(body)):
                self.transport.write(self.conn.send(event))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # h11 will not answer in its state: just close
            pass


def h11_with_head_timeout(seconds: float) -> type[HeadTimeoutProtocol]:
    """The protocol class for uvicorn's ``http=`` option, with a ``head_timeout`` of ``seconds``."""
    return type("H11HeadTimeout", (HeadTimeoutProtocol,), {"head_timeout": float(seconds)})

"""A deadline on the request head (request line + headers) of every HTTP connection `k3 serve` accepts.

uvicorn has none: its keep-alive timer only covers the idle gap after a response and is cancelled by any byte
that arrives, and a freshly accepted connection has no timer at all; ASGI middleware cannot help either, since
it only runs once the head is complete. So a client that sends its headers one byte a second (slowloris), or
connects and sends nothing, holds a connection (a file descriptor, a place under --limit-concurrency) for as long
as it likes. `HeadDeadlineProtocol` is uvicorn's own HTTP protocol (the one it would pick itself) with a timer
that starts when the connection is accepted or its previous response is finished, stops once a request head has
been parsed, and closes the connection when it fires (with a 408 if part of a head had arrived). The body has its
own timeout in the app (api.BODY_TIMEOUT_S); a long response (a stream) is never cut by this one. The head's size
is bounded by h11 itself (16 KiB of incomplete request by default).

It also tells every unfinished request of a connection that the connection is gone: uvicorn tells only its newest
(`cycle`), and under httptools a pipelined request is parsed, and becomes the newest, while the one before it still
streams; that stream would generate on for nobody (see `connection_lost`). And it notices a client that hangs up
while uvicorn is not reading its socket (see `_watch_hangup`)."""
from __future__ import annotations

import asyncio
import logging
import select

from uvicorn.protocols.http.auto import AutoHTTPProtocol

HEADER_TIMEOUT_S = 10.0  # a request head is a few hundred bytes: any live client sends it in well under a second
LIMIT_CONCURRENCY = 1024  # open connections + running requests past which uvicorn answers 503
_SPARE_FILES = 256  # descriptors kept for everything but client sockets: model files, torch, logs, pipes
HANGUP_POLL_S = 0.25  # how often the socket of a connection uvicorn is not reading is checked for the peer's close
# the peer's FIN (Linux's poll flag; POLLHUP and POLLERR, for a reset, are always reported). Elsewhere it is 0 and
# there is no watch: a hang-up during a paused read is seen at the next write, as in plain uvicorn
_POLLRDHUP = getattr(select, "POLLRDHUP", 0)

_TIMEOUT_TEXT = b"the request head (request line and headers) took too long to arrive\n"
_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(_TIMEOUT_TEXT), _TIMEOUT_TEXT))
_log = logging.getLogger("uvicorn.error")


def head_deadline_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with a `timeout_s` deadline on each request head (uvicorn's `http=`)."""
    if not timeout_s > 0:
        raise ValueError(f"header timeout must be > 0 seconds, got {timeout_s!r}")

    class HeadDeadlineProtocol(AutoHTTPProtocol):
        head_timeout_s = timeout_s
        _cycle = None
        _hangup_timer: asyncio.TimerHandle | None = None
        _cycles: list | tuple = ()  # the connection's unfinished requests, oldest first (kept by the setter)

        @property
        def cycle(self):
            """The newest request. Both of uvicorn's protocols assign every request they parse to `cycle`, so its
            setter is where the older, still unfinished ones are remembered."""
            return self._cycle

        @cycle.setter
        def cycle(self, cycle) -> None:
            live = [c for c in self._cycles if not c.response_complete]
            self._cycles, self._cycle = (live if cycle is None else live + [cycle]), cycle

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._head_bytes += len(data)
            super().data_received(data)
            if self._head_timer is not None and self._in_request():
                self._disarm()
            self._watch_hangup()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # the next request's head gets its own deadline, unless a pipelined one has already started
            if not self.transport.is_closing() and not self._in_request():
                self._arm()
            self._watch_hangup()  # reading has resumed (or, under h11, paused again for the next pipelined request)

        def handle_websocket_upgrade(self, *args) -> None:
            self._disarm()  # the connection now belongs to a WebSocket protocol, with its own timeouts
            super().handle_websocket_upgrade(*args)

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._hangup_timer is not None:
                self._hangup_timer.cancel()
            # uvicorn marks only the newest request disconnected: a stream followed by a pipelined request head
            # (parsed at once by httptools) would never see http.disconnect, and generate on for nobody
            for cycle in self._cycles:
                if not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()  # wakes its receive(), which then answers http.disconnect
            super().connection_lost(exc)

        def _watch_hangup(self) -> None:
            """Poll the socket for the peer's close while uvicorn is not reading it, and only then. Both protocols
            pause reading while a request is served and a pipelined one waits (or its body is not yet consumed); a
            paused socket reports neither EOF nor reset until the server writes, and a non-streaming response
            writes nothing until it is done, so a client that pipelines and leaves had all its tokens generated for
            nobody. Called after whatever may pause or resume reading (parsing data, finishing a response)."""
            reading = self.transport.is_closing() or self.transport.is_reading()
            if reading and self._hangup_timer is not None:
                self._hangup_timer.cancel()
                self._hangup_timer = None
            elif not reading and self._hangup_timer is None and _POLLRDHUP:
                self._hangup_timer = self.loop.call_later(HANGUP_POLL_S, self._check_hangup)

        def _check_hangup(self) -> None:
            self._hangup_timer = None
            sock = self.transport.get_extra_info("socket")
            if self.transport.is_closing() or self.transport.is_reading() or sock is None:
                return  # closed, or reading again (a request's receive() resumes reading unseen by this class)
            poller = select.poll()  # asks for the hang-up events only: the unread data stays uvicorn's
            poller.register(sock.fileno(), _POLLRDHUP)
            if poller.poll(0):
                # what uvicorn does on EOF while reading (eof_received returns None): close; connection_lost then
                # marks every unfinished request disconnected. A half-closed client counts as gone there too
                self.transport.close()
            else:
                self._watch_hangup()

        def _in_request(self) -> bool:
            """Whether a request whose head has been parsed is being served (both protocols set `cycle` then)."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._expire)

        def _disarm(self) -> None:
            if getattr(self, "_head_timer", None) is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self._head_bytes:  # a silent idle connection is just closed; a partial head is told why
                self.transport.write(_REQUEST_TIMEOUT)
                _log.info("closed a connection whose request head had not arrived within %g s", self.head_timeout_s)
            self.transport.close()

    return HeadDeadlineProtocol


def fit_connection_limit(limit: int) -> int:
    """The concurrency limit this process can honour: the open-files limit is raised (to its hard cap) so that
    `limit` client sockets fit beside the server's own files; what still does not fit lowers the limit, so that a
    flood of connections meets uvicorn's 503 rather than failing accept() (EMFILE)."""
    import resource  # POSIX only, like the rest of serving

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = limit + _SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < want:
        new_soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
            soft = new_soft
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(1, min(limit, soft - _SPARE_FILES))

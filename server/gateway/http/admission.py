"""Who may hold a gateway process's client connection slots, and the refusals of a connection.

http.seam calls `Admission` at each step of a connection's life (`admit` when it opens, `busy`
when a request's head is complete, `idle` when its answer is, `authenticate` when a request on it
passed the API key check, `release` when it closes); each call is O(1), none runs per chunk:
- at most `max_connections` at once. At the cap a newcomer takes the slot of an idle connection
  (no request of it in progress: it never sent one, is between keep-alive requests, or is still
  sending a request's head), one that never carried an authenticated request first, then any
  other, the longest idle first in each (two insertion-ordered sets, so no scan); only when
  every connection is busy is the newcomer refused (503 too_many_connections). An unauthenticated
  flood thus takes slots only from itself, never from clients with a key;
- at most `max_per_peer` connections from one client address (0: no cap), and at most
  `max_unauthenticated_per_peer` on which no request has passed the key check yet (0: no cap;
  counted only while the gateway has API keys): one more is refused 429
  too_many_connections_from_peer. Without keys every connection counts as authenticated; the app
  says which it is with each request that passed (`authenticate(slot, keys_checked)`), and until
  it first does the gateway is taken to have keys (the safe side).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from server.gateway.errors import GatewayError, error_body


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class HeaderFieldsTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    code = "request_header_fields_too_large"


class TooManyPeerConnections(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "too_many_connections_from_peer"


class TooManyConnections(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "too_many_connections"


_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


def raw_error_response(exc: GatewayError) -> bytes:
    """A complete HTTP/1.1 error response, for answers written before any ASGI app runs."""
    body = error_body(exc)
    return b"".join(
        (
            b"HTTP/1.1 %d %s\r\n" % (exc.status, _REASONS[exc.status]),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        )
    )


class Slot:
    """One admitted connection: its peer, whether it has authenticated, the idle set it is in."""

    __slots__ = ("authenticated", "idle_in", "let_go", "peer")

    def __init__(self, peer: str, authenticated: bool, let_go: Callable[[], None]) -> None:
        self.peer = peer
        self.authenticated = authenticated
        self.idle_in: OrderedDict[Slot, None] | None = None
        # Closes the connection when its slot goes to a newcomer; None once released (the
        # reference to its connection is dropped then: no cycle is left for the garbage collector).
        self.let_go: Callable[[], None] | None = let_go


class Admission:
    """The connection slots of one server (one per ConnectionLimits): see the module doc."""

    def __init__(self, *, max_connections: int, max_per_peer: int = 0, max_unauthenticated_per_peer: int = 0) -> None:
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.max_unauthenticated_per_peer = max_unauthenticated_per_peer
        self.keyed = True  # the gateway checks API keys (until a request says it checks none)
        self.held = 0  # slots held, including those let go whose connection has not closed yet
        self.closed_for_newcomers = 0  # idle connections let go at the cap, since the start
        self._peers: dict[str, int] = {}
        self._unauthenticated: dict[str, int] = {}
        self._fresh: OrderedDict[Slot, None] = OrderedDict()  # idle, never authenticated
        self._known: OrderedDict[Slot, None] = OrderedDict()  # idle, authenticated before

    def admit(self, peer: str, let_go: Callable[[], None]) -> Slot | GatewayError:
        """A slot for a new connection from `peer`, idle; or the refusal to answer it with."""
        held_by_peer = self._peers.get(peer, 0)
        if self.max_per_peer and held_by_peer >= self.max_per_peer:
            return TooManyPeerConnections(
                f"Your address has {held_by_peer} connections open to the gateway, its limit per client "
                "(limits.max_connections_per_peer); reuse them or close some."
            )
        authenticated = not self.keyed
        unauthenticated = self._unauthenticated.get(peer, 0)
        cap = self.max_unauthenticated_per_peer
        if not authenticated and cap and unauthenticated >= cap:
            return TooManyPeerConnections(
                f"Your address has {unauthenticated} connections open to the gateway on which no request "
                "has passed the API key check, its limit per client (limits.max_unauthenticated_per_peer)."
            )
        if self.held >= self.max_connections and not self._let_one_go():
            return TooManyConnections(
                f"The gateway has {self.max_connections} open connections, its limit, all of them busy; retry shortly."
            )
        slot = Slot(peer, authenticated, let_go)
        self.held += 1
        self._peers[peer] = held_by_peer + 1
        if not authenticated:
            self._unauthenticated[peer] = unauthenticated + 1
        self.idle(slot)
        return slot

    def idle(self, slot: Slot) -> None:
        """No request of the connection is in progress: its slot may go to a newcomer."""
        if slot.idle_in is None and slot.let_go is not None:
            idle = self._known if slot.authenticated else self._fresh
            idle[slot] = None
            slot.idle_in = idle

    def busy(self, slot: Slot) -> None:
        """A request of the connection is in progress (from its complete head to its answer's end)."""
        idle = slot.idle_in
        if idle is not None:
            del idle[slot]
            slot.idle_in = None

    def authenticate(self, slot: Slot, keys_checked: bool = True) -> None:
        """A request on the connection passed the API key check (`keys_checked=False`: the gateway
        has no keys; from then on every new connection counts as authenticated from its start)."""
        if not keys_checked:
            self.keyed = False
        if slot.authenticated:
            return
        slot.authenticated = True
        self._uncount_unauthenticated(slot.peer)
        if slot.idle_in is self._fresh:
            self.busy(slot)
            self.idle(slot)

    def release(self, slot: Slot) -> None:
        """The connection closed: its slot is free."""
        if slot.let_go is None:
            return
        slot.let_go = None
        self.busy(slot)
        self.held -= 1
        peer = slot.peer
        left = self._peers[peer] - 1
        if left:
            self._peers[peer] = left
        else:
            del self._peers[peer]
        if not slot.authenticated:
            self._uncount_unauthenticated(peer)

    def _uncount_unauthenticated(self, peer: str) -> None:
        left = self._unauthenticated[peer] - 1
        if left:
            self._unauthenticated[peer] = left
        else:
            del self._unauthenticated[peer]

    def _let_one_go(self) -> bool:
        """Close the idle connection whose slot a newcomer takes (see the module doc); False if none is idle."""
        for idle in (self._fresh, self._known):
            if idle:
                victim, _ = idle.popitem(last=False)
                victim.idle_in = None
                let_go = victim.let_go
                if let_go is not None:
                    self.closed_for_newcomers += 1
                    let_go()
                return True
        return False

"""The connection slots' bookkeeping (server.gateway.http.admission), without sockets: who is let go
at the cap, in which order, and the per-peer caps."""

from __future__ import annotations

from server.gateway.http.admission import (
    Admission,
    Slot,
    TooManyConnections,
    TooManyPeerConnections,
)


class Connections:
    """Stand-ins for connections: `open(name)` admits one, and records it when it is let go."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.slots: dict[str, Slot] = {}
        self.let_go: list[str] = []

    def open(self, name: str, peer: str = "10.0.0.1") -> Slot | Exception:
        def let_go() -> None:
            self.let_go.append(name)
            self.admission.release(self.slots.pop(name))  # as the connection's close does, later

        admitted = self.admission.admit(peer, let_go)
        if isinstance(admitted, Slot):
            self.slots[name] = admitted
        return admitted

    def close(self, name: str) -> None:
        self.admission.release(self.slots.pop(name))

    def request(self, name: str, *, authenticated: bool) -> None:
        """A request on `name` from its head to its answer's end."""
        slot = self.slots[name]
        self.admission.busy(slot)
        if authenticated:
            self.admission.authenticate(slot)
        self.admission.idle(slot)


def test_at_the_cap_the_oldest_idle_never_authenticated_connection_is_let_go_first():
    conns = Connections(Admission(max_connections=3))
    for name in ("keyed", "flood-1", "flood-2"):
        assert isinstance(conns.open(name), Slot)
    conns.request("keyed", authenticated=True)
    conns.request("flood-1", authenticated=False)  # 401: idle again, still unauthenticated
    assert isinstance(conns.open("flood-3"), Slot)
    assert isinstance(conns.open("flood-4"), Slot)
    # flood-2 has been idle the longest (flood-1's 401 made it idle later); "keyed" is kept
    assert conns.let_go == ["flood-2", "flood-1"]
    assert isinstance(conns.open("flood-5"), Slot)
    assert conns.let_go == ["flood-2", "flood-1", "flood-3"]
    assert conns.admission.held == 3 and conns.admission.closed_for_newcomers == 3


def test_authenticated_connections_go_when_no_other_is_idle_the_longest_idle_first():
    conns = Connections(Admission(max_connections=2))
    conns.open("a")
    conns.open("b")
    conns.request("a", authenticated=True)
    conns.request("b", authenticated=True)
    conns.request("a", authenticated=True)  # "a" idle again: now the more recently idle one
    conns.open("c")
    assert conns.let_go == ["b"]


def test_a_busy_connection_is_never_let_go_and_when_all_are_busy_the_newcomer_is_refused():
    conns = Connections(Admission(max_connections=2))
    conns.open("a")
    conns.open("b")
    for name in ("a", "b"):
        conns.admission.busy(conns.slots[name])  # requests in progress
    refused = conns.open("c")
    assert isinstance(refused, TooManyConnections) and refused.status == 503
    assert conns.let_go == []
    conns.admission.idle(conns.slots["b"])  # b's answer is complete
    assert isinstance(conns.open("c"), Slot) and conns.let_go == ["b"]


def test_closed_connections_free_their_slots_and_leave_the_idle_sets():
    conns = Connections(Admission(max_connections=2))
    conns.open("a")
    conns.open("b")
    conns.close("a")
    assert isinstance(conns.open("c"), Slot) and conns.let_go == []
    assert isinstance(conns.open("d"), Slot) and conns.let_go == ["b"]


def test_the_per_peer_cap_counts_each_address_on_its_own():
    conns = Connections(Admission(max_connections=100, max_per_peer=2))
    conns.open("a1", "10.0.0.1")
    conns.open("a2", "10.0.0.1")
    refused = conns.open("a3", "10.0.0.1")
    assert isinstance(refused, TooManyPeerConnections) and refused.status == 429
    assert refused.code == "too_many_connections_from_peer"
    assert isinstance(conns.open("b1", "10.0.0.2"), Slot)
    conns.close("a1")
    assert isinstance(conns.open("a3", "10.0.0.1"), Slot)


def test_the_unauthenticated_per_peer_cap_leaves_authenticated_connections_out():
    conns = Connections(Admission(max_connections=100, max_unauthenticated_per_peer=2))
    conns.open("keyed")
    conns.open("u1")
    assert isinstance(conns.open("u2"), TooManyPeerConnections)  # keyed has not authenticated yet
    conns.request("keyed", authenticated=True)
    assert isinstance(conns.open("u2"), Slot)
    assert isinstance(conns.open("u3"), TooManyPeerConnections)
    assert isinstance(conns.open("other", "10.0.0.2"), Slot)
    conns.close("u1")
    assert isinstance(conns.open("u3"), Slot)


def test_without_keys_every_new_connection_counts_as_authenticated():
    admission = Admission(max_connections=2, max_unauthenticated_per_peer=1)
    conns = Connections(admission)
    conns.open("first")
    assert isinstance(conns.open("second"), TooManyPeerConnections)  # keys are assumed until told
    admission.authenticate(conns.slots["first"], keys_checked=False)  # a request: the gateway has no keys
    assert isinstance(conns.open("second"), Slot) and conns.slots["second"].authenticated
    assert isinstance(conns.open("third"), Slot)
    assert conns.let_go == ["first"]  # the longest idle, all of them authenticated

"""Engines found by DNS, against a real DNS server on loopback (dnslib's) whose answer changes.

The stand-ins all listen on 127.0.0.1, so the replicas are told apart by port: the main test uses
SRV records (`_http._tcp.NAME`: host and port per engine, as a Kubernetes headless Service with a
named port publishes them); the A-record form (`NAME:PORT`) is checked on one address.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from dnslib import QTYPE, RCODE, RR, SRV, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer
from pydantic import ValidationError

from server.config import ModelEngines, ServedModel
from server.gateway.replicas.discovery import DnsLookup, EngineDiscovery
from server.gateway.replicas.pool import EnginePool
from tests.gateway.conftest import chat_body, fast_settings, sse_events
from tests.support import wait_for

SERVICE = "_http._tcp.engines.test."


class Zone(BaseResolver):  # type: ignore[misc]
    """An authoritative answer for any name in `records` (NXDOMAIN for the rest), changeable at any time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[str, list[RR]] = {}
        self.failing = False  # answer SERVFAIL to everything
        self.queries = 0

    def serve_ports(self, ports: list[int]) -> None:
        """SRV: one engine on 127.0.0.1 per port."""
        records = {SERVICE: [RR(SERVICE, QTYPE.SRV, rdata=SRV(0, 0, port, f"e{port}.test."), ttl=0) for port in ports]}
        records.update(
            {f"e{port}.test.": [RR(f"e{port}.test.", QTYPE.A, rdata=A("127.0.0.1"), ttl=0)] for port in ports}
        )
        with self.lock:
            self.records = records

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        name, qtype = str(request.q.qname).lower(), request.q.qtype
        with self.lock:
            self.queries += 1
            failing, records = self.failing, self.records.get(name)
        if failing:
            reply.header.rcode = RCODE.SERVFAIL
        elif records is None:
            reply.header.rcode = RCODE.NXDOMAIN
        else:
            for record in records:
                if record.rtype == qtype:
                    reply.add_answer(record)
        return reply


@pytest.fixture
def dns_zone() -> Iterator[tuple[Zone, str]]:
    """A DNS server on 127.0.0.1 (UDP, a free port) and its zone; yields (zone, "127.0.0.1:port")."""
    zone = Zone()
    quiet = DNSLogger("-recv,-send,-request,-reply,-truncated,-error,-data", False)
    server = DNSServer(zone, address="127.0.0.1", port=0, logger=quiet)
    server.start_thread()
    try:
        yield zone, f"127.0.0.1:{server.server.server_address[1]}"
    finally:
        server.stop()
        server.server.server_close()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.one_process("reads which engines the gateway's pool holds")
def test_replicas_join_and_leave_while_requests_flow_and_none_fails(engines, gateway, dns_zone):
    zone, nameserver = dns_zone
    a, b, c = engines(3)
    zone.serve_ports([port_of(a.url), port_of(b.url)])
    settings = fast_settings({}, discovery={"interval": 0.05, "timeout": 1.0, "nameservers": [nameserver]})
    settings.models = [ModelEngines(name="standin", dns=["_http._tcp.engines.test"])]
    gw = gateway(settings)
    pool = gw.state.upstreams.models["standin"]

    def urls() -> set[str]:
        return {engine.url for engine in pool.engines}

    assert urls() == {a.url, b.url}  # the first round ran before the first request
    kept = {engine.url: engine for engine in pool.engines}

    outcomes: list[str] = []  # "ok", or what went wrong
    stop = threading.Event()

    def client(worker: int) -> None:
        with httpx.Client(timeout=60) as http:
            n = 0
            while not stop.is_set():
                n += 1
                stream = n % 2 == 0
                body = chat_body(f"worker {worker} request {n} " + "x" * 40, stream=stream, max_tokens=4)
                try:
                    response = http.post(f"{gw.url}/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    outcomes.append(f"{type(exc).__name__}: {exc}")
                    continue
                if response.status_code != 200:
                    outcomes.append(f"{response.status_code}: {response.text}")
                elif stream and (sse_events(response.text)[-1:] != ["[DONE]"] or '"error"' in response.text):
                    outcomes.append(f"stream did not complete: {response.text[-200:]}")
                else:
                    outcomes.append("ok")

    workers = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for worker in workers:
        worker.start()
    try:
        # C joins: it gets traffic, and A and B are the same Engine objects as before.
        zone.serve_ports([port_of(a.url), port_of(b.url), port_of(c.url)])
        wait_for(lambda: urls() == {a.url, b.url, c.url}, what=urls)
        wait_for(lambda: c.stats()["finished"] >= 3, what=c.stats)
        assert all(pool.engines[i] is kept[e.url] for i, e in enumerate(pool.engines) if e.url in kept)

        # B leaves while it holds requests: they finish after it left, and it gets no new ones.
        b.faults(hold=True)
        wait_for(lambda: b.stats()["held"] >= 1, what=b.stats)
        held = b.stats()["held"]
        zone.serve_ports([port_of(a.url), port_of(c.url)])
        wait_for(lambda: urls() == {a.url, c.url}, what=urls)
        started_at_b = b.stats()["started"]
        done_before = len(outcomes)
        wait_for(lambda: len(outcomes) >= done_before + 10, what=lambda: len(outcomes))
        assert b.stats()["started"] == started_at_b  # no new request went to B once it left
        httpx.post(f"{b.url}/_standin/release", timeout=5).raise_for_status()
        wait_for(lambda: b.stats()["finished"] >= held and b.stats()["held"] == 0, what=b.stats)
        assert kept[b.url].outstanding == 0  # its requests were counted back on the object that left

        # Everyone leaves but C, then A comes back: a new Engine for A, C's object and state stay.
        c_engine = next(e for e in pool.engines if e.url == c.url)
        checks_before = c_engine.successes
        zone.serve_ports([port_of(c.url)])
        wait_for(lambda: urls() == {c.url}, what=urls)
        zone.serve_ports([port_of(a.url), port_of(c.url)])
        wait_for(lambda: urls() == {a.url, c.url}, what=urls)
        assert next(e for e in pool.engines if e.url == a.url) is not kept[a.url]
        assert next(e for e in pool.engines if e.url == c.url) is c_engine
        wait_for(lambda: c_engine.successes > checks_before, what=lambda: c_engine)  # health checks go on
        done_now = len(outcomes)
        wait_for(lambda: len(outcomes) >= done_now + 10, what=lambda: len(outcomes))
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
    failures = [outcome for outcome in outcomes if outcome != "ok"]
    assert not failures, failures[:5]
    assert len(outcomes) >= 20
    metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
    assert f'engine="127.0.0.1:{port_of(c.url)}"' in metrics  # the collector sees engines found by DNS


def run_discovery(zone: Zone, nameserver: str, dns: str, step: Any) -> None:
    """Drive one EngineDiscovery round by round (no background loop) with `step(discovery, pool)`."""
    model = ServedModel("m", [], dns=[dns])
    pool = EnginePool.from_models([model])
    discovery = EngineDiscovery(pool, [model], DnsLookup([nameserver], timeout=1.0))
    asyncio.run(step(discovery, pool.get("m")))


def test_a_records_give_one_engine_per_address_on_the_named_port(dns_zone):
    zone, nameserver = dns_zone

    async def step(discovery: EngineDiscovery, pool: Any) -> None:
        await discovery.refresh()  # NXDOMAIN: no engines, which is an answer
        assert pool.engines == []
        with zone.lock:
            zone.records = {"engines.test.": [RR("engines.test.", QTYPE.A, rdata=A("127.0.0.1"), ttl=0)]}
        await discovery.refresh()
        assert [e.url for e in pool.engines] == ["http://127.0.0.1:8123"]
        engine = pool.engines[0]
        with zone.lock:
            zone.failing = True  # SERVFAIL: the lookup failed, the engine stays
        await discovery.refresh()
        assert pool.engines == [engine]
        with zone.lock:
            zone.failing, zone.records = False, {"engines.test.": []}  # the name exists, no address
        await discovery.refresh()
        assert pool.engines == []

    run_discovery(zone, nameserver, "engines.test:8123", step)


def test_an_unreachable_dns_server_keeps_the_engines_known(dns_zone):
    zone, nameserver = dns_zone
    zone.serve_ports([9001])

    async def step(discovery: EngineDiscovery, pool: Any) -> None:
        await discovery.refresh()
        assert [e.url for e in pool.engines] == ["http://127.0.0.1:9001"]
        discovery.lookup = DnsLookup(["127.0.0.1:9"], timeout=0.3)  # discard port: nothing answers
        await discovery.refresh()
        assert [e.url for e in pool.engines] == ["http://127.0.0.1:9001"]

    run_discovery(zone, nameserver, "_http._tcp.engines.test", step)


@pytest.mark.parametrize(
    "dns", ["engine-tiny.default.svc:8000", "_http._tcp.engine-tiny.default.svc", ["a.test:1", "_x._tcp.b.test"]]
)
def test_dns_names_that_are_accepted(dns):
    assert ModelEngines(name="m", dns=dns).dns == ([dns] if isinstance(dns, str) else dns)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "m", "dns": "engine-tiny"}, "give the port"),
        ({"name": "m", "dns": "engine tiny:8000"}, "expected NAME:PORT"),
        ({"name": "m", "dns": "http://engine:8000"}, "expected NAME:PORT"),
        ({"name": "m", "dns": "engine:0"}, "1..65535"),
        ({"name": "m", "dns": "engine:8000", "urls": ["http://x:1"]}, "not both"),
        ({"dns": "engine:8000"}, "needs `name`"),
    ],
)
def test_dns_names_that_are_refused(entry, message):
    with pytest.raises(ValidationError, match=message):
        ModelEngines.model_validate(entry)

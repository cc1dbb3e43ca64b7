"""Engines found by DNS: a model's `dns` names, resolved every `discovery.interval` seconds.

A Kubernetes headless Service answers with one address per ready pod, a compose service with
`deploy.replicas` with one per container. Each address becomes an `Engine` (`http://ADDR:PORT`)
of the model's pool; an SRV name (`_http._tcp.NAME`) gives each engine's host and port itself.

Every round compares the addresses with the engines found before:
- an engine whose address stays is the same `Engine` object: its health, load (`outstanding`),
  figures and prefix-cache record go on, and rendezvous affinity keeps its sessions;
- a new address gets one health check before it joins the pool (`join`), so a pod still loading
  its model is not sent traffic before /health answers;
- an address that went is taken out of the pool: no new request is routed there, while requests
  already sent finish on their own connections (the proxy holds the `Engine` and its stream);
  `leave` stops its scrapes and forgets its prefix-cache record.
A lookup that fails (timeout, SERVFAIL, no server) changes nothing: a DNS hiccup must not empty a
pool. A name that does not exist, or has no address, is an answer: no engines (a Service with no
ready pod answers NXDOMAIN).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdata
import dns.resolver
from dns.rdtypes.IN.A import A
from dns.rdtypes.IN.AAAA import AAAA
from dns.rdtypes.IN.SRV import SRV

from server.config import ServedModel, parse_dns
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.pool import EnginePool

log = logging.getLogger("gateway.discovery")

Address = tuple[str, int]  # (IP address, port)


class Lookup(Protocol):
    """The addresses behind one `dns` name; None when the lookup failed (keep what is known)."""

    async def __call__(self, name: str, port: int | None) -> list[Address] | None: ...


class DnsLookup:
    """Lookups through dnspython: the system's resolver (search domains and all), or `nameservers`."""

    def __init__(self, nameservers: Sequence[str] = (), *, timeout: float = 2.0) -> None:
        self.resolver = dns.asyncresolver.Resolver(configure=not nameservers)
        if nameservers:
            self.resolver.nameservers = [_nameserver(server) for server in nameservers]
            self.resolver.domain = dns.name.root  # no search domain of this host's name
        self.timeout = timeout

    async def __call__(self, name: str, port: int | None) -> list[Address] | None:
        try:
            if port is not None:
                return [(address, port) for address in await self._addresses(name)]
            services = await self._records(name, "SRV")
            found: list[Address] = []
            records = sorted((str(rr.target), int(rr.port)) for rr in services if isinstance(rr, SRV))
            for target, target_port in records:
                if target != ".":  # "." : no such service here
                    found += [(address, target_port) for address in await self._addresses(target)]
            return found
        except dns.exception.DNSException as exc:
            log.warning("DNS lookup of %s failed, keeping its engines: %s", name, exc)
            return None

    async def _addresses(self, name: str) -> list[str]:
        v4, v6 = await asyncio.gather(self._records(name, "A"), self._records(name, "AAAA"))
        return sorted({str(rr.address) for rr in (*v4, *v6) if isinstance(rr, A | AAAA)})

    async def _records(self, name: str, rdtype: str) -> list[dns.rdata.Rdata]:
        """The records of one type; none when the name or the type does not exist (an answer, not a failure)."""
        try:
            answer = await self.resolver.resolve(name, rdtype, search=True, lifetime=self.timeout)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        return list(answer)


def _nameserver(server: str) -> dns.nameserver.Nameserver:
    host, sep, port = server.rpartition(":")
    if not sep or ":" in host:  # no port given (an IPv6 address has colons of its own)
        return dns.nameserver.Do53Nameserver(server, 53)
    return dns.nameserver.Do53Nameserver(host.strip("[]"), int(port))


def engine_url(address: Address) -> str:
    host, port = address
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class EngineDiscovery:
    """Keeps the engines of every model with `dns` names equal to what those names resolve to."""

    def __init__(
        self,
        pool: EnginePool,
        models: Iterable[ServedModel],
        lookup: Lookup,
        *,
        interval: float = 5.0,
        join: Callable[[Engine], Awaitable[None]] | None = None,
        leave: Callable[[Engine], None] | None = None,
    ) -> None:
        self.pool = pool
        self.lookup = lookup
        self.interval = interval
        self._join = join
        self._leave = leave
        self._names: dict[str, list[tuple[str, int | None]]] = {}
        self._planned: dict[str, int | None] = {}
        for model in models:
            if model.dns:
                self._names.setdefault(model.name, []).extend(parse_dns(name) for name in model.dns)
                self._planned[model.name] = model.planned_kv_tokens  # planned by the launcher
        self.found: dict[str, dict[str, Engine]] = {name: {} for name in self._names}  # model -> URL -> engine
        self.rounds = 0  # completed resolution rounds (tests wait on it)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """One round now (so the gateway starts with its engines), then one every `interval` s."""
        if not self._names:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="gateway engine discovery")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop discovery for good
                log.exception("engine discovery round failed")

    async def refresh(self) -> None:
        """Resolve every name once and bring each model's engines in line with the answers."""
        await asyncio.gather(*(self._refresh_model(model, names) for model, names in self._names.items()))
        self.rounds += 1

    async def _refresh_model(self, model: str, names: Sequence[tuple[str, int | None]]) -> None:
        answers = await asyncio.gather(*(self.lookup(name, port) for name, port in names))
        if any(answer is None for answer in answers):
            return
        wanted = list(dict.fromkeys(engine_url(address) for answer in answers if answer for address in answer))
        found = self.found[model]
        added = [Engine(model, url, planned_kv_tokens=self._planned[model]) for url in wanted if url not in found]
        if added and self._join is not None:
            await asyncio.gather(*(self._join(engine) for engine in added))
        gone = [engine for url, engine in found.items() if url not in wanted]
        pool = self.pool.get(model)
        # A new list, not an edit of the old one: whoever is iterating the old list finishes on it.
        pool.engines = [engine for engine in pool.engines if engine not in gone] + added
        for engine in added:
            found[engine.url] = engine
            log.info(
                "engine %s for model %s found by DNS (%s)",
                engine.id,
                model,
                "healthy" if engine.healthy else f"not healthy yet: {engine.last_error}",
            )
        for engine in gone:
            del found[engine.url]
            log.info(
                "engine %s for model %s left DNS; %d request(s) in flight finish there",
                engine.id,
                model,
                engine.outstanding,
            )
            if self._leave is not None:
                self._leave(engine)

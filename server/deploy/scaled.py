"""Engines scaled behind one compose service name, which the gateway finds through Docker's DNS.

A `models:` entry with a `profile` and a `dns` name of one label (`dns: engine-tiny:8000`) asks
for engines the gateway finds by DNS. In a compose file such a name can only be one of the file's
own services, so the compose renderer runs the profile's engines as that service, with
`deploy.replicas: <profile replicas>` and each engine listening on the name's port. Docker's
embedded DNS (127.0.0.11 in every container) answers the service name with one address per
running replica, so `docker compose up --scale engine-tiny=4` adds engines the gateway picks up
within `discovery.interval` seconds, without a restart or a new rendering; scaling in takes them
out the same way (server.gateway.replicas.discovery). Prometheus finds them the same way
(`dns_sd_configs`, server.deploy.monitoring).

Everything else about such a service is an engine service's (server.deploy.compose): the one
renderer's command, the health check, the download it waits for, vLLM's drain on SIGTERM.

Not for GPU profiles: Docker reserves the same `device_ids` for every replica of one service, so
GPU engines keep a service each (an entry without `dns`). A name with dots (`engines.example.org:8000`)
or an SRV name is somewhere else: it goes to the gateway as written and no engine is started.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.config import parse_dns
from server.deploy.plan import DeploymentPlan, PlannedEngine, PlannedModel
from server.engine.render import KV_EVENTS_PORT


class ScaledServiceError(ValueError):
    """A `dns` entry that cannot become a scaled compose service, with the reason."""


@dataclass(frozen=True)
class ScaledService:
    """One compose service running `replicas` engines of one profile behind its name."""

    engine: PlannedEngine  # what each replica runs; its `service` is the DNS name
    replicas: int

    @property
    def name(self) -> str:
        return self.engine.service


def service_name_of(target: str) -> tuple[str, int] | None:
    """(service, port) when a `dns` target names a service of the compose file itself: one label and a port."""
    name, port = parse_dns(target)
    name = name.rstrip(".")
    if port is None or "." in name:
        return None
    return name, port


def scaled_services(plan: DeploymentPlan, taken: set[str]) -> list[ScaledService]:
    """The scaled services the plan's `dns` entries ask for; `taken`: the file's other service names."""
    out: list[ScaledService] = []
    names = set(taken)
    for model in plan.models:
        for target in model.entry.dns:
            found = service_name_of(target)
            if found is None:
                continue
            service = _scaled(model, *found)
            if service.name in names:
                raise ScaledServiceError(f"dns {target!r}: the compose file has a service {service.name!r} already")
            names.add(service.name)
            out.append(service)
    return out


def _scaled(model: PlannedModel, name: str, port: int) -> ScaledService:
    profile = model.profile
    if profile is None:
        raise ScaledServiceError(
            f"model {model.name!r}: dns {name}:{port} names a service of this compose file, "
            "but the entry has no `profile` to run in it"
        )
    if profile.device == "gpu":
        raise ScaledServiceError(
            f"model {model.name!r}: Docker gives every replica of one service the same GPUs; "
            "leave out `dns` so that each GPU engine gets a service (and GPUs) of its own"
        )
    events = KV_EVENTS_PORT if profile.kv_events else None
    engine = PlannedEngine(model.name, 0, profile, name, name, port, (), events)
    return ScaledService(engine, profile.replicas)

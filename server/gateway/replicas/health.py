"""Active health checks: every engine's `/health` on an interval, and its model card.

An engine is ejected after `unhealthy_after` failed checks in a row and gets traffic again
after `healthy_after` good ones (the very first check decides at once). When an engine turns
healthy its `/v1/models` is read, for the model's `max_model_len` (trimming budgets, the
gateway's own /v1/models) and its LoRA adapters, and again every `models_interval` seconds while
it stays healthy: an adapter loaded through another worker process, another gateway replica or
on the engine itself is routed here from then on (one loaded through this process, at once:
proxy.fanout). Checks run in the background and never on a request's path.
What a check finds is written on the `Engine` (engine.py), where routing reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from server.gateway.replicas.adapters import adapter_cards
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.pool import EnginePool
from server.gateway.settings import HealthCheck

log = logging.getLogger("gateway.health")


class HealthChecker:
    """Keeps `Engine.healthy` and `Engine.card` current for every engine of `pool`."""

    def __init__(self, pool: EnginePool, client: httpx.AsyncClient, config: HealthCheck) -> None:
        self.pool = pool
        self.client = client
        self.config = config
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """One round of checks (so the gateway starts knowing), then a background loop."""
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="gateway health checks")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop the checks for good
                log.exception("health check round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(engine) for engine in self.pool.engines()))

    async def check(self, engine: Engine) -> None:
        error: str | None = None
        try:
            response = await self.client.get(f"{engine.url}/health", timeout=self.config.timeout)
            ok = response.status_code == 200
            if not ok:
                error = f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if ok and (
            engine.card is None
            or not engine.healthy
            or time.monotonic() - engine.card_read_at >= self.config.models_interval
        ):
            await self.refresh_card(engine)
        was_checked = engine.checked
        if (
            engine.record_check(
                ok, unhealthy_after=self.config.unhealthy_after, healthy_after=self.config.healthy_after, error=error
            )
            or not was_checked
        ):
            if engine.healthy:
                log.info("engine %s for model %s is healthy", engine.id, engine.model)
            else:
                log.warning("engine %s for model %s is unhealthy: %s", engine.id, engine.model, error)

    async def refresh_card(self, engine: Engine) -> None:
        """Read the engine's card for its model from /v1/models (max_model_len and all)."""
        engine.card_read_at = time.monotonic()  # a failed read is retried at the next interval too
        changes = engine.adapter_changes
        try:
            response = await self.client.get(f"{engine.url}/v1/models", timeout=self.config.timeout)
            response.raise_for_status()
            cards = response.json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.warning("engine %s: cannot read /v1/models: %s", engine.id, exc)
            return
        # The LoRA adapters it serves (adapters.py); unless a load or unload through this process
        # landed while the list was on its way: that is newer, the next read catches up.
        if engine.adapter_changes == changes:
            engine.adapters = adapter_cards(cards, engine.model)
        for card in cards:
            if isinstance(card, dict) and card.get("id") == engine.model:
                engine.card = card
                return
        served = [c.get("id") for c in cards if isinstance(c, dict)]
        log.warning(
            "engine %s serves %s, not %r: requests for %r will fail there",
            engine.id,
            served,
            engine.model,
            engine.model,
        )

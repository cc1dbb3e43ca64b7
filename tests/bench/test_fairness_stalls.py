"""bench/fairness.py's StallWatch: what stalled during a phase, read from real servers' /metrics
and /health (a real gateway app in front of the stand-in engine, whose /metrics has no vLLM
histogram), and its table in the report."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client import CollectorRegistry

from bench.fairness import StallWatch, stall_lines, stalls_over
from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings, ModelEngines
from standin import StandinConfig, build_app
from tests.support import serve_in_thread


async def hold_the_loop() -> dict[str, bool]:
    """A handler that blocks its event loop for half a second, as a synchronous call would."""
    time.sleep(0.5)
    return {"held": True}


def test_the_watch_counts_a_held_gateway_loop_and_probes_the_engine():
    with serve_in_thread(build_app(StandinConfig(ttft_ms=5, itl_ms=5, tokens=4))) as engine:
        settings = GatewaySettings(models=[ModelEngines(name="standin", urls=[engine])])
        app = create_app(settings, plan_deployment(settings.models).served_models(), registry=CollectorRegistry())
        app.add_api_route("/test/hold", hold_the_loop)
        with serve_in_thread(app) as gateway:

            async def phase() -> dict:
                async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
                    deadline = time.monotonic() + 60
                    while await stalls_over(client, gateway, *StallWatch.GATEWAY) is None:  # the watch is up
                        assert time.monotonic() < deadline, "the gateway never exported its loop's lag"
                        await asyncio.sleep(0.05)
                    watch = StallWatch(client, gateway, engine, time.perf_counter())
                    await watch.start()
                    assert (await client.get(f"{gateway}/test/hold")).json() == {"held": True}
                    while watch.health["probes"] < 3:
                        await asyncio.sleep(0.05)
                    return await watch.stop()

            seen = asyncio.run(phase())
    assert seen["gateway_loop_lags_over_0.25s"] == 1
    assert seen["engine_itl_gaps_over_0.3s"] is None  # the stand-in has no vLLM histogram: not known, not 0
    assert seen["engine_health"]["probes"] >= 3 and seen["engine_health"]["worst_s"] > 0
    assert seen["load_generator"]["at_s"] is not None


def test_the_report_places_each_runs_worst_turn_beside_what_stalled():
    stalls = {
        "gateway_loop_lags_over_0.25s": 0.0,
        "engine_itl_gaps_over_0.3s": 31.0,
        "engine_health": {"worst_s": 0.61, "at_s": 6.9, "probes": 400, "over": 2},
        "load_generator": {"worst_late_s": 0.004, "at_s": 12.0},
    }
    requests = [{"ttft": None, "sent": 0.0}, {"ttft": 0.651, "sent": 6.8}, {"ttft": 0.2, "sent": 7.5}]
    chapters = [
        {"both_gateway": {"figures": {"worst_turn_s": 0.651}, "requests": requests, "stalls": stalls}},
        {"both_gateway": {"figures": {"worst_turn_s": 0.1}, "requests": []}},  # a run from before the watch
    ]
    lines = stall_lines(chapters)
    [run] = [line for line in lines if line.startswith("| 0 |")]
    assert run == "| 0 | 0.651 (sent at 6.8 s) | 31.0 | 0.610 at 6.9 s (2 of 400 over 0.25 s) | 0.0 | 0.004 at 12.0 s |"
    assert not [line for line in lines if line.startswith("| 1 |")]
    assert stall_lines(chapters[1:]) == []

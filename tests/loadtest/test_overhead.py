"""The load tester's added time: joined with the stand-in's own timings, computed right."""

import asyncio
import math
import time

import httpx
import pytest

from loadtest import scenarios, transport
from loadtest.client import ChatClient, make_transport
from loadtest.overhead import fetch_engine_timings, join, overhead_summary
from loadtest.records import RequestRecord
from loadtest.runner import LoadShape, Runner, StopRule
from standin import StandinConfig, build_app
from tests.support import serve_in_thread


def record(request_id, ttft_s, e2e_s=None, sent_s=0.0, **kw):
    return RequestRecord(request_id=request_id, ttft_s=ttft_s, e2e_s=e2e_s, sent_s=sent_s, **kw)


def test_join_subtracts_the_engine_side_ttft_of_the_same_request():
    records = [
        record("a", 0.105, 0.500, sent_s=1.0),
        record("b", 0.230, None, sent_s=2.0),
        record("c", 0.300, error_kind="http"),  # failed: left out
        record("d", 0.400),
    ]  # the engine never saw it: unjoined
    engine = {
        "a": {"arrived": 10.001, "first_token": 10.101, "last_token": 10.491},
        "b": {"arrived": 20.0, "first_token": 20.2, "last_token": None},
        "c": {"arrived": 0.0, "first_token": 0.1},
    }
    joined = {j.request_id: j for j in join(records, engine)}
    assert set(joined) == {"a", "b"}
    assert joined["a"].engine_ttft_s == pytest.approx(0.100)
    assert joined["a"].added_ttft_s == pytest.approx(0.005)
    assert joined["a"].added_e2e_s == pytest.approx(0.500 - 0.490)
    assert joined["b"].added_ttft_s == pytest.approx(0.030) and joined["b"].added_e2e_s is None
    assert joined["a"].send_leg_s is None  # no shared clock given

    summary = overhead_summary(records, engine)
    assert summary["joined_requests"] == 2 and summary["unjoined_requests"] == 1
    assert summary["median_added_ttft_ms"] == pytest.approx(17.5)  # of 5 and 30 ms
    assert summary["max_added_ttft_ms"] == pytest.approx(30.0)
    assert summary["median_added_e2el_ms"] == pytest.approx(10.0)
    assert "median_send_leg_ms" not in summary


def test_legs_on_a_shared_clock_add_up_to_the_added_ttft():
    # run origin 10.0; sent at 10.0 + 1.0; engine received 0.002 later, wrote the first token at
    # 11.102; the client saw it 0.105 after sending (11.105): legs 2 ms + 3 ms = 5 ms added.
    records = [record("a", 0.105, sent_s=1.0)]
    engine = {"a": {"arrived": 11.002, "first_token": 11.102, "last_token": 11.102}}
    (joined,) = join(records, engine, origin=10.0)
    assert joined.send_leg_s == pytest.approx(0.002)
    assert joined.receive_leg_s == pytest.approx(0.003)
    assert joined.send_leg_s + joined.receive_leg_s == pytest.approx(joined.added_ttft_s)
    summary = overhead_summary(records, engine, origin=10.0)
    assert summary["median_send_leg_ms"] == pytest.approx(2.0)
    assert summary["p99_receive_leg_ms"] == pytest.approx(3.0)


def test_nothing_joined_gives_nan_not_an_error():
    summary = overhead_summary([record("x", 0.1)], {})
    assert summary["joined_requests"] == 0 and summary["unjoined_requests"] == 1
    assert math.isnan(summary["median_added_ttft_ms"])


class SlowToSend:
    """A transport that waits `delay_s` before it posts: a client with a known added time."""

    def __init__(self, inner, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    async def post(self, url, headers, body):
        await asyncio.sleep(self._delay_s)
        return await self._inner.post(url, headers, body)


async def measure(url, *, delay_s=0.0, kind="raw", requests=6):
    async with make_transport(kind, max_connections=4, timeout_s=10) as http, httpx.AsyncClient() as control:
        (await control.delete(f"{url}/_standin/timings")).raise_for_status()
        poster = SlowToSend(http, delay_s) if delay_s else http
        client = ChatClient(url, http=poster, model="standin", timeout_s=10)
        sessions = scenarios.random_prompts(0, input_chars=40, max_tokens=4)
        result = await Runner(client, sessions, LoadShape(concurrency=2), StopRule(num_requests=requests)).run()
        engine = await fetch_engine_timings(f"{url}/_standin/timings", control)
    return result, engine


@pytest.fixture(scope="module")
def slow_engine():
    """A stand-in with a known TTFT of 60 ms."""
    with serve_in_thread(build_app(StandinConfig(ttft_ms=60, itl_ms=5, tokens=4))) as url:
        yield url


@pytest.mark.parametrize("kind", ["raw", "httpx"])
async def test_engine_side_ttft_is_the_standins_known_delay_and_joins_every_request(slow_engine, kind):
    result, engine = await measure(slow_engine, kind=kind)
    assert all(r.ok for r in result.records)
    joined = join(result.measured, engine, origin=result.origin)
    assert len(joined) == len(result.measured) == 6
    for j in joined:
        # the stand-in waited its 60 ms before the first token (a busy machine only adds; its
        # uvloop timers have a 1 ms resolution)
        assert j.engine_ttft_s >= 0.059
        # one monotonic clock on one host: the request reached the engine after it was sent,
        # and the client saw the token after the engine wrote it
        assert j.send_leg_s > 0 and j.receive_leg_s > 0
        assert j.added_ttft_s == pytest.approx(j.send_leg_s + j.receive_leg_s)
        assert j.client_ttft_s > j.engine_ttft_s


async def test_a_known_client_side_delay_shows_up_as_added_time_on_the_send_leg(slow_engine):
    result, engine = await measure(slow_engine, delay_s=0.050)
    summary = overhead_summary(result.measured, engine, origin=result.origin)
    assert summary["joined_requests"] == 6
    # 50 ms spent between the client's send stamp and the write: all of it is added time,
    # on the send leg; the engine's own TTFT does not absorb it
    for j in join(result.measured, engine, origin=result.origin):
        assert j.added_ttft_s >= 0.050 and j.send_leg_s >= 0.050
        assert j.engine_ttft_s >= 0.059
    assert summary["median_added_ttft_ms"] >= 50.0


async def test_a_known_late_stamp_on_arrival_shows_up_on_the_receive_leg(slow_engine):
    # every chunk stamped 40 ms late (the transport's clock runs 40 ms ahead of the sender's):
    # what a client that reads its sockets late would measure
    def late_clock():
        return time.perf_counter() + 0.040

    async with transport.HTTPClient(max_connections=4, clock=late_clock) as http, httpx.AsyncClient() as control:
        (await control.delete(f"{slow_engine}/_standin/timings")).raise_for_status()
        client = ChatClient(slow_engine, http=http, model="standin", timeout_s=10)
        sessions = scenarios.random_prompts(0, input_chars=40, max_tokens=4)
        result = await Runner(client, sessions, LoadShape(concurrency=2), StopRule(num_requests=6)).run()
        engine = await fetch_engine_timings(f"{slow_engine}/_standin/timings", control)
    joined = join(result.measured, engine, origin=result.origin)
    assert len(joined) == 6
    for j in joined:
        assert j.receive_leg_s >= 0.040 and j.send_leg_s > 0
        assert j.added_ttft_s == pytest.approx(j.send_leg_s + j.receive_leg_s)
        assert j.engine_ttft_s >= 0.059  # the engine's own TTFT is not touched by the client's clock
    summary = overhead_summary(result.measured, engine, origin=result.origin)
    assert summary["median_receive_leg_ms"] >= 40.0 and summary["median_added_ttft_ms"] >= 40.0

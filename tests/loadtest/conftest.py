"""A real stand-in engine on loopback for the load tester's tests."""

import httpx
import pytest

from standin import StandinConfig, build_app
from tests.support import serve_in_thread


@pytest.fixture(scope="module")
def standin_server():
    with serve_in_thread(build_app(StandinConfig(model="standin", ttft_ms=30, itl_ms=5, tokens=12))) as url:
        yield url


@pytest.fixture
def standin(standin_server):
    """The stand-in's base URL, faults and stats reset."""
    httpx.post(f"{standin_server}/_standin/faults", json={}, timeout=5).raise_for_status()
    httpx.delete(f"{standin_server}/_standin/stats", timeout=5).raise_for_status()
    return standin_server

"""The session's pair of real replicas (tests/conftest.py `real_replicas`): both serve the tiny
model, each under its own supervisor."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.engine


def test_both_replicas_serve_the_tiny_model(real_replicas):
    assert len(real_replicas) == 2
    assert len({replica.url for replica in real_replicas}) == 2
    for replica in real_replicas:
        models = httpx.get(f"{replica.openai_base_url}/models", timeout=30).json()["data"]
        assert [model["id"] for model in models] == [replica.model]

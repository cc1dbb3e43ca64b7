"""The real vLLM engine on the tiny model, started by the project's supervisor from tiny-cpu.yaml."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.engine.planner import plan_profile
from tests.conftest import ROOT
from tests.support import wait_for

pytestmark = pytest.mark.engine


def test_chat_completion_through_the_openai_sdk(real_engine, request):
    client = openai.OpenAI(base_url=real_engine.openai_base_url, api_key="unused")
    request.addfinalizer(client.close)
    reply = client.chat.completions.create(
        model=real_engine.model,
        max_tokens=8,
        temperature=0,
        messages=[
            {"role": "system", "content": "You plan trips."},
            {"role": "user", "content": "Three days in Lisbon?"},
        ],
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 5


def test_streamed_chat_completion_through_the_openai_sdk(real_engine, request):
    client = openai.OpenAI(base_url=real_engine.openai_base_url, api_key="unused")
    request.addfinalizer(client.close)
    stream = client.chat.completions.create(
        model=real_engine.model,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Plan a museum day"}],
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def engine_capacity_tokens(metrics_text: str) -> tuple[int, dict]:
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "vllm:cache_config_info":
            labels = family.samples[0].labels
            return int(labels["num_gpu_blocks"]) * int(labels["block_size"]), labels
    raise AssertionError("vllm:cache_config_info not exported")


def test_planner_capacity_matches_the_engine(real_engine):
    actual, labels = engine_capacity_tokens(httpx.get(f"{real_engine.url}/metrics", timeout=10).text)
    plan = plan_profile(real_engine.profile)
    assert abs(plan.kv_cache_tokens - actual) <= 0.01 * actual, (plan, labels)
    assert int(labels["block_size"]) == plan.block_size
    assert plan.max_concurrent_sequences == pytest.approx(float(labels["kv_cache_max_concurrency"]), rel=0.01)


def test_plan_command_json_matches_the_engine(real_engine):
    out = subprocess.run(
        [sys.executable, "-m", "server", "plan", str(real_engine.profile.source), "--json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    import json

    planned = json.loads(out.stdout)["kv_cache_tokens"]
    actual, _ = engine_capacity_tokens(httpx.get(f"{real_engine.url}/metrics", timeout=10).text)
    assert abs(planned - actual) <= 0.01 * actual


def vllm_processes() -> set[int]:
    pids = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"tiny-cpu-fp8" in text or b"--served-model-name tiny-fp8" in text:
            pids.add(int(cmdline.parent.name))
    return pids


def test_fp8_profile_refused_before_any_engine_starts():
    """fp8 KV cache needs AVX-512 or AMX on CPU. On a host that has them, the check is shown
    by presenting an AVX2-only CPU (SERVER_HOST_CPU_FLAGS), as on the developers' machines."""
    env = dict(os.environ)
    flags = Path("/proc/cpuinfo").read_text()
    if "avx512f" in flags or "amx_tile" in flags:
        env["SERVER_HOST_CPU_FLAGS"] = "sse4_2,avx,avx2,fma"
    before = vllm_processes()
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "server", "engine", "configs/profiles/tiny-cpu-fp8.yaml", "--port", "8199"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    elapsed = time.perf_counter() - started
    assert out.returncode == 1
    assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in out.stderr
    assert "kv-cache-dtype fp8 on CPU needs x86 with AVX-512 or AMX" in out.stderr
    assert "starting:" not in out.stderr  # the supervisor never launched vLLM
    assert vllm_processes() == before
    # Refused at once, not after starting vLLM (40 s at best on this model); far bound for a busy machine.
    assert elapsed < 30, f"refusal took {elapsed:.1f} s"


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.stops_engine
def test_sigterm_stops_the_engine_and_every_child(real_engine):
    if real_engine.process is None:
        pytest.skip("TEST_ENGINE_URL: this session did not start the engine")
    supervisor = real_engine.process
    tree = descendants(supervisor.pid)
    assert len(tree) >= 2, "expected the vLLM API server and its engine core"
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=60) == 0
    wait_for(
        lambda: not [pid for pid in tree if alive(pid)],
        interval=0.1,
        what=lambda: f"still alive: {[pid for pid in tree if alive(pid)]}",
    )
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{real_engine.url}/health", timeout=2)

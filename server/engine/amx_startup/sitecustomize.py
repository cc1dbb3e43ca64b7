"""Runs at the start of every Python process of a CPU engine the supervisor launched
(server/engine/amx.py puts this directory first on the engine's PYTHONPATH).

On an x86 CPU with AMX, Linux lets a process use the AMX tile registers only after it asked
(arch_prctl ARCH_REQ_XCOMP_PERM); one that uses them without asking dies of SIGILL. oneDNN asks
before its first AMX kernel, but a vLLM worker whose first request is a prompt of a few tokens
reaches an AMX kernel that does not ask, and dies (`Worker proc VllmWorker-0 died unexpectedly
(exit code: -4)`), taking the engine down. The permission does not survive exec, and vLLM starts
its engine core and workers as new interpreters, so each process asks here, before anything runs.

Then the `sitecustomize` this one shadows (the next on sys.path), if any, runs as it would have.
"""

import os
import sys


def _request_amx_permission(quiet: bool) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    refused = libc.syscall(158, 0x1023, 18) != 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    if refused and not quiet:
        sys.stderr.write(f"[amx] pid {os.getpid()}: the kernel refused AMX (errno {ctypes.get_errno()})\n")


def _run_shadowed_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


# "1": the supervisor saw AMX in the CPU's flags; "auto" (the CPU engine image, which cannot know
# the host it will run on): ask anyway, and say nothing where there is no AMX to give.
if os.environ.get("SERVER_REQUEST_AMX") in ("1", "auto"):
    _request_amx_permission(quiet=os.environ["SERVER_REQUEST_AMX"] == "auto")
_run_shadowed_sitecustomize()

"""Runs one vLLM engine from a profile and keeps it running.

The supervisor starts the engine in its own process group (vLLM forks an engine-core process
and more), streams its log with a `[engine NAME]` prefix, waits for `/health`, reports how long
start-up took, restarts a crashed engine with exponential backoff, and on stop terminates the
whole process tree: SIGTERM to the group, SIGKILL to whatever is left after the grace period.
The `engine` command and `up` (server.deploy.local) both use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import httpx

from server.engine.amx import with_amx_permission
from server.engine.hostcheck import check_profile, refuse_message
from server.engine.profiles import Profile, load_profile, resolve_profile_path
from server.engine.render import engine_argv, render_shell

log = logging.getLogger("server.engine.supervisor")

# A crash after this long of healthy running starts the backoff over.
STABLE_AFTER_S = 60.0


class EngineStartError(RuntimeError):
    """The engine did not become ready (it exited, or /health never answered in time)."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGTERM the engine if the supervisor itself dies without cleaning up."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def yield_cpu(nice: int) -> None:  # pragma: no cover - runs in the child between fork and exec
    """Lower this process's CPU priority to `nice`, and its session's: the child has just
    started a session (start_new_session), and where the kernel groups processes by session
    (autogroup, on by default on desktop and many cloud kernels) a process's own nice only
    orders it within that group, while the group's nice weighs it against the gateway's.
    Raising either needs no privilege; where there is no autogroup, the file is absent."""
    if nice <= 0:
        return
    os.nice(nice)
    with contextlib.suppress(OSError):
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(nice))


def child_setup(nice: int) -> Callable[[], None]:
    """What the engine's process runs before vLLM: die with the supervisor, yield the CPU."""

    def setup() -> None:  # pragma: no cover - runs in the child between fork and exec
        _die_with_parent()
        yield_cpu(nice)

    return setup


# vLLM's own drain (0.32: `--shutdown-timeout`): on SIGTERM it lets in-flight requests finish for
# up to this many seconds (its default, 0, aborts them), within `stop`'s 20 s before SIGKILL.
DRAIN_SECONDS = 15


def with_drain(argv: list[str], profile: Profile) -> list[str]:
    """`argv` with vLLM's drain on SIGTERM, unless the profile sets `shutdown-timeout` itself."""
    if "shutdown-timeout" in profile.vllm:
        return argv
    return [*argv, "--shutdown-timeout", str(DRAIN_SECONDS)]


class EngineSupervisor:
    """Start, watch, restart and stop one vLLM engine of a profile."""

    def __init__(
        self,
        profile: Profile,
        *,
        host: str = "127.0.0.1",
        port: int,
        name: str | None = None,
        max_restarts: int = 5,
        ready_timeout: float = 600.0,
        health_interval: float = 2.0,
        argv: list[str] | None = None,
    ) -> None:
        self.profile = profile
        self.host = host
        self.port = port
        self.name = name or f"{profile.served_model_name}:{port}"
        self.max_restarts = max_restarts
        self.ready_timeout = ready_timeout
        self.health_interval = health_interval
        self.argv = argv or with_drain(engine_argv(profile, host=host, port=port), profile)
        self.env = with_amx_permission({**os.environ, **profile.env, "PYTHONUNBUFFERED": "1"}, profile)
        self.url = f"http://{host}:{port}"
        self.restarts = 0
        self.last_lines: deque[str] = deque(maxlen=40)
        self._process: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._ready = asyncio.Event()
        self._failed: EngineStartError | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._ready_at = 0.0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    async def start(self) -> None:
        """Launch the engine and watch it in the background; returns at once."""
        self._stopping = False
        if self.env.get("SERVER_REQUEST_AMX") == "1":
            log.info(
                "[engine %s] this CPU has AMX: each engine process asks Linux for it first (server/engine/amx.py)",
                self.name,
            )
        await self._spawn()
        self._monitor = asyncio.create_task(self._watch(), name=f"supervise {self.name}")

    async def _spawn(self) -> None:
        self._ready.clear()
        self._started_at = time.perf_counter()
        nice = f" (at nice {self.profile.nice})" if self.profile.nice else ""
        log.info("[engine %s] starting%s: %s", self.name, nice, render_shell(self.argv, self.profile.env))
        self._process = await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=child_setup(self.profile.nice),
        )

    async def _watch(self) -> None:
        """Pump the log, detect readiness, restart after crashes until stopped or out of tries."""
        crashes = 0
        while True:
            process = self._process
            assert process is not None
            pump = asyncio.create_task(self._pump(process))
            probe = asyncio.create_task(self._probe_until_ready(process))
            code = await wait_exit(process)
            # Whatever the leader left behind in its group (an engine core, a worker) goes too:
            # it would hold the port, the memory and the log pipe of the next start.
            kill_group(process.pid)
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pump, 5)
            if self._stopping:
                return
            ran_for = time.perf_counter() - self._started_at
            crashes = 1 if self._ready.is_set() and ran_for > STABLE_AFTER_S else crashes + 1
            if crashes > self.max_restarts:
                self._fail(
                    f"engine {self.name} exited with code {code} {crashes} times in a row; "
                    "giving up. Last log lines:\n" + "\n".join(self.last_lines)
                )
                return
            delay = min(2.0 ** (crashes - 1), 30.0)
            log.warning(
                "[engine %s] exited with code %s after %.1f s; restart %d/%d in %.0f s",
                self.name,
                code,
                ran_for,
                crashes,
                self.max_restarts,
                delay,
            )
            await asyncio.sleep(delay)
            if self._stopping:
                return
            self.restarts += 1
            await self._spawn()

    def _fail(self, message: str) -> None:
        log.error("[engine %s] %s", self.name, message)
        self._failed = EngineStartError(message)
        self._ready.set()  # wake waiters; they see _failed

    async def _pump(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        prefix = f"[engine {self.name}] "
        while line := await process.stdout.readline():
            text = line.decode(errors="replace").rstrip()
            self.last_lines.append(text)
            sys.stderr.write(prefix + text + "\n")

    async def _probe_until_ready(self, process: asyncio.subprocess.Process) -> None:
        deadline = time.perf_counter() + self.ready_timeout
        async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as client:
            while process.returncode is None:
                try:
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        self._ready_at = time.perf_counter()
                        log.info(
                            "[engine %s] ready at %s in %.1f s", self.name, self.url, self._ready_at - self._started_at
                        )
                        self._ready.set()
                        return
                except httpx.HTTPError:
                    pass
                if time.perf_counter() > deadline:
                    self._fail(f"engine {self.name} did not answer /health within {self.ready_timeout:.0f} s")
                    return
                await asyncio.sleep(0.5)

    async def wait_ready(self) -> float:
        """Wait until the engine answers /health; returns the start-up time in seconds."""
        await self._ready.wait()
        if self._failed is not None:
            raise self._failed
        return self._ready_at - self._started_at

    async def stop(self, timeout: float = 20.0) -> None:
        """Stop the engine and every process it started."""
        self._stopping = True
        process = self._process
        if process is not None and process.returncode is None:
            log.info("[engine %s] stopping (pid %d)", self.name, process.pid)
            terminate_tree(process.pid)
            try:
                await asyncio.wait_for(wait_exit(process), timeout)
            except TimeoutError:
                log.warning("[engine %s] did not stop in %.0f s; killing", self.name, timeout)
        if process is not None:
            kill_group(process.pid)  # whatever outlived the leader in its group
            with contextlib.suppress(ProcessLookupError):
                await asyncio.wait_for(process.wait(), 5)
            for _ in range(50):  # SIGKILL is delivered asynchronously: wait until all are gone
                if not group_members(process.pid):
                    break
                await asyncio.sleep(0.05)
            else:
                log.error("[engine %s] processes %s outlived SIGKILL", self.name, group_members(process.pid))
        if self._monitor is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        log.info("[engine %s] stopped", self.name)


async def wait_exit(process: asyncio.subprocess.Process) -> int:
    """The leader's exit code. Not `process.wait()`: asyncio's waits for the log pipe to close
    too, and a grandchild that inherited the pipe keeps it open after the leader died."""
    while process.returncode is None:  # noqa: ASYNC110 - nothing to wait on but the return code
        await asyncio.sleep(0.1)
    return process.returncode


def terminate_tree(pid: int) -> None:
    """SIGTERM the process group led by `pid` (vLLM shuts its engine core down on SIGTERM)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def prepare(profile: Profile) -> None:
    """Refuse what cannot run (raises EngineStartError), and build the tiny model if asked."""
    problems = check_profile(profile)
    if problems:
        raise EngineStartError(refuse_message(profile, problems))
    path = profile.model_path
    if profile.build_tiny_model and path is not None:
        from server.engine.tinymodel import build_tiny_model, is_current

        if not is_current(path):  # missing, or built with an older chat template
            build_tiny_model(path, log=lambda msg: log.info("[tiny-model] %s", msg))
    for adapter in profile.lora_adapters:  # the project's tiny LoRA adapter, where a profile asks for it
        if adapter.build_tiny:
            from server.engine.tinyadapter import build_tiny_adapter

            build_tiny_adapter(
                adapter.resolved_path(profile.source),
                base_model=profile.served_model_name,
                log=lambda msg: log.info("[tiny-lora] %s", msg),
            )


async def run_engine(profile: Profile, host: str, port: int, max_restarts: int, ready_timeout: float) -> int:
    supervisor = EngineSupervisor(profile, host=host, port=port, max_restarts=max_restarts, ready_timeout=ready_timeout)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await supervisor.start()
    ready = asyncio.create_task(supervisor.wait_ready())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({ready, stopper}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if ready.done():
        try:
            seconds = ready.result()
            print(
                f"engine {supervisor.name} ready: {supervisor.url}/v1 (model {profile.served_model_name}, "
                f"started in {seconds:.1f} s)",
                flush=True,
            )
        except EngineStartError as exc:
            print(f"error: {exc}", file=sys.stderr)
            code = 1
    if code == 0:
        monitor = supervisor._monitor
        assert monitor is not None
        await asyncio.wait({stopper, monitor}, return_when=asyncio.FIRST_COMPLETED)
        if monitor.done() and not stop.is_set():
            code = 1  # gave up after repeated crashes
    ready.cancel()
    stopper.cancel()
    await supervisor.stop()
    return code


def run_command(profile_name: str, *, host: str, port: int, max_restarts: int, ready_timeout: float) -> int:
    """`python -m server engine`: run one engine until SIGINT/SIGTERM (exit 1 if it cannot start)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    profile = load_profile(resolve_profile_path(profile_name))
    try:
        prepare(profile)
    except EngineStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return asyncio.run(run_engine(profile, host, port, max_restarts, ready_timeout))

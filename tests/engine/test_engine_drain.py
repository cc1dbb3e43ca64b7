"""Engines drain on SIGTERM with vLLM's own option (0.32: `--shutdown-timeout`), as the supervisor starts them."""

from __future__ import annotations

from server.engine.profiles import load_profile, profiles_dir
from server.engine.supervisor import DRAIN_SECONDS, EngineSupervisor, with_drain


def test_the_supervisor_starts_engines_that_drain_within_its_stop_timeout():
    profile = load_profile(profiles_dir() / "tiny-cpu.yaml")
    argv = EngineSupervisor(profile, port=8100).argv
    assert argv[-2:] == ["--shutdown-timeout", str(DRAIN_SECONDS)]
    assert 0 < DRAIN_SECONDS < 20  # `stop` waits 20 s before SIGKILL


def test_a_profile_that_sets_shutdown_timeout_keeps_its_own():
    profile = load_profile(profiles_dir() / "tiny-cpu.yaml")
    profile = profile.model_copy(update={"vllm": {**profile.vllm, "shutdown-timeout": 3}})
    assert with_drain(["vllm"], profile) == ["vllm"]

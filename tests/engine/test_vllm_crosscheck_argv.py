"""Every profile's engine command line, parsed by vLLM 0.32's own `vllm serve` argument parser.

`python -m server engine-args` renders a profile's `vllm:` options as flags; this hands the
rendered arguments (after `vllm serve`, as the vllm/vllm-openai image runs them) to vLLM's
parser and to `AsyncEngineArgs.from_cli_args` in a subprocess, and checks that every option
of the profile arrives under its own name with its value. The engines over several nodes are
parsed per node: the leader's arguments and a worker's (headless, its start rank added as the
chart adds it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from server.engine.profiles import Profile, load_profile, profiles_dir
from server.engine.render import LWS_LEADER_ADDRESS, engine_argv, node_flags
from tests.conftest import ROOT

PARSE = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

out = {}
for name, argv in json.load(sys.stdin).items():
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    try:
        args = parser.parse_args(argv)
        AsyncEngineArgs.from_cli_args(args)
    except SystemExit as exc:
        out[name] = {"error": f"argparse exit {exc.code}"}
        continue
    out[name] = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, dict, type(None)))}
json.dump(out, sys.stdout, default=str)
"""


def node_argvs(profile: Profile) -> dict[str, list[str]]:
    """The arguments after `vllm serve` for each kind of node of the profile's engine."""
    argv = engine_argv(profile, host="0.0.0.0", port=8000, launcher="image")
    if profile.nodes == 1:
        return {profile.name: argv}
    head = engine_argv(profile, host=None, port=None, launcher="image")
    return {
        f"{profile.name}/leader": argv + node_flags(profile, 0, "10.0.0.1"),
        f"{profile.name}/worker": head + node_flags(profile, 1, "10.0.0.1"),
    }


PROFILES = {path.stem: load_profile(path) for path in sorted(profiles_dir().glob("*.yaml"))}
ARGVS = {name: argv for profile in PROFILES.values() for name, argv in node_argvs(profile).items()}


@pytest.fixture(scope="module")
def parsed() -> dict[str, dict[str, Any]]:
    result = subprocess.run(
        [sys.executable, "-c", PARSE], input=json.dumps(ARGVS), capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data: dict[str, dict[str, Any]] = json.loads(result.stdout)
    return data


@pytest.mark.parametrize("name", ARGVS)
def test_vllm_parses_every_option_of_the_profile(name, parsed):
    profile = PROFILES[name.split("/")[0]]
    args = parsed[name]
    assert "error" not in args, f"{name}: vLLM's parser refused {ARGVS[name]}"
    assert args["model_tag"] == (str(profile.model_path) if profile.model_path else profile.model)
    assert args["served_model_name"] == [profile.served_model_name]
    for key, value in profile.vllm.items():
        dest = key.replace("-", "_")
        assert dest in args, f"{name}: --{key} is not an option of vLLM 0.32"
        got = args[dest]
        if isinstance(value, dict):
            got = json.loads(got) if isinstance(got, str) else got
            assert {k: got[k] for k in value} == value or got == value, (key, got)
        elif isinstance(value, list):
            assert [str(v) for v in got] == [str(v) for v in value], (key, got)
        elif value is False:
            assert got in (False, None), (key, got)
        else:
            assert got == value or str(got) == str(value), (key, got, value)


def test_the_multi_node_profile_parses_as_a_leader_and_a_headless_worker(parsed):
    leader, worker = parsed["deepseek-v3-two-nodes/leader"], parsed["deepseek-v3-two-nodes/worker"]
    assert (leader["headless"], worker["headless"]) == (False, True)
    assert leader["data_parallel_address"] == worker["data_parallel_address"] == "10.0.0.1"
    assert (leader["data_parallel_start_rank"], worker["data_parallel_start_rank"]) == (None, 8)
    assert leader["data_parallel_size"] == 16 and leader["data_parallel_size_local"] == 8
    assert leader["enable_expert_parallel"] is True and leader["tensor_parallel_size"] == 1
    assert LWS_LEADER_ADDRESS == "$(LWS_LEADER_ADDRESS)"  # what the chart passes instead of an address


def test_the_parser_check_can_fail(parsed, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: org/m\nserved_model_name: m\nvllm:\n  data-parallel-sise: 2\n")
    argv = engine_argv(load_profile(path), launcher="image")
    result = subprocess.run(
        [sys.executable, "-c", PARSE],
        input=json.dumps({"bad": argv}),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert json.loads(result.stdout)["bad"] == {"error": "argparse exit 2"}
    assert "data-parallel-sise" in result.stderr

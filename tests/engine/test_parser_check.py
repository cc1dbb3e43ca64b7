"""Tool-call and reasoning parsers: every chat profile names one vLLM knows, and the host check
refuses an unknown one before launch, with the valid names, without importing vLLM."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from server.engine.hostcheck import (
    ParserNames,
    check_parsers,
    check_profile,
    parser_names_in,
    plugin_parser_names,
)
from server.engine.profiles import load_profile, profiles_dir
from tests.conftest import ROOT
from tests.engine.test_hostcheck import AVX2, AVX512, ONE_GPU

NAMES = ParserNames(tool=frozenset({"hermes", "llama3_json", "mistral"}), reasoning=frozenset({"deepseek_r1", "qwen3"}))

# The parser that reads each model family's tool calls (its chat template's format).
EXPECTED_TOOL_PARSER = {
    "../../.cache/tiny-llama": "hermes",  # server/engine/tinymodel.py renders Hermes-style calls
    "meta-llama/Llama-3.1-8B-Instruct": "llama3_json",
    "Qwen/Qwen2.5-7B-Instruct": "hermes",
    "deepseek-ai/DeepSeek-V3": "deepseek_v3",  # DeepSeek's own tool-call tokens
}


def write_profile(tmp_path, flags: str, name: str = "p.yaml"):
    path = tmp_path / name
    path.write_text(f"model: org/m\nserved_model_name: m\nvllm:\n{flags}")
    return load_profile(path)


def chat_profiles():
    """Every profile but the embedding ones (vLLM's pooling runner serves no chat)."""
    return sorted(path for path in profiles_dir().glob("*.yaml") if load_profile(path).vllm.get("runner") != "pooling")


@pytest.mark.parametrize("path", chat_profiles(), ids=lambda p: p.stem)
def test_every_chat_profile_is_agent_ready(path):
    profile = load_profile(path)
    assert profile.vllm.get("enable-auto-tool-choice") is True
    assert profile.vllm.get("tool-call-parser") == EXPECTED_TOOL_PARSER[profile.model]
    # None of these models writes reasoning (Llama-3.1, Qwen2.5 and the tiny model have no
    # <think> format); a reasoning parser on them would move answers into reasoning_content.
    assert "reasoning-parser" not in profile.vllm
    assert check_parsers(profile) == []  # against the installed vLLM


@pytest.mark.parametrize("path", chat_profiles(), ids=lambda p: p.stem)
def test_profiles_still_pass_the_whole_host_check_on_their_device(path):
    profile = load_profile(path)
    host = AVX512 if profile.kv_cache_dtype.startswith("fp8") else AVX2
    if profile.device == "gpu":  # one node of the engine: as many GPUs as it holds there
        host = dataclasses.replace(ONE_GPU, gpu_count=profile.gpus_per_node)
    assert check_profile(profile, host) == []


def test_a_node_needs_a_gpu_per_tensor_pipeline_and_local_data_parallel_rank():
    """DeepSeek-V3 at DP=8 holds 8 GPUs a node although each rank is TP=1."""
    profile = load_profile(profiles_dir() / "deepseek-v3.yaml")
    assert (profile.tensor_parallel_size, profile.data_parallel_size_local, profile.gpus_per_node) == (1, 8, 8)
    seven = dataclasses.replace(ONE_GPU, gpu_count=7)
    assert any("is 8 GPUs; this host has 7" in problem for problem in check_profile(profile, seven))


def test_an_unknown_tool_parser_is_refused_with_the_valid_names(tmp_path):
    profile = write_profile(tmp_path, "  enable-auto-tool-choice: true\n  tool-call-parser: llama3\n")
    (problem,) = check_parsers(profile, NAMES)
    assert "tool-call-parser 'llama3'" in problem
    assert problem.endswith("valid names: hermes, llama3_json, mistral")


def test_an_unknown_reasoning_parser_is_refused_with_the_valid_names(tmp_path):
    profile = write_profile(tmp_path, "  reasoning-parser: deepseek-r1\n")
    (problem,) = check_parsers(profile, NAMES)
    assert "reasoning-parser 'deepseek-r1'" in problem
    assert problem.endswith("valid names: deepseek_r1, qwen3")


def test_known_parsers_pass(tmp_path):
    profile = write_profile(
        tmp_path, "  enable-auto-tool-choice: true\n  tool-call-parser: hermes\n  reasoning-parser: qwen3\n"
    )
    assert check_parsers(profile, NAMES) == []


def test_auto_tool_choice_without_a_parser_is_refused(tmp_path):
    (problem,) = check_parsers(write_profile(tmp_path, "  enable-auto-tool-choice: true\n"), NAMES)
    assert "needs tool-call-parser" in problem


def test_a_parser_name_must_be_a_string(tmp_path):
    (problem,) = check_parsers(write_profile(tmp_path, "  tool-call-parser: [hermes]\n"), NAMES)
    assert "expected a parser name" in problem


def test_names_a_plugin_registers_are_accepted(tmp_path):
    (tmp_path / "my_parser.py").write_text(
        "from vllm.tool_parsers import ToolParser, ToolParserManager\n"
        "@ToolParserManager.register_module(['mine', 'mine2'])\n"
        "class Mine(ToolParser):\n    pass\n"
        "ToolParserManager.register_module(name='other', module=Mine)\n"
    )
    assert plugin_parser_names(tmp_path / "my_parser.py") == {"mine", "mine2", "other"}
    profile = write_profile(
        tmp_path, "  enable-auto-tool-choice: true\n  tool-call-parser: mine2\n  tool-parser-plugin: my_parser.py\n"
    )
    assert check_parsers(profile, NAMES) == []  # relative to the profile's folder
    profile = write_profile(tmp_path, "  tool-call-parser: nope\n  tool-parser-plugin: my_parser.py\n")
    assert "valid names: hermes, llama3_json, mine, mine2, mistral, other" in check_parsers(profile, NAMES)[0]
    profile = write_profile(tmp_path, "  tool-call-parser: mine\n  tool-parser-plugin: missing.py\n")
    assert "tool-parser-plugin missing.py cannot be read" in check_parsers(profile, NAMES)[0]


def test_the_check_refuses_through_check_profile_and_the_cli(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "model: ./m\nserved_model_name: m\ndevice: cpu\nbuild_tiny_model: true\n"
        "vllm:\n  enable-auto-tool-choice: true\n  tool-call-parser: hermes2\n"
    )
    assert any("tool-call-parser 'hermes2'" in p for p in check_profile(load_profile(path), AVX2))
    result = subprocess.run(
        [sys.executable, "-m", "server", "check", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "SERVER_HOST_CPU_FLAGS": "avx2"},
    )
    assert result.returncode == 1
    assert "tool-call-parser 'hermes2' is not a tool parser the installed vLLM knows" in result.stderr
    assert "hermes, hf," in result.stderr  # the valid names, sorted


FAST_READ = """
import json, sys, time
from server.engine.hostcheck import installed_parser_names
started = time.perf_counter()
names = installed_parser_names()
print(json.dumps({"seconds": time.perf_counter() - started, "vllm_imported": "vllm" in sys.modules,
                  "tool": sorted(names.tool), "reasoning": sorted(names.reasoning)}))
"""

VLLM_OWN = """
import json
from vllm.tool_parsers import ToolParserManager
from vllm.reasoning import ReasoningParserManager
print(json.dumps({"tool": sorted(ToolParserManager.list_registered()),
                  "reasoning": sorted(ReasoningParserManager.list_registered())}))
"""


def run_json(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_names_read_from_the_package_files_are_vllms_own_registry_without_importing_it():
    fast = run_json(FAST_READ)
    assert not fast["vllm_imported"]
    assert fast["seconds"] < 1.0
    own = run_json(VLLM_OWN)  # about 20 s: vLLM's registries import torch
    assert (fast["tool"], fast["reasoning"]) == (own["tool"], own["reasoning"])
    assert {"hermes", "llama3_json"} <= set(fast["tool"])


def test_a_package_without_the_tables_gives_no_names(tmp_path):
    (tmp_path / "tool_parsers").mkdir()
    (tmp_path / "tool_parsers" / "__init__.py").write_text("PARSERS = {'x': 1}\n")
    assert parser_names_in(tmp_path) is None  # then unknown names cannot be told, and pass


def test_engine_args_show_the_tool_flags():
    result = subprocess.run(
        [sys.executable, "-m", "server", "engine-args", "chat-fp8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "--enable-auto-tool-choice --tool-call-parser llama3_json" in result.stdout

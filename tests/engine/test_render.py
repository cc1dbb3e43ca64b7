"""One renderer: the argv and the --config YAML say the same thing, flag for flag."""

import sys

import yaml

from server.cli import main as cli_main
from server.engine.profiles import load_profile, profiles_dir
from server.engine.render import engine_argv, engine_config, engine_flags, render_shell, render_yaml


def tiny():
    return load_profile(profiles_dir() / "tiny-cpu.yaml")


def test_tiny_cpu_argv_is_exact():
    profile = tiny()
    argv = engine_argv(profile, host="127.0.0.1", port=8100)
    assert argv == [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(profile.model_path),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8100",
        "--dtype",
        "bfloat16",
        "--block-size",
        "128",
        "--kv-cache-dtype",
        "auto",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        "2048",
        "--gpu-memory-utilization",
        "0.3",
        "--max-num-seqs",
        "32",
        "--tensor-parallel-size",
        "1",
        "--enforce-eager",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--tool-strict-level",
        "parameter",
    ]


def test_launchers():
    profile = load_profile(profiles_dir() / "chat-fp8.yaml")
    serve = engine_argv(profile, launcher="serve", port=8000)
    assert serve[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    image = engine_argv(profile, launcher="image", host="0.0.0.0", port=8000)
    assert image[0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert image[1:] == ["0.0.0.0" if part == "127.0.0.1" else part for part in serve[3:]]
    assert "--kv-cache-dtype" in image and image[image.index("--kv-cache-dtype") + 1] == "fp8"


def test_booleans_lists_and_dicts(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "model: org/m\nserved_model_name: m\nvllm:\n"
        "  enable-prefix-caching: false\n  enforce-eager: false\n  trust-remote-code: true\n"
        "  speculative-config: {method: ngram, num_speculative_tokens: 4}\n"
        "  allowed-origins: [a, b]\n  seed: null\n"
    )
    flags = engine_flags(load_profile(path))
    assert flags == [
        "--no-enable-prefix-caching",
        "--trust-remote-code",
        "--speculative-config",
        '{"method":"ngram","num_speculative_tokens":4}',
        "--allowed-origins",
        "a",
        "b",
    ]


def test_yaml_config_matches_argv():
    profile = tiny()
    config = yaml.safe_load(render_yaml(engine_config(profile, host="127.0.0.1", port=8100)))
    argv = engine_argv(profile, host="127.0.0.1", port=8100)
    rebuilt = []
    for key, value in config.items():
        if key == "model":
            continue
        rebuilt += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    assert rebuilt == argv[5:]
    assert config["model"] == argv[4]


def test_render_shell_quotes_and_prefixes_env():
    assert render_shell(["a b", "c"], {"X": "1 2"}) == "X='1 2' 'a b' c"


def test_engine_args_command(capsys):
    assert cli_main(["engine-args", "tiny-cpu", "--port", "8100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("VLLM_CPU_KVCACHE_SPACE=1 ")
    assert "--port 8100" in out and "--enforce-eager" in out
    assert cli_main(["engine-args", "tiny-cpu", "--format", "yaml"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["max-model-len"] == 2048


def test_engine_args_bad_profile(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\n")
    assert cli_main(["engine-args", str(bad)]) == 2
    assert "served_model_name: required key is missing" in capsys.readouterr().err

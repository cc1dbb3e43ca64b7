"""The tiny model builds offline and the same every time, with a chat template vLLM can use."""

import hashlib
import json
import re
import subprocess
import sys

from server.engine.tinymodel import CHAT_TEMPLATE, is_current
from tests.conftest import ROOT


def digest(folder) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir()) if path.is_file()
    }


def test_tiny_model_is_deterministic_and_complete(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        subprocess.run(
            [sys.executable, "-m", "server", "tiny-model", str(folder)],
            check=True,
            cwd=ROOT,
            capture_output=True,
            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        )
    assert digest(first) == digest(second)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(digest(first))
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)  # GQA


RENDER = """
import sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
sys.stdout.write(tokenizer.apply_chat_template(
    [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": None,
      "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
     {"role": "tool", "tool_call_id": "1", "content": "r"}],
    tokenize=False, add_generation_prompt=True))
"""


def test_chat_template_keeps_roles_and_tool_calls(tmp_path):
    # In a child process: transformers brings torch, which has no business in the test process.
    subprocess.run(
        [sys.executable, "-m", "server", "tiny-model", str(tmp_path / "m")], check=True, cwd=ROOT, capture_output=True
    )
    text = subprocess.run(
        [sys.executable, "-c", RENDER, str(tmp_path / "m")], check=True, cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>tool\nr<|im_end|>\n<|im_start|>assistant\n"
    )
    # The Hermes format that vLLM's `hermes` tool-call parser (the tiny profiles' parser) reads:
    # one JSON object with `name` and `arguments` between the tags.
    (call,) = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
    assert json.loads(call) == {"name": "f", "arguments": {"a": 1}}
    assert is_current(tmp_path / "m")


def test_a_model_built_with_another_template_is_not_current(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    assert not is_current(folder)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ old }}"}))
    assert not is_current(folder)  # `python -m server tiny-model` rebuilds it
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    assert is_current(folder)

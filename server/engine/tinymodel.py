"""The project's tiny model: a real Llama-architecture checkpoint vLLM serves, built offline.

Random weights (seeded, so every build is the same), a byte-level BPE tokenizer trained here
on a fixed text, and a ChatML chat template that renders tool calls the way Hermes and Qwen2.5
models write them (`<tool_call>`, a line of `{"name": ..., "arguments": {...}}`, `</tool_call>`),
which is what vLLM's `hermes` tool-call parser reads back from the model's output. Its answers are
gibberish; every part of serving around it (tokenizer, chat template, paged KV cache, prefix
cache, scheduler, metrics) is the real thing.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 2048
SEED = 1234

# The shape of the model: 2 layers, 4 query heads sharing 2 KV heads (GQA), head_dim 64.
MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\\n<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Text the tokenizer learns its merges from: travel planning, the seed's use case.
CORPUS = (
    """\
Plan a three day trip to Lisbon with museums, food markets and a day trip to Sintra.
The itinerary starts at the hotel, visits the castle in the morning and the river in the evening.
Points of interest: opening hours, ticket prices, distance from the station, accessibility.
You are a helpful travel assistant. Answer with a short plan for each day.
Write an article about the history of the railway, the old bridge and the harbour.
The user asked for vegetarian restaurants near the cathedral and a quiet place to read.
Tool results arrive as JSON: {"name": "search_places", "results": [{"id": 1, "rating": 4.5}]}.
Numbers and times: 09:30, 12:45, 18:00, 2 km, 15 minutes, 3 stops, 120 euros, 4.7 stars.
"""
    * 4
)


def is_current(directory: str | Path) -> bool:
    """True if `directory` holds a complete tiny model built with this file's chat template
    (a model built before the template changed is rebuilt: the build is deterministic)."""
    directory = Path(directory)
    if not ((directory / "config.json").exists() and (directory / "tokenizer.json").exists()):
        return False
    try:
        tok_config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(tok_config.get("chat_template") == CHAT_TEMPLATE)


def build_tiny_model(directory: str | Path, *, force: bool = False, log: Callable[[str], object] = print) -> Path:
    """Write the tiny model to `directory` (skipped when a current one is already there)."""
    directory = Path(directory)
    if is_current(directory) and not force:
        log(f"tiny model already at {directory}")
        return directory

    # torch, tokenizers and transformers are imported here only (the gateway never loads them), and
    # used as untyped modules: their own annotations do not describe these calls well enough.
    torch: Any = importlib.import_module("torch")
    tokenizers: Any = importlib.import_module("tokenizers")
    transformers: Any = importlib.import_module("transformers")
    Tokenizer, decoders, models = tokenizers.Tokenizer, tokenizers.decoders, tokenizers.models
    pre_tokenizers, trainers = tokenizers.pre_tokenizers, tokenizers.trainers
    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
    PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast

    started = time.perf_counter()
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)

    log("training the byte-level BPE tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(staging)
    # Older and newer transformers read the template from different files; keep both.
    config_path = staging / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    tok_config["add_bos_token"] = False
    config_path.write_text(json.dumps(tok_config, indent=2))

    log(f"initialising the Llama model (vocab {len(fast)}, seed {SEED})")
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(fast),
        bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **MODEL_SHAPE,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(staging, safe_serialization=True)

    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)
    log(f"tiny model written to {directory} in {time.perf_counter() - started:.1f} s")
    return directory


def build_command(directory: Path, *, force: bool = False) -> int:
    """`python -m server tiny-model`: build it (exit 1 without torch and transformers)."""
    try:
        build_tiny_model(directory, force=force, log=lambda msg: print(f"[tiny-model] {msg}", file=sys.stderr))
    except ImportError as exc:
        print(f"tiny-model: needs torch and transformers ({exc}); run `make install`", file=sys.stderr)
        return 1
    return 0

"""A prompt cut into fixed blocks, each named by a chained hash: the keys both prefix indexes use.

A block's key hashes its parent's key with its own content, so equal keys mean equal prompts from
the first block up to that one, which is what a prefix cache can reuse. Only full blocks get a
key: an engine caches full blocks only.

Two kinds of content, one hash:
- token ids (`token_blocks`): what the engine caches, in its own block size. The precise index
  keys the blocks of vLLM's KV events this way (from the events' token ids, never from vLLM's own
  block hash, whose default algorithm cannot be reproduced outside the engine) and a prompt's
  tokens from the engine's /tokenize the same way, so the two meet.
- text (`text_blocks`): the prompt as the gateway sees it, in blocks of characters. No tokenizer
  is needed, which is what lets the approximate index work in front of any engine.

`prompt_text` is that text for a request body: each chat message's role and text content with
separators (not the rendered chat template, which only the engine knows), or the completion
prompt. The blocks do not line up with the engine's token blocks; they need not: the approximate
index only compares prompts with prompts the gateway itself sent.

What the engine caches apart although the tokens are equal is kept apart by the chain's root
(`root(namespace)`): the LoRA adapter a prompt runs with, and vLLM's `cache_salt`, which the
engine mixes into a prompt's first block only, as the root here (`namespace(adapter, salt)`). So
two tenants whose prompts the gateway salts apart (server.gateway.tenants.isolation) never share
a key, in either index, and each tenant's repeats still meet their own blocks.

Pure functions; blake2b with an 8-byte digest (collisions are harmless here: at worst one
routing decision is based on a block that is not there).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence

BlockKey = int

_ROOT = b"\x00" * 8


def _chain(parent: bytes, content: bytes) -> bytes:
    return hashlib.blake2b(content, digest_size=8, key=parent).digest()


def root(namespace: str = "") -> bytes:
    """The parent of a prompt's first block. A namespace (`namespace()`: a LoRA adapter's name,
    a cache salt) keeps apart blocks of equal tokens that the engine caches apart."""
    return _ROOT if not namespace else hashlib.blake2b(namespace.encode(), digest_size=8).digest()


def namespace(adapter: str = "", salt: str = "") -> str:
    """The namespace of a prompt run with LoRA `adapter` ("" for the base model) and vLLM's
    `cache_salt` `salt` ("" for none). Without a salt it is the adapter's name alone, as before
    salts. The salt enters as a digest, never as itself: a namespace may be shown (a repr in a
    debugger or a log line), a tenant's salt must not be."""
    if not salt:
        return adapter
    return f"{adapter}\x00salt\x00{hashlib.blake2b(salt.encode(), digest_size=16).hexdigest()}"


def request_namespace(adapter: str, body: Mapping[str, object]) -> str:
    """The namespace of `body` as the engine is sent it: its adapter and its `cache_salt`."""
    salt = body.get("cache_salt")
    return namespace(adapter, salt if isinstance(salt, str) else "")


def token_blocks(
    tokens: Sequence[int], block_size: int, *, parent: bytes | None = None, namespace: str = ""
) -> list[BlockKey]:
    """The keys of the full `block_size`-token blocks of `tokens`, chained from `parent` (else the root)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    previous = parent if parent is not None else root(namespace)
    keys: list[BlockKey] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        content = array("q", tokens[start : start + block_size]).tobytes()
        previous = _chain(previous, content)
        keys.append(int.from_bytes(previous, "big"))
    return keys


def key_bytes(key: BlockKey) -> bytes:
    """A key as the `parent` of the next blocks."""
    return key.to_bytes(8, "big")


def text_blocks(text: str, block_chars: int, *, namespace: str = "") -> list[BlockKey]:
    """The keys of the full `block_chars`-character blocks of `text`."""
    if block_chars <= 0:
        raise ValueError("block_chars must be positive")
    previous = root(namespace)
    keys: list[BlockKey] = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = _chain(previous, text[start : start + block_chars].encode("utf-8", "surrogatepass"))
        keys.append(int.from_bytes(previous, "big"))
    return keys


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones (an image's bytes are not text)
        return "".join(text for p in content if isinstance(p, dict) and isinstance(text := p.get("text"), str))
    return ""


def prompt_text(body: Mapping[str, object]) -> str | None:
    """What the engine will see of a request, as text: None when the body carries no prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    parts = []
    for message in messages:
        if isinstance(message, dict):
            parts.append(f"\x1e{message.get('role', '')}\x1f{_text_of(message.get('content'))}")
    return "".join(parts)

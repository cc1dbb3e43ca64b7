"""Cache keys for the token counter: one per message and per tool list, equal for equal content.

The counter (`server.gateway.trimming.counter`) remembers each message's tokens, and each tool
list's cost, under these keys, together with the model's name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable
from typing import Any

from server.gateway.trimming.core import Message

Key = Hashable


def message_key(message: Message) -> Key:
    """A content hash of the message: equal for equal messages, whatever their key order.

    The common ``{"role", "content": str}`` message is keyed by its role, length and Python's
    string hash (SipHash, keyed per process); anything else by a BLAKE2 hash of its canonical JSON.
    """
    content = message.get("content")
    if len(message) == 2 and isinstance(content, str) and isinstance(message.get("role"), str):
        return (message["role"], len(content), hash(content))
    canonical = json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()


def tools_key(tools: list[Any]) -> bytes:
    """A content hash of a request's tool definitions, never equal to a message's key."""
    canonical = json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return b"tools:" + hashlib.blake2b(canonical.encode(), digest_size=16).digest()

"""The token ids of a chat prompt's leading messages, remembered, so the precise index need not ask
an engine's /tokenize for every request.

Precise routing keys a prompt by the engine's own token ids (tokenizer.py, `EngineTokenizer`): one
/tokenize round trip per routed request, before the request itself. On the tiny model on one CPU
core that round trip took 4.5 ms of a 25 ms time to first token (more while the engine is busy),
on every request. Yet what decides where a chat request goes is its leading messages (a tenant's
system prompt, a conversation's earlier turns): an engine can hold blocks beyond them only if it
saw this very last message before. So the leading messages' tokens are kept, keyed by exactly what
renders them (the /tokenize body without the last message and without the generation prompt: the
messages, the tools, the template's arguments), and a request whose leading messages were seen
is keyed from them without a round trip.

That holds only for a chat template that renders the leading messages the same whether or not
more follow (ChatML, Llama 3 and most do; a template that folds the system prompt into the first
user turn, or drops earlier turns' reasoning, does not). So a model's first openings are kept only after
a request's own full tokenization began with them (both are asked for at once, when the leading
part is new; after CHECKS of them, the leading part alone); a model whose template fails that once
is never served from memory again.

State only; bounded: at most `entries` token lists, least recently used dropped first, each kept as
a compact array.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

ENTRIES = 1024  # leading-message token lists kept (about 6 MB at 1,500 tokens each)
CHECKS = 8  # a model's first openings checked against their whole prompts; later ones are taken as they come


def leading_request(request: Mapping[str, Any]) -> dict[str, Any] | None:
    """The /tokenize body of `request`'s leading messages (all but the last, no generation
    prompt), or None when there is nothing to lead with (one message, a plain prompt, or a final
    message the engine continues)."""
    messages = request.get("messages")
    if not isinstance(messages, list) or len(messages) < 2 or request.get("continue_final_message"):
        return None
    return {**request, "messages": messages[:-1], "add_generation_prompt": False}


def request_key(request: Mapping[str, Any]) -> bytes:
    """A digest of everything a /tokenize body renders from."""
    text = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class LeadingTokens:
    """Per model: the token ids of leading messages seen before, and whether its template allows it."""

    def __init__(self, entries: int = ENTRIES) -> None:
        self.entries = entries
        self._tokens: OrderedDict[bytes, array[int]] = OrderedDict()
        self._unstable: set[str] = set()  # models whose template renders leading messages differently
        self._checked: dict[str, int] = {}  # model -> openings that began their whole prompts
        self.served = 0  # requests keyed from memory (no round trip)

    def usable(self, model: str) -> bool:
        return model not in self._unstable

    def get(self, model: str, key: bytes) -> list[int] | None:
        """The remembered leading tokens under `key`, if the model's template allows it."""
        if model in self._unstable:
            return None
        tokens = self._tokens.get(key)
        if tokens is None:
            return None
        self._tokens.move_to_end(key)
        self.served += 1
        return tokens.tolist()

    def checked(self, model: str) -> bool:
        """Whether the model's template has rendered CHECKS openings the same as the start of their
        whole prompts: its later openings are kept without asking for the whole prompt too."""
        return self._checked.get(model, 0) >= CHECKS

    def learn(self, model: str, key: bytes, leading: Sequence[int], full: Sequence[int] | None = None) -> bool:
        """One request's leading tokens, with its full tokens asked for together until the model is
        `checked`: kept when the full ones begin with the leading ones; else the model is never served
        from memory again."""
        if model in self._unstable:
            return False
        if full is not None:
            if len(leading) > len(full) or list(full[: len(leading)]) != list(leading):
                self._unstable.add(model)  # its entries are never read again; the LRU drops them
                return False
            self._checked[model] = self._checked.get(model, 0) + 1
        elif not self.checked(model):
            return False
        self._tokens[key] = array("l", leading)
        self._tokens.move_to_end(key)
        while len(self._tokens) > self.entries:
            self._tokens.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._tokens)

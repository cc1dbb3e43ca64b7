"""A small prefix cache over blocks of words, so that `vllm:prefix_cache_*` move like vLLM's and
`usage.prompt_tokens_details.cached_tokens` has something true to report.

A block is `PREFIX_BLOCK_WORDS` words (the stand-in's tokens) hashed together with every block
before it; a prompt hits while its leading blocks are cached. The `PREFIX_CACHE_BLOCKS` most
recently used blocks are kept.
"""

from __future__ import annotations

import collections

from standin.config import PREFIX_BLOCK_WORDS, PREFIX_CACHE_BLOCKS
from standin.tokens import prompt_words


class PrefixCache:
    """The blocks seen so far, and the query and hit counts in tokens (as vLLM's counters)."""

    def __init__(self) -> None:
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.queries = 0
        self.hits = 0

    def count(self, body: dict) -> int:
        """Look a generation request's prompt up, cache its blocks; returns its hits in tokens."""
        words = prompt_words(body)
        hits_before = self.hits
        self.queries += len(words)
        blocks = self._blocks
        prefix_hash = 0
        hit = True
        for start in range(0, len(words) - PREFIX_BLOCK_WORDS + 1, PREFIX_BLOCK_WORDS):
            prefix_hash = hash((prefix_hash, *words[start : start + PREFIX_BLOCK_WORDS]))
            if hit and prefix_hash in blocks:
                self.hits += PREFIX_BLOCK_WORDS
                blocks.move_to_end(prefix_hash)
            else:
                hit = False
                blocks[prefix_hash] = None
        while len(blocks) > PREFIX_CACHE_BLOCKS:
            blocks.popitem(last=False)
        return self.hits - hits_before

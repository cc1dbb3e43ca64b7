"""How vLLM lays one engine over its GPUs: tensor x pipeline x data parallel, experts split.

- Tensor parallel (TP) splits every attention head group and MLP across `tp` ranks. KV heads
  are divided too, but never below one a rank: with fewer KV heads than ranks each is
  replicated (`max(1, kv_heads // tp)`); MLA caches one latent vector a token, whole on every
  rank. Embeddings and the output head are split by vocabulary rows (padded to 64).
- Pipeline parallel (PP) gives each stage a contiguous run of layers; an uneven remainder goes
  to the stages before the last (the last holds the final norm and the head), as vLLM's
  `get_pp_indices` does. Every rank's KV cache gets the same number of blocks: the smallest.
- Data parallel (DP) runs `dp` copies of the attention, each with a KV cache and scheduler of
  its own. The MoE experts of a stage are split over all `tp x dp` ranks of that stage: by
  whole experts with expert parallelism (EP), by slices of every expert without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

VOCAB_PADDING = 64  # vLLM pads embedding and head rows to a multiple of this


@dataclass(frozen=True)
class Layout:
    """One engine's parallelism: tensor, pipeline and data parallel sizes, experts split or sliced."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def moe_shards(self) -> int:
        """Ranks the experts of one pipeline stage are spread over."""
        return self.tp * self.dp

    def describe(self) -> str:
        parts = [f"TP={self.tp}"]
        if self.pp > 1:
            parts.append(f"PP={self.pp}")
        if self.dp > 1:
            parts.append(f"DP={self.dp}")
        text = " x ".join(parts)
        return text + (" + EP" if self.ep else "") + f" ({self.gpus} GPU{'s' if self.gpus > 1 else ''})"

    def flags(self) -> dict[str, int | bool]:
        """The vLLM options of this layout."""
        out: dict[str, int | bool] = {"tensor-parallel-size": self.tp}
        if self.pp > 1:
            out["pipeline-parallel-size"] = self.pp
        if self.dp > 1:
            out["data-parallel-size"] = self.dp
        if self.ep:
            out["enable-expert-parallel"] = True
        return out


def stage_layers(total: int, pp: int) -> list[tuple[int, int]]:
    """(start, end) layer indices of each pipeline stage."""
    if pp > total:
        raise ValueError(f"pipeline-parallel-size {pp} is more than the model's {total} layers")
    sizes = [total // pp] * pp
    remainder = total % pp
    for i in range(2, remainder + 2):  # the remainder goes to the stages just before the last
        sizes[-i] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def kv_heads_per_rank(kv_heads: int, tp: int, *, mla: bool) -> int:
    """KV heads one tensor-parallel rank caches (MLA: its one latent)."""
    if mla:
        return 1
    return max(1, kv_heads // tp)


def padded_vocab_rows(vocab: int, tp: int) -> int:
    """Embedding or head rows on one tensor-parallel rank."""
    padded = math.ceil(vocab / VOCAB_PADDING) * VOCAB_PADDING
    return math.ceil(padded / tp)


def layout_problem(layout: Layout, *, heads: int, kv_heads: int, layers: int, experts: int) -> str | None:
    """Why vLLM would refuse this layout for the model, or None."""
    if heads % layout.tp:
        return f"{heads} attention heads do not divide by tensor-parallel-size {layout.tp}"
    if kv_heads and kv_heads % layout.tp and layout.tp % kv_heads:
        return f"{kv_heads} KV heads and tensor-parallel-size {layout.tp}: neither divides the other"
    if layout.pp > layers:
        return f"pipeline-parallel-size {layout.pp} is more than the model's {layers} layers"
    if layout.ep and not experts:
        return "enable-expert-parallel on a model without experts"
    return None

"""The routing experiment's workloads against the gateway's real pool and scorer, with modelled
engines: a quick check of a scorer change before the real experiment (bench/routing_experiment.py)
spends the machine's time on it. Not a measurement: the engines are a model.

Each replica is an LRU prefix cache of `--blocks` blocks of `--block-tokens` tokens (vLLM's
order: a finished request's blocks become evictable tail first, so its leading blocks go last);
its KV events (stored / removed) reach the gateway's precise index at once. A prompt's "tokens"
are its characters in pairs (the tiny model's tokenizer makes about 1.9 characters a token).
Two clients at a time (or `--concurrency`): a request takes one time unit per block computed
plus one, so a replica that serves everything is slower, as it is on pinned cores.

python -m bench.routing_simulation --workload hot-prefix --index precise
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from bench.routing_workloads import WORKLOADS, ordered_sessions
from loadtest.scenarios import Session
from loadtest.tenants import tenant_of
from server.config import ServedModel
from server.gateway.replicas.blocks import prompt_text, text_blocks, token_blocks
from server.gateway.replicas.cache import CacheState, PromptView
from server.gateway.replicas.engine import Engine, EngineMetrics
from server.gateway.replicas.pool import EnginePool
from server.gateway.settings import Routing


@dataclass
class ModelEngine:
    """One replica's prefix cache: block key -> None, least recently used first."""

    blocks: int
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    hits: int = 0
    queries: int = 0
    requests: int = 0

    def serve(self, keys: list[int]) -> tuple[int, list[int], list[int]]:
        """Hit blocks, stored keys, removed keys."""
        hit = 0
        for key in keys:
            if key not in self.cache:
                break
            hit += 1
        stored = [k for k in keys[hit:]]
        removed: list[int] = []
        for key in reversed(keys):  # the tail becomes evictable first, the head last
            self.cache[key] = None
            self.cache.move_to_end(key)
        while len(self.cache) > self.blocks:
            old, _ = self.cache.popitem(last=False)
            removed.append(old)
        self.hits += hit
        self.queries += len(keys)
        self.requests += 1
        return hit, stored, removed


# Time units of the serial timing model: what a request costs a replica's core (the tiny model on
# CPU: a fixed part, a little per block computed, then its 8 tokens of answer).
PREFILL_FIXED, PREFILL_BLOCK, DECODE = 5.0, 1.0, 5.0


def tokens_of(text: str) -> list[int]:
    return [ord(text[i]) * 65536 + ord(text[i + 1] if i + 1 < len(text) else " ") for i in range(0, len(text), 2)]


def simulate(
    workload: str,
    index: str,
    *,
    blocks: int,
    block_tokens: int,
    concurrency: int,
    seed: int,
    lag: bool = False,
    weights: dict[str, float] | None = None,
) -> dict:
    """`index`: approximate or precise (the gateway's cache_aware), or round_robin / oracle."""
    spec = WORKLOADS[workload]
    conversations = ordered_sessions(spec, seed)
    pool = EnginePool.from_models([ServedModel("m", ["http://a:1", "http://b:1"])], cache=CacheState())
    model = pool.get("m")
    cache = pool.cache
    engines = {e.id: ModelEngine(blocks) for e in model.engines}
    for engine in model.engines:
        engine.metrics = EngineMetrics(kv_usage=0.0, kv_capacity_tokens=blocks * block_tokens, block_size=block_tokens)
        cache.precise.set_live(engine.id, True)
        cache.precise.state(engine.id).block_size = block_tokens
    policy = "cache_aware" if index in ("approximate", "precise") else "round_robin"
    routing = Routing(
        policy=policy,  # type: ignore[arg-type]
        prefix_index="approximate" if index == "approximate" else "precise",
        prefix_affinity=False,
        weights=weights or {},
    )
    free_at = {e.id: 0.0 for e in model.engines}  # a replica serves one request at a time (a core each)
    ttfts: list[float] = []
    rng = random.Random(seed)
    clock = 0.0
    queue = list(reversed(conversations))
    running: list[tuple[float, int, Engine, tuple[Session, int, list], tuple[str, list[int], list[int]]]] = []
    counter = 0
    reasons: dict[str, int] = {}
    prompt_tokens = cached = 0

    def deliver(events: tuple[str, list[int], list[int]]) -> None:
        engine_id, stored, removed = events
        state = cache.precise.state(engine_id)
        for key in stored:
            state.keys[key] = key
            state.held[key] = 1
            state.stored += 1
        cache.precise.removed(engine_id, removed)

    def start(now: float, session: Session | None = None, turn: int = 0, history: list | None = None) -> None:
        nonlocal counter, prompt_tokens, cached
        if session is None:
            if not queue:
                return
            session, turn, history = queue.pop(), 0, []
        assert history is not None
        messages = [*session.prefix, *history, session.turns[turn]]
        body = {"model": "m", "messages": messages}
        text = prompt_text(body) or ""
        tokens = tokens_of(text)
        view = PromptView(
            text_blocks(text, cache.block_chars), len(text), tokens=tokens if index == "precise" else None
        )
        if index == "oracle":
            engine = model.engines[tenant_of(session) % 2]
            engine.outstanding += 1
        else:
            decision = model.route(routing, prompt=view)
            assert decision is not None
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
            engine = decision.engine
        keys = token_blocks(tokens, block_tokens)
        hit, stored, removed = engines[engine.id].serve(keys)
        events = (engine.id, stored, removed)
        if not lag:
            deliver(events)
        prompt_tokens += len(tokens)
        cached += hit * block_tokens
        counter += 1
        begin = max(now, free_at[engine.id])
        first = begin + PREFILL_FIXED + PREFILL_BLOCK * (len(keys) - hit) + rng.random() * 0.1
        done = first + DECODE
        free_at[engine.id] = done
        ttfts.append(first - now)
        history = [*history, session.turns[turn], {"role": "assistant", "content": "Noted, thank you."}]
        heapq.heappush(running, (done, counter, engine, (session, turn + 1, history), events))

    for _ in range(concurrency):
        start(clock)
    while running:
        clock, _, engine, (session, turn, history), events = heapq.heappop(running)
        if lag:
            deliver(events)  # the engine's events arrive once its prefill is done
        model.release(engine)
        if turn < len(session.turns):
            start(clock, session, turn, history)
        else:
            start(clock)
    return {
        "workload": workload,
        "index": index,
        "hit_share": cached / prompt_tokens,
        "split": [e.requests for e in engines.values()],
        "reasons": reasons,
        "requests": counter,
        "ttft_p90": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
    }


def oracle(workload: str, *, blocks: int, block_tokens: int, seed: int) -> dict:
    spec = WORKLOADS[workload]
    engines = [ModelEngine(blocks), ModelEngine(blocks)]
    prompt_tokens = cached = 0
    for session in ordered_sessions(spec, seed):
        history: list = []
        for message in session.turns:
            text = prompt_text({"messages": [*session.prefix, *history, message]}) or ""
            tokens = tokens_of(text)
            hit, _, _ = engines[tenant_of(session) % 2].serve(token_blocks(tokens, block_tokens))
            prompt_tokens += len(tokens)
            cached += hit * block_tokens
            history += [message, {"role": "assistant", "content": "Noted, thank you."}]
    return {"workload": workload, "index": "oracle", "hit_share": cached / prompt_tokens,
            "split": [e.requests for e in engines]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.routing_simulation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append")
    parser.add_argument("--index", choices=("round_robin", "oracle", "approximate", "precise"), action="append")
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=0, help="default: the workload's")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lag", action="store_true", help="KV events arrive when the request is done, not at once")
    parser.add_argument("--weights", default="", help="scorer weights over the defaults, e.g. outstanding=4")
    args = parser.parse_args()
    for workload in args.workload or sorted(WORKLOADS):
        concurrency = args.concurrency or WORKLOADS[workload].concurrency
        for seed in range(args.seeds):
            weights = {k: float(v) for k, v in (p.split("=") for p in args.weights.split(",") if p)}
            for index in args.index or ("round_robin", "oracle", "approximate", "precise"):
                out = simulate(
                    workload,
                    index,
                    blocks=args.blocks,
                    block_tokens=args.block_tokens,
                    concurrency=concurrency,
                    seed=seed,
                    lag=args.lag,
                    weights=weights,
                )
                print(out)


if __name__ == "__main__":
    main()

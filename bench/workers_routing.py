"""What per-worker routing state costs: the engines' prefix-cache hits with one and with two gateway workers.

Each worker keeps its own approximate prefix index (what it sent where) and its own count of
outstanding requests; only rendezvous hashing (session ids, `user`, prompt prefixes) and the
engines' own figures (scraped, or KV events) are the same in every worker. The stand-in engines
publish no KV events, so the default `cache_aware` policy scores prompts with the approximate
index: the case where workers know least about each other.

Two stand-in engines (fresh, empty prefix caches) behind `python -m server serve --workers N`;
16 conversations of 8 turns run side by side, each turn on a new connection (so the kernel picks
the worker), the history growing by one question and one answer per turn. Measured: the share of
prompt tokens the engines found in their prefix caches (vllm:prefix_cache_hits / queries), once
without and once with an `x-session-id` header per conversation.

Usage: python -m bench.workers_routing --output docs/bench
"""

from __future__ import annotations

import argparse
import json
import re
import threading
from pathlib import Path

import httpx

from bench.procs import PYTHON, Processes, free_port, wait_chat_ready

MODEL = "standin"
CONVERSATIONS, TURNS = 16, 8
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def _text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3 + i // 16) % len(WORDS)] + str((seed + i) % 13) for i in range(words))


def _prefix_counts(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = {
        name: float(value)
        for name, value in re.findall(r"^(vllm:prefix_cache_(?:hits|queries)_total)\{[^}]*\} (\S+)$", text, re.M)
    }
    return found.get("vllm:prefix_cache_hits_total", 0.0), found.get("vllm:prefix_cache_queries_total", 0.0)


def _conversation(url: str, index: int, session: bool, errors: list[str]) -> None:
    messages = [{"role": "system", "content": f"conversation {index}: " + _text(index, 120)}]
    headers = {"connection": "close", **({"x-session-id": f"conversation-{index}"} if session else {})}
    for turn in range(TURNS):
        messages.append({"role": "user", "content": _text(index * 100 + turn, 40)})
        try:
            with httpx.Client(timeout=60) as client:
                response = client.post(
                    f"{url}/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 8},
                    headers=headers,
                )
            response.raise_for_status()
            answer = response.json()["choices"][0]["message"]["content"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            errors.append(repr(exc))
            return
        messages.append({"role": "assistant", "content": answer})


def run_once(workers: int, session: bool) -> dict:
    with Processes() as procs:
        engines = []
        for n in range(2):
            port = free_port()
            started = procs.start(
                f"standin-{n}",
                [PYTHON, "-m", "standin", "--port", str(port), "--model", MODEL, "--ttft-ms", "5",
                 "--itl-ms", "2", "--tokens", "8", "--max-model-len", "32768"],
                core=None,
            )  # fmt: skip
            engines.append((started, f"http://127.0.0.1:{port}"))
        for started, url in engines:
            if error := wait_chat_ready(started, url, MODEL):
                raise SystemExit(f"stand-in engine: {error}")
        port = free_port()
        argv = [PYTHON, "-m", "server", "serve", "--port", str(port), "--workers", str(workers),
                *[arg for _, url in engines for arg in ("--upstream", f"{MODEL}={url}")]]  # fmt: skip
        gateway = procs.start(f"gateway-{workers}", argv, core=None)
        gateway_url = f"http://127.0.0.1:{port}"
        if error := wait_chat_ready(gateway, gateway_url, MODEL, timeout=120):
            raise SystemExit(f"gateway: {error}")
        before = [_prefix_counts(url) for _, url in engines]
        errors: list[str] = []
        threads = [
            threading.Thread(target=_conversation, args=(gateway_url, i, session, errors)) for i in range(CONVERSATIONS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        after = [_prefix_counts(url) for _, url in engines]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    per_engine = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    return {
        "workers": workers,
        "session_header": session,
        "hit_ratio": hits / queries if queries else None,
        "queried_tokens_per_engine": per_engine,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def render_markdown(runs: list[dict]) -> str:
    lines = [
        "# Per-worker routing state: prefix-cache hits with one and two gateway workers",
        "",
        (__doc__ or "").split("\n\n", 1)[1].rsplit("\n\nUsage:", 1)[0],
        "",
        "| workers | x-session-id | prompt tokens found in the prefix caches | tokens queried per engine | errors |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        ratio = run["hit_ratio"]
        lines.append(
            f"| {run['workers']} | {'yes' if run['session_header'] else 'no'} | "
            f"{'n/a' if ratio is None else f'{ratio * 100:.1f} %'} | "
            f"{' / '.join(f'{q:.0f}' for q in run['queried_tokens_per_engine'])} | {run['errors']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workers_routing", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("docs/bench"))
    args = parser.parse_args(argv)
    runs = [run_once(workers, session) for session in (False, True) for workers in (1, 2)]
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "workers-routing.json").write_text(json.dumps(runs, indent=2) + "\n")
    text = render_markdown(runs)
    (args.output / "workers-routing.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

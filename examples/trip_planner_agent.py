"""A trip-planning agent on the OpenAI SDK, with two tools it runs itself: `search_poi` and `get_weather`.

Runs against `make run`'s gateway (the tiny model on CPU) or any deployment of this project:

    .venv/bin/python examples/trip_planner_agent.py                          # 30 turns, streamed
    .venv/bin/python examples/trip_planner_agent.py --turns 5 --no-stream
    .venv/bin/python examples/trip_planner_agent.py --base-url http://GPU-HOST:8000/v1 \\
        --model llama-3.1-8b-instruct --tool-choice auto

Each turn the traveller asks about one day of the trip. The agent sends the whole conversation
with the two tools, runs every call the model makes, sends each result back as a `tool` message
answering its call, and asks again, until the model answers in text (at most `--max-steps`
requests per turn; the last one with `tool_choice="none"`). `--tool-choice named` (the default)
names the tool on the turn's first request: the tiny model's random weights never pick a tool on
their own, and vLLM's guided decoding holds a named call's arguments to the tool's JSON schema.
With a real model, `--tool-choice auto` lets it decide.

The history grows every turn. The gateway trims the oldest turns to fit the model's context (the
`x-trim-status` response header says `trimmed`) and keeps every tool call with its result. Per
turn the agent prints the calls, the time to the first streamed token (a tool-call delta counts),
the prompt tokens the engine saw, and what trimming did.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openai import OpenAI

CITIES = ["Lisbon", "Porto", "Sintra", "Coimbra"]
KINDS = ["museum", "food", "park", "viewpoint"]

# `strict: true` asks vLLM to hold the arguments to the schema (OpenAI's structured function
# calling). Strict schemas name every property as required and allow no others.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search_poi",
            "description": "Points of interest of one kind in a city, with rating and opening hours.",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": CITIES},
                    "kind": {"type": "string", "enum": KINDS},
                },
                "required": ["city", "kind"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city on a day of the trip (1-7).",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": CITIES},
                    "day": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "day"],
                "additionalProperties": False,
            },
        },
    },
]

SYSTEM = (
    "You are a travel planning agent. Use search_poi to find places and get_weather for the "
    "forecast, then answer with a short plan for the day."
)


def _pick(seed: str, options: list[Any]) -> Any:
    return options[hashlib.sha256(seed.encode()).digest()[0] % len(options)]


def search_poi(city: str, kind: str) -> dict[str, Any]:
    """A stand-in for a places API: three deterministic results."""
    return {
        "city": city,
        "kind": kind,
        "results": [
            {
                "name": f"{city} {kind} {i}",
                "rating": _pick(f"{city}{kind}{i}", [3.9, 4.2, 4.5, 4.8]),
                "open": _pick(f"{city}{kind}{i}h", ["09:00-17:00", "10:00-18:00", "12:00-23:00"]),
                "distance_km": _pick(f"{city}{kind}{i}d", [0.4, 1.2, 2.5]),
            }
            for i in (1, 2, 3)
        ],
    }


def get_weather(city: str, day: int) -> dict[str, Any]:
    """A stand-in for a weather API."""
    return {
        "city": city,
        "day": day,
        "forecast": _pick(f"{city}{day}", ["sunny", "cloudy", "rain"]),
        "high_c": _pick(f"{city}{day}t", [17, 21, 24, 28]),
    }


LOCAL_TOOLS: dict[str, Callable[..., dict[str, Any]]] = {"search_poi": search_poi, "get_weather": get_weather}


def run_tool(name: str, arguments: str) -> str:
    """Run one call; a bad call becomes an error the model can read, as agent frameworks do."""
    try:
        args = json.loads(arguments)
        return json.dumps(LOCAL_TOOLS[name](**args))
    except (KeyError, TypeError, ValueError) as exc:
        return json.dumps({"error": f"{type(exc).__name__}: {exc}"})


@dataclass
class Step:
    """One request: the model's message as the agent appends it, and what the gateway said."""

    message: dict[str, Any]
    sent_messages: int  # the history's length when this request was sent
    finish_reason: str | None
    first_token_s: float | None
    seconds: float
    prompt_tokens: int | None
    completion_tokens: int | None
    trim_status: str | None
    trimmed_messages: int


@dataclass
class Turn:
    number: int
    question: str
    steps: list[Step] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments", "result"}

    @property
    def answer(self) -> str:
        return self.steps[-1].message.get("content") or "" if self.steps else ""


def ask(
    client: OpenAI,
    model: str,
    messages: list[dict[str, Any]],
    *,
    tool_choice: Any,
    stream: bool,
    max_tokens: int,
    seed: int,
) -> Step:
    """One chat request with the tools; streamed tool-call deltas are put back together by index."""
    started = time.perf_counter()
    request = dict(
        model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens, seed=seed
    )
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**request)
        completion = raw.parse()
        choice = completion.choices[0]
        reply = choice.message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True)
        return Step(
            reply,
            len(messages),
            choice.finish_reason,
            None,
            time.perf_counter() - started,
            completion.usage.prompt_tokens if completion.usage else None,
            completion.usage.completion_tokens if completion.usage else None,
            raw.headers.get("x-trim-status"),
            int(raw.headers.get("x-trimmed-messages", 0)),
        )

    raw = client.chat.completions.with_raw_response.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    chunks = raw.parse()
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    first = finish = usage = None
    with chunks:
        for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                delta = choice.delta
                if first is None and (delta.content or delta.tool_calls):
                    first = time.perf_counter() - started
                content.append(delta.content or "")
                for part in delta.tool_calls or []:
                    call = calls.setdefault(
                        part.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                    call["id"] = part.id or call["id"]
                    if part.function is not None:
                        call["function"]["name"] += part.function.name or ""
                        call["function"]["arguments"] += part.function.arguments or ""
                finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return Step(
        message,
        len(messages),
        finish,
        first,
        time.perf_counter() - started,
        usage.prompt_tokens if usage else None,
        usage.completion_tokens if usage else None,
        raw.headers.get("x-trim-status"),
        int(raw.headers.get("x-trimmed-messages", 0)),
    )


def run_agent(
    client: OpenAI,
    model: str,
    *,
    turns: int = 30,
    stream: bool = True,
    tool_choice: str = "named",
    max_steps: int = 3,
    max_tokens: int = 160,
    on_turn: Callable[[Turn], None] | None = None,
) -> tuple[list[Turn], list[dict[str, Any]]]:
    """Run the conversation; returns every turn and the whole history the agent kept."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    done: list[Turn] = []
    for number in range(1, turns + 1):
        city, tool = CITIES[number % len(CITIES)], TOOLS[number % 2]["function"]["name"]
        turn = Turn(number, f"Turn {number}. Day {number % 7 + 1} in {city}: what should we do, and the weather?")
        messages.append({"role": "user", "content": turn.question})
        for step_index in range(max_steps):
            if step_index == max_steps - 1:
                choice: Any = "none"
            elif step_index == 0 and tool_choice == "named":
                choice = {"type": "function", "function": {"name": tool}}
            else:
                choice = "auto" if tool_choice in {"named", "auto"} else tool_choice
            step = ask(
                client,
                model,
                messages,
                tool_choice=choice,
                stream=stream,
                max_tokens=max_tokens,
                seed=number * 10 + step_index,
            )
            turn.steps.append(step)
            messages.append(step.message)
            if not step.message.get("tool_calls"):
                break
            for call in step.message["tool_calls"]:
                result = run_tool(call["function"]["name"], call["function"]["arguments"])
                turn.calls.append(
                    {"name": call["function"]["name"], "arguments": call["function"]["arguments"], "result": result}
                )
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        done.append(turn)
        if on_turn is not None:
            on_turn(turn)
    return done, messages


def _compact(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), separators=(",", ":"))
    except ValueError:
        return repr(arguments)


def print_turn(turn: Turn) -> None:
    first = turn.steps[0]
    ttft = f"{first.first_token_s * 1000:6.0f} ms" if first.first_token_s is not None else "      -  "
    calls = ", ".join(f"{c['name']}({_compact(c['arguments'])})" for c in turn.calls) or "no tool call"
    print(
        f"turn {turn.number:2d}  ttft {ttft}  prompt {first.prompt_tokens or 0:5d} tok  "
        f"trim {first.trim_status or '-':9s} dropped {first.trimmed_messages:3d}  {calls}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused", help="the gateway's key, if it has any")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--tool-choice", choices=["named", "auto", "required"], default="named")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--no-stream", dest="stream", action="store_false")
    args = parser.parse_args(argv)
    with OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300) as client:
        turns, messages = run_agent(
            client,
            args.model,
            turns=args.turns,
            stream=args.stream,
            tool_choice=args.tool_choice,
            max_tokens=args.max_tokens,
            on_turn=print_turn,
        )
    trimmed = sum(1 for t in turns for s in t.steps if s.trim_status == "trimmed")
    print(
        f"{len(turns)} turns, {sum(len(t.calls) for t in turns)} tool calls, {len(messages)} messages in "
        f"the agent's history; the gateway trimmed {trimmed} of "
        f"{sum(len(t.steps) for t in turns)} requests",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

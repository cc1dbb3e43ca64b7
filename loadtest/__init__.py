"""A load tester for OpenAI-compatible chat endpoints, measuring from outside as a client.

`python -m loadtest --help` for usage. Layout, one concept per module:

- `sse`: a byte-level Server-Sent Events decoder (pure).
- `chunks`: what one OpenAI `chat.completion.chunk` means for timing (pure).
- `transport`: the HTTP/1.1 client (asyncio + httptools, every chunk stamped on arrival).
- `client`: sends one streamed request and times it (the only place that does HTTP for
  requests; over `transport`, or httpx with `--http-client httpx`).
- `aio`: the event loop (uvloop when installed).
- `records`: the per-request record written to `requests.jsonl`.
- `scenarios`: the built-in workloads (`itinerary`, `articles`, `random`) and `file`.
- `schedule`: open-loop arrival times (Poisson, gamma, constant) (pure).
- `runner`: drives one run (closed-loop concurrency or open-loop rate, stop rules, warm-up).
- `engine_probe`: optional scrapes of a vLLM `/metrics` endpoint (KV-cache usage per request,
  prefix-cache counters around a run).
- `loop_lag`: the generator's own event-loop lag, and the warnings when it was the bottleneck.
- `process_stats`: the generator's CPU, run-queue wait (a busy machine) and GC pauses per run;
  the GC frozen during a run.
- `overhead`: the load tester's added time, its timings joined with an engine's (pure).
- `selfcheck`: `python -m loadtest.selfcheck`, that measurement against the stand-in engine.
- `metrics`: the metric formulas over recorded timings (pure).
- `slo`: `--slo` parsing, goodput and the pass/fail gate (pure).
- `progress`: the live progress line.
- `report`, `plots`: files written at the end (JSONL, summary JSON, Markdown, PNG).
- `cli`: the command line.

It never imports the project's `server` package: it is an outside client.
"""

"""A stand-in for a vLLM 0.32 OpenAI server: real HTTP, vLLM's JSON shapes, exact timing, faults.

Tests and benchmarks run it where a real engine would be too slow, too random or impossible to
break on purpose. It answers like vLLM (`chat.completion`, `chat.completion.chunk`,
`text_completion`, the OpenAI error envelope, `/tokenize`, `/metrics` with vLLM's names) and
generates `tokens` tokens: the first `ttft_ms` after the request arrived, then one every `itl_ms`.

Token counting is deterministic so that callers can predict it (see `count_chat_tokens`):
a chat message costs 4 + its whitespace-separated words, the generation prompt 3, and a plain
prompt its words. Every generated token is one word, so a reply of n tokens has n words.

Runtime control (JSON):
- `POST /_standin/faults` sets faults (replacing the previous set; `{}` resets):
  `health_status` (status of /health), `status` (answer generation requests with that status and
  an OpenAI error envelope), `die_after_chunks` (close the TCP connection abruptly after that many
  SSE events; non-streaming: after that much generation time, without an answer),
  `first_byte_delay_s` (before the response headers), `stall_after_chunks` + `stall_s` (pause a
  stream), `tokenize_status`, `kv_cache_usage_perc`, `metrics_status` and `metrics_text` (the
  status and the whole text of `/metrics`, e.g. a page captured from vLLM), `ttft_ms`, `itl_ms`,
  `tokens`, `hold` (keep each accepted generation request in flight, before its first byte, until
  `POST /_standin/release`), and `times` (the faults apply to that many generation requests, then
  reset themselves).
- `POST /_standin/release` lets every held request go on (its timing starts then) and clears `hold`.
- A request body may carry `"standin": {...}` with the per-request keys above (`ttft_ms`,
  `itl_ms`, `tokens`, `die_after_chunks`, `first_byte_delay_s`, `stall_after_chunks`, `stall_s`,
  `status`); they win over the faults for that request only.
- `GET /_standin/timings`: engine-side timings of recent generation requests, by request id
  (`x-request-id`, else a generated one), on the stand-in's `time.perf_counter()` clock:
  `arrived` (the handler started), `first_token` and `last_token` (just after the first / last
  token event was handed to the server; streams only), `ended`, `tokens` (token events sent),
  and `ttft_s` = `first_token - arrived`. The last `TIMINGS_KEPT` requests are kept;
  `DELETE /_standin/timings` forgets them. Load testers join these with their own timings to
  measure the time they add themselves.
- `StandinConfig(prompt_tokens_details=True)` (`--prompt-tokens-details`) adds
  `usage.prompt_tokens_details.cached_tokens` (the prompt tokens found in the stand-in's prefix
  cache), as vLLM does with `--enable-prompt-tokens-details`; off by default, like vLLM.
- `GET /_standin/stats`: `running`, `started`, `finished`, `aborted` (the client left before the
  response finished; seen at once through `http.disconnect`), `rejected` (answered with an error),
  `died` (dropped by `die_after_chunks`), `held` (waiting for a release), `peak_running`,
  `tokenize_calls`, `requests` (per path), `last_request` (`path`, `headers`, `body` of the last
  generation request) and `last_tokenize`. `DELETE /_standin/stats` zeroes them.

Differences from vLLM 0.32 on purpose: a chat request whose prompt plus `max_tokens` exceeds
`max_model_len` gets 400 (old vLLM behaviour; vLLM 0.32 shortens the answer instead) unless
`strict_context=False`; `x-request-id` is echoed in the response headers (vLLM does that with
`--enable-request-id-headers`).

Run it: `python -m standin --port 8200 [--ttft-ms 20] [--itl-ms 10] [--tokens 32]` (`--help`).

Modules: config.py (`StandinConfig`, the fault keys), tokens.py (the counting rule), app.py (the
ASGI app and vLLM's endpoints), generation.py (checking and planning one request), replies.py (the
SSE stream and the JSON answer on their schedule), control.py (`/_standin/*`: faults, holds, stats,
timings), metrics.py and prefix_cache.py (`/metrics`), wire.py (ASGI helpers, the error envelope),
cli.py (`python -m standin`), lifecycle.py (process faults for supervisor tests: `--exit-now`,
`--crash-after`, `--grandchild-pidfile`). Two small apps beside it: responses.py (the stand-in plus a
`/v1/responses` that refuses over-long prompts, for Responses trimming) and surface.py (Responses
state and streaming, embeddings, uploads, runtime LoRA: the endpoints beyond chat).
"""

from standin.app import Standin, build_app
from standin.cli import main, run
from standin.config import StandinConfig
from standin.tokens import count_chat_tokens, count_message_tokens, count_prompt_tokens

__all__ = [
    "Standin",
    "StandinConfig",
    "build_app",
    "count_chat_tokens",
    "count_message_tokens",
    "count_prompt_tokens",
    "main",
    "run",
]

"""bench/relay_profile.py: py-spy's collapsed stacks sorted into the table's categories."""

from __future__ import annotations

from bench.relay_profile import _names, categorize, category, render_markdown

ROOT = "run (uvloop/__init__.py:1);RequestResponseCycle.run_asgi (uvicorn/protocols/http/httptools_impl.py:2)"
RELAY = ROOT + ";Exchange._relay_stream (server/gateway/proxy/exchange.py:3)"


def test_an_owner_anywhere_in_the_stack_wins_over_the_innermost_frame():
    log = ROOT + ";log_request (server/gateway/observability/logs.py:9);JSONEncoder.encode (json/encoder.py:1)"
    assert category(log.split(";")).startswith("access log")


def test_otherwise_the_innermost_layer_names_the_sample():
    send = RELAY + ";RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:5)"
    assert category(send.split(";")).startswith("client-side HTTP")
    assert category(RELAY.split(";")).startswith("relay loop")
    assert category(["Runner.run (asyncio/runners.py:118)"]).startswith("event loop")
    assert category(["somewhere (else.py:1)"]) == "other"


def test_counts_add_up_to_the_samples():
    raw = f"{RELAY} 7\n{ROOT};UsageScanner.feed (server/gateway/http/sse.py:4) 3\n\n"
    counts, total = categorize(raw)
    assert total == 10 and sum(counts.values()) == 10
    assert counts["relay loop and exchange (proxy.exchange, proxy.proxy)"] == 7


def test_the_report_gives_each_category_per_chunk_and_per_request_and_names_its_flame_graph():
    report = {
        "date": "d", "commit": "c", "loadavg_before": "0", "loadavg_after": "0", "seconds": 20, "rate": 250,
        "max_tokens": 8, "categories": {"access log": 25, "event loop": 75, "idle worker threads (waiting)": 900},
        "busy_samples": 100, "chunks": 1000, "gateway_cpu_s": 0.08, "cpu_us_per_chunk": 80.0, "requests": 100,
        "cpu_us_per_request": 800.0,
    }  # fmt: skip
    text = render_markdown(report)
    assert "| access log | 25.0 % | 20.0 | 200.0 |" in text and "idle worker" not in text
    assert "(answers of 8 tokens)" in text and "per request 800 us (100 requests)" in text
    assert "[relay-flame-8-tokens.svg](relay-flame-8-tokens.svg)" in text
    assert _names(None) == ("relay-profile", "relay-flame.svg")

"""Request logs: one JSON line per request, fixed keys, no credentials, content only on request."""

from __future__ import annotations

import json
import logging

import pytest

from server.gateway.observability.logs import (
    ACCESS_FIELDS,
    ACCESS_LOGGER,
    OPTIONAL_FIELDS,
    _sole_json_handler,
    configure_logging,
    log_request,
)


def access_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]


def test_one_json_line_with_every_field(caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    log_request(
        request_id="r1",
        model="tiny",
        engine="tiny-0",
        status=200,
        stream=True,
        ttft_s=0.0421234567,
        duration_s=1.5,
        prompt_tokens=12,
        completion_tokens=8,
    )
    [line] = access_lines(caplog)
    assert list(line)[: len(ACCESS_FIELDS)] == list(ACCESS_FIELDS)
    assert line["request_id"] == "r1" and line["status"] == 200 and line["stream"] is True
    assert line["ttft_s"] == 0.042123
    assert line["trimmed_messages"] is None and line["error"] is None
    assert "\n" not in caplog.records[-1].getMessage()


def test_a_tenants_fields_follow_the_fixed_ones_in_order_and_other_extras_are_still_checked(caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    log_request(request_id="r5", status=200, queued_s=0.12345678, tenant="planner", priority="interactive")
    log_request(request_id="r6", status=200, tenant="planner", api_key="sk-secret", note="kept")
    first, second = access_lines(caplog)
    assert list(first) == [*ACCESS_FIELDS, *OPTIONAL_FIELDS]
    assert first["tenant"] == "planner" and first["priority"] == "interactive" and first["queued_s"] == 0.123457
    assert second["tenant"] == "planner" and second["note"] == "kept"
    assert "sk-secret" not in json.dumps(second)


def test_credentials_are_never_logged_and_content_only_when_passed(caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    log_request(
        request_id="r2",
        status=401,
        Authorization="Bearer sk-secret",
        headers={"authorization": "Bearer sk-secret"},
        api_key="sk-secret",
        **{"x-api-key": "sk-secret"},
    )
    log_request(request_id="r3", status=200, messages=[{"role": "user", "content": "hello"}])
    first, second = access_lines(caplog)
    assert "sk-secret" not in json.dumps(first)
    assert "hello" not in json.dumps(first)
    assert second["messages"] == [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_configure_logging_formats(fmt, capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging(fmt)
        configure_logging(fmt)  # idempotent: still one line per record
        log_request(request_id="r4", model="tiny", status=200)
        logging.getLogger("gateway.proxy").warning("engine %s ejected", "e1")
        lines = capsys.readouterr().err.strip().splitlines()
    finally:
        for handler in root.handlers[:]:
            if handler not in saved[0]:
                root.removeHandler(handler)
        root.setLevel(saved[1])
    assert len(lines) == 2
    if fmt == "json":
        access, other = map(json.loads, lines)
        assert access["logger"] == ACCESS_LOGGER and access["request_id"] == "r4"
        assert access["level"] == "info" and access["ts"].endswith("Z")
        assert other == {**other, "level": "warning", "msg": "engine e1 ejected"}
    else:
        assert '"request_id":"r4"' in lines[0] and " INFO gateway.access " in lines[0]
        assert lines[1].endswith("WARNING gateway.proxy engine e1 ejected")


def test_the_line_written_directly_is_the_line_logging_writes(capsys):
    """The gateway's own set-up writes access lines straight to its handler's stream; anything else
    on the way (a filter, another handler) sends them through logging. Same line either way."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    access = logging.getLogger(ACCESS_LOGGER)
    fields = dict(request_id="r5", model="tiny", status=200, ttft_s=0.0123456789, routing={"engine": "e"})
    try:
        root.handlers = []  # pytest's own capturing handlers, too: the gateway's handler alone
        configure_logging("json")
        assert _sole_json_handler(access) is root.handlers[0]
        log_request(**fields)
        direct = capsys.readouterr().err
        access.addFilter(lambda record: True)  # now logging must run the filter: the logging path
        assert _sole_json_handler(access) is None
        log_request(**fields)
        via_logging = capsys.readouterr().err
    finally:
        access.filters.clear()
        root.handlers = saved[0]
        root.setLevel(saved[1])
    assert direct.endswith("\n") and direct.count("\n") == 1
    one, two = json.loads(direct), json.loads(via_logging)
    assert one.pop("ts")[:16] == two.pop("ts")[:16]  # the same minute
    assert list(one) == list(two) and one == two
    assert one["logger"] == ACCESS_LOGGER and one["routing"] == {"engine": "e"} and one["ttft_s"] == 0.012346


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="json"):
        configure_logging("yaml")

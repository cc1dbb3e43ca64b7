"""bench/fairness.py --access-log: the gateway it starts writes its access log, and the bench keeps
those lines, and only those, from the gateway's whole log."""

from __future__ import annotations

from pathlib import Path

from bench.fairness import gateway_config, keep_access_log
from server.gateway.settings import GatewaySettings

# Access-log lines the gateway wrote in an earlier run of this bench (stop 44's diagnostic runs).
SAMPLE = Path(__file__).resolve().parents[2] / "docs/bench/fairness/access-log-27f2ad6/planner-access.jsonl"


def test_the_flag_turns_the_gateways_access_log_on_and_its_absence_leaves_it_off():
    assert GatewaySettings.model_validate(gateway_config("http://127.0.0.1:1", True)).access_log is True
    assert GatewaySettings.model_validate(gateway_config("http://127.0.0.1:1")).access_log is False


def test_the_access_lines_are_kept_in_order_and_nothing_else(tmp_path):
    access = SAMPLE.read_text().splitlines()[:5]
    other = [
        '{"ts":"2026-12-07T15:17:14.000Z","level":"info","logger":"gateway","msg":"gateway on http://127.0.0.1:1/v1"}',
        "INFO:     Started server process [123]",
        '{"ts":"2026-12-07T15:17:16.000Z","level":"warning","logger":"gateway.flow","msg":"queue"}',
    ]
    log = tmp_path / "gateway.log"
    log.write_text("\n".join([other[0], access[0], other[1], *access[1:3], other[2], *access[3:]]) + "\n")
    keep_access_log(log, tmp_path / "access.jsonl")
    assert (tmp_path / "access.jsonl").read_text().splitlines() == access


def test_the_gateways_event_loop_stalls_are_kept_beside_the_access_lines(tmp_path):
    access = SAMPLE.read_text().splitlines()[:2]
    stall = (
        '{"ts":"2026-12-08T01:00:00.000Z","level":"warning","logger":"gateway.loop","msg":"the event loop ran '
        '412 ms late: every stream of this process waited as long (no full garbage collection ran meanwhile)"}'
    )
    log = tmp_path / "gateway.log"
    log.write_text("\n".join([access[0], stall, "INFO:     Started server process [123]", access[1]]) + "\n")
    keep_access_log(log, tmp_path / "access.jsonl")
    assert (tmp_path / "access.jsonl").read_text().splitlines() == [access[0], stall, access[1]]


def test_no_gateway_log_writes_no_file(tmp_path):
    keep_access_log(tmp_path / "gateway.log", tmp_path / "access.jsonl")
    assert not (tmp_path / "access.jsonl").exists()

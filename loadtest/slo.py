"""Service-level objectives from the command line: parsing, and the pass/fail gate.

`--slo ttft:500ms` (repeatable) sets a per-request limit; keys `ttft`, `tpot`, `e2e` (alias
`e2el`), values with a unit `ms` or `s` (a bare number is milliseconds, as in vLLM's
`--goodput`). A request is *good* when it succeeded and meets every limit. A run *passes* when
the share of good requests among all measured requests (failures included) is at least
`--slo-attainment` (default 0.95); otherwise the exit code is 1.
"""

from __future__ import annotations

import re

KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2el", "e2el": "e2el"}
_VALUE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


class SLOError(ValueError):
    """An --slo value that cannot be understood."""


def parse_slo(text: str) -> tuple[str, float]:
    """`"ttft:500ms"` -> `("ttft", 0.5)` (seconds)."""
    key, sep, value = text.partition(":")
    key = key.strip().lower()
    if not sep or key not in KEYS:
        raise SLOError(f"--slo {text!r}: expected KEY:VALUE with KEY one of ttft, tpot, e2e")
    match = _VALUE.match(value)
    if not match:
        raise SLOError(f"--slo {text!r}: the value must be a number with ms or s, e.g. 500ms")
    number = float(match.group(1))
    seconds = number if match.group(2) == "s" else number / 1000.0
    return KEYS[key], seconds


def parse_slos(texts: list[str] | None) -> dict[str, float]:
    """All `--slo` values; a key given twice keeps the last value."""
    return dict(parse_slo(text) for text in texts or [])


def verdict(summary: dict, attainment: float) -> dict:
    """Whether a run's summary meets the SLOs: {"passed", "slo_attainment", "required"}."""
    achieved = summary.get("slo_attainment")
    passed = achieved is not None and achieved == achieved and achieved >= attainment
    return {"passed": bool(passed), "slo_attainment": achieved, "required": attainment}

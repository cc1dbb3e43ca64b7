"""Every key of the gateway's settings is in the configuration block of docs/configure/gateway.md,
so an operator finds any setting there (a new setting without a line there fails here)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from server.gateway.settings import GatewaySettings

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configure" / "gateway.md"


def keys(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str]]:
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        yield prefix + name, name
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from keys(field.annotation, f"{prefix}{name}.")


def test_every_gateway_setting_has_its_line_in_the_configuration_block():
    text = PAGE.read_text()
    start = text.index("```yaml")
    block = text[start : text.index("```", start + 7)]
    documented = set(re.findall(r"^\s*([a-z_]+):", block, re.MULTILINE))
    documented |= set(re.findall(r"[{,]\s*([a-z_]+):", block))  # inline mappings: weights: {prefix: 1, ...}
    missing = [full for full, name in keys(GatewaySettings) if name not in documented]
    assert not missing, f"settings without a line in {PAGE.name}'s configuration block: {missing}"

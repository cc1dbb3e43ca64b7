"""The config file's `models` and the command line's `--upstream`, read the same way everywhere."""

from __future__ import annotations

import pytest

from server.config import ModelEngines, SettingsError, parse_upstreams, read_mapping


def test_upstreams_from_the_command_line():
    models = parse_upstreams(["a=http://h:1", "a=http://h:2/", "b=https://x"])
    assert [(m.name, m.urls) for m in models] == [("a", ["http://h:1", "http://h:2"]), ("b", ["https://x"])]
    with pytest.raises(SettingsError):
        parse_upstreams(["no-url"])


def test_a_model_entry_names_its_engines():
    with pytest.raises(ValueError, match="needs `name`"):
        ModelEngines(urls=["http://h:1"])  # a URL-only model needs a name
    with pytest.raises(ValueError, match="give `profile`, `urls` or `dns`"):
        ModelEngines(name="m")


def test_a_config_file_is_a_mapping(tmp_path):
    with pytest.raises(SettingsError, match="no such gateway config"):
        read_mapping(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(SettingsError, match="expected a mapping"):
        read_mapping(tmp_path / "list.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert read_mapping(tmp_path / "empty.yaml") == {}

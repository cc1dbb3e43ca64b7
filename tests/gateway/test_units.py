"""Small pure pieces: body validation, API keys, request ids, engine health bookkeeping, settings."""

from __future__ import annotations

import pytest

from server.gateway.edge.auth import bearer_token, key_matches, load_api_keys
from server.gateway.edge.context import request_id_from
from server.gateway.errors import InvalidRequest
from server.gateway.settings import Auth, GatewaySettings, ModelEngines, SettingsError, parse_upstreams
from server.gateway.engines.pool import Engine
from server.gateway.edge.endpoints import BY_NAME
from server.gateway.edge.requests import parse_request


def test_parse_request_keeps_the_body_and_reads_model_and_stream():
    parsed = parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true}', BY_NAME["chat"])
    assert (parsed.model, parsed.stream) == ("m", True)
    assert parse_request(b'{"model": "m", "prompt": "x"}', BY_NAME["completions"]).stream is False


@pytest.mark.parametrize(("raw", "param", "code"), [
    (b'{"model": "m", "messages": "hi"}', "messages", "invalid_type"),
    (b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0].role", "invalid_type"),
    (b'{"model": "m", "messages": [{"role": "user"}], "stream": 1}', "stream", "invalid_type"),
])
def test_parse_request_names_the_parameter(raw, param, code):
    with pytest.raises(InvalidRequest) as info:
        parse_request(raw, BY_NAME["chat"])
    assert (info.value.param, info.value.code) == (param, code)


def test_parse_request_refuses_deep_nesting_before_anything_walks_it():
    deep = b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * 1000 + b"]" * 1000 + b"}]}"
    with pytest.raises(InvalidRequest) as info:
        parse_request(deep, BY_NAME["chat"])
    assert info.value.code == "invalid_json"
    shallow = b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * 30 + b"]" * 30 + b"}]}"
    assert parse_request(shallow, BY_NAME["chat"]).model == "m"


def test_api_keys_from_env_and_file(tmp_path):
    (tmp_path / "keys").write_text("# ops keys\nfile-key-1\n\n  file-key-2  \n")
    config = Auth(api_keys_env="K", api_keys_file="keys")
    keys = load_api_keys(config, {"K": "env-a, env-b,,"}, base=tmp_path)
    assert keys == [b"env-a", b"env-b", b"file-key-1", b"file-key-2"]
    assert load_api_keys(Auth(api_keys_env="K"), {}) == []
    with pytest.raises(SettingsError, match="cannot read"):
        load_api_keys(Auth(api_keys_file="missing"), {}, base=tmp_path)


def test_key_matching_and_bearer_parsing():
    keys = [b"alpha", b"beta"]
    assert key_matches(b"beta", keys) and not key_matches(b"bet", keys) and not key_matches(b"x", [])
    assert bearer_token([(b"authorization", b"Bearer  tok ")]) == b"tok"
    assert bearer_token([(b"authorization", b"bearer tok")]) == b"tok"
    assert bearer_token([(b"authorization", b"Basic dXNlcg==")]) is None
    assert bearer_token([]) is None


def test_request_ids_are_kept_when_sane_and_made_otherwise():
    assert request_id_from([(b"x-request-id", b"abc-123")]) == "abc-123"
    made = request_id_from([(b"x-request-id", b"has space")])
    assert made != "has space" and len(made) == 32
    assert request_id_from([(b"x-request-id", b"x" * 129)]) != "x" * 129
    assert request_id_from([]) != request_id_from([])


def test_engine_health_bookkeeping():
    engine = Engine("m", "http://127.0.0.1:1/")
    assert engine.id == "127.0.0.1:1" and engine.url == "http://127.0.0.1:1"
    assert engine.record_check(False, unhealthy_after=2, healthy_after=2)  # the first check decides
    assert not engine.healthy
    engine.record_check(True, unhealthy_after=2, healthy_after=2)
    assert not engine.healthy
    engine.record_check(True, unhealthy_after=2, healthy_after=2)
    assert engine.healthy
    engine.record_check(False, unhealthy_after=2, healthy_after=2)
    assert engine.healthy
    engine.record_check(False, unhealthy_after=2, healthy_after=2)
    assert not engine.healthy
    engine.healthy = True
    engine.mark_down("refused")
    assert not engine.healthy and engine.last_error == "refused"


def test_upstreams_from_the_command_line_and_profile_ports():
    models = parse_upstreams(["a=http://h:1", "a=http://h:2/", "b=https://x"])
    resolved = GatewaySettings(models=models).resolve_models({})
    assert [(m.name, m.urls, m.trimming.mode) for m in resolved] == [
        ("a", ["http://h:1", "http://h:2"], "off"), ("b", ["https://x"], "off")]
    with pytest.raises(SettingsError):
        parse_upstreams(["no-url"])
    with pytest.raises(ValueError):
        ModelEngines(urls=["http://h:1"])  # a URL-only model needs a name


def test_profile_models_get_consecutive_ports(tmp_path):
    from server.gateway.settings import load_settings

    profile = tmp_path / "p.yaml"
    profile.write_text("model: /m\nserved_model_name: pm\nreplicas: 2\ndevice: cpu\n")
    config = tmp_path / "g.yaml"
    config.write_text("models:\n  - profile: p.yaml\n    base_port: 9100\n  - name: u\n    urls: [http://e:1]\n")
    settings = load_settings(config)
    resolved = settings.resolve_models(settings.load_profiles())
    assert [(m.name, m.urls, m.trimming.mode) for m in resolved] == [
        ("pm", ["http://127.0.0.1:9100", "http://127.0.0.1:9101"], "auto"), ("u", ["http://e:1"], "off")]

"""Small pure pieces: body validation, API keys, request ids."""

from __future__ import annotations

import pytest

from server.config import SettingsError
from server.gateway.app.auth import bearer_token, key_matches, load_api_keys
from server.gateway.errors import InvalidRequest
from server.gateway.request.endpoints import BY_NAME
from server.gateway.request.ids import request_id_from
from server.gateway.request.request import parse_request
from server.gateway.settings import Auth


def test_parse_request_keeps_the_body_and_reads_model_and_stream():
    parsed = parse_request(
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true}', BY_NAME["chat"]
    )
    assert (parsed.model, parsed.stream) == ("m", True)
    assert parse_request(b'{"model": "m", "prompt": "x"}', BY_NAME["completions"]).stream is False


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b'{"model": "m", "messages": "hi"}', "messages", "invalid_type"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0].role", "invalid_type"),
        (b'{"model": "m", "messages": [{"role": "user"}], "stream": 1}', "stream", "invalid_type"),
    ],
)
def test_parse_request_names_the_parameter(raw, param, code):
    with pytest.raises(InvalidRequest) as info:
        parse_request(raw, BY_NAME["chat"])
    assert (info.value.param, info.value.code) == (param, code)


@pytest.mark.parametrize("value", ["", ",", " , ,"])
def test_an_api_key_variable_without_keys_is_refused_not_an_open_gateway(value):
    with pytest.raises(SettingsError, match="holds no API key"):
        load_api_keys(Auth(api_keys_env="K"), {"K": value})


def test_an_api_key_file_without_keys_is_refused(tmp_path):
    (tmp_path / "keys").write_text("# only a comment\n\n")
    with pytest.raises(SettingsError, match="holds no API key"):
        load_api_keys(Auth(api_keys_file="keys"), {}, base=tmp_path)


def test_an_unknown_model_name_is_echoed_cut_short():
    from server.gateway.errors import ModelNotFound

    message = ModelNotFound("x" * 8_000_000, ["tiny"]).message
    assert len(message) < 300 and "8000000 characters" in message


def test_parse_request_refuses_deep_nesting_before_anything_walks_it():
    deep = b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * 1000 + b"]" * 1000 + b"}]}"
    with pytest.raises(InvalidRequest) as info:
        parse_request(deep, BY_NAME["chat"])
    assert info.value.code == "invalid_json"
    shallow = b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * 30 + b"]" * 30 + b"}]}"
    assert parse_request(shallow, BY_NAME["chat"]).model == "m"


@pytest.mark.parametrize("extra", [0, 50])  # brackets inside strings do not change the depth
def test_the_depth_limit_is_exact(extra):
    def body(depth: int) -> bytes:  # the body object, `messages`, one message, then `content` lists
        content = b"[" * (depth - 3) + b"]" * (depth - 3)
        return (
            b'{"model": "m", "user": "'
            + b"{" * extra
            + b'", "messages": [{"role": "user", "content": '
            + content
            + b"}]}"
        )

    assert parse_request(body(64), BY_NAME["chat"]).model == "m"
    with pytest.raises(InvalidRequest) as info:
        parse_request(body(65), BY_NAME["chat"])
    assert info.value.code == "invalid_json"


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
    made = [request_id_from([]) for _ in range(10_000)]
    assert len(set(made)) == len(made)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in made)

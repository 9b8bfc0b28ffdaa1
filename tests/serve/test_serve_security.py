"""Keys, isolation between sessions, request limits, and malformed requests (4xx, never a 500)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from weir.config.schema import ServeConfig
from weir.serve import Server


def _call(url, body=None, key=None, method=None, raw=None):
    """(status, parsed JSON body) of one HTTP request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _client(base_url, key):
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_a_session_key_reaches_only_its_own_session(server):
    a, b = server.sessions.open({"who": "a"}), server.sessions.open({"who": "b"})
    base = server.base_url
    _client(base, a.api_key).chat.completions.create(**CHAT)
    assert len(a.turns) == 1 and b.turns == []  # A's call is recorded in A only

    for path, method, body in [
        (f"/sessions/{b.id}", "GET", None),
        (f"/sessions/{b.id}/trajectory", "GET", None),
        (f"/sessions/{b.id}/reward", "POST", {"reward": 1.0}),
        (f"/sessions/{b.id}", "DELETE", None),
    ]:
        status, err = _call(base + path, body, key=a.api_key, method=method)
        assert status == 403, path
        assert "another session" in err["error"]["message"]
    assert b.reward is None and not b.closed

    status, own = _call(base + f"/sessions/{a.id}/trajectory", key=a.api_key)
    assert status == 200
    (seg,) = own["segments"]
    assert seg["response_ids"] == a.turns[0].response_ids
    assert _call(base + "/sessions/current/reward", {"reward": 0.5}, key=b.api_key)[0] == 200
    assert (a.reward, b.reward) == (None, 0.5)
    assert _call(base + f"/sessions/{b.id}", key=b.api_key, method="DELETE")[0] == 200
    assert server.sessions.get(b.id) is None and b.closed
    assert _call(base + f"/sessions/{b.id}", key=b.api_key)[0] == 401


def test_missing_unknown_and_closed_keys(server):
    base = server.base_url
    status, err = _call(base + "/chat/completions", CHAT)
    assert status == 401 and "Authorization" in err["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        _client(base, "weir-not-a-key").chat.completions.create(**CHAT)
    s = server.sessions.open()
    s.close()
    with pytest.raises(openai.PermissionDeniedError, match="closed"):
        _client(base, s.api_key).chat.completions.create(**CHAT)
    gone = server.sessions.open()
    server.sessions.remove(gone)
    with pytest.raises(openai.AuthenticationError):
        _client(base, gone.api_key).models.list()


def test_admin_key_opens_sessions_and_session_keys_cannot(server):
    base = server.base_url
    status, opened = _call(base + "/sessions", {"row": {"q": 3}}, key=server.sessions.admin_key)
    assert status == 200 and opened["base_url"] == base
    s = server.sessions.get(opened["id"])
    assert s.row == {"q": 3} and s.api_key == opened["api_key"]
    assert _call(base + "/sessions", {}, key=opened["api_key"])[0] == 403
    status, forced = _call(
        base + "/sessions",
        {"sampling": {"temperature": 0.0, "max_tokens": 2}},
        key=server.sessions.admin_key,
    )
    client = _client(base, forced["api_key"])
    r = client.chat.completions.create(**{**CHAT, "max_tokens": 10, "temperature": 1.5})
    assert r.usage.completion_tokens <= 2
    f = server.sessions.get(forced["id"])
    assert (f.sampling.temperature, f.sampling.max_new_tokens) == (0.0, 2)
    assert (
        _call(base + "/sessions", {"sampling": {"top_p": 0}}, key=server.sessions.admin_key)[0]
        == 400
    )
    # Admin calls are served but recorded nowhere (and may ask for several completions).
    r = _client(base, server.sessions.admin_key).chat.completions.create(n=2, **CHAT)
    assert len(r.choices) == 2 and s.turns == []


@pytest.fixture(scope="module")
def strict(engine, tokenizer):
    cfg = ServeConfig(max_body_bytes=2048, max_tokens=16, max_messages=3, max_n=2)
    with Server(engine, tokenizer, cfg) as srv:
        yield srv


def test_size_limits(strict):
    s = strict.sessions.open()
    client = _client(strict.base_url, s.api_key)
    with pytest.raises(openai.APIStatusError) as big:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x" * 3000}], max_tokens=1
        )
    assert big.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="max_tokens=17 exceeds"):
        client.chat.completions.create(**{**CHAT, "max_tokens": 17})
    with pytest.raises(openai.BadRequestError, match="4 messages exceed"):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a"}] * 4, max_tokens=1
        )
    with pytest.raises(openai.BadRequestError, match="n must be 1 in a session"):
        client.chat.completions.create(n=2, **CHAT)
    with pytest.raises(openai.BadRequestError, match="max_seq_len"):  # longer than the context
        client.completions.create(model="m", prompt="a" * 600, max_tokens=1)
    assert s.turns == []


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"model": "m"}, "messages: Field required"),
        ({"model": "m", "messages": []}, "messages: List should have at least 1 item"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({**CHAT, "temperature": -1}, "temperature"),
        ({**CHAT, "max_tokens": "many"}, "max_tokens"),
        ({**CHAT, "tool_choice": "required"}, "tool_choice"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
        ),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
        ({**CHAT, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
        ({**CHAT, "logit_bias": {"5": 10}}, "logit_bias"),
        ({**CHAT, "frequency_penalty": 0.5}, "frequency_penalty"),
    ],
)
def test_malformed_chat_requests_get_400_with_a_message(server, body, fragment):
    s = server.sessions.open()
    status, err = _call(server.base_url + "/chat/completions", body, key=s.api_key)
    assert status == 400
    assert err["error"]["type"] == "invalid_request_error"
    assert fragment in err["error"]["message"]
    assert s.turns == []


def test_unparsable_bodies_get_400(server):
    s = server.sessions.open()
    url = server.base_url
    status, err = _call(url + "/chat/completions", raw=b"{not json", key=s.api_key)
    assert status == 400 and "JSON" in err["error"]["message"]
    status, err = _call(url + "/completions", raw=b"[1, 2]", key=s.api_key)
    assert status == 400
    for bad in ({"reward": "high"}, {"reward": 1.0, "extra": 1}, {}):
        status, _ = _call(url + f"/sessions/{s.id}/reward", bad, key=s.api_key)
        assert status == 400
    assert _call(url + "/sessions/sess-nope", key=server.sessions.admin_key)[0] == 404


def test_options_at_their_no_op_values_are_accepted(server):
    s = server.sessions.open()
    body = {
        **CHAT,
        "response_format": {"type": "text"},
        "top_logprobs": 0,
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
    }
    status, out = _call(server.base_url + "/chat/completions", body, key=s.api_key)
    assert status == 200 and out["choices"][0]["message"]["role"] == "assistant"


def test_routing_and_decoding_errors_use_the_openai_envelope(server):
    """Unknown routes (404), wrong methods (405) and bodies that are not UTF-8 get the OpenAI error
    envelope, not Starlette's {"detail": ...}."""
    s = server.sessions.open()
    url = server.base_url
    status, err = _call(url + "/no/such/route", CHAT, key=s.api_key)
    assert status == 404 and set(err) == {"error"} and err["error"]["message"]
    status, err = _call(url + "/chat/completions", key=s.api_key, method="GET")
    assert status == 405 and set(err) == {"error"} and err["error"]["message"]
    status, err = _call(url + "/chat/completions", raw=b'{"model": "\xff\xfe"}', key=s.api_key)
    assert status == 400 and set(err) == {"error"} and err["error"]["message"]
    assert s.turns == []


def test_an_engine_failure_is_a_500_that_names_the_error_not_a_traceback(scripted):
    engine, server = scripted
    engine.replies = []  # the scripted engine fails: no reply queued
    s = server.sessions.open()
    status, err = _call(server.base_url + "/chat/completions", CHAT, key=s.api_key)
    assert status == 500
    assert err == {
        "error": {
            "message": "internal server error (IndexError)",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    assert s.turns == []


def test_messages_the_chat_template_rejects_get_400(engine, tokenizer):
    import copy

    strict_tok = copy.deepcopy(tokenizer)
    strict_tok.chat_template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('conversations must start with a user message') }}{% endif %}"
        + tokenizer.chat_template
    )
    with Server(engine, strict_tok) as srv:
        s = srv.sessions.open()
        body = {"model": "m", "messages": [{"role": "assistant", "content": "hi"}]}
        status, err = _call(srv.base_url + "/chat/completions", body, key=s.api_key)
    assert status == 400
    assert "conversations must start with a user message" in err["error"]["message"]

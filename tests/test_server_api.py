"""The server's OpenAI surface beyond answering: seeds that reproduce, fields refused rather than ignored,
model names and aliases, structured output, ``/tokenize`` and ``/detokenize`` in llama-server's shapes, and
Prometheus ``/metrics``.  In process (Starlette's TestClient, the ``openai`` client on top of it)."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.helpers import serving  # noqa: E402

NAME = "tiny"
CHAT = [{"role": "user", "content": "What is 12 * 7?"}]


def error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


# -- seeds -----------------------------------------------------------------------------------------


def test_a_seed_reproduces_a_sampled_answer_in_spec_and_ar_mode(engine, ar_engine):
    answers = {}
    for mode, served in (("spec", engine), ("ar", ar_engine)):
        with serving(served) as (client, _):
            ask = dict(model=NAME, messages=CHAT, temperature=1.0, max_tokens=32)
            first, again = (client.chat.completions.create(seed=5, **ask) for _ in range(2))
            other = client.chat.completions.create(seed=6, **ask)
        assert first.choices[0].message.content == again.choices[0].message.content
        assert other.choices[0].message.content != first.choices[0].message.content
        stats = first.model_extra["x_edge_spec"]
        assert (stats["mode"], stats["sampler"], stats["coupled_seed"]) == (mode, "coupled", 5)
        assert "coupled" in first.system_fingerprint and first.system_fingerprint == again.system_fingerprint
        answers[mode] = first.choices[0].message.content
    assert answers["spec"] == answers["ar"]  # coupled sampling fixes the answer by its seed in every mode


def test_the_response_says_which_sampler_ran(engine):
    with serving(engine) as (client, _):
        unseeded = client.chat.completions.create(model=NAME, messages=CHAT, temperature=1.0, max_tokens=4)
        greedy = client.chat.completions.create(model=NAME, messages=CHAT, temperature=0, seed=3, max_tokens=4)
        chosen = client.chat.completions.create(
            model=NAME, messages=CHAT, temperature=1.0, seed=3, max_tokens=4, extra_body={"sampler": "rejection"}
        )
    assert unseeded.model_extra["x_edge_spec"]["sampler"] == "rejection"
    assert greedy.model_extra["x_edge_spec"]["sampler"] == "greedy"
    assert chosen.model_extra["x_edge_spec"]["sampler"] == "rejection"  # asked for by name: kept
    assert len({unseeded.system_fingerprint, greedy.system_fingerprint, chosen.system_fingerprint}) == 2


# -- fields that would change the answer: refused, not ignored ------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("logit_bias", {"12": 5}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("reasoning_effort", "low"),
        ("function_call", "auto"),
        ("n", 2),
        ("response_format", {"type": "image"}),
        ("response_format", {"type": "json_schema", "json_schema": {}}),
    ],
)
def test_unsupported_chat_fields_are_refused_naming_them(engine, field, value):
    with serving(engine) as (_, http):
        body = error(http.post("/v1/chat/completions", json={"model": NAME, "messages": CHAT, field: value}), 400)
    assert body["param"] == field and body["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value", [("presence_penalty", 1.0), ("logit_bias", {"1": -100})])
def test_unsupported_completion_fields_are_refused(engine, field, value):
    with serving(engine) as (_, http):
        body = error(http.post("/v1/completions", json={"model": NAME, "prompt": "x", field: value}), 400)
    assert body["param"] == field


def test_fields_that_change_nothing_are_accepted(engine):
    harmless = {
        "logit_bias": {},
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logprobs": False,
        "top_logprobs": 0,
        "modalities": ["text"],
        "user": "u",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "stream_options": None,
        "safety_identifier": "s",
        "prompt_cache_key": "k",
        "response_format": {"type": "text"},
    }
    with serving(engine) as (_, http):
        response = http.post(
            "/v1/chat/completions", json={"model": NAME, "messages": CHAT, "max_tokens": 2, **harmless}
        )
    assert response.status_code == 200, response.text


def test_response_format_json_schema_constrains_the_answer(engine):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    with serving(engine) as (client, _):
        response = client.chat.completions.create(
            model=NAME,
            messages=CHAT,
            max_tokens=60,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
        )
    assert json.loads(response.choices[0].message.content)["answer"] in ("yes", "no")


# -- model names -----------------------------------------------------------------------------------


def test_an_unknown_model_is_404_model_not_found(engine):
    with serving(engine) as (client, http):
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
        completion = error(http.post("/v1/completions", json={"model": "gpt-4o", "prompt": "x"}), 404)
        unnamed = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    assert "gpt-4o" in missing.value.body["message"] and NAME in missing.value.body["message"]
    assert completion["code"] == "model_not_found"
    assert unnamed.status_code == 200 and unnamed.json()["model"] == NAME  # no model named: the one served


def test_aliases_name_the_served_model(engine):
    with serving(engine, aliases=["gpt-4o-mini", "coder"]) as (client, http):
        answer = client.chat.completions.create(model="coder", messages=CHAT, max_tokens=2)
        assert [m.id for m in client.models.list().data] == [NAME, "gpt-4o-mini", "coder"]
        assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
        error(http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": CHAT}), 404)
    assert answer.model == NAME
    with serving(engine, aliases=["*"]) as (client, _):  # the catch-all: any name is this model
        assert client.chat.completions.create(model="anything", messages=CHAT, max_tokens=2).model == NAME
        assert [m.id for m in client.models.list().data] == [NAME]


# -- /tokenize, /detokenize ------------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(engine):
    text = "def is_prime(n):\n    return n > 1 <|im_end|>"
    with serving(engine) as (_, http):
        tokens = http.post("/tokenize", json={"content": text}).json()["tokens"]
        assert tokens == engine.bundle.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        assert engine.bundle.tokenizer.tokenizer.token_to_id("<|im_end|>") in tokens  # control tokens parsed
        assert http.post("/detokenize", json={"tokens": tokens}).json() == {"content": text}
        literal = http.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
        assert engine.bundle.tokenizer.tokenizer.token_to_id("<|im_end|>") not in literal
        pieces = http.post("/tokenize", json={"content": "é and ü", "with_pieces": True}).json()["tokens"]
        assert all(set(p) == {"id", "piece"} for p in pieces)
        raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
        assert raw.decode() == "é and ü"
        assert error(http.post("/tokenize", json={"text": "x"}), 400)["param"] == "content"
        assert error(http.post("/detokenize", json={"tokens": [1, "2"]}), 400)["param"] == "tokens"
        assert error(http.post("/detokenize", json={"tokens": [10**9]}), 400)["param"] == "tokens"


def test_tokenize_needs_the_api_key_when_one_is_set(engine):
    with serving(engine, api_key="k") as (_, http):
        assert error(http.post("/tokenize", json={"content": "x"}), 401)["code"] == "missing_api_key"
        ok = http.post("/tokenize", json={"content": "x"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
        assert error(http.get("/metrics"), 401)["code"] == "missing_api_key"


# -- /metrics --------------------------------------------------------------------------------------


def metrics(http) -> dict[tuple[str, tuple], float]:
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_metrics_count_requests_tokens_and_speculation(engine):
    with serving(engine) as (client, http):
        response = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=16, temperature=0)
        http.post("/v1/chat/completions", json={"model": NAME, "messages": CHAT, "n": 3})
        seen = metrics(http)
    usage, stats = response.usage, response.model_extra["x_edge_spec"]
    requests = {labels: v for (name, labels), v in seen.items() if name == "edge_spec_http_requests_total"}
    assert requests[(("route", "/v1/chat/completions"), ("status", "200"))] == 1
    assert requests[(("route", "/v1/chat/completions"), ("status", "400"))] == 1
    assert seen[("edge_spec_prompt_tokens_total", ())] == usage.prompt_tokens
    assert seen[("edge_spec_generated_tokens_total", ())] == usage.completion_tokens
    assert seen[("edge_spec_drafted_tokens_total", ())] == stats["drafted"]
    assert seen[("edge_spec_accepted_tokens_total", ())] == stats["accepted"]
    assert seen[("edge_spec_target_passes_total", ())] == stats["target_calls"]
    for histogram in (
        "edge_spec_tokens_per_target_pass",
        "edge_spec_decode_tokens_per_second",
        "edge_spec_time_to_first_token_seconds",
    ):
        assert seen[(f"{histogram}_count", ())] == 1, histogram
    assert seen[("edge_spec_tokens_per_target_pass_sum", ())] == pytest.approx(stats["tau"], abs=1e-3)
    assert seen[("edge_spec_queue_waiting", ())] == 0


def test_each_app_counts_for_itself(engine):
    with serving(engine) as (client, http):
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2)
    with serving(engine) as (_, http):
        seen = metrics(http)
    assert not any(
        name == "edge_spec_http_requests_total" and dict(labels).get("route") == "/v1/chat/completions"
        for name, labels in seen
    )

"""A JSON-schema ``response_format`` is shown to the model as one system instruction (OpenAI's
``json_schema.description`` is "used by the model"), in the Python API and the server alike, while other
formats and raw prompts are left as the caller wrote them."""

from __future__ import annotations

import json

import pytest

from edge_spec.runtime.constrain import schema_instruction, with_instruction
from edge_spec.runtime.engine import Engine

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "verdict", "description": "A verdict.", "schema": SCHEMA, "strict": True},
}
CHAT = [{"role": "user", "content": "Is 91 prime?"}]


def test_the_instruction_names_the_schema_its_name_and_description():
    text = schema_instruction(FORMAT)
    assert text is not None
    first, description, schema = text.split("\n")
    assert "verdict" in first and "JSON schema" in first
    assert description == "A verdict."
    assert json.loads(schema) == SCHEMA


@pytest.mark.parametrize(
    "response_format",
    [
        None,
        {"type": "text"},
        {"type": "json_object"},
        {"type": "regex", "regex": "yes|no"},
        {"type": "lark", "lark": 'start: "yes"'},
        {"type": "json_schema", "json_schema": {"name": "no schema"}},
    ],
)
def test_formats_without_a_schema_add_nothing(response_format):
    assert schema_instruction(response_format) is None
    assert with_instruction(CHAT, schema_instruction(response_format)) is CHAT


def test_the_instruction_ends_the_leading_system_message_or_becomes_one():
    system = [{"role": "system", "content": "You review maths.  "}, *CHAT]
    joined = with_instruction(system, "INSTRUCTION")
    assert joined[0] == {"role": "system", "content": "You review maths.\n\nINSTRUCTION"}
    assert joined[1:] == CHAT and system[0]["content"] == "You review maths.  "  # the caller's list is untouched
    added = with_instruction(CHAT, "INSTRUCTION")
    assert added == [{"role": "system", "content": "INSTRUCTION"}, *CHAT] and len(CHAT) == 1


@pytest.fixture(scope="module")
def engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, mode="spec", threads=1)


def test_the_model_reads_the_schema_in_the_python_api(engine):
    plain = engine.prompt_ids(CHAT)
    told = engine.prompt_ids(CHAT, response_format=FORMAT)
    assert told == engine.prompt_ids(with_instruction(CHAT, schema_instruction(FORMAT)))
    assert len(told) > len(plain)
    assert engine.prompt_ids(CHAT, response_format={"type": "json_object"}) == plain
    assert engine.prompt_ids("Is 91 prime?", response_format=FORMAT) == engine.prompt_ids("Is 91 prime?")
    answer = engine.complete(CHAT, max_new_tokens=40, response_format=FORMAT)
    assert answer.stats.prompt_tokens == len(told)
    assert engine.complete(CHAT, max_new_tokens=40, response_format=FORMAT, mode="ar").token_ids == answer.token_ids


def test_the_server_counts_the_instruction_in_the_prompt(engine):
    openai = pytest.importorskip("openai")
    from starlette.testclient import TestClient

    from edge_spec.server.serve import build_app

    app, _ = build_app(engine, name="tiny")
    with TestClient(app, base_url="http://127.0.0.1:8000") as http:
        client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="any", http_client=http, max_retries=0)
        told = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=30, temperature=0, response_format=FORMAT
        )
        plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, temperature=0)
    assert told.usage.prompt_tokens == len(engine.prompt_ids(CHAT, response_format=FORMAT))
    assert plain.usage.prompt_tokens == len(engine.prompt_ids(CHAT))


def test_the_instruction_goes_into_the_first_user_message_where_the_template_refuses_a_system_one():
    told = with_instruction([{"role": "user", "content": "Hi"}], "INSTRUCTION", into_user=True)
    assert told == [{"role": "user", "content": "INSTRUCTION\n\nHi"}]


REFUSES_SYSTEM = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_without_a_system_role_reads_the_schema_in_the_user_message(engine, tmp_path, monkeypatch):
    from edge_spec.errors import EdgeSpecError
    from edge_spec.runtime.text import TextTokenizer

    (tmp_path / "tokenizer.json").write_bytes((engine.bundle.bundle_dir / "tokenizer.json").read_bytes())
    config = json.loads((engine.bundle.bundle_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": REFUSES_SYSTEM}))
    refusing = TextTokenizer(tmp_path)
    monkeypatch.setattr(engine.bundle, "tokenizer", refusing)
    told = engine.prompt_ids(CHAT, response_format=FORMAT)
    assert told == refusing.encode_chat(with_instruction(CHAT, schema_instruction(FORMAT), into_user=True))
    with pytest.raises(EdgeSpecError, match="System role not supported"):  # the caller's own system message
        engine.prompt_ids([{"role": "system", "content": "Be brief."}, *CHAT], response_format=FORMAT)

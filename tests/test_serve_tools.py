"""The chat endpoint speaks K3's format (SPEC §1.2) to the official openai SDK, live: tools and tool_choice with
tool_calls (plain and streamed as OpenAI/vLLM stream them), a tool-call round trip, structured output through
`client.chat.completions.parse` with a pydantic schema, thinking on and off, and a 400 for what k3 cannot honour.
The model is a random `tiny`: what it writes is noise, so every structural guarantee here comes from the grammar."""
import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from k3.data import load_tokenizer
from k3.serve.api import create_app
from k3.serve.local_server import local_server
from two_layer_model import two_layer_engine

KEY, NAME = "test-key", "k3-tiny"
OFF = {"chat_template_kwargs": {"thinking": False}}


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=130)
    role: Literal["admin", "user"]
    active: bool


class AddArgs(BaseModel):
    a: int
    b: int


CALC = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                      "required": ["city"]}}}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    with two_layer_engine(tok, seed=3) as eng, local_server(create_app(eng, tok, NAME, api_key=KEY),
                                                               as_k3_serve=True) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def ask(text):
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("thinking", [False, True])
def test_parse_with_a_pydantic_schema(client, thinking):
    """`parse` sends a strict json_schema; a random model's answer must validate against it, with thinking off
    and on (the think section is capped at half of max_tokens, so the JSON always has room)."""
    for seed in range(3):
        r = client.chat.completions.parse(model=NAME, messages=ask("Describe a user."), response_format=Person,
                                          max_tokens=160, seed=seed,
                                          extra_body={"chat_template_kwargs": {"thinking": thinking}})
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, Person), msg.content
        assert Person.model_validate_json(msg.content) == msg.parsed
        assert (msg.reasoning_content is not None) == thinking


def test_json_object_mode(client):
    r = client.chat.completions.create(model=NAME, messages=ask("JSON please"), max_tokens=300, seed=5,
                                       response_format={"type": "json_object"}, extra_body=OFF)
    if r.choices[0].finish_reason == "stop":  # a random model may nest objects past max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_tool_call_round_trip(client, server, tok):
    """A forced call comes back as OpenAI tool_calls with valid typed arguments; sending the call and its result
    back renders them as K3's tool markup, and the model answers."""
    messages = ask("What is 2 + 3?")
    r = client.chat.completions.create(model=NAME, messages=messages, tools=[CALC, WEATHER], max_tokens=200,
                                       tool_choice={"type": "function", "function": {"name": "add"}}, seed=1,
                                       parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id
    args = AddArgs.model_validate_json(call.function.arguments)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(args.a + args.b)}]
    r2 = client.chat.completions.create(model=NAME, messages=messages, tools=[CALC, WEATHER], max_tokens=8,
                                        seed=2, extra_body={"return_token_ids": True, **OFF})
    assert r2.choices[0].finish_reason in ("stop", "length")
    prompt = tok.decode(r2.choices[0].model_extra["prompt_token_ids"])
    assert ('<|open|>call tool="add" index="1"<|sep|>' in prompt
            and f'<|open|>message role="tool" tool="add" index="1"<|sep|>{args.a + args.b}<|close|>message' in prompt)
    assert prompt.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')


def test_required_and_parallel_tool_calls(client):
    for seed in range(3):
        r = client.chat.completions.create(model=NAME, messages=ask("weather?"), tools=[CALC, WEATHER], seed=seed,
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=150,
                                           extra_body=OFF)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        assert r.choices[0].message.content is None
        args = json.loads(calls[0].function.arguments)
        if calls[0].function.name == "add":
            AddArgs.model_validate(args)
        else:
            assert calls[0].function.name == "weather" and args["city"] in ("Paris", "Oslo")


def test_streamed_tool_calls_match_the_plain_answer(client):
    """Stream deltas as OpenAI and vLLM send them: index, id, type and name first, then argument fragments that
    concatenate to the plain response's arguments (same seed, same tokens)."""
    kw = dict(model=NAME, messages=ask("add"), tools=[CALC], tool_choice="required", max_tokens=200, seed=7,
              extra_body=OFF)
    plain = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    first = deltas[0]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name == "add"
    calls = {}
    for d in deltas:
        if d.id:
            calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
        else:
            assert d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments
    assert len(deltas) > len(calls)  # the arguments came in fragments after the name
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" == plain.finish_reason


def test_thinking_on_and_off(client, tok):
    """Thinking on: the answer starts in the think section (a random model never closes it: all reasoning);
    off: the prompt opens the response section and there is no reasoning."""
    on = client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=12, seed=3,
                                        extra_body={"return_token_ids": True})
    off = client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=12, seed=3,
                                         extra_body={"return_token_ids": True, **OFF})
    tok_on, tok_off = on.choices[0].model_extra, off.choices[0].model_extra
    assert on.choices[0].message.reasoning_content and not on.choices[0].message.content
    assert off.choices[0].message.content and off.choices[0].message.model_extra.get("reasoning_content") is None
    assert tok.decode(tok_on["prompt_token_ids"]).endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert tok.decode(tok_off["prompt_token_ids"]).endswith('role="assistant"<|sep|><|open|>response<|sep|>')
    # streamed reasoning arrives as reasoning_content deltas and adds up to the plain answer's
    chunks = list(client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=12, seed=3, stream=True))
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == on.choices[0].message.reasoning_content


def test_reasoning_effort_is_rendered(client, tok):
    r = client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=1, reasoning_effort="high",
                                       extra_body={"return_token_ids": True})
    prompt = tok.decode(r.choices[0].model_extra["prompt_token_ids"])
    assert '<|open|>message role="system" type="thinking-effort"<|sep|>' in prompt
    assert "Now the system is invoked with `thinking_effort=high`." in prompt
    none = client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=1, reasoning_effort="none",
                                          extra_body={"return_token_ids": True})
    assert tok.decode(none.choices[0].model_extra["prompt_token_ids"]).endswith("<|open|>response<|sep|>")


@pytest.mark.parametrize("extra, param", [
    ({"modalities": ["audio"]}, "modalities"),  # (logit_bias is honoured since issue 19)
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"thinking": False}, "reasoning_effort": "high"}, "reasoning_effort"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": [CALC]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": 'a"b'}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_what_k3_cannot_honour_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param and param.split(".")[0].split("[")[0] in e.value.body["message"]


def _doubling(n: int, leaf: dict) -> dict:
    """A tool whose one argument is anyOf two refs to the next definition, n deep: 2^n alternatives from ~50 n bytes."""
    defs = {f"D{i}": {"anyOf": [{"$ref": f"#/$defs/D{i + 1}"}, {"$ref": f"#/$defs/D{i + 1}"}]} for i in range(n)}
    defs[f"D{n}"] = leaf
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/D0"}}, "required": ["x"], "$defs": defs}}}


SELF = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"$ref": "#/$defs/A"}},
    "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "string"}]}}}}}


@pytest.mark.parametrize("tool, words", [
    (_doubling(30, {"type": "string"}), "MiB of grammar"),  # the old expansion: 2^30 alternatives, the server stuck
    (_doubling(12, {"type": "object", "properties": {"pad": {"const": "x" * 4096}}}), "MiB of grammar"),
    (SELF, "leads back to itself"),  # the old expansion: a RecursionError
])
def test_tool_schemas_that_expand_without_bound_are_refused_quickly(client, tool, words):
    """A request of a few kB whose argument schema names exponentially many alternatives (anyOf through $refs) is a
    400 naming `tools` within a second or two, and the server answers the next request; before, the first kind
    built 2^30 alternatives (20 deep already took 52 s and 0.7 GB)."""
    import time
    start = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=4, tools=[tool],
                                       tool_choice="required")
    assert time.perf_counter() - start < 20  # a bound with room for a loaded CI machine; the expansion is ~1 s
    assert e.value.body["param"] == "tools" and words in e.value.body["message"]
    ok = client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=150, tools=[WEATHER],
                                        tool_choice="required", parallel_tool_calls=False, extra_body=OFF)
    assert json.loads(ok.choices[0].message.tool_calls[0].function.arguments)["city"] in ("Paris", "Oslo")

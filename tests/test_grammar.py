"""Constrained decoding (k3.serve.grammar + the batched sampler): the mask equals llguidance's token-by-token verdict,
constrained rows never disturb unconstrained ones, and a random two-layer `tiny` model's output follows SPEC §1.2's
markup with JSON that validates and tool calls whose arguments validate, parsed back by the output parser."""
import json
from typing import Literal, Optional

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from k3.data import load_tokenizer
from k3.serve.grammar import (Grammar, GrammarError, bitmask_to_bool, chat_grammar, fill_bitmasks,
                              unpack_with_shifts)
from k3.serve.output_parser import OutputParser
from k3.serve.sampling import SamplingParams, mask_grammar_rows, sample_tokens
from two_layer_model import two_layer_engine


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties false, as OpenAI's strict schemas are
    sku: str = Field(max_length=6)
    qty: int = Field(ge=1, le=99)


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["buy", "sell"]
    items: list[Item] = Field(min_length=1, max_length=2)
    urgent: bool
    note: Optional[Literal["fragile"]] = None


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    with two_layer_engine(tok, seed=5) as eng:
        yield eng


def schema_format(model):
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": model.model_json_schema()}}


def prompt(tok, thinking, **kw):
    return tok.apply_chat_template([{"role": "user", "content": "go"}], add_generation_prompt=True, thinking=thinking,
                                   **kw)


def parse(tok, ids, thinking, tools=None):
    p = OutputParser(tok, tools, thinking=thinking)
    p.feed(ids)
    p.finish()
    return p.message()


def test_mask_equals_llguidance_verdict_per_token(tok):
    """The batched bitmask, unpacked, allows exactly the tokens that the matcher accepts one at a time,
    at every step of a walk through the grammar (the reference: validate_tokens for each of the 8192 ids)."""
    g = Grammar(tok, chat_grammar(tok, thinking=False, response_format=schema_format(Item)))
    states = [g.start(), g.start()]
    gen = torch.Generator().manual_seed(0)
    V = tok.vocab_size
    for step in range(6):
        words = torch.zeros(2, (V + 31) // 32, dtype=torch.int32)
        fill_bitmasks(states, words)
        allowed = bitmask_to_bool(words, V)
        reference = torch.tensor([states[0].matcher.validate_tokens([t]) == 1 for t in range(V)])
        assert torch.equal(allowed[0], reference) and torch.equal(allowed[1], reference)
        assert 0 < int(reference.sum()) < V
        choices = reference.nonzero()[:, 0]
        t = int(choices[torch.randint(len(choices), (1,), generator=gen)])
        for s in states:
            s.advance(t)


def test_bit_unpacking_paths_agree_with_a_plain_loop():
    words = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    plain = torch.tensor([[bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(150)] for r in range(3)])
    assert torch.equal(bitmask_to_bool(words, 150), plain)  # the host path (numpy)
    assert torch.equal(unpack_with_shifts(words)[:, :150], plain)  # the device path, run here on the CPU
    padded = bitmask_to_bool(words, 170)  # a model vocabulary past the tokenizer's: the extra ids are never allowed
    assert torch.equal(padded[:, :160], bitmask_to_bool(words, 160)) and not padded[:, 160:].any()


def test_masking_leaves_unconstrained_rows_alone(tok):
    g = Grammar(tok, chat_grammar(tok, thinking=False, response_format={"type": "json_object"}))
    logits = torch.randn(3, tok.vocab_size)
    state = g.start()
    masked = mask_grammar_rows(logits, [None, state, None])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    finite = torch.isfinite(masked[1])
    assert tok.decode(finite.nonzero()[:, 0].tolist()).startswith("{")  # only tokens that open an object
    assert torch.equal(masked[1][finite], logits[1][finite])
    # the sampler picks within the mask, and advances the state (its mask changes)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=0)]
    tokens, _ = sample_tokens(logits, params, [None] * 3, [None, state, None])
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == int(masked[1].argmax())
    assert not torch.equal(mask_grammar_rows(logits, [None, state, None])[1].isfinite(), finite)


def test_constrained_and_free_rows_batch_without_changing_each_other(engine, tok):
    """A request's tokens do not depend on its batch mates, constrained or not (per-request seeds and masks)."""
    g = Grammar(tok, chat_grammar(tok, thinking=False, response_format=schema_format(Item)))
    free = SamplingParams(max_tokens=20, seed=1, ignore_eos=True)
    held = SamplingParams(max_tokens=60, seed=2, grammar=g)
    ids = prompt(tok, False)
    alone = [engine.generate([ids], [p])[0].output_ids for p in (free, held)]
    together = engine.generate([ids, ids], [free, held])
    assert [list(o.output_ids) for o in together] == [list(a) for a in alone]
    assert list(alone[0]) != list(alone[1][:20])


@pytest.mark.parametrize("thinking", [False, True])
def test_random_model_writes_json_that_validates(engine, tok, thinking):
    g = Grammar(tok, chat_grammar(tok, thinking=thinking, response_format=schema_format(Order), think_budget=20))
    ids = prompt(tok, thinking, response_format=schema_format(Order))
    outs = engine.generate([ids] * 4, [SamplingParams(max_tokens=300, seed=s, grammar=g) for s in range(4)])
    for o in outs:
        assert o.finish_reason == "stop"
        msg = parse(tok, o.output_ids, thinking)
        Order.model_validate_json(msg["content"])
        assert bool(msg["reasoning_content"]) == thinking


def test_think_budget_closes_the_think_section(engine, tok):
    g = Grammar(tok, chat_grammar(tok, thinking=True, response_format={"type": "json_object"}, think_budget=8))
    out = engine.generate([prompt(tok, True)], [SamplingParams(max_tokens=40, seed=3, grammar=g)])[0]
    close = tok.convert_tokens_to_ids("<|close|>")
    assert close in out.output_ids and list(out.output_ids).index(close) <= 8


def test_forced_tool_calls_validate_and_render_back_identically(engine, tok):
    """tool_choice names a tool whose argument key needs XTML escaping; the random model's call parses into
    OpenAI arguments that validate, and rendering that message back gives the generated markup, byte for byte."""
    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")
        q: Literal["a&b", 'say "hi"']
        n: int = Field(ge=0, le=9)
        flag: Optional[bool] = None

    schema = Args.model_json_schema()
    schema["properties"]['k"&ey'] = schema["properties"].pop("flag")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": schema}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {}}}}]
    choice = {"type": "function", "function": {"name": "lookup"}}
    g = Grammar(tok, chat_grammar(tok, thinking=False, tools=tools, tool_choice=choice, parallel_tool_calls=False))
    ids = prompt(tok, False, tools=tools, tool_choice=choice)
    for o in engine.generate([ids] * 3, [SamplingParams(max_tokens=200, seed=s, grammar=g) for s in range(3)]):
        msg = parse(tok, o.output_ids, False, tools)
        (call,) = msg["tool_calls"]
        assert call["function"]["name"] == "lookup"
        args = json.loads(call["function"]["arguments"])
        flag = args.pop('k"&ey', None)
        assert flag is None or isinstance(flag, bool)
        Args.model_validate(args)
        again = tok.apply_chat_template([{"role": "assistant", "content": "",
                                          "tool_calls": [{"id": "x", "type": "function", "function": {
                                              "name": "lookup", "arguments": json.loads(call["function"]["arguments"])}}]}],
                                         thinking=False, tokenize=False)
        generated = tok.decode(o.output_ids)
        assert again.endswith("<|end_of_msg|>") and generated.endswith("<|end_of_msg|>")
        assert again.split('role="assistant"<|sep|><|open|>response<|sep|>', 1)[1] == generated


def test_nested_pydantic_arguments_follow_their_refs(engine, tok):
    """A tool whose parameters come from pydantic with a nested model ($defs/$ref): the object argument is JSON
    that validates against the nested model."""
    class Point(BaseModel):
        model_config = ConfigDict(extra="forbid")
        x: int = Field(ge=0, le=9)
        y: int = Field(ge=0, le=9)

    class Move(BaseModel):
        model_config = ConfigDict(extra="forbid")
        to: Point

    tools = [{"type": "function", "function": {"name": "move", "parameters": Move.model_json_schema()}}]
    assert "$ref" in json.dumps(tools)
    g = Grammar(tok, chat_grammar(tok, thinking=False, tools=tools, tool_choice="required", parallel_tool_calls=False))
    out = engine.generate([prompt(tok, False, tools=tools)], [SamplingParams(max_tokens=80, seed=0, grammar=g)])[0]
    (call,) = parse(tok, out.output_ids, False, tools)["tool_calls"]
    Move.model_validate_json(call["function"]["arguments"])
    assert 'key="to" type="object"' in tok.decode(out.output_ids)


def test_tool_choice_none_forbids_the_tools_section(tok):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    state = Grammar(tok, chat_grammar(tok, thinking=False, tools=tools, tool_choice="none")).start()
    for t in tok.encode_text("fine") + [tok.convert_tokens_to_ids("<|close|>")]:
        state.advance(t)
    for t in tok.encode_text("response") + [tok.convert_tokens_to_ids("<|sep|>")]:
        state.advance(t)
    # after the response closes, only the message may close: opening `tools` is not allowed
    assert state.matcher.validate_tokens([tok.convert_tokens_to_ids("<|open|>")]) == 0
    assert state.matcher.validate_tokens([tok.convert_tokens_to_ids("<|close|>")]) == 1
    # with tool_choice auto and a response_format, the same point may open tools
    auto = Grammar(tok, chat_grammar(tok, thinking=False, tools=tools, response_format={"type": "json_object"}))
    s = auto.start()
    for t in tok.encode_text("{}") + [tok.convert_tokens_to_ids("<|close|>")] + tok.encode_text("response") + \
            [tok.convert_tokens_to_ids("<|sep|>")]:
        s.advance(t)
    assert s.matcher.validate_tokens([tok.convert_tokens_to_ids("<|open|>")]) == 1


def test_nothing_to_enforce_gives_no_grammar(tok):
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat_grammar(tok, thinking=True) is None
    assert chat_grammar(tok, tools=tools, tool_choice="auto", response_format={"type": "text"}) is None


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}], tool_choice="required"),
     "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "x<|close|>"}}], tool_choice="required"),
     "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}), "response_format.json_schema"),
])
def test_bad_constraints_name_the_field(tok, kw, param):
    with pytest.raises(GrammarError) as e:
        chat_grammar(tok, **kw)
    assert e.value.param == param


def test_uncompilable_schema_is_a_grammar_error(tok):
    lark = chat_grammar(tok, thinking=False, response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}}})
    with pytest.raises(GrammarError) as e:
        Grammar(tok, lark)
    assert e.value.param == "response_format" and "cannot be compiled" in str(e.value)


def _accepts(grammar, ids) -> bool:
    """Whether a fresh matcher of `grammar` takes `ids` whole and may end there."""
    m = grammar.start().matcher
    return all(m.consume_token(t) for t in ids) and (m.is_accepting() or m.is_stopped())


def _forced_call(tok, properties: dict):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}]
    return Grammar(tok, chat_grammar(tok, thinking=False, tools=tools, tool_choice="required",
                                     parallel_tool_calls=False))


def _call_ids(tok, **arguments):
    """What the model writes for a call of f with these arguments (thinking off), as ids."""
    ids = tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": arguments}}]}], thinking=False)
    return _after_generation_prompt(tok, ids)


def _after_generation_prompt(tok, ids):
    """ids after `<|open|>message role="assistant"<|sep|><|open|>response<|sep|>` (the prompt, thinking off)."""
    sep = tok.convert_tokens_to_ids("<|sep|>")
    return ids[[i for i, t in enumerate(ids) if t == sep][1] + 1:]


def test_raw_string_arguments_follow_their_pattern(tok):
    """JSON Schema's `pattern` matches anywhere unless anchored; on a raw string argument it is enforced so,
    together with the length bounds, also through `/`, alternatives and anchors."""
    anchored = _forced_call(tok, {"code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"}})
    assert _accepts(anchored, _call_ids(tok, code="ABC-12"))
    for bad in ("xABC-12", "ABC-123", "abc-12"):
        assert not _accepts(anchored, _call_ids(tok, code=bad)), bad
    found = _forced_call(tok, {"path": {"type": "string", "pattern": "b/c", "maxLength": 5}})
    assert _accepts(found, _call_ids(tok, path="b/c")) and _accepts(found, _call_ids(tok, path="ab/cd"))
    assert not _accepts(found, _call_ids(tok, path="ab/cde")) and not _accepts(found, _call_ids(tok, path="abc"))
    either = _forced_call(tok, {"s": {"type": "string", "pattern": "^a|b$"}})
    assert _accepts(either, _call_ids(tok, s="ax")) and _accepts(either, _call_ids(tok, s="xb"))
    assert not _accepts(either, _call_ids(tok, s="xa"))
    free = _forced_call(tok, {"s": {"type": "string"}})  # the reference: without a pattern all of them pass
    assert all(_accepts(free, _call_ids(tok, s=v)) for v in ("xABC-12", "abc", "xa"))


@pytest.mark.parametrize("prop, words", [
    ({"type": "string", "format": "date"}, ["format", "'date'", "raw string", "'when'"]),
    ({"type": "string", "pattern": "(?=a)b"}, ["pattern", "'(?=a)b'", "look-around"]),
    ({"type": "string", "pattern": "(a)\\1"}, ["pattern", "backreferences"]),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "bogus"}}}, ["format", "'bogus'"]),
])
def test_unenforceable_argument_keywords_are_refused_by_name(tok, prop, words):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"when": prop}, "required": ["when"]}}}]
    with pytest.raises(GrammarError) as e:
        chat_grammar(tok, thinking=False, tools=tools, tool_choice="required")
    assert e.value.param == "tools" and all(w in str(e.value) for w in words), str(e.value)
    assert chat_grammar(tok, thinking=False, tools=tools, tool_choice="auto") is None  # nothing enforced: no 400


def _json_ids(tok, text):
    """The response section holding `text`, then the end of the message (thinking off), as ids."""
    return _after_generation_prompt(tok, tok.apply_chat_template([{"role": "assistant", "content": text}],
                                                                 thinking=False))


def test_json_schema_strings_enforce_pattern_and_format(tok):
    schema = {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                               "code": {"type": "string", "pattern": "^[a-z]+$"}},
              "required": ["day", "code"], "additionalProperties": False}
    g = Grammar(tok, chat_grammar(tok, thinking=False, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert _accepts(g, _json_ids(tok, '{"day":"2026-12-01","code":"abc"}'))
    assert not _accepts(g, _json_ids(tok, '{"day":"soon","code":"abc"}'))
    assert not _accepts(g, _json_ids(tok, '{"day":"2026-12-01","code":"ABC"}'))


@pytest.mark.parametrize("string, words", [
    ({"type": "string", "format": "bogus"}, ["format", "'bogus'"]),
    ({"type": "string", "pattern": "(?<=a)b"}, ["pattern", "'(?<=a)b'", "look-around"]),
])
def test_json_schema_keywords_that_cannot_run_are_refused_by_name(tok, string, words):
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": string}}}
    with pytest.raises(GrammarError) as e:
        chat_grammar(tok, thinking=False, response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert e.value.param == "response_format.json_schema" and all(w in str(e.value) for w in words), str(e.value)

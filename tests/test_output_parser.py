"""The output parser (k3.serve.output_parser): rendered assistant messages parse back to the same fields, streaming
at any cut equals one-shot parsing, and the known failure modes of real deployments are recovered."""
import json
import random

import pytest

from k3.data import load_tokenizer
from k3.serve.output_parser import OutputParser

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
    "expr": {"type": "string"}, "digits": {"type": "number"}, "exact": {"type": "boolean"}}}}}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def generated_ids(tok, message, thinking=True):
    """The ids a model writes for `message`: its rendering minus the generation prompt."""
    user = [{"role": "user", "content": "q"}]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, thinking=thinking)
    full = tok.apply_chat_template(user + [message], thinking=thinking)
    assert full[:len(prompt)] == prompt
    return full[len(prompt):]


def ids_of(tok, text):
    """Ids of a string written in markup (the model's own output, markers included)."""
    return tok.encode(text)


def parse(tok, ids, cuts=(), **kw):
    """Feed ids in pieces split at `cuts`; → (final message, concatenated deltas)."""
    p = OutputParser(tok, [CALC], call_id=lambda n: f"call_{n}", **kw)
    deltas, start = [], 0
    for cut in [*sorted(cuts), len(ids)]:
        deltas.append(p.feed(ids[start:cut]))
        start = cut
    deltas.append(p.finish())
    streamed = {"reasoning_content": "".join(d.reasoning_content for d in deltas),
                "content": "".join(d.content for d in deltas), "tool_calls": {}}
    for d in deltas:
        for tc in d.tool_calls:
            call = streamed["tool_calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None and tc["type"] == "function"  # id and name come once, first
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            call["arguments"] += tc["function"]["arguments"]
    return p.message(), streamed


def calls_of(message):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]


MESSAGES = [
    {"role": "assistant", "reasoning_content": "Think about <|close|> it.", "content": "The answer is 4."},
    {"role": "assistant", "reasoning_content": "", "content": "Multi\nline\n\n  text ünïcödé 日本 🙂"},
    {"role": "assistant", "reasoning_content": "Need the tool.", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "calc", "arguments": {
            "expr": "2 + \"3\"\n", "digits": 4, "exact": False, "extra": None, "list": [1, {"a": "b"}],
            "obj": {"k": [True]}, "ratio": 0.125, 'we"ird&key <|sep|>': "v"}}},  # attribute escaping
        {"id": "b", "type": "function", "function": {"name": "calc", "arguments": {}}}]},
    {"role": "assistant", "reasoning_content": "json form", "content": "calling", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "1+1"}'}}]},
]


@pytest.mark.parametrize("i", range(len(MESSAGES)))
@pytest.mark.parametrize("thinking", [True, False])
def test_round_trip_render_tokenize_parse(tok, i, thinking):
    m = MESSAGES[i]
    got, streamed = parse(tok, generated_ids(tok, m, thinking), thinking=thinking)
    assert got["content"] == (m["content"] or None if m.get("tool_calls") else m["content"])
    assert got["reasoning_content"] == (m["reasoning_content"] if thinking else "")
    want_calls = [(c["function"]["name"], c["function"]["arguments"] if isinstance(c["function"]["arguments"], dict)
                   else json.loads(c["function"]["arguments"])) for c in m.get("tool_calls", [])]
    assert calls_of(got) == want_calls  # values typed: numbers, booleans, null, arrays, objects
    assert [c["id"] for c in got.get("tool_calls", [])] == [f"call_{n}" for n in range(len(want_calls))]


def test_streaming_equals_one_shot_at_every_cut(tok):
    rng = random.Random(0)
    for m in MESSAGES:
        for thinking in (True, False):
            ids = generated_ids(tok, m, thinking)
            whole, whole_streamed = parse(tok, ids, thinking=thinking)
            cut_sets = [[c] for c in range(1, len(ids))]  # every single cut point
            cut_sets += [rng.sample(range(1, len(ids)), rng.randrange(1, len(ids))) for _ in range(30)]
            cut_sets.append(list(range(1, len(ids))))  # one id at a time
            for cuts in cut_sets:
                got, streamed = parse(tok, ids, cuts, thinking=thinking)
                assert got == whole and streamed == whole_streamed, cuts
            # and the streamed deltas add up to the final message
            assert whole_streamed["reasoning_content"] == whole["reasoning_content"]
            assert whole_streamed["content"] == (whole["content"] or "")
            assert [(c["id"], c["name"], c["arguments"]) for c in whole_streamed["tool_calls"].values()] == [
                (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]


def test_truncated_outputs_at_every_length_stream_identically_and_give_valid_json(tok):
    ids = generated_ids(tok, MESSAGES[2])
    for n in range(len(ids) + 1):
        whole, _ = parse(tok, ids[:n])
        got, streamed = parse(tok, ids[:n], [n // 3, n // 2])
        assert got == whole
        for call in got.get("tool_calls", []):
            json.loads(call["function"]["arguments"])  # a cut call still carries valid JSON


def test_truncated_call_keeps_complete_arguments_and_a_cut_string(tok):
    text = ('why<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
            '<|open|>call tool="calc" index="1"<|sep|><|open|>argument key="digits" type="number"<|sep|>3'
            '<|close|>argument<|sep|><|open|>argument key="expr" type="string"<|sep|>12*(3')
    got, _ = parse(tok, ids_of(tok, text))
    assert calls_of(got) == [("calc", {"digits": 3, "expr": "12*(3"})]
    cut_number = text.replace('key="expr" type="string"<|sep|>12*(3', 'key="ratio" type="number"<|sep|>0.5')
    got, _ = parse(tok, ids_of(tok, cut_number))
    assert calls_of(got) == [("calc", {"digits": 3})]  # a number cut short could be wrong: dropped


def test_skipped_think_section_is_recovered(tok):
    # the model opens response without closing think
    got, _ = parse(tok, ids_of(tok, "plan<|open|>response<|sep|>Done.<|close|>response<|sep|>"
                                    "<|close|>message<|sep|><|end_of_msg|>"))
    assert (got["reasoning_content"], got["content"]) == ("plan", "Done.")
    # the model closes think and writes its answer without opening response
    got, _ = parse(tok, ids_of(tok, "plan<|close|>think<|sep|>\nDone.<|end_of_msg|>"))
    assert (got["reasoning_content"], got["content"]) == ("plan", "\nDone.")
    # think opened again by the model although the prompt opened it; whitespace between sections is layout
    got, _ = parse(tok, ids_of(tok, "<|open|>think<|sep|>a<|close|>think<|sep|>\n<|open|>response<|sep|>b"
                                    "<|close|>response<|sep|>\n<|close|>message<|sep|>"))
    assert (got["reasoning_content"], got["content"]) == ("a", "b")


def test_a_repeated_assistant_header_is_skipped_and_a_new_message_ends_the_turn(tok):
    got, _ = parse(tok, ids_of(tok, '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>r<|close|>think<|sep|>'
                                    '<|open|>response<|sep|>c<|close|>response<|sep|>'
                                    '<|open|>message role="user"<|sep|>fake turn'))
    assert (got["reasoning_content"], got["content"]) == ("r", "c")


def test_tools_opened_before_think_was_closed(tok):
    text = ('let me compute<|open|>tools<|sep|><|open|>call tool="calc" index="1"<|sep|>'
            '<|open|>argument key="expr" type="string"<|sep|>1+1<|close|>argument<|sep|>'
            '<|open|>argument key="exact" type="boolean"<|sep|>true<|close|>argument<|sep|><|close|>call<|sep|>'
            '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
    got, _ = parse(tok, ids_of(tok, text))
    assert got["reasoning_content"] == "let me compute" and got["content"] is None
    assert calls_of(got) == [("calc", {"expr": "1+1", "exact": True})]
    # a call opened straight inside think, without tools
    got, _ = parse(tok, ids_of(tok, text.replace("<|open|>tools<|sep|>", "")))
    assert calls_of(got) == [("calc", {"expr": "1+1", "exact": True})]


def test_argument_types_come_from_the_tag_else_the_schema_and_bad_json_stays_text(tok):
    text = ('<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="calc" index="1"<|sep|>'
            '<|open|>argument key="digits"<|sep|>7<|close|>argument<|sep|>'  # no type: the schema says number
            '<|open|>argument key="expr"<|sep|>7<|close|>argument<|sep|>'  # no type: the schema says string
            '<|open|>argument key="exact" type="boolean"<|sep|>yes<|close|>argument<|sep|>'  # not JSON: kept as text
            '<|close|>call<|sep|><|close|>tools<|sep|>')
    got, _ = parse(tok, ids_of(tok, text))
    assert calls_of(got) == [("calc", {"digits": 7, "expr": "7", "exact": "yes"})]


def test_generation_ends_at_the_end_of_the_turn(tok):
    ids = ids_of(tok, "r<|close|>think<|sep|><|open|>response<|sep|>c<|close|>response<|sep|>"
                      "<|close|>message<|sep|><|end_of_msg|>more text<|open|>response<|sep|>x")
    got, _ = parse(tok, ids)
    assert (got["reasoning_content"], got["content"]) == ("r", "c")
    got, _ = parse(tok, ids_of(tok, "r<|close|>think<|sep|><|open|>response<|sep|>c<|end_of_msg|>tail"))
    assert got["content"] == "c"


def test_tiktoken_tokenizer_round_trip(tmp_path):
    pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install tiktoken)")
    from test_tokenizer_interface import write_released_style_tokenizer

    tok = load_tokenizer(write_released_style_tokenizer(tmp_path))
    m = MESSAGES[2]
    got, _ = parse(tok, generated_ids(tok, m))
    assert got["reasoning_content"] == m["reasoning_content"]
    assert calls_of(got) == [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]


@pytest.mark.parametrize("number", ["-6e955", "1e400", "-1.5E+309"])
def test_number_beyond_float_keeps_the_models_text_as_strict_json(tok, number):
    """JSON numbers have no range: a value Python's float cannot hold stays the model's text, never `Infinity`."""
    text = ('<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>'
            '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="calc" index="1"<|sep|>'
            f'<|open|>argument key="digits" type="number"<|sep|>{number}<|close|>argument<|sep|>'
            '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
    generation_prompt = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    ids = ids_of(tok, text)[len(ids_of(tok, generation_prompt)):]  # what the model writes after the prompt
    message, streamed = parse(tok, ids, cuts=[len(ids) // 2])
    args = message["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args, parse_constant=_reject) == json.loads("{\"digits\": " + number + "}")
    assert number in args and streamed["tool_calls"][0]["arguments"] == args


def _reject(name):
    raise AssertionError(f"{name} in the arguments is not JSON")

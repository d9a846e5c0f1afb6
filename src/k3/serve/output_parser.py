"""Generated ids → OpenAI's assistant message: `reasoning_content`, `content` and `tool_calls` (SPEC §1.2).

Works token by token, so the same parser serves streaming (one `feed` per engine step) and non-streaming (one
`feed` of everything): both see the same ids and therefore classify them identically.

    parser = OutputParser(tokenizer, tools, thinking=True)
    for step_ids in generation:
        delta = parser.feed(step_ids)      # Delta: reasoning_content, content, tool_calls (OpenAI stream deltas)
    last = parser.finish()                 # what was held back (a truncated call is closed here)
    message = parser.message()             # {"role": "assistant", "content", "reasoning_content", "tool_calls"?}

Recovered failure modes of real deployments: a skipped think section (the model opens `response` or `tools`
without closing `think`, or writes text after closing think without opening `response`), a duplicated
`<|open|>think`, and a truncated call (generation ends inside a call: the complete arguments are kept).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from k3.data.chat_template import CLOSE, END_OF_MSG, OPEN, SEP, unescape_attr

_ATTR = re.compile(r'([A-Za-z_][\w-]*)="([^"]*)"')


@dataclass
class Delta:
    """What one `feed` (or `finish`) adds. tool_calls are OpenAI streaming deltas: the first for a call carries
    index, id, type and function.name (arguments ""), later ones {"index", "function": {"arguments": fragment}}."""
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning_content or self.content or self.tool_calls)

    def to_openai(self) -> dict:
        """The `delta` object of a chat.completion.chunk, holding only the fields that changed."""
        out: dict = {}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class OutputParser:
    """Incremental parser of one generated assistant turn (the ids after the generation prompt).

    tokenizer: a k3 tokenizer (k3.data.load_tokenizer); tools: the request's OpenAI `tools` (they type an
    argument that lacks a `type` attribute); thinking: whether the generation prompt opened `think` (True) or
    `response` (False); call_id: makes the id of the n-th call (0-based), default `call_<random hex>`.

    Sections are read from the markers alone: after `<|open|>` or `<|close|>` the ids up to `<|sep|>` are the tag
    (`NAME attr="v"…`); every other id is text of the section it falls in. A string argument streams as it is
    written; other arguments are sent whole when closed, parsed as JSON by their type (kept as a string if they
    are not valid JSON). A call's argument fragments always concatenate to its final `arguments`.
    """

    def __init__(self, tokenizer, tools: list[dict] | None = None, thinking: bool = True, call_id=None):
        sp = tokenizer.special_tokens
        self._tok = tokenizer
        self._open, self._close, self._sep = sp[OPEN], sp[CLOSE], sp[SEP]
        self._stop = set(tokenizer.stop_token_ids) | {sp[END_OF_MSG]}
        self._specials = set(sp.values())
        prefix = uuid.uuid4().hex[:24]
        self._call_id = call_id or (lambda n: f"call_{prefix}{n}")
        self._schemas = {}  # tool name -> {argument: JSON-schema type}
        for t in tools or []:
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                props = (fn.get("parameters") or {}).get("properties") or {}
                self._schemas[fn["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
        self._state = "think" if thinking else "response"
        self._header: list[int] | None = None  # ids of a tag being read, after <|open|> or <|close|>
        self._header_kind = ""
        self._decoder = tokenizer.decode_stream(skip_special_tokens=True)
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._outside: list[str] = []  # text after a section closed: content once it is more than whitespace
        self._calls: list[dict] = []  # {"id", "name", "arguments": [fragments], "args": count}
        self._arg: dict | None = None  # the argument being read: key, type, text pieces
        self._done = False
        self._new_reasoning: list[str] = []  # what the current feed adds (joined once: no quadratic string growth)
        self._new_content: list[str] = []
        self._new_calls: list[dict] = []  # OpenAI call deltas, their arguments as lists of fragments

    # ---- public ----------------------------------------------------------------------------------------------
    def feed(self, token_ids) -> Delta:
        """Consume newly generated ids (ints or a 1-D tensor); return what they add."""
        for t in token_ids:
            if self._done:
                break
            self._token(int(t))
        return self._take_delta()

    def finish(self) -> Delta:
        """Generation ended (stop id, length, abort): flush held-back text, close a truncated call."""
        if not self._done:
            self._end()
        return self._take_delta()

    @property
    def has_tool_calls(self) -> bool:
        """True once a call has started (finish_reason "tool_calls")."""
        return bool(self._calls)

    def message(self) -> dict:
        """The whole assistant message so far: role, content (None when empty and there are calls),
        reasoning_content, and tool_calls ([{id, type: "function", function: {name, arguments: JSON str}}])."""
        content = "".join(self._content)
        msg = {"role": "assistant", "content": content if content or not self._calls else None,
               "reasoning_content": "".join(self._reasoning)}
        if self._calls:
            msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": "".join(c["arguments"])}}
                                 for c in self._calls]
        return msg

    def _take_delta(self) -> Delta:
        for d in self._new_calls:
            d["function"]["arguments"] = "".join(d["function"]["arguments"])
        delta = Delta("".join(self._new_reasoning), "".join(self._new_content), self._new_calls)
        self._new_reasoning, self._new_content, self._new_calls = [], [], []
        return delta

    # ---- tokens ----------------------------------------------------------------------------------------------
    def _token(self, t: int) -> None:
        if t in self._stop:
            self._end()
        elif t in (self._open, self._close):
            self._flush_text()
            self._header, self._header_kind = [], "open" if t == self._open else "close"
        elif self._header is not None:
            if t == self._sep:
                ids, self._header = self._header, None
                self._tag(self._header_kind, self._tok.decode(ids, skip_special_tokens=True))
            elif t not in self._specials:
                self._header.append(t)
        elif t not in self._specials:
            self._text(self._decoder.step(t))

    def _text(self, piece: str) -> None:
        if not piece:
            return
        state = self._state
        if state == "think":
            self._reasoning.append(piece)
            self._new_reasoning.append(piece)
        elif state == "response":
            self._add_content(piece)
        elif state == "outside":  # after a section closed: whitespace is layout, anything else is content
            self._outside.append(piece)
            held = "".join(self._outside)
            if held.strip():
                self._outside = []
                self._state = "response"
                self._add_content(held)
        elif state == "argument":
            self._arg["text"].append(piece)
            if self._arg["type"] == "string":
                self._fragment(json.dumps(piece, ensure_ascii=False)[1:-1])
        elif state == "json":
            self._fragment(piece)
        # text inside `tools` or `call` but outside an argument is layout: dropped

    def _flush_text(self) -> None:
        """A marker ends the current text run. Bytes of a character cut by it are dropped (they decode to
        nothing valid), and layout whitespace between sections is dropped."""
        self._decoder = self._tok.decode_stream(skip_special_tokens=True)
        self._outside = []

    def _add_content(self, piece: str) -> None:
        self._content.append(piece)
        self._new_content.append(piece)

    # ---- tags ------------------------------------------------------------------------------------------------
    def _tag(self, kind: str, header: str) -> None:
        name = header.split(" ", 1)[0].strip()
        attrs = {k: unescape_attr(v) for k, v in _ATTR.findall(header)}
        state = self._state
        if kind == "open":
            if name == "think" and state in ("outside", "response"):
                self._state = "think"
            elif name == "response" and state in ("think", "outside", "response"):
                self._state = "response"  # from think: the model skipped closing it
            elif name == "tools" and state in ("think", "outside", "response"):
                self._state = "tools"
            elif name == "call" and state in ("think", "outside", "response", "tools", "call", "argument", "json"):
                self._end_call()
                self._start_call(attrs.get("tool", ""))
            elif name == "argument" and state in ("call", "argument"):
                self._end_argument()
                self._arg = {"key": attrs.get("key", ""), "type": attrs.get("type") or self._schema_type(
                    attrs.get("key", "")), "text": []}
                if self._arg["type"] == "string":
                    self._fragment(self._key_prefix() + json.dumps(self._arg["key"], ensure_ascii=False) + ': "')
                self._state = "argument"
            elif name == "json" and state == "call" and not self._calls[-1]["args"]:
                self._calls[-1]["json"] = True
                self._state = "json"
            elif name == "message":
                if attrs.get("role") == "assistant" and not (self._reasoning or self._content or self._calls):
                    return  # the model repeated its own message header before writing anything: keep reading
                self._end()  # the model began another message: this turn is over
        else:
            if name == "think" and state == "think":
                self._state = "outside"
            elif name == "response" and state == "response":
                self._state = "outside"
            elif name == "tools" and state in ("tools", "call", "argument", "json"):
                self._end_call()
                self._state = "outside"
            elif name == "call" and state in ("call", "argument", "json"):
                self._end_call()
                self._state = "tools"
            elif name == "argument" and state == "argument":
                self._end_argument()
            elif name == "json" and state == "json":
                self._state = "call"
            elif name == "message":
                self._end()

    def _schema_type(self, key: str) -> str:
        return (self._schemas.get(self._calls[-1]["name"]) or {}).get(key) or "string"

    # ---- calls -----------------------------------------------------------------------------------------------
    def _start_call(self, name: str) -> None:
        n = len(self._calls)
        call = {"id": self._call_id(n), "name": name, "arguments": [], "args": 0, "json": False}
        self._calls.append(call)
        self._new_calls.append({"index": n, "id": call["id"], "type": "function",
                                "function": {"name": name, "arguments": []}})
        self._state = "call"

    def _key_prefix(self) -> str:
        call = self._calls[-1]
        call["args"] += 1
        return "{" if call["args"] == 1 else ", "

    def _fragment(self, text: str) -> None:
        if not text:
            return
        call = self._calls[-1]
        call["arguments"].append(text)
        d = self._new_calls
        if d and d[-1]["index"] == len(self._calls) - 1:
            d[-1]["function"]["arguments"].append(text)
        else:
            d.append({"index": len(self._calls) - 1, "function": {"arguments": [text]}})

    def _end_argument(self, truncated: bool = False) -> None:
        arg, self._arg = self._arg, None
        if arg is None:
            return
        self._state = "call"
        if arg["type"] == "string":
            self._fragment('"')
            return
        if truncated:
            return  # a cut number, object or array cannot be trusted: drop it
        self._fragment(self._key_prefix() + json.dumps(arg["key"], ensure_ascii=False) + ": "
                       + _json_value("".join(arg["text"])))

    def _end_call(self, truncated: bool = False) -> None:
        if self._state not in ("call", "argument", "json") or not self._calls:
            return
        self._end_argument(truncated)
        call = self._calls[-1]
        if not call["json"]:
            self._fragment("}" if call["args"] else "{}")
        self._state = "tools"

    def _end(self) -> None:
        """The turn is over (a stop id, a new message, or the end of generation)."""
        self._flush_text()
        self._end_call(truncated=True)
        self._done = True


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def _json_value(text: str) -> str:
    """An argument's value as strict JSON text: re-serialised where Python's floats hold it; the model's own text
    where it is valid JSON they cannot hold (1e999 would otherwise become the non-JSON `Infinity`); a JSON string
    where it is not the JSON its type promised."""
    try:
        return json.dumps(json.loads(text, parse_constant=_not_json), ensure_ascii=False, allow_nan=False)
    except ValueError:
        pass
    try:
        json.loads(text, parse_float=str, parse_int=str, parse_constant=_not_json)
        return text.strip()
    except ValueError:
        return json.dumps(text, ensure_ascii=False)

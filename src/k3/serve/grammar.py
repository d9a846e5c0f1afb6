"""Constrained decoding: the grammar an assistant turn (SPEC §1.2 markup) must follow when a request asks for JSON
(`response_format`) or forces tool calls (`tool_choice`), compiled by llguidance, and each sequence's matcher, which
gives the sampler the allowed next tokens as a bitmask.

llguidance (Microsoft's Rust grammar engine behind Guidance; also used by vLLM and SGLang) was chosen over xgrammar
and outlines-core: its one abi3 wheel has no Python dependencies (xgrammar pulls triton, transformers and tvm-ffi),
its Lark grammars name special tokens by id (`<[163587]>`), which the XTML markers are, and it computes a mask in
about 0.1 ms a row on this project's CPU (benchmarks/bench_grammar.py) without precomputing per-grammar tables.

The grammar covers everything the model writes after the generation prompt: the think section (free text, capped
at `think_budget` tokens so that a model that never closes it still reaches the constrained part), the response
(free text, a JSON value, or empty when a call is forced), the tools section with typed arguments, and the close
of the message; `<|end_of_msg|>` is then the only token allowed."""
from __future__ import annotations

import json
import re
import threading
import weakref

import numpy as np
import torch

from k3.data.chat_template import CLOSE, OPEN, SEP, escape_attr, json_type

MAX_PARALLEL_CALLS = 8  # a grammar enumerates call indices 1..this when parallel_tool_calls is on
# What the tools' argument alternatives may add to a grammar. A few hundred bytes of anyOf through $ref name 2^n
# alternatives (each of n definitions lists the next one twice), and $defs copied into each would multiply a
# request's size: a grammar past this is refused before it is built, not built for minutes and gigabytes.
MAX_TOOLS_GRAMMAR_CHARS = 8 << 20
MAX_BRANCH_DEPTH = 32  # anyOf/oneOf within anyOf/oneOf at an argument's top; deeper is a $ref leading to itself
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_COMPACT_JSON = {"whitespace_flexible": False}  # no free whitespace: a model cannot pad JSON forever
_ANY_TEXT = "/(?s:.*)/"  # any text; markers are special tokens, which no text lexeme matches


class GrammarError(ValueError):
    """A request's constraint that cannot be compiled; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema) -> str:
    schema = dict(schema) if isinstance(schema, dict) else {}
    schema["x-guidance"] = _COMPACT_JSON
    return "%json " + json.dumps(schema, ensure_ascii=False)


class Markup:
    """Lark fragments for XTML tags: markers by their special ids, tag heads as text."""

    def __init__(self, tokenizer):
        ids = tokenizer.special_tokens
        self.open, self.close, self.sep = (f"<[{ids[m]}]>" for m in (OPEN, CLOSE, SEP))

    def open_tag(self, head: str) -> str:
        return f"{self.open} {_lit(head)} {self.sep}"

    def close_tag(self, name: str) -> str:
        return f"{self.close} {_lit(name)} {self.sep}"


def _resolve(schema, root: dict, depth: int = 0):
    """A property's schema with a local `$ref` (`#/$defs/Name`, as pydantic writes nested models) followed."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#/") \
            and depth < 32:
        target = root
        for key in schema["$ref"][2:].split("/"):
            target = target.get(key) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            return schema  # left for llguidance to report
        schema, depth = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}, depth + 1
    return schema


class _Budget:
    """The characters the tools' arguments may still add to one grammar (MAX_TOOLS_GRAMMAR_CHARS)."""

    def __init__(self):
        self.left = MAX_TOOLS_GRAMMAR_CHARS

    def spend(self, chars: int, where: str) -> None:
        self.left -= chars
        if self.left < 0:
            raise GrammarError(f"tools: at {where}, the tools' argument types come to more than "
                               f"{MAX_TOOLS_GRAMMAR_CHARS >> 20} MiB of grammar (anyOf/oneOf branches once their "
                               f"$refs are followed); simplify the schemas", "tools")


def _value_alternatives(schema: dict, root: dict, where: str, budget: _Budget,
                        depth: int = 0) -> list[tuple[str, str]]:
    """→ [(XTML argument type, Lark expression of the value)] that a property's schema allows; root: the tool's
    parameters schema, whose `$defs` the property's JSON sub-schemas keep; where: the argument, for errors;
    budget: what the alternatives may still add (each visit counts, so an expansion is stopped as it grows)."""
    if depth > MAX_BRANCH_DEPTH:
        raise GrammarError(f"tools: {where} nests anyOf/oneOf more than {MAX_BRANCH_DEPTH} deep (a $ref that leads "
                           f"back to itself?)", "tools")
    budget.spend(64, where)  # about what an alternative's tags cost, whatever it yields
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        schema = {}
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else list(schema["enum"] or [])
        out = []
        for v in values:
            kind = json_type(v)
            out.append((kind, _lit(v if kind == "string" else json.dumps(v, ensure_ascii=False))))
        return out
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches:
        return [alt for b in branches for alt in _value_alternatives(b, root, where, budget, depth + 1)]
    types = schema.get("type")
    types = types if isinstance(types, list) else [types] if types else \
        ["string", "number", "boolean", "null", "object", "array"]
    out = []
    for t in types:
        if t == "string":
            out.append(("string", _string_rule(schema, where)))
        else:
            sub = {k: v for k, v in schema.items() if k not in ("type", "anyOf", "oneOf")}
            sub["type"] = t
            if '"$ref"' in json.dumps(sub):  # its definitions, only where it refers to them
                sub.update({k: root[k] for k in ("$defs", "definitions") if k in root})
            out.append(("number" if t == "integer" else t, _json_rule(sub)))
    for _, value in out:
        budget.spend(len(value), where)
    return out


def _string_rule(schema: dict, where: str = "argument") -> str:
    """A raw string argument (SPEC §1.2: strings are written raw): length bounds and `pattern` are enforced (both:
    the intersection, `&`, which Lark allows only in a named token). A `format` is refused: llguidance checks
    formats only inside JSON strings, and the raw form has no quotes; a `pattern` says the same thing here."""
    if "format" in schema:
        raise GrammarError(f"tools: {where} has format {schema['format']!r}, which cannot be enforced on a raw "
                           "string argument; give a 'pattern' instead", "tools")
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    parts = []
    if isinstance(lo, int) or isinstance(hi, int):
        parts.append(f"/(?s:.{{{int(lo or 0)},{'' if hi is None else int(hi)}}})/")
    if "pattern" in schema:
        parts.append(f"/{_search_regex(schema['pattern'], where)}/")
    return " & ".join(parts) or _ANY_TEXT


def _top_level_alternatives(pattern: str) -> list[str]:
    """`pattern` split at its `|` that are outside groups, classes and escapes."""
    alts, depth, in_class, escaped, start = [], 0, False, False, 0
    for i, c in enumerate(pattern):
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            alts.append(pattern[start:i])
            start = i + 1
    return alts + [pattern[start:]]


def _search_regex(pattern, where: str) -> str:
    """A JSON Schema `pattern` (matched anywhere in the string unless anchored) as a whole-text regex for a Lark
    literal: each top-level alternative loses its `^`/`$` anchors or gains `(?s:.*)` where it has none. The
    regex engine has no anchors, lookarounds or backreferences: a pattern needing them is refused by name."""
    if not isinstance(pattern, str):
        raise GrammarError(f"tools: {where} has a pattern that is not a string: {pattern!r}", "tools")
    alts = []
    for alt in _top_level_alternatives(pattern):
        head = "" if alt.startswith("^") else "(?s:.*)"
        alt = alt[1:] if alt.startswith("^") else alt
        body = alt[:-1]
        anchored_end = alt.endswith("$") and (len(body) - len(body.rstrip("\\"))) % 2 == 0  # not an escaped $
        tail = "" if anchored_end else "(?s:.*)"
        alts.append(f"{head}(?:{body if anchored_end else alt}){tail}")
    regex = re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", "|".join(alts))  # a bare / would end the Lark literal
    error = _lark_error(f"start: /{regex}/")
    if error:
        raise GrammarError(f"tools: {where} has pattern {pattern!r}, which cannot be enforced: {error}", "tools")
    return regex


def _one_line(error: str) -> str:
    """llguidance's multi-line error as one line: its `error:` lines, else its first."""
    why = " ".join(line.strip() for line in error.splitlines() if line.strip().startswith("error:"))
    return why or error.splitlines()[0]


def _lark_error(lark: str) -> str | None:
    """Why llguidance rejects a grammar (one line), or None."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))
    return _one_line(error) if error else None


def _check_json_strings(schema, param: str) -> None:
    """Every `pattern` and `format` in a JSON schema that llguidance enforces (it enforces both inside JSON
    strings), or a GrammarError naming the keyword and its value: what it cannot run is refused, never ignored."""
    import llguidance

    if isinstance(schema, list):
        for item in schema:
            _check_json_strings(item, param)
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in ("pattern", "format") and isinstance(value, str):
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", key: value})
            error = llguidance.LLMatcher.validate_grammar(grammar)
            if error:
                raise GrammarError(f"{param}: {key} {value!r} cannot be enforced: {_one_line(error)}", param)
        elif key not in ("const", "enum", "default", "examples"):  # values there are data, not schemas
            _check_json_strings(value, param)


class ChatGrammar:
    """Builds the Lark grammar of one assistant turn for a request's tools, tool_choice and response_format."""

    def __init__(self, tokenizer):
        self.m = Markup(tokenizer)
        self.rules: list[str] = []
        self.budget = _Budget()
        self._arguments: dict[int, str] = {}  # tool t → its arguments' rules, shared by every call index

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def tool_call(self, tool: dict, index: int, t: int) -> str:
        head = self.m.open_tag(f'call tool="{escape_attr(tool["function"]["name"])}" index="{index}"')
        return f"{head} {self.arguments(tool, t)} {self.m.close_tag('call')}"

    def arguments(self, tool: dict, t: int) -> str:
        """Tool t's arguments in order, each a rule of its typed alternatives (built once a grammar)."""
        if t in self._arguments:
            return self._arguments[t]
        fn = tool["function"]
        name, params = fn["name"], fn.get("parameters") or {}
        _check_json_strings(params, "tools")  # here, not in _check_tools: a tool no grammar enforces is not refused
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        args = []
        for k, (key, prop) in enumerate(props.items()):
            alts = []
            where = f"{name}'s argument {key!r}"
            for j, (kind, value) in enumerate(_value_alternatives(prop, params, where, self.budget)):
                if " & " in value:  # an intersection must be a named token
                    value = self.rule(f"STR_{t}_{k}_{j}", value)
                head = self.m.open_tag('argument key="%s" type="%s"' % (escape_attr(key), kind))
                alts.append(f"{head} {value} {self.m.close_tag('argument')}")
            rule = self.rule(f"arg_{t}_{k}", " | ".join(alts))
            args.append(rule if key in required else f"{rule}?")
        self._arguments[t] = " ".join(args)
        return self._arguments[t]

    def tools_section(self, tools: list[dict], parallel: bool) -> str:
        calls = []
        for index in range(1, (MAX_PARALLEL_CALLS if parallel else 1) + 1):
            calls.append(self.rule(f"call_{index}", " | ".join(self.tool_call(tool, index, t)
                                                              for t, tool in enumerate(tools))))
        nested = calls[-1]
        for c in reversed(calls[:-1]):  # call_1 (call_2 (call_3 …)?)?: indices count up from 1
            nested = f"{c} ({nested})?"
        return f"{self.m.open_tag('tools')} {nested} {self.m.close_tag('tools')}"

    def build(self, thinking: bool, content: str, tools_part: str, think_budget: int | None) -> str:
        m = self.m
        think = ""
        if thinking:
            budget = f"[max_tokens={int(think_budget)}]" if think_budget else ""
            self.rules.append(f"think{budget}: {_ANY_TEXT}")
            think = f"think {m.close_tag('think')} {m.open_tag('response')} "
        start = f"start: {think}{content} {m.close_tag('response')} {tools_part} {m.close_tag('message')}"
        return "\n".join([start, *self.rules]) + "\n"


def _check_tools(tools) -> list[dict]:
    out = []
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise GrammarError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}",
                               f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not TOOL_NAME.match(fn["name"]):
            raise GrammarError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'; got "
                               f"{fn.get('name')!r}", f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and isinstance(params.get("properties", {}), dict)):
            raise GrammarError(f"tools[{i}].function.parameters must be a JSON schema object",
                               f"tools[{i}].function.parameters")
        out.append(t)
    return out


def chat_grammar(tokenizer, *, thinking: bool = True, tools=None, tool_choice=None,
                 parallel_tool_calls: bool = True, response_format=None, think_budget: int | None = None) -> str | None:
    """The Lark grammar of the assistant turn a request constrains, or None when nothing is enforced
    (no response_format and tool_choice auto). Raises GrammarError naming the request field."""
    tools = _check_tools(tools)
    fmt = (response_format or {}).get("type", "text") if isinstance(response_format, dict) else "text"
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if fmt == "text" and not forced and tool_choice != "none":
        return None
    if tool_choice == "none" and not tools and fmt == "text":
        return None
    g = ChatGrammar(tokenizer)
    if forced:
        if not tools:
            raise GrammarError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            tools = [t for t in tools if t["function"]["name"] == name]
            if not tools:
                raise GrammarError(f"tool_choice names the function {name!r}, which is not among the tools",
                                   "tool_choice")
        content = '""'  # a forced call comes with an empty response, as OpenAI's and vLLM's do
        tools_part = g.tools_section(tools, parallel_tool_calls)
    else:
        if fmt == "json_object":
            content = _json_rule({"type": "object"})
        elif fmt == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise GrammarError("response_format.json_schema must be an object whose 'schema' is a JSON schema",
                                   "response_format.json_schema")
            _check_json_strings(spec.get("schema") or {}, "response_format.json_schema")
            content = _json_rule(spec.get("schema") or {})
        elif fmt == "text":
            content = g.rule("text", _ANY_TEXT)
        else:
            raise GrammarError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {fmt!r}",
                               "response_format.type")
        tools_part = f"({g.tools_section(tools, parallel_tool_calls)})?" if tools and tool_choice != "none" else ""
    return g.build(thinking, content, tools_part, think_budget)


# ---- compiled grammars and per-sequence matchers ------------------------------------------------------------
_LL_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer):
    """llguidance's view of a k3 tokenizer (built once per tokenizer: ~0.1 s for the bundled BPE, ~1 s for the
    released 163,840-id vocabulary). `<|end_of_msg|>` is its end of sequence."""
    import llguidance

    with _LOCK:
        cached = _LL_TOKENIZERS.get(tokenizer)
        if cached is not None:
            return cached
        eos = tokenizer.eos_token_id
        if hasattr(tokenizer, "backend"):  # the bundled BPE: Hugging Face tokenizers JSON
            ll = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos)
        else:  # the released tiktoken files
            enc = tokenizer.encoding
            ll = llguidance.LLTokenizer.from_tiktoken(encoder=enc._mergeable_ranks, special_tokens=enc._special_tokens,
                                                      pattern=enc._pat_str, eos_token=eos, n_vocab=tokenizer.vocab_size)
        _LL_TOKENIZERS[tokenizer] = ll
        return ll


class Grammar:
    """A checked grammar for one tokenizer; `start()` gives a fresh matcher per sequence (n choices, retries)."""

    def __init__(self, tokenizer, lark: str, param: str = "response_format"):
        import llguidance

        self.ll = ll_tokenizer(tokenizer)
        self.text = llguidance.LLMatcher.grammar_from_lark(lark)
        error = llguidance.LLMatcher.validate_grammar(self.text, self.ll)
        if error:
            raise GrammarError(f"{param}: the constraint cannot be compiled: {error.splitlines()[0]}", param)
        self.eos = tokenizer.eos_token_id

    def start(self) -> "GrammarState":
        return GrammarState(self)


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, grammar: Grammar):
        import llguidance

        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(grammar.ll, grammar.text, log_level=0)

    def advance(self, token: int) -> None:
        """Consume the sampled token (which the mask allowed). A matcher that fails stays in its error state,
        where the mask allows only the end of the turn."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)


_EXECUTOR = None


def fill_bitmasks(states: list[GrammarState], bitmask: torch.Tensor) -> None:
    """Each state's allowed next tokens into bitmask[i] (int32 words, bit j of word w = token 32w + j), computed
    in parallel across sequences by llguidance's thread pool."""
    import llguidance
    from llguidance.torch import fill_next_token_bitmask_par

    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    fill_next_token_bitmask_par(_EXECUTOR, [(s.matcher, i) for i, s in enumerate(states)], bitmask)
    for i, s in enumerate(states):
        if s.matcher.is_error():  # never expected; end the turn rather than sample from an empty set
            bitmask[i].zero_()
            bitmask[i, s.grammar.eos // 32] = 1 << (s.grammar.eos % 32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab: int, device=None) -> torch.Tensor:
    """[R, W] int32 words → [R, vocab] bool on `device`, True where allowed. On the host numpy unpacks the bits
    (a byte table, ~10x faster than shifts in torch); for a GPU the words travel (32x fewer bytes than bools)
    and are unpacked there."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # little-endian words
        allowed = torch.from_numpy(bits).view(torch.bool)[:, :vocab]
    else:
        allowed = unpack_with_shifts(bitmask.to(device, non_blocking=True))[:, :vocab]
    if allowed.shape[1] < vocab:  # ids past the tokenizer's vocabulary (a padded model vocabulary): never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed


def unpack_with_shifts(words: torch.Tensor) -> torch.Tensor:
    """[R, W] int32 → [R, 32 W] bool with torch ops alone (where the words are: the GPU path)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words[:, :, None] >> shifts) & 1).view(words.shape[0], -1).bool()

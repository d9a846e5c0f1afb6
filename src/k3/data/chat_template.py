"""K3's chat markup, "XTML" (SPEC §1.2): OpenAI-format messages → the exact prompt string, or its ids.

A tag opens as `<|open|>NAME ATTR="v"…<|sep|>` and closes as `<|close|>NAME<|sep|>`; each message ends with
`<|end_of_msg|>`. The renderer builds a list of parts (marker names and text) once; `tokenize=False` joins them,
`tokenize=True` maps markers to their special ids and encodes each text run as ordinary text, so text that a
user, a tool or the model supplies never becomes markup, even when it spells `<|close|>`.
Text runs are encoded one at a time, so a conversation's ids only grow at the end as turns are added (prefix
caching), and the generation prompt is exactly the start of the assistant message the model then writes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
ROLES = ("system", "developer", "user", "assistant", "tool")
THINKING_EFFORTS = ("low", "medium", "high", "max")
TOOL_DECLARE_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
THINKING_EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`.")
# SPEC §1.2 names these two announcements but not their wording; k3 words them as the effort one is worded.
TOOL_CHOICE_TEXT = "Now the system is invoked with `tool_choice={}`."
RESPONSE_FORMAT_TEXT = "Now the system is invoked with `response_format={}`."


@dataclass(frozen=True)
class Marker:
    """One of the renderer's special tokens (never produced from text)."""
    name: str


@dataclass(frozen=True)
class Ids:
    """Ids made elsewhere (an image's media block), spliced in as they are."""
    ids: tuple


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def open_tag(tag: str, /, **attrs) -> list:
    head = tag + "".join(f' {k}="{escape_attr(str(v))}"' for k, v in attrs.items() if v is not None)
    return [Marker(OPEN), head, Marker(SEP)]


def close_tag(tag: str) -> list:
    return [Marker(CLOSE), tag, Marker(SEP)]


def message_text(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content[{i}] must be {{'type': 'text', 'text': str}} (only text is supported)")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}.content must be a string or a non-empty list of text parts")


def _is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _content_parts(content, where: str, media) -> list:
    """Text, or with OpenAI `image_url` parts the text runs between images and each image's `media(url, where)` ids."""
    if not (isinstance(content, list) and any(_is_image_part(p) for p in content)):
        return [message_text(content, where)]
    if media is None:
        raise ValueError(f"{where}.content has an image_url part, but this model has no vision tower (text only)")
    parts = []
    for i, part in enumerate(content):
        if _is_image_part(part):
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ValueError(f"{where}.content[{i}].image_url.url must be a string (a base64 data URL)")
            parts.append(Ids(tuple(media(url, f"{where}.content[{i}]"))))
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise ValueError(f"{where}.content[{i}] must be {{'type': 'text', 'text': str}} or "
                             f"{{'type': 'image_url', 'image_url': {{'url': 'data:image/...;base64,...'}}}}")
    return parts


def json_type(value) -> str:
    """The XTML `type` of a JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    raise ValueError(f"argument value {value!r} is not a JSON value")


def _call_parts(call: dict, index: int, where: str) -> list:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    args = fn.get("arguments", {})
    parts = open_tag("call", tool=fn["name"], index=index)
    if isinstance(args, str):  # OpenAI's JSON string: carried verbatim in a json block
        parts += [*open_tag("json", type="object"), args, *close_tag("json")]
    elif isinstance(args, dict):
        for key, value in args.items():
            try:
                kind = json_type(value)
            except ValueError as e:
                raise ValueError(f"{where}.function.arguments[{key!r}]: {e}") from None
            text = value if kind == "string" else json.dumps(value, ensure_ascii=False)
            parts += [*open_tag("argument", key=key, type=kind), text, *close_tag("argument")]
    else:
        raise ValueError(f"{where}.function.arguments must be a JSON string or an object")
    return parts + close_tag("call")


def _message(role: str, body: list, /, **attrs) -> list:
    return [*open_tag("message", role=role, **attrs), *body, *close_tag("message"), Marker(END_OF_MSG)]


def _assistant_body(m: dict, where: str, thinking: bool) -> list:
    reasoning = m.get("reasoning_content")
    if reasoning is None:
        reasoning = m.get("reasoning") or ""
    if not isinstance(reasoning, str):
        raise ValueError(f"{where}.reasoning_content must be a string")
    content = message_text(m["content"], where) if m.get("content") not in (None, "") else ""
    body = [*open_tag("think"), reasoning, *close_tag("think")] if thinking else []
    body += [*open_tag("response"), content, *close_tag("response")]
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    if calls:
        body += open_tag("tools")
        for j, call in enumerate(calls):
            body += _call_parts(call, j + 1, f"{where}.tool_calls[{j}]")
        body += close_tag("tools")
    return body


def _tool_results(messages: list, start: int, calls: list, media) -> tuple[list, int]:
    """The run of tool messages from `start`, ordered as the calls were and numbered from 1 → (parts of each
    message, the index after the run)."""
    run = []
    end = start
    while end < len(messages) and isinstance(messages[end], dict) and messages[end].get("role") == "tool":
        run.append(end)
        end += 1
    call_ids = [c.get("id") for c in calls if isinstance(c, dict)]
    names = {c.get("id"): (c.get("function") or {}).get("name") for c in calls if isinstance(c, dict)}
    order = sorted(run, key=lambda i: (call_ids.index(messages[i].get("tool_call_id"))
                                       if messages[i].get("tool_call_id") in call_ids else len(call_ids)))
    rendered = []
    for n, i in enumerate(order, start=1):
        m, where = messages[i], f"messages[{i}]"
        if "content" not in m:
            raise ValueError(f"{where}.content is required")
        name = names.get(m.get("tool_call_id")) or m.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.tool_call_id {m.get('tool_call_id')!r} matches no call of the assistant "
                             f"message before it, and the message has no name")
        rendered.append(_message("tool", _content_parts(m["content"], where, media), tool=name, index=n))
    return rendered, end


def _check_choice(tool_choice, tools) -> str | None:
    """The announced tool_choice value, or None for `auto` (the default, not announced)."""
    if tool_choice is None or tool_choice == "auto":
        return None
    if tool_choice in ("none", "required"):
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and tool_choice.get("type") == "function"):
        raise ValueError("tool_choice must be 'auto', 'none', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    declared = {(t.get("function") or {}).get("name") for t in tools or [] if isinstance(t, dict)}
    if fn["name"] not in declared:
        raise ValueError(f"tool_choice names the function {fn['name']!r}, which is not among the tools")
    return json.dumps({"type": "function", "function": {"name": fn["name"]}}, separators=(",", ":"),
                      ensure_ascii=False)


def _check_format(response_format) -> str | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    if kind == "json_schema" and not isinstance(response_format.get("json_schema"), dict):
        raise ValueError("response_format.json_schema must be an object with the schema")
    return json.dumps(response_format, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def render_parts(messages: list, tools: list | None = None, add_generation_prompt: bool = False,
                 thinking: bool = True, thinking_effort: str | None = None, tool_choice=None,
                 response_format=None, media=None) -> tuple[list, list[int]]:
    """messages → (parts: text str, Marker or Ids; the part count after each rendered message).
    Raises ValueError naming the bad field. media(url, where) gives an image part's ids (vision models)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools must be a list of objects")
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"thinking_effort must be one of {', '.join(THINKING_EFFORTS)}; got {thinking_effort!r}")
    choice, fmt = _check_choice(tool_choice, tools), _check_format(response_format)
    parts: list = []
    ends: list[int] = []

    def add(message_parts):
        parts.extend(message_parts)
        ends.append(len(parts))

    if tools:
        declared = json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        add(_message("system", [TOOL_DECLARE_HEADER + declared + "\n```"], type="tool-declare"))
    if thinking_effort is not None:
        add(_message("system", [THINKING_EFFORT_TEXT.format(thinking_effort)], type="thinking-effort"))
    i, calls = 0, []
    while i < len(messages):
        m, where = messages[i], f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{where}.name must be a string")
        if role == "tool":
            rendered, i = _tool_results(messages, i, calls, media)
            for r in rendered:
                add(r)
            continue
        if role == "assistant":
            add(_message("assistant", _assistant_body(m, where, thinking), name=name))
            calls = m.get("tool_calls") or []
        else:
            if "content" not in m:
                raise ValueError(f"{where}.content is required")
            add(_message("system" if role == "developer" else role, _content_parts(m["content"], where, media),
                         name=name))
        i += 1
    if choice is not None:
        add(_message("system", [TOOL_CHOICE_TEXT.format(choice)], type="tool-choice"))
    if fmt is not None:
        add(_message("system", [RESPONSE_FORMAT_TEXT.format(fmt)], type="response-format"))
    if add_generation_prompt:
        parts += [*open_tag("message", role="assistant"), *open_tag("think" if thinking else "response")]
    return parts, ends


def parts_to_text(parts: list, tokenizer=None) -> str:
    out = []
    for p in parts:
        if isinstance(p, Marker):
            out.append(p.name)
        elif isinstance(p, Ids):
            if tokenizer is None:
                raise ValueError("an image part can only be rendered as text through a tokenizer")
            out.append(tokenizer.decode(list(p.ids)))
        else:
            out.append(p)
    return "".join(out)


def parts_to_ids(parts: list, tokenizer) -> tuple[list[int], list[int]]:
    """→ (ids, the id count after each part). Adjacent text parts are joined and encoded as one run of plain text."""
    ids: list[int] = []
    offsets: list[int] = []
    text: list[str] = []
    pending = 0  # parts whose text is still in `text`

    def flush():
        nonlocal pending
        if text:
            ids.extend(tokenizer.encode_text("".join(text)))
            text.clear()
        offsets.extend([len(ids)] * pending)
        pending = 0

    for p in parts:
        if isinstance(p, str):
            text.append(p)
            pending += 1
            continue
        flush()
        ids.extend([tokenizer.convert_tokens_to_ids(p.name)] if isinstance(p, Marker) else p.ids)
        offsets.append(len(ids))
    flush()
    return ids, offsets


def render_chat(tokenizer, messages: list, add_generation_prompt: bool = True, media=None,
                **options) -> tuple[list[int], list[int]]:
    """messages → (ids, the position after each rendered message), for the server's prefix cache checkpoints.
    options: tools, thinking, thinking_effort, tool_choice, response_format (as in render_parts)."""
    parts, ends = render_parts(messages, add_generation_prompt=add_generation_prompt, media=media, **options)
    ids, offsets = parts_to_ids(parts, tokenizer)
    return ids, [offsets[e - 1] for e in ends]


def generation_prompt(tokenizer, thinking: bool = True) -> list[int]:
    """Ids of the assistant turn's opening, as render_chat appends it."""
    return parts_to_ids([*open_tag("message", role="assistant"), *open_tag("think" if thinking else "response")],
                        tokenizer)[0]

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

from dataclasses import dataclass, field


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

    tokenizer: a k3 tokenizer (k3.data.load_tokenizer); tools: the request's OpenAI `tools` (used to type an
    argument that lacks a `type` attribute); thinking: whether the generation prompt opened `think` (True) or
    `response` (False); call_id: makes the id of the n-th call (0-based), default `call_<random hex>`.
    """

    def __init__(self, tokenizer, tools: list[dict] | None = None, thinking: bool = True, call_id=None):
        raise NotImplementedError

    def feed(self, token_ids) -> Delta:
        """Consume newly generated ids (ints or a 1-D tensor); return what they add."""
        raise NotImplementedError

    def finish(self) -> Delta:
        """Generation ended (stop id, length, abort): flush held-back text, close a truncated call."""
        raise NotImplementedError

    @property
    def has_tool_calls(self) -> bool:
        """True once a call has started (finish_reason "tool_calls")."""
        raise NotImplementedError

    def message(self) -> dict:
        """The whole assistant message so far: role, content (None when empty and there are calls),
        reasoning_content, and tool_calls ([{id, type: "function", function: {name, arguments: JSON str}}])."""
        raise NotImplementedError

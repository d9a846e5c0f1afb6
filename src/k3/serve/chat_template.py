"""The server's names for the chat markup, which lives in `k3.data.chat_template` (rendering) and
`k3.serve.output_parser` (parsing); kept so that callers of the old names go on working."""
from __future__ import annotations

from k3.data.chat_template import generation_prompt, message_text, render_chat
from k3.serve.output_parser import OutputParser

__all__ = ["render_chat", "generation_prompt", "message_text", "ChatOutputParser"]


class ChatOutputParser:
    """One id at a time → (reasoning delta, content delta): OutputParser without tool calls."""

    def __init__(self, tokenizer, thinking: bool = True):
        self._parser = OutputParser(tokenizer, thinking=thinking)

    def step(self, token_id: int) -> tuple[str, str]:
        d = self._parser.feed([token_id])
        return d.reasoning_content, d.content

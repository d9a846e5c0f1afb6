"""K3-style chat markup (SPEC §1.2): each message is `<|open|>role<|sep|>content<|close|>`; an assistant message
thinks first: `<|open|>assistant<|sep|><|open|>think<|sep|>R<|close|><|open|>response<|sep|>C<|close|><|end_of_msg|>`.
Every text piece is encoded on its own, so a conversation's ids only ever grow at the end (prefix-cache
friendly), and the generation prompt is exactly the start of the assistant message the model then writes."""
from __future__ import annotations

ROLES = ("system", "developer", "user", "assistant", "tool")


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


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> tuple[list[int], list[int]]:
    """messages → (token ids, the position after each message). Raises ValueError naming the bad field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    sp = tokenizer.special_tokens
    OPEN, CLOSE, SEP, EOM = sp["<|open|>"], sp["<|close|>"], sp["<|sep|>"], sp["<|end_of_msg|>"]
    enc = tokenizer.encode
    ids, ends = [tokenizer.bos_id], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
        if role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
            if not isinstance(reasoning, str):
                raise ValueError(f"{where}.reasoning_content must be a string")
            content = message_text(m.get("content"), where) if m.get("content") is not None else ""
            ids += [OPEN, *enc("assistant"), SEP, OPEN, *enc("think"), SEP, *enc(reasoning), CLOSE,
                    OPEN, *enc("response"), SEP, *enc(content), CLOSE, EOM]
        else:
            if "content" not in m:
                raise ValueError(f"{where}.content is required")
            ids += [OPEN, *enc(role), SEP, *enc(message_text(m["content"], where)), CLOSE]
        ends.append(len(ids))
    if add_generation_prompt:
        ids += generation_prompt(tokenizer)
    return ids, ends


def generation_prompt(tokenizer) -> list[int]:
    sp = tokenizer.special_tokens
    return [sp["<|open|>"], *tokenizer.encode("assistant"), sp["<|sep|>"], sp["<|open|>"], *tokenizer.encode("think"),
            sp["<|sep|>"]]


class ChatOutputParser:
    """Splits generated ids into reasoning (the think section) and content (the response section)."""

    def __init__(self, tokenizer):
        sp = tokenizer.special_tokens
        self.open, self.close, self.sep = sp["<|open|>"], sp["<|close|>"], sp["<|sep|>"]
        self.specials = set(sp.values())
        self.section = "think"  # think → header → response → done
        self.decoders = {"think": tokenizer.decode_stream(True), "response": tokenizer.decode_stream(True)}

    def step(self, token_id: int) -> tuple[str, str]:
        """→ (reasoning delta, content delta)."""
        if self.section == "think":
            if token_id == self.close:
                self.section = "header"
                return "", ""
            return self.decoders["think"].step(token_id), ""
        if self.section == "header":  # `<|open|>response<|sep|>` is markup
            if token_id == self.sep:
                self.section = "response"
            return "", ""
        if self.section == "response":
            if token_id == self.close:
                self.section = "done"
                return "", ""
            return "", self.decoders["response"].step(token_id)
        return "", ""

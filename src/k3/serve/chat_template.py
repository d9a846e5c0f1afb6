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


def _is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def content_ids(tokenizer, content, where: str, media=None) -> list[int]:
    """Ids of a message's content. Text is encoded as one string; with OpenAI `image_url` parts, the text runs
    between images are encoded separately and each image becomes `media(url, where)` (its media block ids)."""
    if not (isinstance(content, list) and any(_is_image_part(p) for p in content)):
        return tokenizer.encode(message_text(content, where))
    if media is None:
        raise ValueError(f"{where}.content has an image_url part, but this model has no vision tower (text only)")
    ids, text = [], []
    for i, part in enumerate(content):
        if _is_image_part(part):
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ValueError(f"{where}.content[{i}].image_url.url must be a string (a base64 data URL)")
            if text:
                ids += tokenizer.encode("".join(text))
                text = []
            ids += media(url, f"{where}.content[{i}]")
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        else:
            raise ValueError(f"{where}.content[{i}] must be {{'type': 'text', 'text': str}} or "
                             f"{{'type': 'image_url', 'image_url': {{'url': 'data:image/...;base64,...'}}}}")
    if text:
        ids += tokenizer.encode("".join(text))
    return ids


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                media=None) -> tuple[list[int], list[int]]:
    """messages → (token ids, the position after each message). Raises ValueError naming the bad field.
    media: called as media(url, where) for each image_url part of a non-assistant message; returns its ids."""
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
            ids += [OPEN, *enc(role), SEP, *content_ids(tokenizer, m["content"], where, media), CLOSE]
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

"""Engine outputs as OpenAI bodies: `CompletionRenderer` (text, echo, logprobs with character offsets, vLLM's
prompt_logprobs) and `ChatRenderer` (messages, reasoning, tool calls). Each gives the SSE chunks of a stream
(`opening`, `stream`) and the choices of a full body (`body`); k3.serve.serving drives them."""
from __future__ import annotations

from k3.serve.output_parser import OutputParser
from k3.serve.serving import Collected, now


class CompletionRenderer:
    """req: a CompletionRequest; prompts: token ids per prompt; prompt_texts: what echo returns per prompt."""

    def __init__(self, tokenizer, req, prompts: list[list[int]], prompt_texts: list[str], cid: str, model: str):
        self.tok, self.req, self.prompts, self.prompt_texts = tokenizer, req, prompts, prompt_texts
        self.cid, self.model, self.n = cid, model, req.n
        self.started: set[int] = set()
        self.decoders: dict[int, object] = {}  # per streamed choice: generated text per token, for offsets
        self.gen_chars: dict[int, int] = {}
        # a streamed token is sent at once, even while its text is held back, when its logprobs or id are asked for
        self.wants_tokens = req.logprobs is not None or req.return_token_ids
        self.plain = not (req.echo or req.logprobs is not None or req.return_token_ids or req.prompt_logprobs is not None)

    def header(self) -> dict:
        return {"id": self.cid, "object": "text_completion", "created": now(), "model": self.model}

    def opening(self, num_choices: int) -> list[dict]:
        return []

    # ---- logprobs ----------------------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def _top(self, lp, k: int) -> dict[str, float]:
        """The top k (as in the API: at most logprobs entries) plus the chosen token, keyed by text (vLLM's)."""
        top = {self._token(t): v for t, v in lp.top[:k]}
        top.setdefault(self._token(lp.token_id), lp.logprob)
        return top

    def _prompt_block(self, ids: list[int], lps: list | None) -> dict:
        """Logprobs of an echoed prompt: text offsets from 0, the first token's logprob None (nothing predicts it)."""
        k = self.req.logprobs
        toks, values, tops, offsets, pos = [], [], [], [], 0
        dec = self.tok.decode_stream(skip_special_tokens=False)
        for j, t in enumerate(ids):
            lp = lps[j] if lps is not None and j < len(lps) else None
            toks.append(self._token(t))
            values.append(lp.logprob if lp is not None else None)
            tops.append(self._top(lp, k) if lp is not None else None)
            offsets.append(pos)
            pos += len(dec.step(t))
        return {"tokens": toks, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _generated_block(self, c: int, lps: list, start: int) -> dict:
        """Logprobs of generated tokens; offsets count characters from `start` (the choice's echoed prompt)."""
        dec = self.decoders.setdefault(c, self.tok.decode_stream(skip_special_tokens=True))
        toks, values, tops, offsets = [], [], [], []
        for lp in lps:
            toks.append(self._token(lp.token_id))
            values.append(lp.logprob)
            tops.append(self._top(lp, self.req.logprobs))
            offsets.append(start + self.gen_chars.get(c, 0))
            self.gen_chars[c] = self.gen_chars.get(c, 0) + len(dec.step(lp.token_id))
        return {"tokens": toks, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _logprobs(self, c: int, first: bool, prompt_lps, lps, text_len: int | None = None) -> dict | None:
        if self.req.logprobs is None:
            return None
        p = c // self.n
        echo = self.req.echo and first
        start = len(self.prompt_texts[p]) if self.req.echo else 0
        block = self._generated_block(c, lps, start)
        if echo:
            head = self._prompt_block(self.prompts[p], prompt_lps)
            block = {key: head[key] + block[key] for key in block}
        if text_len is not None:  # a stop string cut the text: no offset past its end
            block["text_offset"] = [min(o, text_len) for o in block["text_offset"]]
        return block

    def _prompt_logprobs(self, ids: list[int], lps) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank, decoded_token}} (the prompt's
        own token and the top k), the first None."""
        k = self.req.prompt_logprobs
        if k is None:
            return None
        out: list = []
        for j, t in enumerate(ids):
            lp = lps[j] if lps is not None and j < len(lps) else None
            if lp is None:
                out.append(None)
                continue
            ranks = {tid: r + 1 for r, (tid, _) in enumerate(lp.top)}
            entry = {str(tid): {"logprob": v, "rank": r + 1, "decoded_token": self._token(tid)}
                     for r, (tid, v) in enumerate(lp.top[:k])}
            entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "rank": ranks.get(lp.token_id),
                                                "decoded_token": self._token(lp.token_id)})
            out.append(entry)
        return out

    # ---- chunks and bodies -----------------------------------------------------------------------------
    def stream(self, c: int, out) -> list[dict]:
        if self.plain:  # the common case, once per token per stream: text only
            if not (out.new_text or out.finished):
                return []
            return [{"id": self.cid, "object": "text_completion", "created": now(), "model": self.model, "choices": [
                {"index": c, "text": out.new_text, "logprobs": None,
                 "finish_reason": out.finish_reason if out.finished else None}]}]
        req, p = self.req, c // self.n
        first = c not in self.started
        prompt_lps = out.prompt_logprobs
        if not (out.new_text or out.finished or (first and (req.echo or prompt_lps is not None))
                or (self.wants_tokens and out.new_token_ids)):
            return []
        self.started.add(c)
        text = (self.prompt_texts[p] if req.echo and first else "") + out.new_text
        choice = {"index": c, "text": text, "logprobs": self._logprobs(c, first, prompt_lps, out.new_logprobs),
                  "finish_reason": out.finish_reason if out.finished else None}
        if first and req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(self.prompts[p], prompt_lps)
        if req.return_token_ids:
            choice["token_ids"] = list(out.new_token_ids)
        return [{**self.header(), "choices": [choice]}]

    def body(self, got: list[Collected]) -> dict:
        req, choices = self.req, []
        for c, g in enumerate(got):
            p, o = c // self.n, g.final
            text = (self.prompt_texts[p] if req.echo else "") + o.text
            choice = {"index": c, "text": text,
                      "logprobs": self._logprobs(c, True, g.prompt_logprobs, g.logprobs, len(text)),
                      "finish_reason": o.finish_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(self.prompts[p], g.prompt_logprobs)
            if req.return_token_ids:
                choice.update(token_ids=list(o.output_ids), prompt_token_ids=list(self.prompts[p]))
            choices.append(choice)
        return {**self.header(), "choices": choices}


class ChatRenderer:
    """req: a ChatRequest; thinking: whether the generation prompt opened thinking (the parser must know)."""

    def __init__(self, tokenizer, req, prompt: list[int], thinking: bool, cid: str, model: str):
        self.tok, self.req, self.prompt, self.thinking = tokenizer, req, prompt, thinking
        self.cid, self.model = cid, model
        self.parsers: dict[int, OutputParser] = {}

    def header(self) -> dict:
        return {"id": self.cid, "object": "chat.completion.chunk", "created": now(), "model": self.model}

    def _parser(self) -> OutputParser:
        return OutputParser(self.tok, self.req.tools, thinking=self.thinking)

    def _finish_reason(self, out, parser) -> str | None:
        if not out.finished:
            return None
        return "tool_calls" if out.finish_reason == "stop" and parser.has_tool_calls else out.finish_reason

    def _logprobs(self, lps) -> dict | None:
        if not self.req.logprobs:
            return None
        dec = self.tok.decode
        return {"content": [{"token": dec([lp.token_id]), "logprob": lp.logprob, "bytes": None,
                             "top_logprobs": [{"token": dec([t]), "logprob": v, "bytes": None} for t, v in lp.top]}
                            for lp in lps]}

    def opening(self, num_choices: int) -> list[dict]:
        return [{**self.header(), "choices": [{"index": c, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]}
                for c in range(num_choices)]

    def stream(self, c: int, out) -> list[dict]:
        parser = self.parsers.setdefault(c, self._parser())
        deltas = [parser.feed(out.new_token_ids)]
        if out.finished:
            deltas.append(parser.finish())
        deltas = [d.to_openai() for d in deltas if d] or [{}]
        chunks = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            # with token ids (or logprobs) on, every token is sent at once, even one that adds no text
            wants_tokens = self.req.return_token_ids or self.req.logprobs
            if not (delta or (last and out.finished) or (k == 0 and wants_tokens and out.new_token_ids)):
                continue
            choice = {"index": c, "delta": delta, "logprobs": self._logprobs(out.new_logprobs) if k == 0 else None,
                      "finish_reason": self._finish_reason(out, parser) if last else None}
            if self.req.return_token_ids:
                choice["token_ids"] = list(out.new_token_ids) if k == 0 else []
            chunks.append({**self.header(), "choices": [choice]})
        return chunks

    def body(self, got: list[Collected]) -> dict:
        choices = []
        for c, g in enumerate(got):
            o, parser = g.final, self._parser()
            parser.feed(o.output_ids)
            parser.finish()
            message = parser.message()
            message["reasoning_content"] = message["reasoning_content"] or None
            choice = {"index": c, "message": message, "logprobs": self._logprobs(g.logprobs),
                      "finish_reason": self._finish_reason(o, parser)}
            if self.req.return_token_ids:
                choice.update(token_ids=list(o.output_ids), prompt_token_ids=list(self.prompt))
            choices.append(choice)
        return {**self.header(), "object": "chat.completion", "choices": choices}

"""Host cost of parsing generated ids into reasoning, content and tool calls (k3.serve.output_parser), per token.

A streaming server feeds each request's new ids to its OutputParser once per engine step, so this cost is paid
per token on the host, on top of the incremental detokenising every server does anyway. Rows: the parser fed one
id at a time (streaming) and all at once (a plain response); the peer/floor is the bare incremental decoder
(`tokenizer.decode_stream`) over the same ids, which any text-streaming server runs. One assistant turn: a think
section, a response, two tool calls (string, number, object arguments).
Run: OMP_NUM_THREADS=1 python benchmarks/bench_output_parser.py [--repeats 20]
"""
import argparse
import statistics
import time

from k3.data import load_tokenizer
from k3.serve.output_parser import OutputParser

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "k": {"type": "number"}, "filters": {"type": "object"}}}}}]


def assistant_ids(tok) -> list[int]:
    reasoning = " ".join(f"Step {i}: weigh the evidence about the question and what the user wants." for i in range(40))
    content = " ".join(f"Sentence {i} of the answer, in plain words." for i in range(30))
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "search", "arguments": {
        "query": "kimi k3 tokenizer split pattern " * 4, "k": 10 + i, "filters": {"year": 2026, "lang": ["en", "zh"]}}}}
        for i in range(2)]
    user = [{"role": "user", "content": "q"}]
    prompt = tok.apply_chat_template(user, tools=TOOLS, add_generation_prompt=True)
    full = tok.apply_chat_template(user + [{"role": "assistant", "reasoning_content": reasoning, "content": content,
                                            "tool_calls": calls}], tools=TOOLS)
    return full[len(prompt):]


def best_us_per_token(fn, n_tokens: int, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) / n_tokens * 1e6, statistics.median(times) / n_tokens * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    tok = load_tokenizer()
    ids = assistant_ids(tok)

    def streaming():
        p = OutputParser(tok, TOOLS, call_id=lambda n: f"call_{n}")
        for t in ids:
            p.feed([t])
        p.finish()
        return p.message()

    def one_shot():
        p = OutputParser(tok, TOOLS, call_id=lambda n: f"call_{n}")
        p.feed(ids)
        p.finish()
        return p.message()

    def bare_decode():
        d = tok.decode_stream(skip_special_tokens=True)
        return "".join(d.step(t) for t in ids)

    assert streaming() == one_shot() and len(one_shot()["tool_calls"]) == 2
    print(f"{len(ids)} generated ids (bundled BPE); microseconds per token, best / median of {a.repeats}")
    print("| what | µs/token (best) | µs/token (median) |\n|---|---|---|")
    for name, fn in (("OutputParser, one id per feed (streaming)", streaming),
                     ("OutputParser, all ids in one feed", one_shot),
                     ("bare decode_stream (floor: any streaming server)", bare_decode)):
        best, med = best_us_per_token(fn, len(ids), a.repeats)
        print(f"| {name} | {best:.1f} | {med:.1f} |")


if __name__ == "__main__":
    main()

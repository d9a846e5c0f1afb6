"""How well a model fine-tuned on the calculator task (k3.data.calculator_task) really answers: N fresh problems,
each played through a live `k3 serve` with the official openai SDK and the real tool loop (the model's calls are
executed and their results sent back), scored by
k3.data.calculator_task.score: format ok (one typed `calculator` call, then an answer in `content`, think closed
both times), arguments ok (the question's a, op, b), answer ok (its last integer is the true result), and whether
the answer is the tool's result (copied right, whatever was asked).
Run: python benchmarks/eval_calculator.py --model runs/calc/model [--n 100] [--show 2] [--json out.json]
     (--base-url URL uses a server that is already running instead of starting `k3 serve`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from k3.data.calculator_task import QUESTIONS, problem, run_agent, score
from k3.serve.local_server import serve_process

EVAL_SEED = 20261201  # not the dataset's seed (0): the problems are fresh


def token_loss(model_dir: str, n: int, seed: int) -> dict[str, float]:
    """Mean loss (nats) of the model on the assistant's tokens of `n` fresh one-question conversations, split into
    number tokens (a digit in them: what must be copied) and the rest (the format)."""
    import torch
    from pathlib import Path

    from k3 import K3ForCausalLM
    from k3.data import Tokenizer
    from k3.data.calculator_task import conversation
    from k3.data.conversations import render_conversation

    model = K3ForCausalLM.from_pretrained(model_dir).eval()
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    rng = random.Random(seed + 1)
    sums = {"number": [0.0, 0], "format": [0.0, 0]}
    with torch.no_grad():
        for _ in range(n):
            ids, learn = render_conversation(tok, conversation(rng))
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
            for i in range(1, len(ids)):
                if learn[i]:
                    kind = "number" if any(c.isdigit() for c in tok.decode([ids[i]])) else "format"
                    sums[kind][0] += float(nll[i - 1])
                    sums[kind][1] += 1
    out = {f"{k}_nats": v[0] / v[1] for k, v in sums.items()}
    out["number_share_of_loss"] = sums["number"][0] / (sums["number"][0] + sums["format"][0])
    out["number_share_of_tokens"] = sums["number"][1] / (sums["number"][1] + sums["format"][1])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model directory to serve with `k3 serve`")
    ap.add_argument("--base-url", help="a running server's /v1 URL instead")
    ap.add_argument("--n", type=int, default=100, help="problems (default: 100; 0: only --token-loss)")
    ap.add_argument("--seed", type=int, default=EVAL_SEED)
    ap.add_argument("--concurrency", type=int, default=16, help="problems in flight at once (default: 16)")
    ap.add_argument("--show", type=int, default=1, help="transcripts to print (default: 1)")
    ap.add_argument("--json", help="write the per-problem results and totals here")
    ap.add_argument("--token-loss", type=int, default=0, metavar="N",
                    help="also the loss on number vs format tokens over N conversations (needs --model)")
    a = ap.parse_args(argv)
    if not (a.model or a.base_url):
        ap.error("give --model DIR or --base-url URL")
    if a.token_loss:
        if not a.model:
            ap.error("--token-loss needs --model")
        losses = token_loss(a.model, a.token_loss, a.seed)
        print(f"loss over {a.token_loss} conversations: number tokens {losses['number_nats']:.3f} nats, format "
              f"tokens {losses['format_nats']:.3f}; numbers are {100 * losses['number_share_of_tokens']:.0f}% of "
              f"the learned tokens and {100 * losses['number_share_of_loss']:.0f}% of the loss", flush=True)
    rng = random.Random(a.seed)
    problems = [problem(rng) for _ in range(a.n)]
    questions = [rng.choice(QUESTIONS).format(a=x, op=op, b=y) for x, op, y in problems]
    if a.n == 0:  # the token loss alone (no server, no openai: runs where only torch is)
        return 0
    import openai

    with contextlib.ExitStack() as stack:
        if a.base_url:
            base_url, name = a.base_url, None
        else:  # `k3 serve` as a user starts it
            t0 = time.monotonic()
            log = stack.enter_context(tempfile.NamedTemporaryFile(suffix=".log"))
            url = stack.enter_context(serve_process(a.model, log.name, "--served-model-name", "calc"))
            print(f"k3 serve --model {a.model}: up in {time.monotonic() - t0:.1f} s", flush=True)
            base_url, name = f"{url}/v1", "calc"
        client = openai.OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"), timeout=600)
        name = name or client.models.list().data[0].id
        t0 = time.monotonic()
        with ThreadPoolExecutor(a.concurrency) as pool:
            transcripts = list(pool.map(
                lambda q: run_agent(client, name, q, max_rounds=2, temperature=0, max_tokens=200), questions))
        wall = time.monotonic() - t0
    results = [score(q, t) for q, t in zip(questions, transcripts)]
    totals = {k: 100.0 * sum(r[k] for r in results) / len(results) for k in results[0]}
    for q, t in list(zip(questions, transcripts))[:a.show]:
        print(f"--- {q}")
        for m in t:
            print(json.dumps(m, ensure_ascii=False))
    print(f"{a.n} fresh problems (seed {a.seed}) in {wall:.1f} s through the tool loop:")
    print(" | ".join(f"{k.replace('_', ' ')} {v:.0f}%" for k, v in totals.items()))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({"totals": totals, "wall_s": wall, "problems": [
                {"question": q, **r, "transcript": t} for q, r, t in zip(questions, results, transcripts)]}, fh,
                indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

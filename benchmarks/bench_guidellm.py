r"""guidellm (vLLM's load generator, unmodified) against `k3 serve` at concurrency 1, 8 and 32 on the CPU: synthetic
prompts of 64 tokens, 16 output tokens, /v1/completions streamed, with an API key; 2 x c requests per level
(8 at least). Prints one row per level from guidellm's JSON report and exits 1 if any request failed.

guidellm lives in its own venv (its pins clash with the dev extra's):

    python -m venv .venv-guidellm && .venv-guidellm/bin/pip install guidellm
    python benchmarks/bench_guidellm.py --guidellm .venv-guidellm/bin/guidellm [--model runs/tiny/model]

Without --model a random `tiny` K3 is saved to a temporary directory (fp32) and served."""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from k3.serve.local_server import serve_process


def save_random_tiny(directory: Path) -> None:
    from k3 import K3Config, K3ForCausalLM
    from k3.data import Tokenizer

    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.reset_parameters(seed=0)
    model.save_pretrained(directory, dtype=None)
    Tokenizer.from_file().save_pretrained(directory)


def row(report: dict) -> dict:
    m = report["benchmarks"][0]["metrics"]

    def ok(name: str, stat: str = "median") -> float:  # over the successful requests
        return m[name]["successful"][stat]

    totals = m["request_totals"]
    return {"ok": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
            "req_s": m["requests_per_second"]["successful"]["mean"],
            "out_tok_s": m["output_tokens_per_second"]["total"]["mean"],
            "ttft_ms": ok("time_to_first_token_ms"), "itl_ms": ok("inter_token_latency_ms"),
            "tpot_ms": ok("time_per_output_token_ms"), "e2e_s": ok("request_latency")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--guidellm", default="guidellm", help="the guidellm executable (its own venv)")
    p.add_argument("--model", type=Path, default=None, help="model directory (default: a random tiny one)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    a = p.parse_args()
    key, name = "bench-guidellm", "k3-tiny"
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            model = Path(tmp) / "model"
            save_random_tiny(model)
        rows = []
        with serve_process(model, Path(tmp) / "serve.log", "--served-model-name", name, "--memory-gib", "0.5",
                           "--block-size", "64", "--match-unit", "16", env={"K3_API_KEY": key}) as url:
            for c in (int(x) for x in a.concurrency.split(",")):
                out = Path(tmp) / f"c{c}.json"
                subprocess.run([a.guidellm, "run", "--backend", f"kind=openai_http,target={url},model={name},"
                                f"api_key={key},request_format=/v1/completions",
                                "--profile", f"kind=concurrent,streams={c}",
                                "--constraint", f"kind=max_requests,count={max(8, 2 * c)}",
                                "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
                                "--tokenizer", f"kind=huggingface_auto,model={model}",
                                "--output", f"kind=json,path={out}", "--disable-console"], check=True)
                rows.append({"concurrency": c, **row(json.loads(out.read_text()))})
                print(json.dumps(rows[-1]), flush=True)
    print("| c | ok | errored | incomplete | req/s | out tok/s | TTFT ms (median) | ITL ms | TPOT ms | e2e s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['ok']} | {r['errored']} | {r['incomplete']} | {r['req_s']:.2f} | "
              f"{r['out_tok_s']:.1f} | {r['ttft_ms']:.0f} | {r['itl_ms']:.0f} | {r['tpot_ms']:.0f} | "
              f"{r['e2e_s']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 1 if any(r["errored"] or r["incomplete"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

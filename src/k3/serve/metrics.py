"""Serving metrics in Prometheus' text format, named like vLLM's where one exists (no client library needed)."""
from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = list(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip(self.buckets + ["+Inf"], self.counts):
            cum += c
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {cum}')
        out += [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {self.count}"]
        return out


class Metrics:
    """Counters and histograms the engine updates; `render(engine)` adds the live gauges."""

    def __init__(self, model_name: str = "k3"):
        self.model_name = model_name
        self.lock = threading.Lock()
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}

    def on_token(self, first: bool, latency: float) -> None:
        with self.lock:
            (self.ttft if first else self.itl).observe(latency)
            self.generation_tokens += 1

    def on_finish(self, reason: str, e2e: float, prompt_tokens: int) -> None:
        with self.lock:
            self.e2e.observe(e2e)
            self.prompt_tokens += prompt_tokens
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self, engine) -> str:
        lab = f'model_name="{self.model_name}"'
        pool, sched = engine.pool, engine.scheduler
        st = pool.stats
        lines = []

        def metric(name, kind, value, help_):
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{lab}}} {value}"])

        metric("vllm:num_requests_running", "gauge", len(sched.running), "Requests in the running batch.")
        metric("vllm:num_requests_waiting", "gauge", len(sched.waiting), "Requests waiting (incl. swapped).")
        metric("vllm:kv_cache_usage_perc", "gauge", pool.num_used_blocks / pool.capacity.num_blocks,
               "Fraction of MLA latent blocks in use (1 = full).")
        metric("k3:kda_state_slots_used", "gauge", pool.num_used_slots, "KDA state slots held by sequences.")
        metric("k3:kda_checkpoints", "gauge", len(pool.checkpoints), "KDA state checkpoints cached.")
        metric("vllm:prefix_cache_queries_total", "counter", st["query_tokens"], "Prompt tokens looked up.")
        metric("vllm:prefix_cache_hits_total", "counter", st["hit_tokens"], "Prompt tokens restored from cache.")
        metric("vllm:num_preemptions_total", "counter", sched.num_preemptions, "Preemptions (swap to host).")
        with self.lock:
            metric("vllm:prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of finished requests.")
            metric("vllm:generation_tokens_total", "counter", self.generation_tokens, "Generated tokens.")
            lines += ["# HELP vllm:request_success_total Finished requests by reason.",
                      "# TYPE vllm:request_success_total counter"]
            for reason, n in sorted(self.finished.items()):
                lines.append(f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} {n}')
            for name, h, help_ in (("vllm:time_to_first_token_seconds", self.ttft, "Time to first token."),
                                   ("vllm:inter_token_latency_seconds", self.itl, "Time between tokens."),
                                   ("vllm:e2e_request_latency_seconds", self.e2e, "Request latency.")):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + h.lines(name, lab)
        return "\n".join(lines) + "\n"

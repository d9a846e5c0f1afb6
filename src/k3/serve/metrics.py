"""Serving metrics with vLLM's names, types and buckets (so vLLM's dashboards and alerts work unchanged), rendered
by prometheus_client in Prometheus' text format or, when the scraper asks for it, OpenMetrics. The engine thread
updates plain counters and histograms under a lock; a collector turns them into metric families at scrape time,
adding the live gauges (running, waiting, cache usage). Every series carries `model_name` (the served name)."""
from __future__ import annotations

import bisect
import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, … up to max_value (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Histogram:
    def __init__(self, buckets):
        self.buckets = [float(b) for b in buckets]
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def family(self, name: str, help_: str, labels: dict) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, help_, labels=list(labels))
        cum, rows = 0, []
        for le, c in zip(self.buckets + [float("inf")], self.counts):
            cum += c
            rows.append(("+Inf" if le == float("inf") else repr(le), cum))
        fam.add_metric(list(labels.values()), rows, self.sum)
        return fam


# name → (buckets, help); the request-level histograms vLLM exports
_TIMES = {
    "vllm:time_to_first_token_seconds": (TTFT_BUCKETS, "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": (TOKEN_LATENCY_BUCKETS, "Histogram of inter-token latency in seconds."),
    "vllm:time_per_output_token_seconds": (TOKEN_LATENCY_BUCKETS, "Histogram of time per output token in seconds."),
    "vllm:e2e_request_latency_seconds": (REQUEST_LATENCY_BUCKETS, "Histogram of e2e request latency in seconds."),
    "vllm:request_queue_time_seconds": (REQUEST_LATENCY_BUCKETS,
                                        "Histogram of time spent in WAITING phase for request."),
    "vllm:request_inference_time_seconds": (REQUEST_LATENCY_BUCKETS,
                                            "Histogram of time spent in RUNNING phase for request."),
    "vllm:request_prefill_time_seconds": (REQUEST_LATENCY_BUCKETS,
                                          "Histogram of time spent in PREFILL phase for request."),
    "vllm:request_decode_time_seconds": (REQUEST_LATENCY_BUCKETS,
                                         "Histogram of time spent in DECODE phase for request."),
    "vllm:time_per_prefill_token_request_seconds": (PREFILL_TOKEN_BUCKETS,
                                                    "Time spent per token during prefill phase in seconds."),
    "vllm:iteration_tokens_total": (ITERATION_TOKEN_BUCKETS, "Histogram of number of tokens per engine_step."),
    "vllm:request_params_n": (N_BUCKETS, "Histogram of the n request parameter."),
}
_COUNTS = {  # token-count histograms, bucketed 1-2-5 up to max_model_len
    "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
    "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "vllm:request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
}


class Metrics:
    """What the engine (and the HTTP layer) records; `render(engine, accept)` is the /metrics body."""

    def __init__(self, model_name: str = "k3", max_model_len: int = 1 << 20):
        self.model_name = model_name
        self.lock = threading.Lock()
        self.hist = {name: Histogram(b) for name, (b, _) in _TIMES.items()}
        self.set_max_model_len(max_model_len)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)

    def describe_model(self, model_name: str, max_model_len: int) -> None:
        """The served model's name and length limit (the label and the length histograms' buckets)."""
        self.model_name = model_name
        self.set_max_model_len(max_model_len)

    def set_max_model_len(self, max_model_len: int) -> None:
        buckets = buckets_1_2_5(max_model_len)
        with self.lock:
            for name in _COUNTS:
                self.hist[name] = Histogram(buckets)

    # ---- recording ---------------------------------------------------------------------------------------
    def on_step(self, seqs, lens, now: float) -> None:
        """An engine step over `seqs` computing `lens` tokens each: iteration tokens; when each was first run."""
        with self.lock:
            self.hist["vllm:iteration_tokens_total"].observe(sum(lens))
        for s in seqs:
            if getattr(s, "metrics_scheduled", None) is None:
                s.metrics_scheduled = now  # leaves the waiting queue: queue time ends, prefill starts

    def on_token(self, first: bool, latency: float) -> None:
        with self.lock:
            self.hist["vllm:time_to_first_token_seconds" if first else "vllm:inter_token_latency_seconds"].observe(
                latency)
            self.generation_tokens += 1

    def on_request(self, n: int, max_tokens: int) -> None:
        """A request's parameters, once per request (the HTTP layer's: n choices of one prompt)."""
        with self.lock:
            self.hist["vllm:request_params_n"].observe(n)
            self.hist["vllm:request_params_max_tokens"].observe(max_tokens)
            self.hist["vllm:request_max_num_generation_tokens"].observe(max_tokens)

    def on_finish(self, seq, reason: str, now: float) -> None:
        """A sequence finished (stop or length): its phases, from arrival to its last token."""
        scheduled = getattr(seq, "metrics_scheduled", None) or seq.arrival
        first = seq.first_token_time or now
        generated = len(seq.tokens) - seq.prompt_len
        with self.lock:
            h = self.hist
            h["vllm:e2e_request_latency_seconds"].observe(now - seq.arrival)
            h["vllm:request_queue_time_seconds"].observe(scheduled - seq.arrival)
            h["vllm:request_prefill_time_seconds"].observe(first - scheduled)
            h["vllm:request_decode_time_seconds"].observe(now - first)
            h["vllm:request_inference_time_seconds"].observe(now - scheduled)
            if seq.prompt_len:
                h["vllm:time_per_prefill_token_request_seconds"].observe((first - scheduled) / seq.prompt_len)
            if generated > 1:
                h["vllm:time_per_output_token_seconds"].observe((now - first) / (generated - 1))
            h["vllm:request_prompt_tokens"].observe(seq.prompt_len)
            h["vllm:request_generation_tokens"].observe(generated)
            self.prompt_tokens += seq.prompt_len
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def totals(self, names) -> dict[str, tuple[float, int]]:
        """(sum, count) of each named histogram, read together."""
        with self.lock:
            return {name: (self.hist[name].sum, self.hist[name].count) for name in names}

    def on_abort(self, count: int = 1) -> None:
        """Requests cancelled before they finished (client gone, or an error in a sibling choice)."""
        with self.lock:
            self.finished["abort"] = self.finished.get("abort", 0) + count

    # ---- exposition ------------------------------------------------------------------------------------------
    def families(self, engine) -> list:
        lab = {"model_name": self.model_name}
        names, values = list(lab), list(lab.values())
        pool, sched, cfg = engine.pool, engine.scheduler, engine.config
        st = pool.stats
        out = []

        def gauge(name, help_, value):
            fam = GaugeMetricFamily(name, help_, labels=names)
            fam.add_metric(values, value)
            out.append(fam)

        def counter(name, help_, value):  # name without _total (the exposition adds it)
            fam = CounterMetricFamily(name, help_, labels=names)
            fam.add_metric(values, value)
            out.append(fam)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(sched.running))
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed (incl. swapped).",
              len(sched.waiting))
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage (MLA latent blocks). 1 means 100 percent usage.",
              pool.num_used_blocks / pool.capacity.num_blocks)
        gauge("k3:kda_state_slots_used", "KDA state slots held by sequences.", pool.num_used_slots)
        gauge("k3:kda_checkpoints", "KDA state checkpoints cached.", len(pool.checkpoints))
        counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                st["query_tokens"])
        counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                st["hit_tokens"])
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", sched.num_preemptions)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=names + ["block_size", "num_gpu_blocks", "enable_prefix_caching",
                                                 "num_kda_state_slots", "max_model_len"])
        info.add_metric(values + [str(pool.capacity.block_size), str(pool.capacity.num_blocks),
                                  str(bool(cfg.prefix_caching)), str(pool.capacity.num_slots),
                                  str(engine.max_model_len)], 1)
        out.append(info)
        with self.lock:
            counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens)
            counter("vllm:generation_tokens", "Number of generation tokens processed.", self.generation_tokens)
            success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                          labels=names + ["finished_reason"])
            for reason, n in sorted(self.finished.items()):
                success.add_metric(values + [reason], n)
            out.append(success)
            helps = {**{k: v[1] for k, v in _TIMES.items()}, **_COUNTS}
            out += [h.family(name, helps[name], lab) for name, h in self.hist.items()]
        return out

    def render(self, engine, accept: str | None = None) -> tuple[bytes, str]:
        """(body, content type): OpenMetrics when `accept` (the request's Accept header) asks for it, else
        Prometheus' text format 0.0.4."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(self.families(engine)))
        if "application/openmetrics-text" in (accept or ""):
            # allow-utf-8 keeps the colons of vLLM's names in the samples (the default escaping turns them into
            # underscores there but not in the TYPE lines, which the OpenMetrics parser then misreads)
            escaping = getattr(openmetrics, "ALLOWUTF8", None)  # older clients neither escape nor take the option
            body = (openmetrics.generate_latest(registry, escaping=escaping) if escaping
                    else openmetrics.generate_latest(registry))
            return body, openmetrics.CONTENT_TYPE_LATEST
        return generate_latest(registry), PROMETHEUS_TEXT


class _Snapshot:
    """A prometheus_client collector over families built at scrape time."""

    def __init__(self, families):
        self._families = families

    def collect(self):
        return iter(self._families)


class StepLog:
    """A trace of the engine's steps, for benchmarks (`LLMEngine.step_log`): each launched step (time, rows, tokens,
    prompt rows) and each EngineThread iteration (start, step returned, outputs handed to the server; the time its
    new requests took to queue before it). `summary` says where a run's time went:
    taking requests in, stepping, handing outputs over, or idle (waiting for requests).
    metrics: the engine's Metrics, whose latency histograms give the summary the engine's own view of each
    request's phases over the trace (`PHASES`: from its arrival at the engine, so a client's TTFT less the
    engine's is what HTTP, the pipe and the client took)."""

    PHASES = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
              "prefill": "vllm:request_prefill_time_seconds"}

    def __init__(self, metrics: Metrics | None = None):
        self.launches: list[tuple[float, int, int, int, bool]] = []
        self.iterations: list[tuple[float, float, float, float]] = []
        self.metrics = metrics
        self.marks = self._phase_sums()

    def _phase_sums(self) -> dict[str, tuple[float, int]]:
        if self.metrics is None:
            return {}
        totals = self.metrics.totals(self.PHASES.values())
        return {k: totals[name] for k, name in self.PHASES.items()}

    def launch(self, now: float, seqs: list, lens: list[int], overlapped: bool = False) -> None:
        """overlapped: launched while the previous step was still on the device (async output)."""
        self.launches.append((now, len(seqs), sum(lens), sum(1 for s in seqs if s.in_prefill), overlapped))

    def iteration(self, start: float, stepped: float, emitted: float, intake: float = 0.0) -> None:
        self.iterations.append((start, stepped, emitted, intake))

    def _within(self, lo: float, hi: float) -> list[tuple[float, float, float, float]]:
        """The iterations cut to the window [lo, hi] (the timed run, by the client's clock): a warm-up's last
        iteration still emitting as the trace began, or the run's last one still handing over after the client had
        its final token, count only their parts within it, so the phases cannot add up past the run's wall."""
        def clip(t):
            return min(max(t, lo), hi)
        return [(clip(a), clip(b), clip(c), clip(a) - clip(a - intake)) for a, b, c, intake in self.iterations]

    def summary(self, wall: float, start: float | None = None) -> dict:
        """Seconds taking requests in / stepping / emitting / idle over `wall` (the window from `start` on, where
        given: the iterations cut to it), and per kind of launched step (decode-only, or with prompt rows): count,
        mean rows and tokens, the mean time to the next launch (the step's period, which includes whatever the host
        did in between) and how many launched while the previous step was still on the device (`overlapped`; the
        others waited for its read-back). `slowest`: the five longest periods (a capture shows here)."""
        its = self.iterations if start is None else self._within(start, start + wall)
        step = sum(it[1] - it[0] for it in its)
        emit = sum(it[2] - it[1] for it in its)
        intake = sum(it[3] for it in its)
        out = {"iterations": len(self.iterations), "intake_s": intake, "step_s": step, "emit_s": emit,
               "idle_s": wall - intake - step - emit}
        periods = [(b[0] - a[0], a) for a, b in zip(self.launches, self.launches[1:])]
        for kind, keep in (("decode", lambda p: p == 0), ("prompt", lambda p: p > 0)):
            ps = [(dt, a) for dt, a in periods if keep(a[3])]
            n = len(ps) or 1
            out[kind] = {"steps": len(ps), "rows": sum(a[1] for _, a in ps) / n,
                         "tokens": sum(a[2] for _, a in ps) / n, "period_ms": 1e3 * sum(dt for dt, _ in ps) / n,
                         "overlapped": sum(a[4] for _, a in ps)}
        out["slowest"] = [{"ms": 1e3 * dt, "rows": a[1], "tokens": a[2], "prompt_rows": a[3]}
                          for dt, a in sorted(periods, key=lambda x: x[0], reverse=True)[:5]]
        now = self._phase_sums()
        out["engine_ms"] = {k: 1e3 * (now[k][0] - s0) / (now[k][1] - n0) if now[k][1] > n0 else float("nan")
                            for k, (s0, n0) in self.marks.items()}  # mean per request, over the trace
        return out

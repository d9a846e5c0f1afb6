"""Expert load balancing for the MoE router bias (SPEC §3.6).

Quantile Balancing sets each expert's selection bias to the exact coordinate minimiser: the value that
leaves exactly `q = m k / n` tokens of the batch above that token's routing cutoff. It comes in an exact
form (sort the margins) and a scalable form (per-expert integer histograms, one all-reduce per step).
The DeepSeek-V3 sign rule is kept as a baseline. `ExpertBalancer` drives every MoE layer of a model.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

__all__ = [
    "route_topk",
    "routing_margins",
    "quantile_bias",
    "QuantileHistogram",
    "sign_bias_update",
    "max_violation",
    "expert_load",
    "ExpertBalancer",
]


def _check_scores(scores: Tensor, bias: Tensor, k: int) -> None:
    if not isinstance(scores, Tensor) or scores.dim() != 2:
        raise ValueError(f"scores must be a 2-D tensor [tokens, experts], got {getattr(scores, 'shape', type(scores))}")
    if not isinstance(bias, Tensor) or bias.shape != (scores.shape[1],):
        raise ValueError(
            f"bias must be a 1-D tensor [experts={scores.shape[1]}], got {getattr(bias, 'shape', type(bias))}"
        )
    if not isinstance(k, int) or not 1 <= k < scores.shape[1]:
        raise ValueError(f"k must be an int in [1, num_experts - 1] = [1, {scores.shape[1] - 1}], got {k!r}")


def _check_mask(mask: Tensor | None, m: int) -> None:
    if mask is not None and (mask.shape != (m,) or mask.dtype != torch.bool):
        raise ValueError(f"mask must be a bool tensor [tokens={m}], got {mask.dtype} {tuple(mask.shape)}")


def route_topk(scores: Tensor, bias: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Route each token to the top-k of `scores + bias` and return its cutoff.

    scores: [m, n] router scores; bias: [n]. Returns `topk_idx: [m, k]` (long) and `cutoff: [m]`, the
    (k+1)-th largest biased value of each token (alpha_i in SPEC §3.6).
    """
    _check_scores(scores, bias, k)
    biased = scores + bias.to(scores.dtype)
    values, idx = biased.topk(k + 1, dim=1)
    return idx[:, :k], values[:, k]


def routing_margins(scores: Tensor, bias: Tensor, k: int) -> Tensor:
    """Margins `r_ij = alpha_i - s_ij`: expert j takes token i iff `b_j > r_ij`.

    scores: [m, n]; bias: [n]. Returns [m, n] in the dtype of `scores + bias`.
    """
    _, cutoff = route_topk(scores, bias, k)
    return cutoff[:, None] - scores


def _target_count(m: int | float, k: int, n: int) -> float:
    return float(m) * k / n


def quantile_bias(scores: Tensor, bias: Tensor, k: int, mask: Tensor | None = None, centre: bool = True) -> Tensor:
    """Exact Quantile Balancing update.

    scores: [m, n] sigmoid router scores; bias: [n] the bias the batch was routed with; mask: [m] bool,
    True = real token (padding is excluded). For each expert the new bias is placed midway between the
    q-th and (q+1)-th smallest margins (q = m k / n, rounded to the nearest integer count), so exactly q
    tokens have `r_ij < b_j`. With `centre` the mean over experts is subtracted (routing is invariant to
    a common shift). Returns [n] in the dtype of `bias`; the input bias is returned unchanged if no token
    is left after masking.
    """
    _check_scores(scores, bias, k)
    _check_mask(mask, scores.shape[0])
    # float64: margins of near-equal scores must keep their order so the count is exact.
    margins = routing_margins(scores.double(), bias.double(), k)
    if mask is not None:
        margins = margins[mask.to(margins.device)]
    m, n = margins.shape
    if m == 0:
        return bias.clone()
    ordered, _ = margins.sort(dim=0)
    # Sentinels one unit outside the data so q = 0 or q = m still yields a finite bias.
    padded = torch.cat([ordered[:1] - 1.0, ordered, ordered[-1:] + 1.0], dim=0)
    # Rank position q + 0.5 (1-based) in `ordered` is index q + 0.5 in `padded`: the midpoint between
    # the q-th and (q+1)-th margins, which leaves round(q) margins below it.
    pos = _target_count(m, k, n) + 0.5
    lo = int(pos)
    frac = pos - lo
    lo = min(lo, m + 1)
    hi = min(lo + 1, m + 1)
    new = padded[lo] * (1.0 - frac) + padded[hi] * frac
    if centre:
        new = new - new.mean()
    return new.to(dtype=bias.dtype, device=bias.device)


class QuantileHistogram:
    """Histogram estimate of the Quantile Balancing bias, accumulated over micro-batches and ranks.

    Per expert, margins are counted in `bins` uniform bins over `[min(b) - 1, max(b) + 1]` (which holds
    every margin, since sigmoid scores lie in (0, 1)); the range is fixed by the first `observe` after a
    `reset`. Counts are int64 so summing them over ranks is exact.
    """

    def __init__(self, num_experts: int, k: int, bins: int = 1000):
        if not isinstance(num_experts, int) or num_experts < 2:
            raise ValueError(f"num_experts must be an int >= 2, got {num_experts!r}")
        if not isinstance(k, int) or not 1 <= k < num_experts:
            raise ValueError(f"k must be an int in [1, {num_experts - 1}], got {k!r}")
        if not isinstance(bins, int) or bins < 1:
            raise ValueError(f"bins must be a positive int, got {bins!r}")
        self.num_experts = num_experts
        self.k = k
        self.bins = bins
        self.reset()

    def reset(self) -> None:
        """Forget all counts and the range (call once per optimizer step, after `solve`)."""
        self.hist: Tensor | None = None  # [n, bins] int64
        self.count: Tensor | None = None  # [1] int64, tokens seen
        self.lo: float | None = None
        self.hi: float | None = None

    @property
    def bin_width(self) -> float:
        if self.lo is None:
            raise RuntimeError("QuantileHistogram has no range yet: call observe() first")
        return (self.hi - self.lo) / self.bins

    def observe(self, scores: Tensor, bias: Tensor, mask: Tensor | None = None) -> None:
        """Add one micro-batch. scores: [m, n]; bias: [n] (the bias it was routed with); mask: [m] bool."""
        _check_scores(scores, bias, self.k)
        _check_mask(mask, scores.shape[0])
        if scores.shape[1] != self.num_experts:
            raise ValueError(f"scores has {scores.shape[1]} experts, histogram was built for {self.num_experts}")
        if self.lo is None:
            self.lo = float(bias.min()) - 1.0
            self.hi = float(bias.max()) + 1.0
            self.hist = torch.zeros(self.num_experts, self.bins, dtype=torch.int64, device=scores.device)
            self.count = torch.zeros(1, dtype=torch.int64, device=scores.device)
        margins = routing_margins(scores.double(), bias.double(), self.k)
        if mask is not None:
            margins = margins[mask.to(margins.device)]
        n = self.num_experts
        # Clamp: margins lie inside the range in exact arithmetic; this only guards rounding at the edges.
        idx = ((margins - self.lo) / self.bin_width).floor().long().clamp_(0, self.bins - 1)
        flat = idx + torch.arange(n, device=idx.device) * self.bins
        self.hist += torch.bincount(flat.reshape(-1), minlength=n * self.bins).view(n, self.bins)
        self.count += margins.shape[0]

    def pack(self) -> Tensor:
        """Counts as one int64 tensor `[n * bins + 1]`: histogram then token count."""
        if self.hist is None:
            raise RuntimeError("QuantileHistogram is empty: call observe() first")
        return torch.cat([self.hist.reshape(-1), self.count])

    def unpack(self, packed: Tensor) -> None:
        """Inverse of `pack` (after a reduction over ranks)."""
        n_hist = self.num_experts * self.bins
        if packed.shape != (n_hist + 1,):
            raise ValueError(f"packed counts must have shape [{n_hist + 1}], got {tuple(packed.shape)}")
        self.hist = packed[:n_hist].reshape(self.num_experts, self.bins).to(torch.int64)
        self.count = packed[n_hist:].to(torch.int64)

    def all_reduce(self, fn: Callable[[Tensor], Tensor | None]) -> None:
        """Apply a reduction (e.g. an in-place SUM all-reduce over data-parallel ranks) to the counts.

        `fn` receives one int64 tensor; it may modify it in place (returning None) or return a new one.
        """
        packed = self.pack()
        out = fn(packed)
        self.unpack(packed if out is None else out)

    def solve(self, centre: bool = True) -> Tensor:
        """New bias from the accumulated counts: invert each expert's CDF at q = count k / n.

        Linear interpolation inside the bin that crosses q. Returns [n] float32 (centred if `centre`).
        """
        if self.hist is None:
            raise RuntimeError("QuantileHistogram is empty: call observe() first")
        hist = self.hist.double()
        total = float(self.count.item())
        target = _target_count(total, self.k, self.num_experts)
        cdf = hist.cumsum(dim=1)  # [n, bins]: margins in bins 0..b
        # First bin whose cumulative count reaches the target.
        crossing = (cdf < target).sum(dim=1).clamp_(max=self.bins - 1)  # [n]
        below = torch.where(crossing > 0, cdf.gather(1, (crossing - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        inside = hist.gather(1, crossing[:, None])[:, 0]
        frac = torch.where(inside > 0, (target - below) / inside.clamp(min=1.0), 0.0).clamp(0.0, 1.0)
        new = self.lo + (crossing.double() + frac) * self.bin_width
        if centre:
            new = new - new.mean()
        return new.float()


def sign_bias_update(load: Tensor, bias: Tensor, gamma: float = 1e-3) -> Tensor:
    """DeepSeek-V3 rule: `b_j += gamma * sign(mean(load) - load_j)`. load, bias: [n]. Returns [n]."""
    if load.shape != bias.shape:
        raise ValueError(f"load {tuple(load.shape)} and bias {tuple(bias.shape)} must have the same shape")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    load = load.to(torch.float64)
    step = torch.sign(load.mean() - load) * gamma
    return (bias.double() + step.to(bias.device)).to(bias.dtype)


def max_violation(load: Tensor) -> float:
    """MaxVio = max(load) / mean(load) - 1 over experts. load: [n]. Zero load gives 0.0."""
    load = load.double()
    mean = load.mean()
    if mean <= 0:
        return 0.0
    return float(load.max() / mean - 1.0)


def expert_load(topk_idx: Tensor, num_experts: int) -> Tensor:
    """Tokens routed to each expert. topk_idx: [m, k] long. Returns [num_experts] int64."""
    return torch.bincount(topk_idx.reshape(-1), minlength=num_experts)[:num_experts].to(torch.int64)


def _is_moe(module: nn.Module) -> bool:
    gate = getattr(module, "gate", None)
    return (
        gate is not None
        and isinstance(getattr(gate, "e_score_correction_bias", None), Tensor)
        and isinstance(getattr(module, "top_k", None), int)
        and isinstance(getattr(module, "num_experts", None), int)
    )


class ExpertBalancer:
    """Updates the `e_score_correction_bias` of every MoE layer of a model once per optimizer step.

    An MoE layer is any module with `gate.e_score_correction_bias` ([E] fp32 buffer), `top_k`,
    `num_experts`, and, after a training forward, `last_scores` ([N, E] detached fp32 sigmoid scores or
    None) and `last_mask` ([N] bool or None). Call `observe()` after each micro-batch forward and `step()`
    after the optimizer step. The bias a batch produces is written in `step()`, so it first routes the next
    batch. `all_reduce(t)` sums an int64 tensor over the ranks holding different tokens (one call a step).
    """

    MODES = ("quantile", "sign", "none")

    def __init__(
        self,
        model: nn.Module,
        mode: str = "quantile",
        bins: int = 1000,
        gamma: float = 1e-3,
        all_reduce: Callable[[Tensor], Tensor | None] | None = None,
        exact: bool | None = None,
    ):
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        self.mode = mode
        self.gamma = gamma
        self.all_reduce = all_reduce
        self.layers = [m for m in model.modules() if _is_moe(m)]
        self.histograms = [QuantileHistogram(m.num_experts, m.top_k, bins) for m in self.layers]
        # One process sees the whole batch: sort the margins exactly. Across ranks: the histogram estimate.
        self.exact = (all_reduce is None) if exact is None else exact
        if self.exact and all_reduce is not None:
            raise ValueError("exact quantiles need every token in one process; use the histogram (exact=False) with all_reduce")
        self._reset_loads()

    def _reset_loads(self) -> None:
        self.loads = [None] * len(self.layers)
        self._seen = [False] * len(self.layers)
        self._scores: list[list[Tensor]] = [[] for _ in self.layers]  # exact mode: kept scores per micro-batch

    def discard(self) -> None:
        """Forget what was observed since the last `step` (a training step that is being run again), and any
        scores a layer still holds."""
        self._reset_loads()
        for histogram in self.histograms:
            histogram.reset()
        for layer in self.layers:
            layer.last_scores = layer.last_mask = None

    def observe(self) -> None:
        """Read and clear `last_scores` of every MoE layer; never changes a bias."""
        for i, layer in enumerate(self.layers):
            scores = getattr(layer, "last_scores", None)
            if scores is None:
                continue
            mask = getattr(layer, "last_mask", None)
            bias = layer.gate.e_score_correction_bias.detach()
            scores = scores.detach().float()
            kept = scores if mask is None else scores[mask]
            idx, _ = route_topk(kept, bias.to(kept.device), layer.top_k)
            load = expert_load(idx, layer.num_experts)
            self.loads[i] = load if self.loads[i] is None else self.loads[i] + load
            if self.mode == "quantile" and self.exact:
                self._scores[i].append(kept)
            elif self.mode == "quantile":
                self.histograms[i].observe(scores, bias.to(scores.device), mask)
            self._seen[i] = True
            layer.last_scores = None
            layer.last_mask = None

    def _reduce(self) -> None:
        # One integer all-reduce for all layers: loads, then each layer's packed histogram.
        seen = [i for i in range(len(self.layers)) if self._seen[i]]
        if self.all_reduce is None or not seen:
            return
        parts = [self.loads[i] for i in seen]
        if self.mode == "quantile":
            parts += [self.histograms[i].pack() for i in seen]
        sizes = [p.numel() for p in parts]
        packed = torch.cat([p.to(parts[0].device) for p in parts])
        out = self.all_reduce(packed)
        packed = packed if out is None else out
        chunks = list(packed.split(sizes))
        for i in seen:
            self.loads[i] = chunks.pop(0)
        if self.mode == "quantile":
            for i in seen:
                self.histograms[i].unpack(chunks.pop(0))

    @torch.no_grad()
    def step(self) -> dict:
        """Write new biases (in place) and return metrics of the batch just observed.

        Returns `{"maxvio": [per layer], "maxvio_mean": float, "load": [per layer list of ints]}`; a layer
        that saw no tokens reports maxvio NaN and keeps its bias.
        """
        self._reduce()
        maxvio, loads = [], []
        for i, layer in enumerate(self.layers):
            buf = layer.gate.e_score_correction_bias
            if not self._seen[i]:
                maxvio.append(float("nan"))
                loads.append([])
                continue
            load = self.loads[i]
            maxvio.append(max_violation(load))
            loads.append([int(v) for v in load.tolist()])
            if self.mode == "quantile" and self.exact:
                new = quantile_bias(torch.cat(self._scores[i]), buf.detach().to(self._scores[i][0].device), layer.top_k)
                buf.copy_(new.to(buf.device, buf.dtype))
            elif self.mode == "quantile":
                buf.copy_(self.histograms[i].solve().to(buf.device, buf.dtype))
            elif self.mode == "sign":
                buf.copy_(sign_bias_update(load.to(buf.device), buf, self.gamma))
            self.histograms[i].reset()
        self._reset_loads()
        valid = [v for v in maxvio if v == v]
        return {
            "maxvio": maxvio,
            "maxvio_mean": sum(valid) / len(valid) if valid else float("nan"),
            "load": loads,
        }

"""Optimizers for k3: Muon (Newton–Schulz orthogonalised momentum) for hidden matrices, AdamW for the rest.

`build_optimizer` splits a model's parameters by name into Muon and AdamW groups and returns one
optimizer object whose groups all carry a `base_lr` that a schedule multiplies.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor, nn

__all__ = ["newton_schulz", "Muon", "MuonWithAdamW", "build_optimizer", "param_role", "OPTIMIZERS"]

OPTIMIZERS = ("muon", "adamw")

# Quintic Newton–Schulz coefficients (the widely published "Muon" choice): p(x) = a x + b x^3 + c x^5.
# They trade exact convergence for a steep slope at 0, so 5 steps push every singular value with
# sigma / ||G||_F >= 2e-3 into about [0.68, 1.21] (checked by evaluating p^5 on a grid), and no singular
# value ever leaves [0, 1.21].
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.float32) -> Tensor:
    """Approximately orthogonalise a matrix or a batch of matrices.

    G: [..., m, n]. Returns X: [..., m, n] in G's dtype with the singular vectors of G and singular values
    mapped by p^steps after Frobenius normalisation (see NS_COEFFS for the band). `dtype` is the working
    precision (float32 by default; bfloat16 is fine on GPU).
    """
    if G.dim() < 2:
        raise ValueError(f"G must have at least 2 dims [..., m, n], got shape {tuple(G.shape)}")
    a, b, c = NS_COEFFS
    X = G.to(dtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


def muon_scale(shape: torch.Size) -> float:
    """Update scale for an orthogonalised matrix [..., m, n]: 0.2 * sqrt(max(m, n)).

    An orthogonal m x n matrix has RMS entry 1/sqrt(max(m, n)); times 0.2 sqrt(max(m, n)) its RMS is 0.2,
    about AdamW's typical update RMS, so both optimizers share one learning rate and weight decay.
    """
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def _check_hparams(lr: float, weight_decay: float) -> None:
    if not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")


class Muon(torch.optim.Optimizer):
    """Muon: nesterov momentum, Newton–Schulz orthogonalisation, decoupled weight decay.

    Params must be 2-D `[out, in]` or stacked experts `[E, out, in]` (each expert orthogonalised on its
    own, batched). Update: `buf = mu buf + g`; `u = g + mu buf` (nesterov) or `buf`;
    `p *= 1 - lr wd`; `p -= lr * muon_scale * NS(u)`.
    Groups with `use_muon=False` are updated with AdamW instead (used by `MuonWithAdamW`).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_dtype: torch.dtype | None = None,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ):
        _check_hparams(lr, weight_decay)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        defaults = dict(
            lr=lr, base_lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, ns_dtype=ns_dtype, betas=betas, eps=eps, use_muon=True,
        )
        super().__init__(params, defaults)
        self._replica_groups: dict = {}  # id(param) → process group it is replicated over (see spread_over)
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if p.dim() not in (2, 3):
                        raise ValueError(f"Muon params must be 2-D or 3-D, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            update = self._muon_update if group["use_muon"] else self._adamw_update
            sharded, spread = [], {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"] and _is_dtensor(p):
                    sharded.append(p)
                elif group["use_muon"] and id(p) in self._replica_groups:
                    spread.setdefault(self._replica_groups[id(p)], []).append(p)
                else:
                    update(p, group)
            if sharded:
                self._sharded_muon_update(sharded, group)
            for pg, ps in spread.items():
                self._spread_muon_update(ps, pg, group)
        return loss

    def spread_over(self, replica_groups: dict) -> None:
        """Spread the Newton–Schulz work of replicated Muon matrices over the ranks holding their copies.

        replica_groups: {parameter: process group (None for the default group)} of plain-tensor matrices that
        every rank of that group holds identically (data parallel without FSDP; expert copies). Each matrix is
        then orthogonalised by one owner rank and the results reach the group in one all-gather. Every rank of
        a group must call `step` with the same matrices having gradients. A group of one rank changes nothing.
        """
        import torch.distributed as dist
        muon = {id(p) for g in self.param_groups if g["use_muon"] for p in g["params"]}
        for p, pg in replica_groups.items():
            if id(p) not in muon:
                raise ValueError(f"spread_over: a {tuple(p.shape)} parameter is not in a Muon group of this optimizer")
            if _is_dtensor(p):
                raise ValueError(f"spread_over: a {tuple(p.shape)} parameter is a DTensor (sharded matrices "
                                 f"already take the gather/scatter path); pass replicated plain tensors only")
            if dist.get_world_size(pg) > 1:
                self._replica_groups[id(p)] = pg

    def load_state_dict(self, state_dict: dict) -> None:
        """Load like torch, but keep the saved dtype of moments (torch casts them to a bf16 param's dtype)."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for index, saved in state_dict["state"].items():
            p = params[index]
            for key, value in saved.items():
                if isinstance(value, Tensor) and key != "step":
                    self.state[p][key] = value.to(device=p.device, copy=True)

    def _direction(self, p: Tensor, group: dict) -> Tensor:
        """Advance p's momentum and return the direction to orthogonalise (float32). On a DTensor parameter both
        are this rank's shard: the momentum is elementwise, so shards need no communication."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        buf, grad = _local(state["momentum_buffer"]), _local(p.grad).float()
        mu = group["momentum"]
        buf.mul_(mu).add_(grad)
        return grad.add(buf, alpha=mu) if group["nesterov"] else buf

    @staticmethod
    def _ns_dtype(p: Tensor, group: dict) -> torch.dtype:
        return group["ns_dtype"] or (torch.bfloat16 if p.is_cuda else torch.float32)

    @staticmethod
    def _apply(p: Tensor, ortho: Tensor, group: dict) -> None:
        """p −= lr·(wd·p + muon_scale·ortho), on p's local data (shape: the full matrix's)."""
        data, lr = _local(p), group["lr"]
        if group["weight_decay"]:
            data.mul_(1.0 - lr * group["weight_decay"])
        data.add_(ortho.to(data.dtype), alpha=-lr * muon_scale(p.shape))

    def _muon_update(self, p: Tensor, group: dict) -> None:
        direction = self._direction(p, group)
        self._apply(p, newton_schulz(direction, steps=group["ns_steps"], dtype=self._ns_dtype(p, group)).float(), group)

    def _sharded_muon_update(self, params: list[Tensor], group: dict) -> None:
        """Distributed Muon for row-sharded (FSDP2) matrices: each matrix is orthogonalised once, whole, by one
        owner rank (round-robin over the matrices, largest first), with one all-to-all gathering the shards
        to their owners and one scattering the results back. Bytes travel in the Newton–Schulz working dtype,
        which is where the single-process update casts first, so the result equals it."""
        by_group: dict = {}
        for p in params:
            by_group.setdefault(_row_shard_group(p), []).append(p)
        for pg, ps in by_group.items():
            _gather_orthogonalise_scatter(ps, [self._direction(p, group) for p in ps], pg, group["ns_steps"],
                                          self._ns_dtype(ps[0], group),
                                          lambda p, ortho: self._apply(p, ortho.float(), group))

    def _spread_muon_update(self, params: list[Tensor], pg, group: dict) -> None:
        """Replicated matrices over `pg`: every rank advances its (replicated) momentum, each owner orthogonalises
        its matrices and one all-gather of the results, in the Newton–Schulz working dtype, reaches every rank."""
        _orthogonalise_spread(params, [self._direction(p, group) for p in params], pg, group["ns_steps"],
                              self._ns_dtype(params[0], group), lambda p, ortho: self._apply(p, ortho.float(), group))

    def _adamw_update(self, p: Tensor, group: dict) -> None:
        grad = p.grad.float()
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = float(state["step"])
        state["exp_avg"].lerp_(grad, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        lr = group["lr"]
        if group["weight_decay"]:
            p.mul_(1.0 - lr * group["weight_decay"])
        denom = (state["exp_avg_sq"] / (1.0 - beta2**t)).sqrt_().add_(group["eps"])
        step = state["exp_avg"] / (1.0 - beta1**t) / denom
        p.add_(step.to(p.dtype), alpha=-lr)


def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard (sharing its storage, so in-place updates land in the DTensor), else t."""
    return t.to_local() if _is_dtensor(t) else t


def _row_shard_group(p: Tensor):
    """The process group over which DTensor `p` is split by rows (FSDP2's Shard(0) on a 1-D mesh)."""
    from torch.distributed.tensor import Shard
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ValueError(f"distributed Muon shards rows over a 1-D mesh (Shard(0)); got placements "
                         f"{tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh for a {tuple(p.shape)} matrix")
    return p.device_mesh.get_group()


def _row_counts(rows: int, world: int) -> list[int]:
    """Rows of each rank under Shard(0) (torch.chunk's rule: ⌈rows/world⌉ each, the last ones short or empty)."""
    per = -(-rows // world)
    return [max(0, min(per, rows - r * per)) for r in range(world)]


def owner_ranks(sizes: list[int], world: int) -> list[int]:
    """The rank that orthogonalises each matrix (by element count): round-robin over the ranks, largest first,
    so every rank owns the same number of matrices to within one and the big ones are spread first."""
    owner = [0] * len(sizes)
    for n, i in enumerate(sorted(range(len(sizes)), key=lambda i: -sizes[i])):
        owner[i] = n % world
    return owner


def _orthogonalise_spread(params: list[Tensor], directions: list[Tensor], pg, steps: int, ns_dtype: torch.dtype,
                          apply) -> None:
    """directions[i] of matrices params[i], identical on every rank of `pg` → each orthogonalised by its owner →
    `apply(p, result)` on every rank. One all-gather of each rank's results, padded to the longest rank's."""
    import torch.distributed as dist
    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    owner = owner_ranks([p.numel() for p in params], world)
    owned = [[i for i in range(len(params)) if owner[i] == r] for r in range(world)]
    sizes = [sum(params[i].numel() for i in owned[r]) for r in range(world)]
    flat = torch.zeros(max(sizes), dtype=ns_dtype, device=directions[0].device)
    if owned[me]:
        flat[:sizes[me]] = torch.cat([newton_schulz(directions[i].to(ns_dtype), steps=steps, dtype=ns_dtype).reshape(-1)
                                      for i in owned[me]])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=pg)
    for r in range(world):
        parts = gathered[r][:sizes[r]].split([params[i].numel() for i in owned[r]])
        for i, part in zip(owned[r], parts):
            apply(params[i], part.view(params[i].shape))


def _gather_orthogonalise_scatter(params: list[Tensor], local_dirs: list[Tensor], pg, steps: int,
                                  ns_dtype: torch.dtype, apply) -> None:
    """Shards local_dirs[i] of full matrices params[i] (DTensors over `pg`) → each full matrix orthogonalised by
    its owner → `apply(p, local rows of the result)` on every rank. Every rank of `pg` calls this together."""
    import torch.distributed as dist
    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    owner = owner_ranks([p.numel() for p in params], world)
    rows = [_row_counts(p.shape[0], world) for p in params]
    width = [math.prod(p.shape[1:]) for p in params]  # elements per row
    for i, d in enumerate(local_dirs):
        if d.shape[0] != rows[i][me]:
            raise ValueError(f"a {tuple(params[i].shape)} matrix holds {d.shape[0]} rows on rank {me}, expected "
                             f"{rows[i][me]} (torch.chunk's rule for Shard(0))")
    mine = [i for i in range(len(params)) if owner[i] == me]
    # gather: to owner j, my rows of each matrix j owns (in matrix order)
    send = [[i for i in range(len(params)) if owner[i] == j] for j in range(world)]
    send_sizes = [sum(rows[i][me] * width[i] for i in send[j]) for j in range(world)]
    recv_sizes = [sum(rows[i][s] * width[i] for i in mine) for s in range(world)]
    dev = local_dirs[0].device
    out = torch.empty(sum(recv_sizes), dtype=ns_dtype, device=dev)
    flat = torch.cat([local_dirs[i].reshape(-1).to(ns_dtype) for j in range(world) for i in send[j]]
                     or [out.new_empty(0)])
    dist.all_to_all_single(out, flat, recv_sizes, send_sizes, group=pg)
    pieces = [list(part.split([rows[i][s] * width[i] for i in mine])) for s, part in enumerate(out.split(recv_sizes))]
    results = []
    for n, i in enumerate(mine):
        full = torch.cat([pieces[s][n] for s in range(world)]).view(params[i].shape)
        results.append(newton_schulz(full, steps=steps, dtype=ns_dtype))
    # scatter: each rank gets its rows of every matrix, by owner, in matrix order
    back = torch.cat([r.reshape(-1, width[i])[sum(rows[i][:s]):sum(rows[i][:s + 1])].reshape(-1)
                      for s in range(world) for i, r in zip(mine, results)] or [out.new_empty(0)])
    mine_back = torch.empty(sum(send_sizes), dtype=ns_dtype, device=dev)
    dist.all_to_all_single(mine_back, back, send_sizes, recv_sizes, group=pg)
    parts = mine_back.split([rows[i][me] * width[i] for j in range(world) for i in send[j]])
    for i, part in zip([i for j in range(world) for i in send[j]], parts):
        apply(params[i], part.view(rows[i][me], *params[i].shape[1:]))


class MuonWithAdamW(Muon):
    """One optimizer holding Muon groups (`use_muon=True`) and AdamW groups (`use_muon=False`).

    A single object keeps `state_dict`, `zero_grad` and the schedule (`param_groups[i]["lr"]` from
    `base_lr`) uniform across both kinds.
    """

    def __init__(self, param_groups: list[dict], lr: float, **kwargs):
        if not param_groups:
            raise ValueError("MuonWithAdamW needs at least one param group")
        super().__init__(param_groups, lr=lr, **kwargs)


def param_role(name: str, param: Tensor) -> tuple[str, bool]:
    """Which optimizer a parameter gets and whether it decays: returns ("muon"|"adamw", decay).

    AdamW: embeddings, lm_head, every 1-D param (norms, biases, A_log, dt_bias), AttnRes pseudo-queries
    (`res_proj`, shape [1, D]), the router `gate.weight`, conv kernels (`conv1d`). Muon: other 2-D/3-D
    matrices. No decay on 1-D params, embeddings and the pseudo-queries (vectors stored as [1, D]).
    """
    is_embedding = "embed_tokens" in name
    is_vector = param.dim() < 2 or "res_proj" in name
    is_router = name == "gate.weight" or name.endswith(".gate.weight")
    adamw = (
        is_embedding or is_vector or is_router or "lm_head" in name or "conv1d" in name or param.dim() > 3
    )
    decay = not (is_embedding or is_vector)
    return ("adamw" if adamw else "muon"), decay


def build_optimizer(
    model: nn.Module,
    name: str = "muon",
    lr: float = 3e-4,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
) -> torch.optim.Optimizer:
    """Build the optimizer for a k3 model: "muon" (Muon + AdamW by name) or "adamw" (AdamW everywhere).

    Every group has `base_lr` = lr (a schedule sets `lr = base_lr * multiplier`) and a `role` tag
    ("muon", "adamw_decay", "adamw_no_decay"). Frozen params (requires_grad False) are left out.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer name must be one of {OPTIMIZERS}, got {name!r}")
    _check_hparams(lr, weight_decay)
    buckets: dict[str, list[Tensor]] = {"muon": [], "adamw_decay": [], "adamw_no_decay": []}
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            continue
        kind, decay = param_role(pname, p)
        if name == "adamw" and kind == "muon":
            kind = "adamw"
        key = "muon" if kind == "muon" else ("adamw_decay" if decay else "adamw_no_decay")
        buckets[key].append(p)
    groups = []
    for role, params in buckets.items():
        if params:
            groups.append(
                dict(
                    params=params, role=role, lr=lr, base_lr=lr, use_muon=role == "muon",
                    weight_decay=0.0 if role == "adamw_no_decay" else weight_decay,
                )
            )
    if not groups:
        raise ValueError("model has no trainable parameters")
    if name == "adamw":
        for g in groups:
            del g["use_muon"]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay)
    return MuonWithAdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas)

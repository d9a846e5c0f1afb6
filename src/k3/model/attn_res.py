"""Block Attention Residuals (SPEC §3.1): a softmax mix over stored blocks and the live partial sum."""
import torch
from torch.autograd.function import once_differentiable

from k3 import envs
from k3.model.norm import RMSNorm
from k3.ops.fused_linear import DerivedWeight
from k3.ops.norm import rms_norm
from k3.ops.triton_dispatch import call_op, triton_module, use_triton, use_triton_op


def attn_res_mix(sources: list[torch.Tensor], norm: RMSNorm, proj: torch.nn.Linear,
                 out_norm: RMSNorm | None = None) -> torch.Tensor:
    """`out = Σ_i softmax_i(⟨RMSNorm_u(v_i), w⟩) · v_i` in fp32 over sources v_i: [B, T, D] each.

    `norm` holds the key norm weight u, `proj` the pseudo-query w as a [1, D] weight. For backward only the
    sources themselves and two [n, B, T] statistics are kept (not fp32 copies of the [n, B, T, D] stack).
    out_norm: an RMSNorm after the mix, out_norm(out) returned; in the kernels' launches where they run and take
    it (`_folds_norm`: the mix itself is then never stored).
    """
    if _kernel_takes(sources, "_attn_res_triton"):
        if out_norm is not None and _folds_norm(out_norm, sources[-1]):
            return _AttnResMixFused.apply(norm.weight, proj.weight, norm.eps, out_norm.weight, out_norm.eps, *sources)
        out = _AttnResMixFused.apply(norm.weight, proj.weight, norm.eps, None, 0.0, *sources)
    elif not (torch.is_grad_enabled() and any(t.requires_grad for t in [*sources, norm.weight, proj.weight])):
        # inference: the forward alone (Dynamo mis-binds a Function's *sources when no gradient is recorded)
        out = _mix_forward(norm.weight, proj.weight, norm.eps, sources)[0]
    else:
        out = _AttnResMix.apply(norm.weight, proj.weight, norm.eps, *sources)
    return out if out_norm is None else out_norm(out)


class BlockGrads:
    """The gradients of one forward's AttnRes sources, each summed in one buffer by the mixes that read it.

    A block is a source of every later mix (the embedding of all of them), so autograd would receive one fresh
    gradient per mix and add them pairwise: per further mix a write, then an add that reads two and writes one.
    Here `attach(block)` returns the block as the mixes should read it (an identity node, tagged); each mix's
    backward adds its part into the block's buffer (the first one writes it) and hands autograd nothing for
    it; the identity node's backward, which autograd runs after every reader's, returns the buffer (plus any
    gradient from a reader that is not a mix). The partial sums p are attached too: each is read by one mix and
    by the residual add after it (`residual_add`), whose backward leaves its gradient here, so the mix writes
    its part plus that gradient in one pass instead of autograd adding them. Switch: K3_NO_BLOCK_GRAD_BUFFER
    (k3.envs)."""

    def __init__(self):
        # per slot (tensor, the backward pass that left it, whether it is ours to add into): a sum left by a
        # pass that never reached the source (autograd.grad of something upstream, retain_graph) is stale in
        # the next pass, not added to; a residual add's gradient is read, never written
        self._entries: list[tuple[torch.Tensor, int, bool] | None] = []

    @staticmethod
    def wanted() -> bool:
        return torch.is_grad_enabled() and not envs.current().no_block_grad_buffer

    def attach(self, source: torch.Tensor) -> torch.Tensor:
        if not source.requires_grad:
            return source
        slot = len(self._entries)
        self._entries.append(None)
        out = _BlockGradSink.apply(source, self, slot)
        out._k3_block_grad = (self, slot)  # how a mix's forward (`_sinks`) knows the tensor for a source
        return out

    def _held(self, slot: int) -> tuple[torch.Tensor, bool] | None:
        entry = self._entries[slot]
        if entry is None or entry[1] != torch._C._current_graph_task_id():
            return None
        return entry[0], entry[2]

    def _hold(self, slot: int, t: torch.Tensor, owned: bool) -> None:
        self._entries[slot] = (t, torch._C._current_graph_task_id(), owned)

    def buffer(self, slot: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(where a mix's backward writes its gradient for the slot, what it adds to it or None): the sum so far
        itself, or a fresh buffer plus the residual add's gradient, or a fresh buffer alone (the first writer)."""
        held = self._held(slot)
        if held is not None and held[1]:
            return held[0], held[0]
        buf = torch.empty_like(like)
        self._hold(slot, buf, True)
        return buf, (held[0] if held is not None else None)

    def add(self, slot: int, grad: torch.Tensor) -> None:
        """A mix's gradient for the slot, from the torch path (a fresh tensor, ours to keep)."""
        self._accumulate(slot, grad, owned=True)

    def deposit(self, slot: int, grad: torch.Tensor) -> None:
        """A residual add's gradient for the slot (shared with the add's other operand: never written)."""
        self._accumulate(slot, grad, owned=False)

    def _accumulate(self, slot: int, grad: torch.Tensor, owned: bool) -> None:
        """Adds grad into the slot's sum, writing in place only into tensors this object owns."""
        held = self._held(slot)
        if held is None:
            self._hold(slot, grad, owned)
        elif held[1]:
            held[0].add_(grad)
        else:
            self._hold(slot, grad.add_(held[0]) if owned else held[0] + grad, True)

    def take(self, slot: int) -> torch.Tensor | None:
        held, self._entries[slot] = self._held(slot), None
        return None if held is None else held[0]


def residual_add(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """p + x for a partial sum p; where p is an attached AttnRes source the sum is attached too, and the add's
    gradient for p goes to p's BlockGrads slot (see BlockGrads), not through autograd."""
    sink = getattr(p, "_k3_block_grad", None)
    if sink is None or not torch.is_grad_enabled():
        return p + x
    return sink[0].attach(_ResidualAdd.apply(p, x, *sink))


class _ResidualAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, x, grads, slot):
        ctx.grads, ctx.slot = grads, slot
        return p + x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if grad is not None:
            ctx.grads.deposit(ctx.slot, grad)
        return None, grad, None, None


class _BlockGradSink(torch.autograd.Function):
    """Identity forward; backward returns the block's summed buffer (see BlockGrads)."""

    @staticmethod
    def forward(ctx, block, grads, slot):
        ctx.set_materialize_grads(False)  # mixes hand back no gradient: no zeros made for them
        ctx.grads, ctx.slot = grads, slot
        return block.view_as(block)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        buf = ctx.grads.take(ctx.slot)
        if grad is not None:  # a reader that is not a mix (layer 0's norm reads the embedding)
            buf = grad if buf is None else buf + grad
        return buf, None, None


def _sinks(sources) -> tuple | None:
    """Per source its (BlockGrads, slot) where it is an attached block, or None when no source is one."""
    sinks = tuple(getattr(s, "_k3_block_grad", None) for s in sources)
    return sinks if any(sinks) else None


def _hand_over(sinks, grads):
    """Per source: its gradient for autograd, or None where a BlockGrads buffer took it (the torch path)."""
    if sinks is None:
        return grads
    out = []
    for sink, g in zip(sinks, grads):
        if sink is None:
            out.append(g)
        else:
            sink[0].add(sink[1], g)
            out.append(None)
    return out


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _mix_forward(u, w, eps, sources) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, scores [n, B, T], softmax weights a [n, B, T]) of the mix, in fp32 (fp64 for fp64 sources)."""
    dt = _compute_dtype(sources[0])
    # autocast would run the two matmuls in bf16; the mix is fp32 (and backward assumes it)
    with torch.autocast(sources[0].device.type, enabled=False):
        v = torch.stack(sources).to(dt)  # [n, B, T, D]
        keys = rms_norm(v, u, eps)
        scores = keys @ w[0].to(dt)  # [n, B, T]
        a = torch.softmax(scores, dim=0)
        out = torch.einsum("nbt,nbtd->btd", a, v).to(sources[0].dtype)
    return out, scores, a


class _AttnResMix(torch.autograd.Function):
    """Forward: the SPEC formula on the stacked sources. Backward: recomputed one source at a time.

    With r_i = rsqrt(mean(v_i²) + eps), s_i = r_i ⟨v_i, u⊙w⟩, a = softmax(s), out = Σ a_i v_i and g = ∂L/∂out:
    ∂L/∂a_i = ⟨g, v_i⟩, ∂L/∂s_i = a_i (∂L/∂a_i − Σ_j a_j ∂L/∂a_j),
    ∂L/∂v_i = a_i g + ∂L/∂s_i (r_i u⊙w − s_i r_i² v_i / D), ∂L/∂u = w ⊙ q, ∂L/∂w = u ⊙ q with
    q = Σ_{i,b,t} ∂L/∂s_i r_i v_i.
    """

    @staticmethod
    def forward(ctx, u, w, eps, *sources):
        out, scores, a = _mix_forward(u, w, eps, sources)
        ctx.eps, ctx.sinks = eps, _sinks(sources)
        ctx.save_for_backward(u, w, scores, a, *sources)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        u, w, scores, a, *sources = ctx.saved_tensors
        dt = scores.dtype
        g = grad_out.to(dt)
        uw = u.to(dt) * w[0].to(dt)
        D = g.shape[-1]
        da = torch.stack([(g * v.to(dt)).sum(-1) for v in sources])  # [n, B, T]
        ds = a * (da - (a * da).sum(0, keepdim=True))
        q = torch.zeros(D, dtype=dt, device=g.device)
        grads = []
        for v, a_i, ds_i, s_i in zip(sources, a, ds, scores):
            vf = v.to(dt)
            r = torch.rsqrt(vf.pow(2).mean(-1) + ctx.eps)  # [B, T]
            coef = (ds_i * r)[..., None]
            grads.append((a_i[..., None] * g + coef * uw - (coef * s_i[..., None] * r[..., None] / D) * vf).to(v.dtype))
            q += (coef * vf).flatten(0, -2).sum(0)
        du = (q * w[0].to(dt)).to(u.dtype)
        dw = (q * u.to(dt)).to(w.dtype)[None]
        return du, dw, None, *_hand_over(ctx.sinks, grads)


def _norm_arg(nw: torch.Tensor | None, eps: float):
    """The mix kernels' `norm` argument: (weight, eps) of the RMSNorm they take, or None."""
    return None if nw is None else (nw, eps)


def _fused_mix_backward(ctx, grad_out, u, w, nw, sources, scores, lse, into):
    """(∂L/∂u, ∂L/∂w, ∂L/∂sources, ∂L/∂nw or None) by k3.ops._attn_res_triton's backward, for both fused Functions
    (ctx.eps: the key norm's eps, ctx.norm: the folded norm's, read only with a weight nw)."""
    du, dw, grads, *normed = triton_module("_attn_res_triton").mix_backward(
        grad_out, u, w, ctx.eps, tuple(sources), scores, lse, into=into, norm=_norm_arg(nw, ctx.norm))
    return du, dw, grads, (normed[0] if normed else None)


class _AttnResMixFused(torch.autograd.Function):
    """`_AttnResMix` through k3.ops._attn_res_triton: one read of each source forward, two backward. Keeps the
    sources, the scores and one log-sum-exp per row. With a norm weight nw (not None) it returns RMSNorm_nw(mix)
    (eps neps) instead, the norm in the same launches (as `_AttnResAddMixFused`'s)."""

    @staticmethod
    def forward(ctx, u, w, eps, nw, neps, *sources):
        kernels = triton_module("_attn_res_triton")
        ctx.eps, ctx.sinks, ctx.norm = eps, _sinks(sources), neps
        sources = tuple(s.contiguous() for s in sources)
        out, scores, lse = kernels.mix_forward(u, w, eps, sources, norm=_norm_arg(nw, neps))
        ctx.save_for_backward(u, w, nw, scores, lse, *sources)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        u, w, nw, scores, lse, *sources = ctx.saved_tensors
        # a block's gradient is added by the kernel into its BlockGrads buffer (written by the first mix)
        sinks = ctx.sinks or (None,) * len(sources)
        into = [None if sink is None else sink[0].buffer(sink[1], v) for sink, v in zip(sinks, sources)]
        du, dw, grads, d_nw = _fused_mix_backward(ctx, grad_out, u, w, nw, sources, scores, lse, into)
        return du, dw, None, d_nw, None, *(g if dest is None else None for g, dest in zip(grads, into))


class _AttnResAddMixFused(torch.autograd.Function):
    """`residual_add(p, x)` and then `_AttnResMixFused` over [*blocks, p + x], the add in the mix's forward launch
    (k3.ops._attn_res_triton.mix_add_forward: p and x read, the sum written, instead of a separate add writing
    it and the mix reading it again). Returns (mix, p + x). Backward: the sum's gradient is the mix's part plus
    the one autograd brings for the sum (its other readers, through its BlockGrads slot), made by the mix's
    kernel in one pass; it is x's gradient and p's, which goes to p's slot where p is attached, as
    `_ResidualAdd` leaves it.
    With a norm weight nw (not None) the first output is RMSNorm_nw(mix) (eps neps), in the same launches: the mix
    is never stored (the backward recomputes it from the sources it reads anyway), so the norm's own pass each
    way, the mix's write and read and its gradient's, are saved."""

    @staticmethod
    def forward(ctx, u, w, eps, nw, neps, p, x, *blocks):
        ctx.set_materialize_grads(False)  # the sum may have no other reader: no zeros made for it
        ctx.eps, ctx.sinks, ctx.p_sink = eps, _sinks(blocks), getattr(p, "_k3_block_grad", None)
        ctx.norm = neps
        sources = tuple(s.contiguous() for s in (*blocks, p))
        out, total, scores, lse = triton_module("_attn_res_triton").mix_add_forward(
            u, w, eps, sources, x.contiguous(), norm=_norm_arg(nw, neps))
        ctx.save_for_backward(u, w, nw, scores, lse, *sources[:-1], total)
        return out, total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_total):
        u, w, nw, scores, lse, *sources = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(sources[-1])
        sinks = ctx.sinks or (None,) * (len(sources) - 1)
        into = [None if sink is None else sink[0].buffer(sink[1], v) for sink, v in zip(sinks, sources)]
        into.append(None if grad_total is None else (torch.empty_like(sources[-1]), grad_total.contiguous()))
        du, dw, grads, d_nw = _fused_mix_backward(ctx, grad_out, u, w, nw, sources, scores, lse, into)
        d_total = grads[-1]
        d_p = d_total
        if ctx.p_sink is not None:
            ctx.p_sink[0].deposit(ctx.p_sink[1], d_total)
            d_p = None
        return (du, dw, None, d_nw, None, d_p, d_total,
                *(g if dest is None else None for g, dest in zip(grads, into[:-1])))


def attn_res_mix_norm(blocks: list[torch.Tensor], p: torch.Tensor | None, norm: RMSNorm, proj: torch.nn.Linear,
                      out_norm: RMSNorm, add: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A mix as a layer reads it: (p', out_norm(attn_res_mix(blocks + [p'], norm, proj))) with the partial sum
    p' = p + add (p without add, add where p is None: a fresh block's zeros).

    At inference on CUDA one launch does the add, the mix and the norm (k3.ops._attn_res_norm_triton;
    K3_NO_TRITON=_attn_res_norm_triton turns it off); in training, where the mix takes k3.ops._attn_res_triton, one
    launch does the add (`_AttnResAddMixFused`; without an add `attn_res_mix`'s), the mix and the norm (unless
    K3_NO_MIX_NORM_FOLD), and one their backward; otherwise the separate ops, each autograd's. The add is always the
    next mix's (k3.model.decoder leaves each `p + ffn` to it)."""
    if p is None:
        p, add = add, None
    sources = [*blocks, p]
    if _fused_mix_norm(sources, add, norm, proj, out_norm):
        kernels = triton_module("_attn_res_norm_triton")
        y, total = kernels.mix_norm_forward(norm.weight, proj.weight, norm.eps,
                                            tuple(s.contiguous() for s in sources), out_norm.weight,
                                            out_norm.eps, None if add is None else add.contiguous(),
                                            uw=_kept_score_weight(norm, proj, kernels.score_weight))
        return (p if total is None else total.view_as(p)), y.view_as(p)
    if add is not None and _fused_add_mix(sources, add):
        fold = _folds_norm(out_norm, add)
        out, total = _AttnResAddMixFused.apply(norm.weight, proj.weight, norm.eps, out_norm.weight if fold else None,
                                               out_norm.eps, p, add, *blocks)
        return _attached_like(total, [p, *blocks]), out if fold else out_norm(out)
    if add is not None:
        p = residual_add(p, add)
    else:
        p = _attached_like(p, blocks)
    return p, attn_res_mix([*blocks, p], norm, proj, out_norm)


def attn_res_mix_norm_route(blocks: list[torch.Tensor], p: torch.Tensor | None, norm: RMSNorm,
                            proj: torch.nn.Linear, out_norm: RMSNorm, add: torch.Tensor, moe) -> tuple:
    """`attn_res_mix_norm(blocks, p, norm, proj, out_norm, add)` before a MoE layer's FFN, plus that MoE's routing
    of its output: (p', y, (idx, weights, scores) or None). Where k3.ops._attn_res_route_triton takes it (the
    fused mix + norm would run, the MoE's router is a plain `Router` the decode kernel reads, rows within the
    router kernel's, a width and expert count the one launch fits; on by default since session 32, 8% off the graphed
    batch-1 step on an H100), the mix and the router are one launch; else the routing is None and the MoE routes
    its input itself."""
    from k3.ops.router import use_router_kernel

    q = add if p is None else p
    gate = getattr(moe, "gate", None)
    rw = getattr(gate, "weight", None)
    rows = q.numel() // q.shape[-1]
    route = (isinstance(rw, torch.Tensor) and type(rw) in (torch.Tensor, torch.nn.Parameter) and rw.dim() == 2
             and rw.device == q.device and rw.shape[1] == q.shape[-1]
             and use_router_kernel(q.reshape(rows, -1), rw, torch.is_grad_enabled() and rw.requires_grad)
             and _kernel_takes([q], "_attn_res_route_triton", inside_compile=True)
             and triton_module("_attn_res_route_triton").fits(rw.shape[1], rw.shape[0])
             and _fused_mix_norm([*blocks, q], None if p is None else add, norm, proj, out_norm))
    if not route:
        return (*attn_res_mix_norm(blocks, p, norm, proj, out_norm, add=add), None)
    if p is None:
        p, add = add, None
    sources = [*blocks, p]
    kernels = triton_module("_attn_res_norm_triton")
    outs = call_op("attn_res_mix_norm_route", _kept_score_weight(norm, proj, kernels.score_weight), float(norm.eps),
                   [s.contiguous() for s in sources], out_norm.weight, float(out_norm.eps),
                   None if add is None else add.contiguous(), rw.contiguous(), gate.e_score_correction_bias,
                   gate.tickets(rows, q.device), moe.top_k, moe.renormalize, float(moe.scale))
    y, idx, w, scores, total = outs
    return (p if add is None else total.view_as(p)), y.view_as(p), (idx, w, scores)


def _kept_score_weight(norm: RMSNorm, proj: torch.nn.Linear, make) -> torch.Tensor:
    """`make(u, w)` (the fused mix's fp32 u ⊙ w) kept on the norm module (a DerivedWeight, refreshed outside
    compiled code), so a decode step does not launch its casts and product at every mix."""
    kept = norm.__dict__.get("_k3_score_weight")
    if kept is None:
        kept = norm.__dict__["_k3_score_weight"] = DerivedWeight(make, norm, proj)
    if not torch.compiler.is_compiling():
        kept.refresh()
    return kept.current()


def _attached_like(p: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
    """p attached to the blocks' BlockGrads where they have one and p is not attached yet (a fresh block's first
    partial sum, the attention output alone), so its mix and the residual add after it sum in one pass."""
    tag = getattr(blocks[0], "_k3_block_grad", None) if blocks else None
    if tag is None or getattr(p, "_k3_block_grad", None) is not None:
        return p
    return tag[0].attach(p)


def _fused_add_mix(sources, add) -> bool:
    """Whether a training mix takes the residual add into its launch (`_AttnResAddMixFused`): where the mix
    itself takes k3.ops._attn_res_triton, with the add of the sources' dtype and shape (K3_NO_RESIDUAL_ADD_FOLD:
    never)."""
    return not envs.current().no_residual_add_fold and _kernel_takes([*sources, add], "_attn_res_triton")


def _folds_norm(out_norm: RMSNorm, x: torch.Tensor) -> bool:
    """Whether a training mix on the kernels (`_fused_add_mix`, or `attn_res_mix`'s) also takes the RMSNorm after
    it: a plain RMSNorm with a weight over x's width (not a replaced module, not a DTensor's weight),
    K3_NO_MIX_NORM_FOLD unset."""
    nw = getattr(out_norm, "weight", None)
    return (not envs.current().no_mix_norm_fold and type(out_norm) is RMSNorm
            and type(nw) in (torch.Tensor, torch.nn.Parameter) and nw.shape == x.shape[-1:] and nw.device == x.device)


def _fused_mix_norm(sources, add, norm, proj, out_norm) -> bool:
    """Whether `attn_res_mix_norm` takes the one-launch kernel: no gradient wanted, CUDA sources (and add) of one
    dtype and shape that the kernel takes (k3.ops.triton_dispatch.use_triton_op: inside torch.compile too, where
    the kernel is the custom op k3::attn_res_mix_norm), a norm weight over their width."""
    tensors = sources if add is None else [*sources, add]
    if torch.is_grad_enabled() and any(t.requires_grad for t in [*tensors, norm.weight, proj.weight, out_norm.weight]):
        return False
    return (_kernel_takes(tensors, "_attn_res_norm_triton", inside_compile=True)
            and out_norm.weight.shape == tensors[0].shape[-1:])


def _kernel_takes(tensors, name: str, inside_compile: bool = False) -> bool:
    """Whether the kernels of k3.ops.<name> take these tensors: not empty, one dtype and shape, and the kernel
    chosen for them (triton_dispatch's use_triton; with inside_compile, use_triton_op: inside torch.compile too)."""
    x = tensors[0]
    chosen = use_triton_op if inside_compile else use_triton
    return x.numel() > 0 and chosen(x, name) and all(t.dtype == x.dtype and t.shape == x.shape for t in tensors)

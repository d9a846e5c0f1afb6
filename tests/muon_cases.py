"""What the distributed Muon tests (FSDP-sharded and replicated matrices) share: a stack of matrices of uneven
shapes with seeded gradients and the single-process updates they must equal; a counter of Newton–Schulz calls;
and a tiny K3 trained by one process, which a parallel run must follow."""
import torch
from torch import nn

import k3.train.optim as optim
from k3.train.optim import build_optimizer
from parallel_harness import batch, make_model

STEPS = 3  # Muon steps of the matrix stack


def model(shapes) -> nn.Module:
    """One bias-free Linear per (out, in) shape, then a LayerNorm (an AdamW parameter), in float64."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(i, o, bias=False) for o, i in shapes], nn.LayerNorm(shapes[-1][0]))
    return net.double()


def grads(shapes, step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model(shapes).named_parameters()}


def assert_equal_single_process(shapes, ranks_params: list[dict]) -> None:
    """Each rank's parameters after STEPS equal one process's Muon on the same gradients (and every one moved)."""
    net = model(shapes)
    opt = build_optimizer(net, "muon", lr=0.05, weight_decay=0.1)
    for step in range(STEPS):
        for n, p in net.named_parameters():
            p.grad = grads(shapes, step)[n]
        opt.step()
    start = dict(model(shapes).named_parameters())
    for params in ranks_params:
        for n, p in net.named_parameters():
            assert not torch.equal(p, start[n])  # it moved, so equality means something
            torch.testing.assert_close(params[n], p.detach(), rtol=0, atol=1e-12, msg=n)


class CountedNewtonSchulz:
    """Replaces optim.newton_schulz while active and records the shape of every matrix it orthogonalises."""

    def __enter__(self):
        self.calls, self.real = [], optim.newton_schulz

        def counted(G, *a, **k):
            self.calls.append(tuple(G.shape))
            return self.real(G, *a, **k)

        optim.newton_schulz = counted
        return self

    def __exit__(self, *exc):
        optim.newton_schulz = self.real


def k3_steps(step_fn, model_, opt, steps: int = 2) -> None:
    """`steps` Muon steps of a tiny K3 on the shared batches; step_fn(batch) runs forward and backward."""
    for step in range(steps):
        step_fn(batch(10 + step, 4, 9))
        opt.step()
        opt.zero_grad()


def assert_k3_follows_one_process(states: list[dict]) -> None:
    """Each rank's full state dict after two steps equals one process's (and every Muon matrix moved)."""
    model_ = make_model(0)
    opt = build_optimizer(model_, "muon", lr=0.02, weight_decay=0.1)

    def one_process(b):
        logits = model_(b["input_ids"]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100).backward()

    k3_steps(one_process, model_, opt)
    start = make_model(0).state_dict()
    muon = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    for state in states:
        for n, p in model_.named_parameters():
            atol = 1e-7
            if id(p) in muon:  # every Muon matrix moved, so equality means something
                assert not torch.equal(p, start[n]), n
                # Muon's momentum and Newton-Schulz run in float32: a last-bit difference in a summed gradient
                # rounds one way or the other there, and Newton-Schulz's five steps carry it into the update (seen:
                # up to 1.3e-5 of the largest move, 2.4e-7 of 0.018, on an AVX-512 CPU, session 36). The bound is 1e-4
                # of that move; a wrong update (a shard missed, a wrong scale) is off by the order of the move itself.
                atol = max(atol, 1e-4 * float((p.detach() - start[n]).abs().max()))
            torch.testing.assert_close(state[n], p.detach(), rtol=1e-6, atol=atol, msg=lambda m, n=n: f"{n}: {m}")

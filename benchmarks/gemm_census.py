"""Every matrix product of one training step, by shape: how fast each runs alone against the card's best GEMM.

Issue 23's profiles put ~46% of `small`'s step in GEMMs (mm, addmm_, the grouped expert GEMMs) at roughly two thirds
of the card's large-GEMM rate; this says which shapes lose the time. The step's products (aten mm, addmm, addmm_,
bmm, baddbmm, _grouped_mm; forward and backward alike, recorded under a dispatch mode below autograd) are grouped
by operator, operand shapes, layouts (N: rows contiguous, T: transposed), dtypes and expert group sizes; each group
is then replayed alone on random operands of the same shapes and strides and timed. fla's KDA kernels do their
products inside Triton and are not here.
Columns: calls a step, GFLOP a call, ms a step alone, TFLOP/s, % of a square 8192³ GEMM measured in the same run
(the peer: cuBLAS at its best on this card), % of the datasheet peak (the hardware limit), and the ms a step the
shape loses against the square GEMM's rate. `where`: the k3 line of the first call (backward products without a
Python frame say "(autograd)").
--blas cublaslt|cublas: each non-grouped product also timed with that library as torch's preferred BLAS (a column,
and the step's totals under each and under the faster a shape): whether k3 should pick one for training.
Run: PYTHONPATH=src python benchmarks/gemm_census.py [--preset small] [--batch 8] [--seq 4096] [--rows 30] [--blas ..]
(on a machine without CUDA it runs the preset in fp32 on the CPU, timed there; tests use that.)
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench_util import PEAK_BF16, cpu_time_ms, measure_ceilings, save, table, time_ms  # noqa: E402

from k3.config import K3Config  # noqa: E402
from k3.model.decoder import K3ForCausalLM  # noqa: E402

aten = torch.ops.aten
PRODUCTS = {aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm, aten._grouped_mm}


@dataclasses.dataclass(frozen=True)
class Product:
    """One matrix product's shape class: the operator, its two operands (shape, stride, dtype), the groups of a
    grouped product (offsets, as lists) and its output dtype."""
    op: str
    a: tuple
    b: tuple
    offs: tuple | None
    out_dtype: str

    @property
    def flop(self) -> int:
        return product_flop(self.op, self.a[0], self.b[0], self.offs)

    @property
    def layout(self) -> str:
        return "".join("N" if stride[-1] == 1 else "T" for _, stride, _ in (self.a, self.b))

    def label(self) -> str:
        groups = f", {len(self.offs)} groups" if self.offs is not None else ""
        return f"{self.op} {'x'.join(map(str, self.a[0]))} @ {'x'.join(map(str, self.b[0]))}{groups}"


def product_flop(op: str, a: tuple, b: tuple, offs: tuple | None) -> int:
    """2 · multiply-adds of one product. a, b: the two operands' shapes. Grouped products (torch._grouped_mm)
    split one dimension by `offs` (cumulative ends): a 2-D a and 3-D b split a's rows (MoE forward), 2-D a and b
    their shared K (weight gradients), 3-D a and 2-D b b's columns; 3-D with 3-D is a plain batch."""
    if op in ("mm", "addmm", "addmm_"):
        (m, k), (_, n) = a, b
        return 2 * m * k * n
    if op in ("bmm", "baddbmm"):
        (g, m, k), (_, _, n) = a, b
        return 2 * g * m * k * n
    if op != "_grouped_mm":
        raise ValueError(f"not a matrix product: {op}")
    total = offs[-1] if offs else None
    if len(a) == 2 and len(b) == 3:
        return 2 * total * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * b[1] * total
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * total
    return 2 * a[0] * a[1] * a[2] * b[2]


def _operands(func, args, kwargs) -> tuple:
    """(a, b, offs, out_dtype) of a product call in aten's own argument order."""
    name = func.overloadpacket.__name__
    if name in ("addmm", "addmm_", "baddbmm"):
        a, b = args[1], args[2]
    else:
        a, b = args[0], args[1]
    offs = kwargs.get("offs", args[2] if name == "_grouped_mm" and len(args) > 2 else None)
    out_dtype = kwargs.get("out_dtype", args[4] if name == "_grouped_mm" and len(args) > 4 else None)
    return a, b, offs, out_dtype or a.dtype


def _where() -> str:
    """The innermost k3 line of the calling stack outside k3.ops (else inside it), or "(autograd)"."""
    k3_frames = [f for f in traceback.extract_stack()[:-3] if "/k3/" in f.filename]
    frames = [f for f in k3_frames if "/k3/ops/" not in f.filename] or k3_frames
    if not frames:
        return "(autograd)"
    f = frames[-1]
    return f"{f.filename.rsplit('/k3/', 1)[-1]}:{f.lineno} {f.name}"


class Census(TorchDispatchMode):
    """Counts the products dispatched inside it: `calls[Product]`, `where[Product]` (the first call's line)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.where: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in PRODUCTS:
            a, b, offs, out_dtype = _operands(func, args, kwargs)
            key = Product(func.overloadpacket.__name__, _spec(a), _spec(b),
                          tuple(offs.tolist()) if offs is not None else None, str(out_dtype).removeprefix("torch."))
            if key not in self.where:  # (the stack is read once a shape, not at every call)
                self.where[key] = _where()
            self.calls[key] += 1
        return func(*args, **kwargs)


def _spec(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch.")


def _operand(spec: tuple, device) -> torch.Tensor:
    shape, stride, dtype = spec
    return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device).normal_()


def replay(p: Product, device) -> callable:
    """A call of the product on fresh random operands of its shapes, strides and dtypes."""
    a, b = _operand(p.a, device), _operand(p.b, device)
    if p.op == "_grouped_mm":
        offs = torch.tensor(p.offs, dtype=torch.int32, device=device) if p.offs is not None else None
        out_dtype = getattr(torch, p.out_dtype)
        return lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=None if out_dtype == a.dtype else out_dtype)
    if p.op in ("addmm", "addmm_"):
        c = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype, device=device)
        return lambda: torch.addmm(c, a, b) if p.op == "addmm" else c.addmm_(a, b)
    if p.op == "baddbmm":
        c = torch.zeros(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=device)
        return lambda: torch.baddbmm(c, a, b)
    return (lambda: a @ b)


def census_of_step(model: K3ForCausalLM, ids: torch.Tensor) -> Census:
    """The products of one forward and backward (after one unrecorded step: lazy initialisations, autotuning)."""
    model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    with Census() as census:
        model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return census


def rows_of(census: Census, device, timer, square_tflops: float, peak: float, other_blas: str | None = None
            ) -> list[dict]:
    """One row a shape class; with `other_blas` ("cublaslt", "cublas") each non-grouped product also timed under
    that library (torch.backends.cuda.preferred_blas_library), in `{other_blas}_ms_step`."""
    rows = []
    for p, n in census.calls.items():
        call = replay(p, device)
        ms = timer(call)
        tflops = p.flop / (ms * 1e-3) / 1e12
        rows.append(dict(product=p.label(), layout=p.layout, dtype=p.a[2], calls=n, GFLOP=p.flop / 1e9,
                         ms_step=ms * n, TFLOPs=tflops, of_square=tflops / square_tflops, of_peak=tflops * 1e12 / peak,
                         lost_ms=ms * n - p.flop * n / (square_tflops * 1e12) * 1e3, where=census.where[p]))
        if other_blas is not None:
            rows[-1][f"{other_blas}_ms_step"] = float("nan") if p.op == "_grouped_mm" else n * blas_time_ms(
                other_blas, call, timer)
    return sorted(rows, key=lambda r: -r["lost_ms"])


def blas_time_ms(library: str, call, timer) -> float:
    """`timer(call)` with `library` as torch's preferred BLAS, the previous choice restored after."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return timer(call)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=None, help="default: small on CUDA, tiny on the CPU")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--blas", default=None, choices=["cublaslt", "cublas"],
                    help="also time each product under this BLAS library (CUDA)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    preset = a.preset or ("small" if cuda else "tiny")
    cfg = K3Config.preset(preset)
    B, T = a.batch or (8 if cuda else 2), a.seq or (4096 if cuda else 128)
    torch.manual_seed(0)
    with device:
        model = K3ForCausalLM(cfg).to(torch.bfloat16 if cuda else torch.float32)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    census = census_of_step(model, ids)
    del model
    if cuda:
        torch.cuda.empty_cache()
        square = measure_ceilings()["matmul_TFLOPs"]  # the 8192³ bf16 product the other benchmarks' limits use
        timer, peak = time_ms, PEAK_BF16
    else:
        sq = torch.randn(1024, 1024)
        square = 2 * 1024 ** 3 / (cpu_time_ms(lambda: sq @ sq, reps=5) * 1e-3) / 1e12
        timer, peak = functools.partial(cpu_time_ms, reps=5), float("nan")
    other = a.blas if cuda else None
    rows = rows_of(census, device, timer, square, peak, other)
    total_ms = sum(r["ms_step"] for r in rows)
    total_flop = sum(r["GFLOP"] * r["calls"] for r in rows) * 1e9
    print(table(rows[:a.rows], ["product", "layout", "dtype", "calls", "GFLOP", "ms_step", "TFLOPs", "of_square",
                                "of_peak", "lost_ms", *([f"{other}_ms_step"] if other else []), "where"]))
    summary = dict(preset=preset, B=B, T=T, shapes=len(rows), calls=sum(r["calls"] for r in rows),
                   ms_step_alone=total_ms, TFLOP_step=total_flop / 1e12, TFLOPs=total_flop / (total_ms * 1e-3) / 1e12,
                   square_TFLOPs=square, ms_at_square_rate=total_flop / (square * 1e12) * 1e3)
    if other:  # the step's non-grouped products under the other library, and the faster of the two a shape
        plain = [r for r in rows if r[f"{other}_ms_step"] == r[f"{other}_ms_step"]]
        summary.update({f"plain_ms_step_{torch.backends.cuda.preferred_blas_library().name.lower()}":
                        sum(r["ms_step"] for r in plain), f"plain_ms_step_{other}":
                        sum(r[f"{other}_ms_step"] for r in plain),
                        "plain_ms_step_best": sum(min(r["ms_step"], r[f"{other}_ms_step"]) for r in plain)})
    print(summary)
    save(f"gemm_census_{summary['preset']}", {"summary": summary, "rows": rows})


if __name__ == "__main__":
    main()

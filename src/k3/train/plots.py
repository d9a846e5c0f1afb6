"""PNG plots of a run: train/validation loss, and per-layer expert load (MaxVio over steps, final loads)."""
from __future__ import annotations

import json
from pathlib import Path


def plot_run(metrics_path: Path, out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recs = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    if not recs:
        return []
    out_dir = Path(out_dir)
    steps = [r["step"] for r in recs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in recs], lw=1, label="train")
    ev = [r for r in recs if "val_loss" in r]
    ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="k3 train: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    loss_png = out_dir / "loss.png"
    fig.savefig(loss_png, dpi=110)
    plt.close(fig)

    paths = [loss_png]
    with_load = [r for r in recs if r.get("load")]
    if with_load:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
        mv = np.array([r["maxvio_layers"] for r in with_load], dtype=float)
        for i in range(mv.shape[1]):
            a1.plot([r["step"] for r in with_load], mv[:, i], lw=1, label=f"MoE layer {i + 1}")
        a1.set(xlabel="step", ylabel="MaxVio = max load / mean load − 1", title="expert balance per layer")
        a1.set_yscale("symlog", linthresh=0.1)
        a1.grid(alpha=0.3)
        a1.legend(fontsize=7)
        load = np.array(with_load[-1]["load"], dtype=float)
        load = load / load.mean(axis=1, keepdims=True)
        im = a2.imshow(load, aspect="auto", cmap="coolwarm", vmin=0, vmax=2)
        a2.set(xlabel="expert", ylabel="MoE layer", title=f"load / mean load at step {with_load[-1]['step']}")
        fig.colorbar(im, ax=a2)
        fig.tight_layout()
        p = out_dir / "expert_load.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths

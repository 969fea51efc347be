"""What a run leaves behind besides checkpoints: the metrics file and the loss curve.

    <output_dir>/metrics.jsonl     one JSON line per optimizer step (step, loss, lr, grad_norm,
                                   tokens_per_s, tflops_per_s, mfu, mfu_full_attention (throughput.py),
                                   elapsed_s, val_loss every eval_steps; for a mixture of experts
                                   moe_aux_loss, moe_imbalance, moe_dropped (moe_metrics.py)); rank 0 only
    <output_dir>/loss_curve.png    train (and validation) loss against the step, at the end

On a resume the lines of the steps up to the checkpoint are kept and the rest dropped, so the file
reads as one uninterrupted run; a partial last line (a write cut by a crash) is dropped with a note.
The file is rewritten through a temporary file, so a crash during the rewrite loses nothing.
"""
from __future__ import annotations

import json
import os
from typing import Callable, List, Optional, Tuple


def read_jsonl(path: str) -> Tuple[List[dict], List[int]]:
    """(records, numbers of the lines that are not JSON) of a metrics file: a crash mid-write leaves
    a partial last line, which must not block the resume."""
    records, dropped = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                dropped.append(number)
    return records, dropped


def open_metrics(path: str, start_step: int, log: Callable[[str], None]):
    """(the metrics file opened for appending, the records of the steps kept before `start_step`)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    history: List[dict] = []
    if start_step > 0 and os.path.exists(path):    # keep the lines of the steps before the resume
        records, dropped = read_jsonl(path)         # a line cut by a crash is dropped
        if dropped:
            log(f"note: {path}: dropped {len(dropped)} unreadable line(s) "
                f"(line {', '.join(map(str, dropped))}; "
                f"a write cut short by the crash)")
        history = [r for r in records if r.get("step", 0) <= start_step]
    # rewrite through a temporary file: a crash here must not lose the lines kept
    with open(path + ".tmp", "w") as tmp:
        tmp.writelines(json.dumps(r) + "\n" for r in history)
    os.replace(path + ".tmp", path)
    return open(path, "a"), history


def plot_loss_curve(history: List[dict], output_dir: str, shape, log: Callable[[str], None]) -> Optional[str]:
    """<output_dir>/loss_curve.png from the records, or None (no records, or no matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no loss-curve PNG (pip install -e '.[plot]')")
        return None
    if not history:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], label="train")
    val = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"minipar {'x'.join(map(str, shape))} (pp x dp_rep x dp_shard x cp x tp)")
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(output_dir, "loss_curve.png")
    os.makedirs(output_dir, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path

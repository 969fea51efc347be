"""How often a training step stops the host for the device, per steady-state step, and where.

    python benchmarks/sync_check.py          on a GPU: torch.cuda.set_sync_debug_mode("warn"), the ground
                                             truth, each warning named by its minipar line; on a CPU:
                                             minipar/trainer/host_syncs.py's count
    ... --moe                                a 2-layer Mixtral (ep 1): one more per MoE layer

One process (a world of one: the plain step, no DDP; the 4-rank layouts are tests/test_host_syncs.py's),
a small model, `--steps` steps; the loop iterations after the first two are counted whole (the step,
its record, the stop flag). Expected (docs/design.md, host syncs): none at a step that does not log,
one at a logging step (the losses and norms since the last), and with --moe one per MoE layer and
micro-batch. Prints the counts, writes them to --out as JSON, and exits 1 when a step has more.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MOE = ["--model.model_type", "mixtral", "--model.num_local_experts", "4", "--model.num_experts_per_tok", "2",
       "--model.router_aux_loss_coef", "0.01"]


def main(argv=None) -> int:
    import torch

    from minipar.trainer.host_syncs import HostSyncs, host_tensors, optimizer_host_state, where
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--logging_steps", type=int, default=3)
    p.add_argument("--moe", action="store_true")
    p.add_argument("--small", action="store_true", help="a smaller model and batch (this script's CPU check)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"     # the trainer's own choice
    layers, first = 2, 2
    width, seq, batch = (64, 32, 4) if args.small else (256, 128, 8)
    run_argv = [os.path.join(ROOT, "configs", "default.yaml"), "--model.hidden_size", str(width),
                "--model.intermediate_size", str(2 * width), "--model.num_hidden_layers", str(layers),
                "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2",
                "--sequence_len", str(seq),
                "--global_batch_size", str(batch), "--max_steps", str(args.steps), "--warmup_steps", "2",
                "--eval_steps", "0", "--logging_steps", str(args.logging_steps), "--progress_bar", "false",
                "--save_steps", "0", "--save_final_checkpoint", "false", "--export_hf", "false",
                "--dtype", "bfloat16" if args.device == "cuda" else "float32",
                "--output_dir", os.path.join("/tmp", f"sync_check_{os.getpid()}"), *(MOE if args.moe else [])]
    trainer = Trainer(setup_run(run_argv))
    original, state = trainer.train_step, dict(step=None, events=collections.defaultdict(list))

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            state["events"][state["step"]].append(f"{where()} {str(message).splitlines()[0][:60]}")

    def start():
        if args.device == "cuda":
            state["saved"] = warnings.showwarning
            state["catch"] = warnings.catch_warnings()
            state["catch"].__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = on_warning
            torch.cuda.set_sync_debug_mode("warn")
        else:
            host = [host_tensors(trainer.batches), optimizer_host_state(trainer.optimizer)]
            state["syncs"] = HostSyncs(host=host)
            state["syncs"].__enter__()

    def stop():
        if args.device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = state["saved"]
            state["catch"].__exit__(None, None, None)
        else:
            state["syncs"].__exit__(None, None, None)
            for step, events in state["syncs"].by_step.items():
                state["events"][step] = [f"{w} {what}" for w, what in events]

    def train_step(step):
        if step == first:
            start()
        if step == args.steps - 1:            # the last iteration (it also ends the run) is not counted
            stop()
        elif step >= first:
            state["step"] = step + 1
            if "syncs" in state:
                state["syncs"].at_step(step + 1)
        return original(step)
    trainer.train_step = train_step
    trainer.train()
    per_layer = layers if args.moe else 0
    report, bad = {}, []
    for step in range(first + 1, args.steps):
        events = state["events"].get(step, [])
        allowed = per_layer + (1 if step % args.logging_steps == 0 else 0)
        report[step] = dict(collections.Counter(events), total=len(events), allowed=allowed)
        print(f"step {step}: {len(events)} host syncs (allowed {allowed})"
              + "".join(f"\n    {n} x {e}" for e, n in collections.Counter(events).items()))
        if len(events) > allowed:
            bad.append(step)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=args.device, moe=args.moe, steps=report), f, indent=1)
    print("sync_check: " + ("every step within its allowance" if not bad else f"too many at steps {bad}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

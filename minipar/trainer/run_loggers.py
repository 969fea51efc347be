"""Where a step's record goes besides metrics.jsonl: TensorBoard and Weights & Biases (rank 0 only).

    use_tensorboard: true      event files under <output_dir>/runs (Axolotl's and HF Trainer's
                               place), one scalar per metric under HF's tags:
                                 train/loss  train/learning_rate  train/grad_norm  train/tokens_per_s
                                 train/tflops_per_s  train/mfu  train/mfu_full_attention  eval/loss
                                 eval/perplexity, and eval/generations (text) with eval_prompts
                               `tensorboard --logdir <output_dir>/runs` shows them. After a resume
                               the steps past the checkpoint are purged from the view (purge_step),
                               as metrics.jsonl drops its lines past the checkpoint.
    wandb_project: NAME        wandb.init(project, entity, name, mode, dir=output_dir, the config)
                               and the same scalars per step; wandb_mode: offline writes the run
                               under <output_dir>/wandb for a later `wandb sync`.

Both packages are optional (`make` installs both, wandb with the test extra; `pip install minipar`
neither), so each is imported only when its key is set: a run that does not ask for it never pays
for the import (wandb starts a service process) and never fails for the want of it. Whether it
can be imported was checked before any collective (config/check.py), so here it is there.
"""
from __future__ import annotations

import os
from typing import List

# the record's key -> the tag it is logged under (HF Trainer's names)
TAGS = dict(loss="train/loss", lr="train/learning_rate", grad_norm="train/grad_norm",
            tokens_per_s="train/tokens_per_s", tflops_per_s="train/tflops_per_s", mfu="train/mfu",
            mfu_full_attention="train/mfu_full_attention", val_loss="eval/loss",
            val_perplexity="eval/perplexity")


class TensorBoardLogger:
    def __init__(self, output_dir: str, start_step: int):
        # late: tensorboard is optional (use_tensorboard), and SummaryWriter imports it
        from torch.utils.tensorboard import SummaryWriter
        self.log_dir = os.path.join(output_dir, "runs")
        self.writer = SummaryWriter(self.log_dir, purge_step=start_step + 1 if start_step else None)

    def log(self, record: dict) -> None:
        for key, tag in TAGS.items():
            if key in record:
                self.writer.add_scalar(tag, record[key], record["step"])
        for row in record.get("eval_generations", []):      # eval_prompts: the text, per step
            self.writer.add_text("eval/generations", f"**{row['prompt']}**{row['completion']}",
                                 record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, cfg):
        import wandb  # late: optional (wandb_project), and it starts a service process
        self.wandb = wandb
        self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, name=cfg.wandb_name,
                              mode=cfg.wandb_mode, dir=cfg.output_dir, config=cfg.to_dict())

    def log(self, record: dict) -> None:
        self.run.log({tag: record[key] for key, tag in TAGS.items() if key in record}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_loggers(cfg, start_step: int, is_main: bool) -> List[object]:
    """The loggers the config asks for (none on ranks other than 0)."""
    if not is_main:
        return []
    out: List[object] = []
    if cfg.use_tensorboard:
        out.append(TensorBoardLogger(cfg.output_dir, start_step))
    if cfg.wandb_project:
        out.append(WandbLogger(cfg))
    return out

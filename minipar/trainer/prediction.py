"""The planner's prediction for this run: what `python -m minipar.plan` says of the trainer's own
config, for the closing summary (run_summary.py prints it beside the measured throughput and peak).

    read_train_config(path)       a config file as train.py reads it for its model: load_config, then
                                  the tokenizer's vocabulary (run_setup.py's step 3: a base model's
                                  embedding resized to the tokens the file adds, a model from
                                  scratch sized to its tokenizer), so a plan of the file is the run's
    from_train_config(cfg)        a TrainConfig as the planner's question: (ModelShape, layout sizes
                                  [with the pipeline's], Batch, Options), the model, layout, batch and
                                  options the trainer runs; rl: dpo as rows (2 per pair) and its
                                  reference (Options.dpo_reference: plan/reference_cost.py)
    planner_prediction(cfg, pc)   (peak TFLOP/s, the GPU's name or None) -> {tokens_per_s, mfu,
                                  memory_bytes, gpu}: minipar/plan/estimate.py's plan (per stage:
                                  plan/pipeline.py's plan_pipeline) of this layout at that peak

The product reads the planner, never the other way: minipar/plan/ knows no TrainConfig (its
`python -m minipar.plan --config` program reads one through this file). Pure arithmetic on the config:
no process group, no tensor, no communication.
"""
from __future__ import annotations

import dataclasses

from minipar.gpus import PRESETS, preset_for_device
from minipar.lora import check_targets
from minipar.pipeline_parallel import chunks_per_rank
from minipar.plan import Batch, Cluster, Layout, ModelShape, Options, Pipeline, plan, plan_pipeline
from minipar.trainer.config.rl_keys import reference_of
from minipar.trainer.config.train_config import load_config
from minipar.trainer.run_setup import run_vocabulary
from models.llama import LlamaForCausalLM


def read_train_config(path, argv=None, notes=None):
    """The TrainConfig of a config file (+ `--key value` overrides) with the model train.py builds
    from it: its final vocabulary (run_vocabulary). `notes` collects what was derived."""
    notes = [] if notes is None else notes
    cfg = load_config(path, argv, notes)
    run_vocabulary(cfg, notes)
    return cfg


def from_train_config(cfg):
    """(model, layout sizes, batch, options) of a TrainConfig (what train.py would run)."""
    model = ModelShape.from_dict(dataclasses.asdict(cfg.model))
    sizes = dict(dp_replicate=cfg.dp_replicate_size, dp_shard=cfg.dp_shard_size, cp=cfg.cp_size,
                 tp=cfg.tp_size, sequence_parallel=cfg.sequence_parallel,
                 cp_impl=cfg.cp_impl, cp_ulysses_size=cfg.cp_ulysses_size, ep=cfg.ep_size)
    if (cfg.pp_size or 1) > 1:          # minipar/plan/pipeline.py
        sizes.update(pp=cfg.pp_size, pipeline_schedule=cfg.pipeline_schedule,
                     virtual_stages=chunks_per_rank(cfg.pipeline_schedule, cfg.pipeline_virtual_stages),
                     pipeline_layers=cfg.pipeline_layers,
                     pipeline_overlap_steps=cfg.pipeline_overlap_steps, max_grad_norm=cfg.max_grad_norm)
    # rl: dpo counts pairs; the planner counts rows, 2 per pair, and the reference (reference_cost.py)
    double = (lambda n: n if n is None or not cfg.rl else 2 * n)      # (None: derived later)
    batch = Batch(double(cfg.global_batch_size), double(cfg.micro_batch_size), cfg.sequence_len)
    opts = Options(dtype=cfg.dtype, prefetch=cfg.fsdp.prefetch,
                   reshard_after_forward=cfg.fsdp.reshard_after_forward,
                   sync_each_batch=cfg.fsdp.sync_each_batch,
                   gradient_checkpointing=cfg.gradient_checkpointing,
                   selective_ac_option=cfg.selective_ac_option, compile=cfg.compile,
                   dpo_reference=reference_of(cfg) or "", optimizer=cfg.optimizer,
                   **_lora(cfg))
    return model, sizes, batch, opts


def _lora(cfg) -> dict:
    """adapter: lora's rank and targets (the trainer's check_targets: the model's declared order)."""
    if cfg.adapter != "lora":
        return {}
    targets = check_targets(cfg.lora_target_modules, cfg.lora_target_linear,
                            LlamaForCausalLM.lora_targets_of(cfg.model), LlamaForCausalLM.lora_target_modules)
    return dict(lora_r=cfg.lora_r, lora_targets=tuple(targets))


def planner_prediction(cfg, pconf):
    """peak TFLOP/s -> what `python -m minipar.plan` predicts for this run's own layout (pconf: the
    ParallelismConfig the groups were built from), for the trainer's closing summary. The config is
    read when the summary asks, so a run the planner cannot model says so there (a ValueError, which
    run_summary.py prints) and trains all the same."""
    layout = Layout(pconf.dp_replicate_size, pconf.dp_shard_size, pconf.cp_size, pconf.tp_size,
                    pconf.sequence_parallel, pconf.cp_impl, pconf.cp_ulysses_size)

    def predict(peak_tflops: float, device_name: str = None) -> dict:
        model, sizes, batch, opts = from_train_config(cfg)
        # a GPU with a preset (minipar/gpus.py) is planned with its HBM, memory and NVLink
        gpu = preset_for_device(device_name) if device_name else None
        cluster = Cluster(**dict(PRESETS[gpu] if gpu else {}, peak_tflops=peak_tflops))
        if pconf.pp_size > 1:
            p = plan_pipeline(model, layout, Pipeline.from_sizes(sizes), batch, opts, cluster)
        else:
            p = plan(model, layout, batch, opts, cluster)
        return dict(tokens_per_s=p["time"]["tokens_per_s"], mfu=p["time"]["mfu"],
                    memory_bytes=p["memory"]["total"], gpu=gpu)
    return predict

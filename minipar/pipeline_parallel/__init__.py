"""Pipeline parallelism: the decoder's layers cut into stages along pgm.pp, micro-batches flowing
through them forward and their gradients flowing back.

    stage.py      which layers a stage holds (the split rule, pipeline_layers), the stage module
    p2p.py        the sends and receives between neighbours, paired in exchanges NCCL cannot deadlock
    schedules.py  AFAB, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V as per-rank action lists, their
                  minimum micro-batch counts, which rank holds which virtual stage, which action sends
    simulate.py   the action lists on an ideal machine: bubbles, the closed forms, chunks held
    split_backward.py  the Linears' backward split into B (dL/dx) and a later W (dL/dW)
    side_vectors.py  what a model's loss needs carried besides h (an MoE's aux loss), riding with it
    hooks.py      what a caller adds to a step: the data-parallel reduction point, the benchmark's Recorder
    executor.py   runs an action list: receive, compute, send, one step, calling the hooks
    overlap_steps.py  stages that step without waiting for each other (pipeline_overlap_steps),
                  post_validate.py their clipping, checked a step late

    from minipar.pipeline_parallel import build_stage, schedule_order, run_schedule
    stage = build_stage(LlamaForCausalLM(config, pgm), pgm)          # before fully_shard/replicate
    loss = run_schedule(stage, schedule_order("1f1b", pgm.pp.size, m, pgm.pp.rank), pgm, batches, n)
"""
from .executor import forward_only, run_schedule
from .hooks import Recorder, ScheduleHooks
from .overlap_steps import OverlapSteps
from .p2p import Exchange, exchange_plan, forward_plan, plan_exchanges
from .schedules import (
    SCHEDULES,
    SPLIT_BACKWARD,
    Action,
    check_schedule,
    chunk_stages,
    chunks_per_rank,
    schedule_order,
    sends_to,
    stage_owners,
)
from .simulate import peak_in_flight, simulate, theory_bubble
from .split_backward import WeightGradStore, split_weight_gradients
from .stage import PipelineStage, build_stage, split_layers, stage_chunks

__all__ = ["OverlapSteps", "Recorder", "ScheduleHooks", "forward_only", "run_schedule", "Exchange",
           "exchange_plan", "forward_plan", "plan_exchanges", "SCHEDULES", "SPLIT_BACKWARD",
           "Action", "check_schedule", "chunk_stages", "chunks_per_rank", "schedule_order", "sends_to",
           "stage_owners", "peak_in_flight",
           "simulate",
           "theory_bubble",
           "WeightGradStore", "split_weight_gradients", "PipelineStage", "build_stage", "split_layers",
           "stage_chunks"]

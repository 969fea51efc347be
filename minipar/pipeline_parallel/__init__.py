"""Pipeline parallelism: the decoder's layers cut into stages along pgm.pp, micro-batches flowing
through them forward and their gradients flowing back.

    executor.py   runs an action list: receive, compute, send, one step, calling the caller's hooks
                  (ScheduleHooks); reads with schedules.py and p2p.py, and is handed the rest;
                  forward_only: an evaluation's forwards alone, pipelined
    schedules.py  AFAB, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V as per-rank action lists, their
                  minimum micro-batch counts, which rank holds which virtual stage, which action sends
    p2p.py        the sends and receives between neighbours (StageLink), as the plan says
    p2p_plan.py   that plan: the exchanges each rank posts before each action, which NCCL cannot deadlock
    simulate.py   the action lists on an ideal machine: bubbles, the closed forms, chunks held
    stage.py      which layers a stage holds (the split rule, pipeline_layers), the stage module; what
                  it hands the executor (its plan, its side vectors)
    split_backward.py  the Linears' backward split into B (dL/dx) and a later W (dL/dW)
    side_vectors.py  what a model's loss needs carried besides h (an MoE's aux loss), riding with it
    recorder.py   the benchmark's Recorder: what a step really did (a ScheduleHooks)
    overlap_steps.py  stages that step without waiting for each other (pipeline_overlap_steps),
                  post_validate.py their clipping, checked a step late
    tied_ends.py  a tied embedding on two stages: a copy on each, gradients summed each step

    from minipar.pipeline_parallel import build_stage, schedule_order, run_schedule
    stage = build_stage(LlamaForCausalLM(config, pgm), pgm)          # before fully_shard/replicate
    loss = run_schedule(stage, schedule_order("1f1b", pgm.pp.size, m, pgm.pp.rank), pgm, batches, n)
"""
from .executor import ScheduleHooks, forward_only, run_schedule
from .overlap_steps import OverlapSteps
from .p2p import Exchange
from .p2p_plan import exchange_plan, forward_plan, plan_exchanges
from .recorder import Recorder
from .schedules import (
    SCHEDULES,
    SPLIT_BACKWARD,
    Action,
    check_schedule,
    chunk_stages,
    chunks_per_rank,
    forward_order,
    forward_window,
    schedule_order,
    sends_to,
    stage_owners,
)
from .simulate import forward_span, peak_in_flight, simulate, theory_bubble
from .split_backward import WeightGradStore, split_weight_gradients
from .stage import PipelineStage, build_stage, split_layers, stage_chunks

__all__ = ["OverlapSteps", "Recorder", "ScheduleHooks", "forward_only", "run_schedule", "Exchange",
           "exchange_plan", "forward_plan", "plan_exchanges", "SCHEDULES", "SPLIT_BACKWARD",
           "Action", "check_schedule", "chunk_stages", "chunks_per_rank", "forward_order", "forward_window",
           "schedule_order", "sends_to",
           "stage_owners", "forward_span", "peak_in_flight",
           "simulate",
           "theory_bubble",
           "WeightGradStore", "split_weight_gradients", "PipelineStage", "build_stage", "split_layers",
           "stage_chunks"]

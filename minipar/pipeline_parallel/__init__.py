"""Pipeline parallelism: the decoder's layers cut into stages along pgm.pp, micro-batches flowing
through them forward and their gradients flowing back.

    stage.py      which layers a stage holds (the split rule, pipeline_layers), the stage module
    p2p.py        the sends and receives of activations and gradients between neighbours
    schedules.py  AFAB, 1F1B and interleaved 1F1B as per-rank action lists, their minimum
                  micro-batch counts, and an ideal-time model of them
    executor.py   runs an action list: compute, send, receive, one step

    from minipar.pipeline_parallel import build_stage, schedule_order, run_schedule
    stage = build_stage(LlamaForCausalLM(config, pgm), pgm)          # before fully_shard/replicate
    loss = run_schedule(stage, schedule_order("1f1b", pgm.pp.size, m, pgm.pp.rank), pgm, batches, n)
"""
from .executor import Recorder, forward_only, run_schedule
from .schedules import SCHEDULES, Action, check_schedule, schedule_order, simulate, theory_bubble
from .stage import PipelineStage, build_stage, split_layers, stage_chunks

__all__ = ["Recorder", "forward_only", "run_schedule", "SCHEDULES", "Action", "check_schedule",
           "schedule_order", "simulate", "theory_bubble", "PipelineStage", "build_stage", "split_layers",
           "stage_chunks"]

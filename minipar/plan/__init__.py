"""The planner: memory, bytes per step and a time estimate per layout, checked against real runs.

    from minipar.plan import ModelShape, Layout, Batch, Options, Cluster, plan, search
    python -m minipar.plan --help

model.py holds the counts (what the tests hold exactly against the ledger and the measured state),
estimate.py the placement on nodes, the stated time model and the search, pipeline.py the
same per stage under pipeline parallelism (zero3_replay.py: ZeRO-3's gathers over a schedule).
"""
from .estimate import Cluster, crosses_nodes, layouts, plan, search
from .model import Batch, Layout, ModelShape, Options, activations, collectives, flops, memory, units
from .pipeline import Pipeline, plan_pipeline, plan_stage

__all__ = ["Batch", "Cluster", "Layout", "ModelShape", "Options", "activations", "collectives",
           "crosses_nodes", "flops", "layouts", "memory", "Pipeline", "plan", "plan_pipeline", "plan_stage",
           "search", "units"]

"""The planner: memory, bytes per step and a time estimate per layout, checked against real runs.

    from minipar.plan import ModelShape, Layout, Batch, Options, Cluster, plan, search
    python -m minipar.plan --help

inputs.py holds the question (model shape, layout, batch, options), feasible.py whether a layout
runs the model at all (the trainer's checks), model.py, activation_bytes.py and
collective_counts.py the counts (memory and FLOPs, what a micro-batch keeps for backward, the collectives:
what the tests hold exactly against the ledger and the measured state), estimate.py the placement on
nodes and the stated time model, pipeline.py the same under pipeline parallelism
(pipeline_stage.py: one stage, stage_units.py: what it holds; long_step.py: a long step from
three short ones; zero3_replay.py: ZeRO-3's gathers over a schedule), layout_search.py the
ranking of every layout of a world, pp and cp_impl included, and the recommendation by stated
rules; moe.py a mixture of experts' share (the experts over ep and edp, the token exchanges);
report.py the text `python -m minipar.plan` prints. The library knows no TrainConfig: the trainer
asks it (minipar/trainer/prediction.py), and only the program, __main__.py, reads a config file.
"""
from .activation_bytes import activations
from .collective_counts import collectives
from .estimate import Cluster, crosses_nodes, plan
from .inputs import Batch, Layout, ModelShape, Options
from .layout_search import layouts, search
from .long_step import plan_stage
from .model import flops, memory, units
from .pipeline import plan_pipeline
from .pipeline_stage import Pipeline

__all__ = ["Batch", "Cluster", "Layout", "ModelShape", "Options", "activations", "collectives",
           "crosses_nodes", "flops", "layouts", "memory", "Pipeline", "plan", "plan_pipeline", "plan_stage",
           "search", "units"]

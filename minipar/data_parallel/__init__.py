"""Data parallelism: replicas that sum their gradients, in two rungs of one ladder.

    naive.py   the textbook version: after backward, one blocking all-reduce per parameter
    ddp.py     bucketed all-reduces launched during backward, overlapped with it (torch DDP's design)

    from minipar.data_parallel import replicate, replicate_naive
    sync = replicate(model, pgm.dp_cp)      # then loss.backward(); with sync.no_sync(): ... to accumulate
"""
from .ddp import Bucket, GradSync, replicate
from .naive import NaiveGradSync, replicate_naive

__all__ = ["Bucket", "GradSync", "NaiveGradSync", "replicate", "replicate_naive"]

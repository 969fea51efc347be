"""Data parallelism: replicas that sum their gradients (ddp.py: buckets overlapped with backward).

    from minipar.data_parallel import replicate
    sync = replicate(model, pgm.dp_cp)      # then loss.backward(); with sync.no_sync(): ... to accumulate
"""
from .ddp import Bucket, GradSync, replicate

__all__ = ["Bucket", "GradSync", "replicate"]

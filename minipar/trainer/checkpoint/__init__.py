"""Checkpoints: written atomically, verified by checksums, resharded on load to any layout, rotated
without ever losing the newest good one, exported as a Hugging Face directory. In reading order:

    save_load.py   save_checkpoint / load_checkpoint: sharded (each rank its segments) or full (HF
                   names), and export_hf
    layout.py      the segments of each tensor a rank holds, and full <-> local: the resharding
    atomic.py      a checkpoint directory written as a temporary one and renamed, the every-rank
                   agreement, the manifest, stale temporaries, rotation (save_total_limit)
    verify.py      the manifest's checksums, the newest checkpoint whose checksums hold
    files.py       the formats of the files inside: tensors, RNG states, the model check
    async_save.py  async_save: the state copied to the host at the step boundary, written by a
                   background thread over a gloo group of its own
    export.py      `python -m minipar.trainer.checkpoint.export CKPT HF_DIR`: any checkpoint, of any
                   layout, as a Hugging Face directory, on one process
"""

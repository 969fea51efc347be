"""The training program's parts, composed by train.py:

    train_config.py   the YAML keys (Axolotl's names) and --key value overrides
    config_keys.py    Axolotl's keys mapped onto minipar's; the batch triple, max_steps from num_epochs
    run_setup.py      every check that needs no communication, then the process groups
    run_lock.py       output_dir writable, and one run per output_dir (a lock file)
    trainer.py        the model, the parallel wrappers, the step, logs, evaluation, checkpoints
    data.py           tokenizer, the step-indexed sampler, the dp/cp split of a batch
    optim.py          AdamW on the shards, warmup + cosine, global-norm clipping across shards
    checkpoint.py     sharded and full checkpoints, resharding on load (checkpoint_io.py: atomic
                      directories, manifest, checksums); export.py: a checkpoint -> a HF directory
"""

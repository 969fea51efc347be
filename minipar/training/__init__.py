"""The training program's parts, composed by train.py:

    train_config.py   the YAML keys (Axolotl's names) and --key value overrides
    config_values.py  a value checked against its key's type; one error for every unknown key
    config_keys.py    Axolotl's keys mapped onto minipar's; the batch triple, max_steps from num_epochs
    run_setup.py      every check that needs no communication, then the process groups
    run_lock.py       output_dir writable, and one run per output_dir (a lock file)
    trainer.py        the model, the parallel wrappers, the step, evaluation, checkpoints
    train_loop.py     the run around the step: resume, logs, metrics, saves, a SIGTERM stop, the summary
    metrics_file.py   metrics.jsonl (kept across a resume, a cut last line dropped) and the loss curve
    data.py           tokenizer, the step-indexed sampler, the dp/cp split of a batch
    tokenizer.py      the model's tokenizer (tokenizer_config, AutoTokenizer) or the bundled bytes
    datasets.py       Axolotl datasets (completion, chat_template) -> ids and labels, label masking
    packing.py        rows of sequence_len: whole examples packed with document ids, the row sampler
    example_data.py   a small offline example: a BPE tokenizer with a chat template, chat rows
    optim.py          AdamW on the shards, warmup + cosine, global-norm clipping across shards
    checkpoint.py     sharded and full checkpoints, resharding on load (checkpoint_layout.py: the
                      segments, full <-> local; checkpoint_io.py: atomic directories, manifest;
                      checkpoint_verify.py: checksums, the latest; checkpoint_files.py: the file
                      formats); export.py: a checkpoint -> a HF directory
"""

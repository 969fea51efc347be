"""The trainer around the techniques: what train.py runs. The techniques and their composition
(minipar/compose.py) never import it. Three packages, then the run itself. In reading order:

    config/           the keys, their types and values, every check before anything is written
    data/             tokens, examples, packed rows, the share of each global batch a rank computes
    checkpoint/       save, load and reshard, verify, rotate, export to Hugging Face
    run_setup.py      every check that needs no communication, then the process groups
    run_lock.py       output_dir writable, and one run per output_dir (a lock file)
    batch_source.py   a step's global batch, this rank's share of it, the eval batches and their loop
    trainer.py        compose.py's model and step with the optimizer, the batches, evaluation, saves
    train_loop.py     the run around the step: resume, logs, metrics, saves, a SIGTERM stop, summary
    prediction.py     the planner's prediction for this run's layout, for the closing summary
    lifecycle.py      the ranks agree at the start, stop together on SIGTERM, end cleanly
    metrics_file.py   metrics.jsonl (kept across a resume) and the loss curve
    eval_samples.py   eval_prompts: a few greedy generations at each evaluation
    load_model.py     a checkpoint of any layout or an HF directory back in memory, with its tokenizer
                      (python -m minipar.generate and python -m minipar.evaluate)

Each package's __init__ lists its own files in reading order.
"""

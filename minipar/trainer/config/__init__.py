"""The run's configuration: the YAML keys (Axolotl's and accelerate's names), their types and their
values, all checked before anything is written or any process group exists. In reading order:

    train_config.py   TrainConfig and load_config: YAML file, then `--key value` overrides, then
                      the checks, every problem of all of them in one error
    schema.py         the keys as pydantic models, in groups as Axolotl's schema has them: each
                      key's type, default, range and Axolotl alias
    errors.py         pydantic's ValidationError worded as one line per problem; unknown keys with
                      a "did you mean" from the schema; the one error
    keys.py           Axolotl's spellings in the schema's names; the batch triple (global = micro x
                      accumulation x dp), max_steps from num_epochs; Axolotl's defaults for a fine-tune
    axolotl_keys.py   every other key of Axolotl's schema folded onto minipar's: honoured, noted
                      (no effect here) or refused with the alternative, all in the one error
    axolotl_table.py, axolotl_table_run.py
                      the table: one row per key, by topic (the model, precision and kernels,
                      LoRA, the optimizer; the data, evaluation, checkpoints and logging, the launch)
    axolotl_docs.py   that table as the docs list it (docs/finetuning.md's generated block)
    rl_keys.py        preference training's keys (rl: dpo) and the reference each run takes
    check.py          the checks across keys (cudnn without CP, LoRA, the data files, ...)
"""

"""The run's configuration: the YAML keys (Axolotl's and accelerate's names), their types and their
values, all checked before anything is written or any process group exists. In reading order:

    train_config.py   TrainConfig (every key and its default) and load_config: YAML file, then
                      `--key value` overrides, then the checks
    values.py         a value checked against its key's type; one error naming every unknown key
    keys.py           Axolotl's and accelerate's spellings mapped onto minipar's keys; the batch
                      triple (global = micro x accumulation x dp), max_steps from num_epochs;
                      Axolotl's defaults for a fine-tune
    axolotl_keys.py   Axolotl's boilerplate keys, one table: honoured, noted (no effect here) or
                      refused with the alternative; every refusal collected into the one error
    check.py          every value check (learning_rate, max_grad_norm, save_total_limit, data
                      paths, ...), all wrong values in one ValueError
"""

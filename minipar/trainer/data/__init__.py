"""The data of a run: tokens, examples, packed rows, and the share of each global batch that one
rank computes. In reading order:

    batches.py       bytes as tokens, the step-indexed sampler (a pure function of seed and step),
                     the dp / cp split of a global batch, num_items_in_batch
    tokenizer.py     the model's tokenizer (tokenizer_config, AutoTokenizer) or the bundled bytes;
                     the byte tokenizer exported beside a byte-level model
    special_tokens.py  Axolotl's special_tokens, tokens, added_tokens_overrides applied; the size
                     the base's embedding is resized to
    chat_templates.py  chat_template by name (chatml, llama3, ...), tokenizer_default, jinja
    chat_template_table.py  the named templates' Jinja, each rendering as Axolotl's of that name
    datasets.py      Axolotl `datasets` entries -> ids and labels, several mixed
    sources.py       where the rows come from: jsonl/txt read here; JSON arrays, parquet, arrow,
                     csv, save_to_disk folders through Hugging Face `datasets`
    formats.py       completion, pretrain, alpaca, input_output: which tokens are trained
    chat_format.py   chat_template / sharegpt rows: mappings, roles, roles_to_train, train_on_eos
    packing.py       rows of sequence_len: whole examples packed with document ids; the row sampler
    prepared.py      the tokenized, packed rows saved under dataset_prepared_path and found again
    stream.py        pretraining_dataset streamed: documents read, tokenized and packed a buffer at a
                     time as the steps need them (a one-buffer corpus: packing.py's rows exactly)
    stream_sampler.py  a stream's global batches in step order; its position in a checkpoint
    preference.py    DPO's pairs: prompt / chosen / rejected rows, Axolotl's chat_template form
    reference_cache.py  DPO's precomputed reference numbers, cached beside the prepared rows
    example_data.py  a small offline example: a BPE tokenizer with a chat template, chat rows
    make_example.py  `python -m minipar.trainer.data.make_example DIR`: a small Llama checkpoint,
                     its tokenizer and chat data, to fine-tune offline
"""

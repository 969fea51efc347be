"""What each of Axolotl's keys does in minipar (2 of 2): the data, preference training, evaluation,
checkpoints and the Hub, logging integrations, the launch and the runtime, and other tools' work.
axolotl_table.py has the model side and says what a row (honoured, noted, refused; `accept`) means.
Data only.
"""
from __future__ import annotations

from minipar.trainer.config.axolotl_table import honoured, noted, refused, sub_option

_CPU_WORK = "how Axolotl spreads its preprocessing; minipar tokenises once and saves the rows " \
            "(dataset_prepared_path)"
_PACKING = "how Axolotl's multipack sampler bins rows; minipar packs first-fit in a seeded order, each " \
           "example kept apart, which trains the same examples"
_SAMPLES = "sample generation during evaluation: use eval_prompts (greedy generations logged at each eval)"
_RUNTIME = "a Python / CUDA memory housekeeping interval; minipar's loop needs none"
_DDP = "PyTorch DDP's knob; minipar's data parallelism is its own (ddp: bucketed)"
_LOGGER = "not integrated: metrics go to metrics.jsonl, TensorBoard (use_tensorboard) and wandb " \
          "(wandb_project)"
_HUB = "nothing is pushed to the Hub; the model is written to <output_dir>/hf"
_GRADIO = "the Gradio chat UI is `axolotl inference --gradio`'s, not training's"
_INTERNAL = "set by Axolotl itself while it runs; minipar works it out"

DATA = {
    "pretraining_dataset": honoured("local files only: each entry becomes a `datasets` entry of type "
                                    "pretrain (text_column), streamed (streaming: true): read, tokenized "
                                    "and packed as the steps need them, in buffers of "
                                    "streaming_multipack_buffer_size documents, max_steps required "
                                    "(minipar/trainer/data/stream.py; streaming: false prepares it once); "
                                    "it replaces `datasets`, as in Axolotl"),
    "streaming": honoured("pretraining_dataset streams unless streaming: false (then prepared once)"),
    "streaming_multipack_buffer_size": honoured("the documents a streamed buffer packs at a time "
                                                "(default 10000)"),
    "pretrain_multipack_buffer_size": honoured("the older name of streaming_multipack_buffer_size"),
    "pretrain_multipack_attn": honoured("true (the default): packed documents attend only to themselves; "
                                        "false: across them"),
    "pretraining_sample_concatenation": honoured("true: whole documents concatenated into rows, attention "
                                                 "across them (pretraining_dataset only, without "
                                                 "sample_packing)"),
    "pad_to_sequence_len": noted("minipar's batches are always sequence_len long (padded or packed)"),
    "pad_to_multiple_of": noted("minipar's batches are always sequence_len long (padded or packed)"),
    "eval_sample_packing": noted("evaluation rows are prepared as the training rows (sample_packing)"),
    "group_by_length": noted("rows are drawn in the sampler's seeded order"),
    "test_datasets": refused("separate evaluation datasets are not read; use val_set_size (held out of "
                             "`datasets`)"),
    "shuffle_merged_datasets": refused("rows are always drawn in a seeded order, a new one each epoch; "
                                       "remove shuffle_merged_datasets: false", accept=(True,)),
    "shuffle_before_merging_datasets": refused("the entries are mixed, then drawn in one seeded order; "
                                               "remove it"),
    "curriculum_sampling": refused("rows are drawn in a seeded order, not the file's; remove it"),
    "dataset_exact_deduplication": refused("rows are not deduplicated; remove the duplicates from the file"),
    "dataset_shard_num": refused("the whole dataset is read; cut the file to the shard wanted"),
    "dataset_shard_idx": refused("the whole dataset is read; cut the file to the shard wanted"),
    "min_sample_len": refused("short rows are kept (rows without a trained label are left out); remove "
                              "the short rows from the file"),
    "excess_length_strategy": refused("a row longer than sequence_len is refused without packing and cut "
                                      "into sequence_len pieces with sample_packing; shorten the rows or "
                                      "raise sequence_len"),
    "max_packed_sequence_len": refused("removed from Axolotl too; use sample_packing: true with "
                                       "sequence_len"),
    "use_pose": refused("PoSE's skipped position ids are not supported; train on rows of the length wanted "
                        "(sequence_len, with context parallelism for long ones)"),
    "pose_max_context_len": sub_option("use_pose"),
    "pose_num_chunks": sub_option("use_pose"),
    "pose_split_on_token_ids": sub_option("use_pose"),
    "sample_packing_bin_size": noted(_PACKING),
    "sample_packing_group_size": noted(_PACKING),
    "sample_packing_eff_est": noted(_PACKING),
    "sample_packing_mp_start_method": noted(_PACKING),
    "sample_packing_sequentially": noted(_PACKING),
    "multipack_real_batches": noted(_PACKING),
    "batch_flattening": noted("rows are padded or packed to sequence_len; flattening is a speed-up for "
                              "the same loss"),
    "preprocess_iterable": noted(_CPU_WORK),
    "skip_prepare_dataset": noted(_CPU_WORK),
    "dataset_processes": noted(_CPU_WORK),
    "dataset_num_proc": noted(_CPU_WORK),
    "dataset_keep_in_memory": noted(_CPU_WORK),
    "num_dataset_shards_to_save": noted(_CPU_WORK),
    "push_dataset_to_hub": noted("the prepared rows stay in dataset_prepared_path; nothing is pushed"),
    "remove_unused_columns": noted("minipar's rows hold only ids, labels and positions"),
    "dataloader_num_workers": noted("batches are cut from the prepared tensors in the training process"),
    "dataloader_pin_memory": noted("batches are cut from the prepared tensors in the training process"),
    "dataloader_prefetch_factor": noted("batches are cut from the prepared tensors in the training process"),
    "dataloader_drop_last": noted("global batches are always full: one at an epoch's end is completed from "
                                  "the next epoch's order"),
    "role_boundaries": noted("multimodal masking only; minipar masks text chats by their turns"),
}

EVALUATION = {
    "evals_per_epoch": honoured("eval_steps = ceil(max_steps / (evals_per_epoch x num_epochs))"),
    "eval_steps": honoured("null: evals_per_epoch decides, or minipar's default"),
    "eval_strategy": honoured("steps: eval_steps; epoch: evals_per_epoch 1; no: eval_steps 0"),
    "evaluation_strategy": honoured("eval_strategy's old name, read as it"),
    "eval_batch_size": noted("evaluation takes eval_batches micro-batches of micro_batch_size rows"),
    "eval_sequence_len": noted("evaluation rows are sequence_len long, as the training rows"),
    "eval_table_size": noted(_SAMPLES),
    "eval_max_new_tokens": noted(_SAMPLES),
    "generate_samples": noted(_SAMPLES),
    "num_generation_samples": noted(_SAMPLES, accept=(3,)),
    "generation_max_new_tokens": noted(_SAMPLES, accept=(50,)),
    "generation_temperature": noted(_SAMPLES, accept=(0.7,)),
    "generation_do_sample": noted(_SAMPLES, accept=(True,)),
    "generation_top_p": noted(_SAMPLES),
    "generation_top_k": noted(_SAMPLES),
    "generation_prompt_ratio": noted(_SAMPLES, accept=(0.5,)),
    "do_causal_lm_eval": noted("the evaluation is the held-out loss; BLEU & co are not computed"),
    "eval_causal_lm_metrics": noted("the evaluation is the held-out loss; BLEU & co are not computed"),
    "do_bench_eval": noted("no benchmark evaluation runs; the evaluation is the held-out loss"),
    "bench_dataset": noted("no benchmark evaluation runs; the evaluation is the held-out loss"),
    "bench_split": noted("no benchmark evaluation runs; the evaluation is the held-out loss"),
    "load_best_model_at_end": refused("the final weights are the last step's; remove it (every saved "
                                      "checkpoint can be exported)"),
    "metric_for_best_model": noted("an option of load_best_model_at_end, which minipar refuses"),
    "greater_is_better": noted("an option of load_best_model_at_end, which minipar refuses"),
}

CHECKPOINTS_AND_LOGGING = {
    "saves_per_epoch": honoured("save_steps = ceil(max_steps / (saves_per_epoch x num_epochs))"),
    "save_steps": honoured("null: no periodic saves (only the final one), as 0; unless saves_per_epoch"),
    "save_strategy": honoured("steps: save_steps; epoch: saves_per_epoch 1; no: save_steps 0 (the final "
                              "save stays); best is refused (no best-model tracking; use save_steps)"),
    "auto_resume_from_checkpoints": honoured("true: resume_from_checkpoint: latest"),
    "save_only_model": noted("checkpoints keep the optimizer state so a resume is exact; the model "
                             "alone is <output_dir>/hf (export_hf)"),
    "save_safetensors": noted("checkpoints and hf/ are always safetensors"),
    "save_first_step": noted("no extra checkpoint after step 1; save_steps decides"),
    "fsdp_final_state_dict_type": noted("the final model is <output_dir>/hf (whole safetensors); "
                                        "checkpoints are sharded"),
    "dynamic_checkpoint": noted("no checkpoint on a file or a signal; save_steps decides"),
    "hub_model_id": noted(_HUB),
    "hub_strategy": noted(_HUB),
    "hub_revision": noted(_HUB),
    "hf_use_auth_token": noted("minipar reads local directories only"),
    "wandb_watch": noted("gradients and parameters are not logged as wandb histograms"),
    "wandb_log_model": noted("the model is not uploaded as a wandb artifact; it is written to "
                             "<output_dir>/hf"),
    "wandb_run_id": noted("the run's wandb id is wandb's own (wandb_name names it)"),
    "use_wandb": noted("wandb logs when wandb_project is set"),
    "logging_dir": noted("TensorBoard event files go to <output_dir>/runs"),
    "include_tokens_per_second": noted("tokens per second are always logged (metrics.jsonl)"),
    "include_tkps": noted("tokens per second are always logged (metrics.jsonl)", accept=(True,)),
    "profiler_steps": honoured("N steps from profiler_steps_start: profile_steps [start + 1, start + N], "
                               "a torch.profiler trace (no CUDA memory snapshot)"),
    "profiler_steps_start": honoured("the first step of profiler_steps (0: the first step)"),
    **{k: noted(_LOGGER) for k in (
        "use_mlflow", "mlflow_tracking_uri", "mlflow_experiment_name", "mlflow_run_name",
        "hf_mlflow_log_artifacts", "use_comet", "comet_api_key", "comet_workspace", "comet_project_name",
        "comet_experiment_key", "comet_mode", "comet_online", "comet_experiment_config", "use_trackio",
        "trackio_project_name", "trackio_run_name", "trackio_space_id")},
    "use_otel_metrics": noted(_LOGGER),
    "otel_metrics_host": noted(_LOGGER, accept=("localhost",)),
    "otel_metrics_port": noted(_LOGGER, accept=(8000,)),
    **{k: noted(_GRADIO) for k in ("gradio_title", "gradio_share", "gradio_server_name", "gradio_server_port",
                                   "gradio_max_new_tokens", "gradio_temperature")},
}

PREFERENCE = {
    "trl": honoured("trl.beta: dpo_beta (rl_beta); its other keys are GRPO's (rl: grpo is refused) and "
                    "noted"),
    "dpo_label_smoothing": honoured("TRL's label_smoothing eps in [0, 0.5): cDPO's sigmoid loss and the "
                                    "robust loss (dpo_loss_type robust); refused with hinge and ipo"),
    "dpo_use_weighting": refused("WPO's weighting of the DPO loss is not supported; remove it"),
    "dpo_loss_weights": refused("one DPO loss (dpo_loss_type sigmoid, robust, hinge or ipo); remove "
                                "dpo_loss_weights"),
    "dpo_padding_free": noted("each side of a pair is one padded row; padding-free is the same loss"),
    "dpo_use_liger_kernel": noted("Liger's fused kernel for the same loss; minipar computes it"),
    "dpo_norm_loss": refused("removed from Axolotl too (TRL 0.29); remove it"),
    "dpo_use_logits_to_keep": refused("removed from Axolotl too (TRL 0.29); remove it"),
    "dpo_generate_during_eval": refused("removed from Axolotl too (TRL 0.29); remove it"),
    "rpo_alpha": refused("RPO's extra NLL term is not supported (Axolotl refuses it too); remove it"),
    "max_prompt_len": refused("prompts are kept whole and the response is cut to fit sequence_len; "
                              "remove max_prompt_len (or shorten the prompts)"),
    "reward_model": refused("reward models are not trained here; use rl: dpo on preference pairs"),
    "process_reward_model": refused("reward models are not trained here; use rl: dpo on preference pairs"),
    "center_rewards_coefficient": sub_option("reward_model"),
    "cpo_alpha": sub_option("rl: simpo / cpo"),
    "simpo_gamma": sub_option("rl: simpo"),
    "orpo_alpha": sub_option("rl: orpo"),
    "kto_desirable_weight": sub_option("rl: kto"),
    "kto_undesirable_weight": sub_option("rl: kto"),
    "ebft": sub_option("rl: ebft"),
    "vllm": sub_option("rl: grpo"),
}

RUNTIME = {
    "strict": noted("minipar always checks every key (unknown keys are refused)"),
    "debug": noted("minipar has no debug mode; the log and metrics.jsonl are always written"),
    "local_rank": noted("the rank comes from torchrun's environment"),
    "world_size": noted("the world comes from torchrun's environment"),
    "device": noted("each rank takes its device from torchrun's LOCAL_RANK"),
    "sequence_parallel_degree": honoured("context_parallel_size's old name (Axolotl's too), read as it"),
    "heads_k_stride": noted("a kernel knob of Axolotl's ring attention; minipar's ring is its own (cp_impl)"),
    "ring_attn_func": noted("which ring kernel Axolotl uses; minipar's ring is its own (cp_impl, cp_layout)"),
    "loss_watchdog_threshold": noted("no loss watchdog: a non-finite loss stops the run"),
    "loss_watchdog_patience": noted("no loss watchdog: a non-finite loss stops the run"),
    "gc_steps": noted(_RUNTIME),
    "gc_collect_steps": noted(_RUNTIME),
    "torch_empty_cache_steps": noted(_RUNTIME),
    "ddp_bucket_cap_mb": noted(_DDP),
    "ddp_broadcast_buffers": noted(_DDP),
    "ddp_find_unused_parameters": noted(_DDP),
    "accelerator_config": noted("accelerate is not used; minipar's loop is its own"),
    "deepcompile": noted("DeepSpeed's compiler; DeepSpeed is not used (compile: torch.compile)"),
    "axolotl_config_path": noted(_INTERNAL),
    "is_preprocess": noted(_INTERNAL),
    "total_num_tokens": noted(_INTERNAL),
    "total_supervised_tokens": noted(_INTERNAL),
    "use_ray": refused("Ray does not launch minipar; use torchrun (docs/README.md)"),
    "ray_num_workers": noted("an option of use_ray, which minipar refuses", accept=(1,)),
    "ray_run_name": noted("an option of use_ray, which minipar refuses"),
    "resources_per_worker": noted("an option of use_ray, which minipar refuses"),
    "trainer_cls": refused("a custom trainer class is Axolotl's code; remove trainer_cls"),
    "plugins": noted("Axolotl's kernel plugins (Liger, Cut Cross-Entropy) are noted (the same math); "
                     "any other plugin is refused: it is Axolotl's code (remove it)"),
    # another tool's work, refused with its own explanation instead of a misleading "did you mean"
    "deepspeed": refused("DeepSpeed is not used: minipar's ZeRO-3 is fsdp_version: 2 with dp_shard_size "
                         "(ZeRO-1/2: dp_replicate_size, ZeRO-3: dp_shard_size); remove `deepspeed`"),
    "fp16": refused("fp16 mixed precision is not supported: use bf16: true (or dtype: float32)"),
    "gptq": refused("GPTQ-quantised bases need GPU kernels minipar does not have; use a bf16 or fp32 base"),
    "relora_steps": refused("ReLoRA is not supported; use adapter: lora"),
}

TOPICS = {"the data": DATA, "preference training": PREFERENCE, "evaluation": EVALUATION,
          "checkpoints, the Hub and logging": CHECKPOINTS_AND_LOGGING, "the launch and the runtime": RUNTIME}

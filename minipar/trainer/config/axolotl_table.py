"""What each of Axolotl's keys does in minipar (1 of 2): the model and its tokenizer, precision,
attention and kernels, LoRA, the optimizer and its schedule. axolotl_table_run.py has the data,
preference training, evaluation, checkpoints, logging and the launch; axolotl_keys.py applies both
(fold), and axolotl_docs.py lists them (table, doc_table).

Every top-level key of Axolotl's config schema (tests/data/axolotl_schema_keys.txt, read from
Axolotl's pydantic models) is a field of TrainConfig (schema.py, with Axolotl's name or as an
alias) or has one Row here, by topic:

    honoured   mapped onto minipar's keys by axolotl_keys.fold (bfloat16: true -> bf16: true), or
               a field with Axolotl's meaning listed for the docs (warmup_ratio)
    noted      accepted; one note in the run's log says it has no effect here and why: what it
               changes is speed, memory, a GPU kernel or another tool's output, never the
               trained weights
    refused    it changes what is trained and minipar does not do it: one line of the file's ONE
               error message, with the alternative

A value in `accept` (default: the empty ones, null, [], {} and false) is what minipar does anyway
and says nothing: a template's boilerplate (`neftune_noise_alpha:`) or Axolotl's default written
out (`shuffle_merged_datasets: true`). Data only: no code runs here.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

HONOURED, NOTED, REFUSED = "honoured", "noted", "refused"


class Row(NamedTuple):
    status: str
    why: str
    accept: Optional[tuple] = None     # values that say nothing; None: null, [], {} and false


def honoured(why: str) -> Row:
    return Row(HONOURED, why)


def noted(why: str, accept: Optional[tuple] = None) -> Row:
    return Row(NOTED, why, accept)


def refused(why: str, accept: Optional[tuple] = None) -> Row:
    return Row(REFUSED, why, accept)


def sub_option(owner: str) -> Row:
    """An option of a feature that is itself refused: no effect without it, so noted."""
    return noted(f"an option of {owner}, which minipar refuses (without it the option does nothing)")


_KERNEL = "a GPU kernel for the same math; minipar's own layers compute it"
_LIGER = "Liger's fused Triton kernel for the same math; minipar's layers compute it"
_UNSLOTH = "Unsloth's kernels (removed from Axolotl too); minipar's layers compute the same math"
_MEMORY = "a memory saver that leaves the result unchanged; minipar's are gradient_checkpointing and ZeRO-3"
_LOADING = "minipar loads each rank's slices of base_model itself (models/hf_checkpoint.py)"
_LORA_KERNEL = "Axolotl's Triton LoRA kernels for the same math; minipar's LoRA layers compute it"

MODEL = {
    "base_model_config": honoured("a directory equal to base_model (or empty) is accepted: base_model's "
                                  "config.json is read; another directory is refused (copy its config.json "
                                  "into base_model)"),
    "model_type": honoured("checked against base_model's config.json architectures (AutoModelForCausalLM "
                           "or the family's class); a mismatch is refused (models/hf_classes.py)"),
    "type_of_model": honoured("model_type's field name in Axolotl: read as model_type"),
    "tokenizer_type": honoured("checked against the tokenizer's class (AutoTokenizer, the family's "
                               "tokenizer, its Fast form); a mismatch is refused"),
    "is_llama_derived_model": noted("the family comes from base_model's config.json"),
    "is_mistral_derived_model": noted("the family comes from base_model's config.json"),
    "is_qwen_derived_model": noted("the family comes from base_model's config.json"),
    "is_falcon_derived_model": noted("the family comes from base_model's config.json"),
    "cls_model_config": noted("the config class follows base_model's config.json (model_type)"),
    "model_revision": noted("base_model is a local directory: there is no Hub revision to pick"),
    "revision_of_model": noted("base_model is a local directory: there is no Hub revision to pick"),
    "trust_remote_code": noted("no remote code runs: the family's layers are minipar's own"),
    "model_config": refused("overrides of base_model's config (rope_scaling, ...) are not applied; edit "
                            "config.json in a copy of base_model"),
    "overrides_of_model_config": refused("overrides of base_model's config are not applied; edit config.json "
                                         "in a copy of base_model"),
    "model_kwargs": refused("from_pretrained keyword arguments are not applied; remove model_kwargs"),
    "overrides_of_model_kwargs": refused("from_pretrained keyword arguments are not applied; remove them"),
    "rope_scaling": refused("removed from Axolotl too; set rope_scaling in base_model's config.json"),
    "reinit_weights": refused("base_model's weights are always loaded; for random weights leave base_model "
                              "out and give the `model` section"),
    "num_labels": refused("minipar trains causal language models only; remove num_labels"),
    "processor_type": refused("multimodal processors are not supported: minipar trains text models; use a "
                              "text base"),
    "processor_kwargs": refused("multimodal processors are not supported: minipar trains text models; "
                                "remove processor_kwargs"),
    "image_size": noted("images apply to multimodal models only; minipar trains text models"),
    "image_resize_algorithm": noted("images apply to multimodal models only; minipar trains text models"),
    "freeze_mm_modules": noted("minipar loads text models only: there is no vision or audio tower to freeze"),
    "use_kernels": noted("Hub kernels (MegaBlocks, ...) compute the same math; minipar's layers do"),
    "experts_implementation": noted("how MoE experts are computed (a kernel choice); minipar's experts "
                                    "are models/moe.py's"),
    "llama4_linearized_experts": noted("Llama 4 only; its family is not one minipar loads"),
    "device_map": noted(_LOADING),
    "max_memory": noted(_LOADING),
    "gpu_memory_limit": noted(_LOADING),
    "low_cpu_mem_usage": noted(_LOADING),
    "experimental_skip_move_to_device": noted(_LOADING, accept=(True,)),
    # the tokenizer (data/special_tokens.py, data/chat_templates.py, models/resize_vocab.py)
    "special_tokens": honoured("bos/eos/pad/unk_token and additional_special_tokens added to the "
                               "tokenizer, the base's embedding (and untied lm_head) resized when it "
                               "has fewer rows, the model config's ids set "
                               "(minipar/trainer/data/special_tokens.py)"),
    "tokens": honoured("added to the tokenizer, the embedding resized as for special_tokens"),
    "added_tokens_overrides": honoured("{id: text}: the tokenizer's added tokens renamed, ids kept"),
    "resize_token_embeddings_to_32x": honoured("a resized vocabulary rounded up to a multiple of 32"),
    "mean_resizing_embeddings": honoured("true: new rows the mean of the old ones; false (Axolotl's "
                                         "default): N(0, initializer_range) (models/resize_vocab.py)"),
    "shrink_embeddings": honoured("a base vocabulary larger than the tokenizer cut to it"),
    "chat_template": honoured("tokenizer_default, tokenizer_default_fallback_<name>, jinja "
                              "(chat_template_jinja), or a name of Axolotl's, rendering as Axolotl's "
                              "template of that name (chatml, qwen_25, qwen3, llama3, llama4, mistral_*, "
                              "gemma, gemma3, phi_3, phi_35, phi_4, cohere, deepseek_v3, ...; its vision, "
                              "command_a, gemma4 and jamba templates refused with why: "
                              "minipar/trainer/data/chat_templates.py); saved with the tokenizer"),
    "chat_template_jinja": honoured("the template of chat_template: jinja (a Jinja string or a file)"),
    "tokenizer_use_fast": refused("minipar loads the fast tokenizer (tokenizer.json), whose ids a slow one "
                                  "may not match; remove tokenizer_use_fast: false", accept=(True,)),
    "tokenizer_legacy": refused("the tokenizer is used as saved in its directory; save it with the legacy "
                                "setting wanted and point tokenizer_config at it"),
    "tokenizer_use_mistral_common": refused("mistral-common tokenizers are not read; use the model's "
                                            "tokenizer.json (a transformers tokenizer directory)"),
    "tokenizer_save_jinja_files": noted("the tokenizer is saved as transformers writes it, its chat "
                                        "template with it", accept=(True,)),
    "chat_template_kwargs": refused("the chat template is rendered without extra variables; edit the "
                                    "template (chat_template: jinja) to fix them"),
    "default_system_message": refused("rows are rendered as written; add the system turn to the rows, or "
                                      "put it in the template (chat_template: jinja)"),
    "eot_tokens": refused("the end of a turn is the template's eos token; use train_on_eos / train_on_eot "
                          "in the datasets entry"),
    "fix_untrained_tokens": refused("embedding rows are not changed on load; fix them in a copy of "
                                    "base_model"),
}

PRECISION_AND_KERNELS = {
    "bfloat16": honoured("true: bf16: true (dtype bfloat16; float32 master weights and optimizer states are "
                         "kept, as for bf16); beside bf16: false it is refused"),
    "float32": honoured("true: bf16: false where bf16 is not set (bf16 wins, as in Axolotl)"),
    "float16": refused("fp16 is not supported: use bf16: true (or dtype: float32)"),
    "fp8": refused("FP8 training is not supported: use bf16: true"),
    "fp8_enable_fsdp_float8_all_gather": sub_option("fp8"),
    "tf32": noted("minipar computes in `dtype` (float32 or bfloat16) and does not switch TF32 matmuls "
                  "on; a CPU has no TF32"),
    "fp32_norms": noted("minipar's RMSNorm computes its statistics in float32, and the master weights "
                        "are float32"),
    "fp32_norm_classes": noted("minipar's RMSNorm computes its statistics in float32"),
    "embeddings_skip_upcast": noted("the master weights are float32 whatever `dtype` computes in"),
    # attention: the kernel choice (context_parallel/kernel_choice.py)
    "flash_attention": honoured("true: attention_backend flash"),
    "sdp_attention": honoured("true: attention_backend auto (SDPA picks the kernel)"),
    "flex_attention": honoured("true: attention_backend auto (the same attention, minipar's kernels)"),
    "eager_attention": honoured("true: attention_backend math"),
    "xformers_attention": honoured("true: attention_backend auto (xformers' memory-efficient attention is "
                                   "exact; SDPA picks the kernel)"),
    "attn_implementation": honoured("flash_attention_2 / flash_attention_3: flash; sdpa, flex_attention, "
                                    "xformers: auto; eager: math; sage and fp8 (approximate) are refused"),
    "sage_attention": refused("SageAttention quantises Q and K to int8 (an approximation); use "
                              "attn_implementation: sdpa or flash_attention_2 (exact attention)"),
    "s2_attention": refused("shifted-sparse attention is not supported (Axolotl removed it too); use "
                           "attention_backend"),
    "scaling_softmax": refused("Scaled Softmax (SSMax) attention changes the model; remove it"),
    "scaling_softmax_factor": sub_option("scaling_softmax"),
    "scaling_softmax_bias": sub_option("scaling_softmax"),
    "flex_attn_compile_kwargs": noted("minipar does not use flex attention; attention_backend picks the "
                                      "kernel"),
    "sdpa_varlen": noted("packed documents are kept apart by minipar's own attention "
                         "(context_parallel/documents.py)"),
    "large_head_attention": noted("the kernel for head_dim > 256: minipar's auto takes exact math there"),
    "flash_attn_d512": noted("the kernel for head_dim > 256: minipar's auto takes exact math there"),
    "gemma4_hybrid_attn_impl": noted("a kernel choice for Gemma 4, not a family minipar loads"),
    "fused_attn_kernel": noted(_KERNEL),
    "flash_attn_cross_entropy": noted(_KERNEL),
    "flash_attn_fuse_mlp": noted(_KERNEL),
    "flash_attn_rms_norm": noted(_KERNEL),
    "flash_optimum": noted("BetterTransformer kernels for the same math; minipar's layers compute it"),
    "chunked_cross_entropy": noted("a memory saver for the same loss; minipar computes the loss on its "
                                   "tp shards of the vocabulary"),
    "chunked_cross_entropy_num_chunks": noted("a memory saver for the same loss"),
    "cut_cross_entropy": noted("Cut Cross-Entropy computes the same loss with less memory; minipar "
                               "computes it on its tp shards of the vocabulary"),
    "liger_rope": noted(_LIGER), "liger_rms_norm": noted(_LIGER), "liger_rms_norm_gated": noted(_LIGER),
    "liger_layer_norm": noted(_LIGER), "liger_swiglu": noted(_LIGER), "liger_glu_activation": noted(_LIGER),
    "liger_cross_entropy": noted(_LIGER), "liger_fused_linear_cross_entropy": noted(_LIGER),
    "liger_use_token_scaling": refused("it weights each token's loss by its probability; remove it "
                                       "(the plain cross-entropy)"),
    "unsloth_cross_entropy_loss": noted(_UNSLOTH), "unsloth_lora_mlp": noted(_UNSLOTH),
    "unsloth_lora_qkv": noted(_UNSLOTH), "unsloth_lora_o": noted(_UNSLOTH),
    "unsloth_rms_norm": noted(_UNSLOTH), "unsloth_rope": noted(_UNSLOTH),
    # memory: the same result, other costs
    "gradient_checkpointing_kwargs": noted("use_reentrant: minipar's activation checkpointing is always "
                                           "non-reentrant (torch.utils.checkpoint use_reentrant=False)"),
    "selective_checkpointing": noted("minipar's selective form is gradient_checkpointing: selective with "
                                     "selective_ac_option (op: keep matmul and attention outputs)"),
    "activation_offloading": noted(_MEMORY),
    "layer_offloading": noted(_MEMORY),
    "tiled_mlp": noted(_MEMORY),
    "tiled_mlp_num_shards": noted(_MEMORY),
    "tiled_mlp_use_original_mlp": noted(_MEMORY, accept=(True,)),
    "torch_compile_options": noted("inductor flags are left at torch's defaults; compile_mode picks the "
                                   "mode (docs/compile.md)"),
}

ADAPTERS = {
    "peft_use_dora": refused("DoRA is not supported; use adapter: lora"),
    "peft_use_rslora": refused("rsLoRA scales by alpha / sqrt(r); for the same update use adapter: lora "
                               "with lora_alpha = alpha x sqrt(lora_r)"),
    "peft_init_lora_weights": refused("LoRA starts as PEFT's default (A random, B = 0); remove "
                                      "peft_init_lora_weights", accept=(True,)),
    "peft": refused("LoftQ initialisation is not supported; remove `peft` (adapter: lora starts from B = 0)"),
    "peft_layers_to_transform": refused("adapters go on every decoder layer; remove it, or choose "
                                        "lora_target_modules"),
    "peft_layers_pattern": refused("adapters go on every decoder layer; remove it"),
    "peft_layer_replication": refused("layer replication is not supported; remove it"),
    "peft_trainable_token_indices": refused("embedding rows are not trained under LoRA; train every weight "
                                            "(adapter: null) or remove it"),
    "peft_autocast_adapter_dtype": refused("adapters keep float32 master weights (PEFT's default); remove "
                                           "peft_autocast_adapter_dtype: false", accept=(True,)),
    "peft_ensure_weight_tying": noted("adapters go on the decoder's projections only: no tied embedding "
                                      "carries one"),
    "lora_alpha_pattern": refused("one lora_alpha for every adapter; remove lora_alpha_pattern"),
    "lora_rank_pattern": refused("one lora_r for every adapter; remove lora_rank_pattern"),
    "lora_fan_in_fan_out": refused("minipar's projections are nn.Linear (out, in), not Conv1D; remove it"),
    "lora_target_parameters": refused("adapters on raw parameters (MoE experts) are not supported; use "
                                      "lora_target_modules"),
    "loraplus_lr_ratio": refused("LoRA+ (a larger learning rate for B) is not supported; remove it "
                                 "(one learning_rate)"),
    "loraplus_lr_embedding": sub_option("loraplus_lr_ratio"),
    "lora_mlp_kernel": noted(_LORA_KERNEL), "lora_qkv_kernel": noted(_LORA_KERNEL),
    "lora_o_kernel": noted(_LORA_KERNEL), "lora_embedding_kernel": noted(_LORA_KERNEL),
    "lora_on_cpu": noted(_LOADING),
    "merge_method": noted("merge_lora writes W0 + (alpha/r) B A shard by shard either way"),
    "bnb_config_kwargs": sub_option("load_in_4bit"),
    "qlora_sharded_model_loading": sub_option("adapter: qlora"),
    "model_quantization_config": refused("quantised bases (MXFP4, FP8) need GPU kernels minipar does not "
                                         "have; use a bf16 or fp32 base"),
    "model_quantization_config_kwargs": sub_option("model_quantization_config"),
    "quantize_moe_experts": refused("quantised experts need GPU kernels minipar does not have; use a bf16 "
                                    "or fp32 base"),
    "use_onebitllms": refused("1.58-bit training is not supported; use a bf16 or fp32 base"),
    "qat": refused("quantisation-aware training is not supported; train in bf16 (bf16: true) and "
                   "quantise the exported <output_dir>/hf"),
    "quantization": noted("post-training quantisation is `axolotl quantize`'s step, after training; "
                          "quantise <output_dir>/hf with your tool"),
    "relora": refused("ReLoRA is not supported; use adapter: lora"),
    "relora_cpu_offload": sub_option("relora"),
    "relora_prune_method": sub_option("relora"),
    "relora_prune_ratio": sub_option("relora"),
    "lisa_n_layers": refused("LISA (training a few layers at a time) is not supported; use adapter: lora"),
    "lisa_step_interval": refused("LISA is not supported; use adapter: lora"),
    "lisa_layers_attribute": sub_option("lisa_n_layers"),
    "unfrozen_parameters": refused("freezing some weights is not supported; train every weight (adapter: "
                                   "null) or LoRA (adapter: lora)"),
}

OPTIMIZER_AND_SCHEDULE = {
    "warmup_ratio": honoured("warmup_steps = int(warmup_ratio x max_steps), as Axolotl"),
    "warmup_steps": honoured("a float below 1 is a ratio (warmup_ratio), as Axolotl accepts"),
    "cosine_min_lr_ratio": honoured("min_lr_ratio (the cosine's floor as a fraction of learning_rate)"),
    "adam_epsilon": honoured("AdamW's eps (torch's, or bitsandbytes' AdamW and AdEMAMix), as the HF "
                             "Trainer's adam_epsilon"),
    "lr_scheduler": honoured("cosine, cosine_with_min_lr, linear, constant, constant_with_warmup "
                             "(minipar/lr_schedule.py SCHEDULES)"),
    "batch_size": honoured("micro_batch_size x gradient_accumulation_steps per data-parallel rank, as "
                           "Axolotl: gradient_accumulation_steps = batch_size / micro_batch_size"),
    "lr_scheduler_kwargs": refused("extra scheduler arguments are not read; use min_lr_ratio "
                                   "(cosine_min_lr_ratio) and warmup_steps"),
    "cosine_constant_lr_ratio": refused("the cosine is not held flat part-way; use min_lr_ratio and "
                                        "lr_scheduler"),
    "lr_quadratic_warmup": refused("the warmup is linear; remove lr_quadratic_warmup"),
    "lr_div_factor": sub_option("lr_scheduler: one_cycle"),
    "jagged_restart_steps": refused("jagged restarts of the schedule are not supported; use lr_scheduler"),
    "jagged_restart_warmup_steps": refused("jagged restarts are not supported; use warmup_steps"),
    "jagged_restart_anneal_steps": refused("jagged restarts are not supported; use lr_scheduler"),
    "lr_groups": refused("one learning_rate for every weight; remove lr_groups"),
    "embedding_lr": refused("one learning_rate for every weight; remove embedding_lr"),
    "embedding_lr_scale": refused("one learning_rate for every weight; remove embedding_lr_scale"),
    "optim_args": refused("AdamW takes adam_beta1, adam_beta2, adam_epsilon and weight_decay; use those "
                          "(bitsandbytes' AdEMAMix takes the HF Trainer's defaults for its own: beta3 "
                          "0.9999, alpha 5)"),
    "optim_target_modules": sub_option("optimizer: galore"),
    "adam_beta3": sub_option("optimizer: came_pytorch"),
    "adam_epsilon2": sub_option("optimizer: came_pytorch"),
    "torchdistx_path": sub_option("optimizer: adamw_anyprecision"),
    **{f"dion_{k}": sub_option("optimizer: dion") for k in ("lr", "momentum", "rank_fraction",
                                                                    "rank_multiple_of")},
    **{f"qgalore_{k}": sub_option("optimizer: qgalore") for k in (
        "rank", "update_proj_gap", "scale", "proj_type", "proj_quant", "proj_bits", "proj_group_size",
        "cos_threshold", "gamma_proj", "queue_size")},
    "neftune_noise_alpha": refused("NEFTune's noise on the embeddings is not added; remove it"),
    "noisy_embedding_alpha": refused("NEFTune's noise on the embeddings is not added; remove it"),
    "use_eaft": refused("the entropy-aware focal loss is not supported; remove it (the plain "
                        "cross-entropy)"),
    "eaft_alpha": sub_option("use_eaft"),
    "eaft_k": sub_option("use_eaft"),
    "auto_find_batch_size": noted("micro_batch_size is used as given; an out-of-memory stops the run"),
    "early_stopping_patience": refused("there is no early stopping; set max_steps"),
}

TOPICS = {"the model and its tokenizer": MODEL, "precision, attention and kernels": PRECISION_AND_KERNELS,
          "LoRA and other adapters": ADAPTERS, "the optimizer and the schedule": OPTIMIZER_AND_SCHEDULE}

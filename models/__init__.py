"""The reference models built from minipar's parallel layers: llama.py, the Llama decoder with
Hugging Face's parameter names (TP and CP inside it; DDP and ZeRO-3 wrap it from outside);
llama_layer.py, one decoder layer (attention, the MLP or a mixture of experts);
llama_config.py, its shape and the families' named differences (Qwen2's q/k/v biases, sliding
windows, Phi-3's partial RoPE, Qwen3's q/k norms, Gemma's scaled embeddings, sandwich norms, GeGLU,
query scale and soft-caps, the experts), with config_checks.py (what each family's config may be)
and hf_config.py (config.json's keys per family, transformers 4's and 5's); rope.py, the rotary
position tables; llama_init.py, meta-device construction filled from a seed or a checkpoint;
hf_checkpoint.py, a Hugging Face directory read slice by slice; full_state.py, the whole model's
tensors gathered out of a parallel model and sliced back in; resize_vocab.py its vocabulary
resized for added tokens, hf_classes.py Axolotl's model_type / tokenizer_type checked against it;
kv_cache.py, generation's K/V cache and the cached forward through the same layers."""

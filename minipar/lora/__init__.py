"""LoRA: low-rank adapters on a frozen, sharded base (Hu et al., 2021). The files in reading order:

    adapter.py       the adapter inside a Column/RowParallelLinear (which piece is whole, which is
                     split, which gradient is summed over tp), add_lora on a model's declared targets
    peft_format.py   PEFT's adapter directory (adapter_config.json, adapter_model.safetensors) out and
                     in, and the merge W0 + (alpha / r) B A for a plain Hugging Face directory

    from minipar.lora import add_lora
    add_lora(model, ["q_proj", "v_proj"], r=8, alpha=16)   # base frozen; adapters trainable
"""
from .adapter import LoRA, adapters_off, add_lora, check_targets, lora_parameters, lora_summary, lora_targets
from .peft_format import (
    adapter_config,
    adapter_shapes,
    check_adapter,
    full_adapters,
    load_adapters,
    merge,
    minipar_name,
    peft_key,
    read_adapter_config,
    save_adapter,
)

__all__ = ["LoRA", "adapters_off", "add_lora", "check_targets", "lora_parameters", "lora_summary",
           "lora_targets", "adapter_config", "adapter_shapes", "check_adapter", "full_adapters",
           "load_adapters", "merge", "minipar_name", "peft_key", "read_adapter_config", "save_adapter"]

"""Write a small Hugging Face Llama checkpoint to fine-tune, offline: the first command of the
README's "Fine-tune a Hugging Face model".

    python -m minipar.trainer.data.make_example out/example
      out/example/model/    config.json, model-0000k-of-0000n.safetensors + model.safetensors.index.json
                            (random weights, as `save_pretrained` shards them), and the tokenizer
      then: torchrun --nproc-per-node 8 train.py configs/finetune.yaml
      and preference training on out/example/preference.jsonl (48 generated pairs, chat form):
            torchrun --nproc-per-node 8 train.py configs/dpo.yaml   (dpo_lora.yaml: LoRA)

    python -m minipar.trainer.data.make_example out/example_moe --model mixtral    (or qwen3_moe)
      the same with a small mixture of experts, its experts one tensor each as on the Hub
      (model.layers.0.block_sparse_moe.experts.3.w1.weight, ...; models/hf_names.py)
      then: torchrun --nproc-per-node 8 train.py configs/finetune_moe.yaml

The checkpoint is written tensor by tensor with safetensors (no transformers model is built, so a
checkpoint of any size can be made in the memory of one shard file): the HF names and full shapes
come from minipar's own Llama built on the meta device, the values from the same seeded
initialisation as a fresh run (models/llama_init.py). benchmarks/bench_load.py makes its 300 M
parameter checkpoint with `write_checkpoint` too. With `datasets` in the tree, the example's
tokenizer and chat data come from minipar/trainer/data/example_data.py.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import torch

from minipar.trainer.checkpoint.save_load import copy_tokenizer
from minipar.trainer.data import example_data
from models.hf_names import hub_shapes, stacked_expert
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig
from models.llama_init import SeededInit

# a small Llama (about 4 M parameters) with what real ones carry: GQA, llama3 RoPE scaling
EXAMPLE = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
               rope_theta=500000.0,
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=256))
# small mixtures of experts (about 14 M parameters, 5 M active per token): 8 experts, top-2
MOE = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=4, max_position_embeddings=2048, rope_theta=1000000.0, num_local_experts=8,
           num_experts_per_tok=2, router_aux_loss_coef=0.001)
EXAMPLES = {"llama": EXAMPLE,
            "mixtral": dict(MOE, model_type="mixtral", intermediate_size=512),
            "qwen3_moe": dict(MOE, model_type="qwen3_moe", head_dim=32, intermediate_size=768,
                              moe_intermediate_size=512, norm_topk_prob=True, rms_norm_eps=1e-6)}


def write_checkpoint(directory: str, config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                     max_shard_bytes: int = 2 ** 30, progress: bool = False) -> dict:
    """config.json + safetensors shards (+ index when more than one) of a randomly initialised
    Llama; returns the index's weight_map. Holds at most one shard's tensors in memory."""
    from safetensors.torch import save_file
    model = LlamaForCausalLM(config, device="meta")
    init = SeededInit(model, seed)
    # the Hub's tensors (an MoE's experts one each), each with minipar's parameter and expert index
    names, source = [], {}
    for n, p in model.named_parameters():        # tied weights once
        parts = hub_shapes(n, tuple(p.tp_full_shape), config.model_type)
        for j, (hub, shape) in enumerate(parts):
            names.append((hub, shape))
            source[hub] = (n, j if stacked_expert(n) else None)
    drawn = {}

    def full(hub):                               # a stacked expert weight is drawn once, then cut
        name, j = source[hub]
        if j is None:
            return init.full(name)
        if name not in drawn:
            drawn.clear()
            drawn[name] = init.full(name)
        return drawn[name][j]
    groups, size = [[]], 0
    for name, shape in names:                    # consecutive tensors, cut at max_shard_bytes
        nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    os.makedirs(directory, exist_ok=True)
    weight_map, n = {}, len(groups)
    for k, group in enumerate(groups, 1):
        fname = "model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
        tensors = {name: full(name).to(dtype).contiguous() for name in group}
        save_file(tensors, os.path.join(directory, fname + ".tmp"), metadata={"format": "pt"})
        os.replace(os.path.join(directory, fname + ".tmp"), os.path.join(directory, fname))
        weight_map.update(dict.fromkeys(group, fname))
        del tensors
        if progress:
            print(f"  wrote {fname} ({len(group)} tensors)", flush=True)
    if n > 1:
        total = sum(torch.Size(s).numel() for _, s in names) * torch.tensor([], dtype=dtype).element_size()
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump(dict(metadata=dict(total_size=total), weight_map=weight_map), f, indent=2)
    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(dtype).replace("torch.", "")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    return weight_map


def make_example(directory: str, seed: int = 0, num_conversations: int = 2000,
                 tokenizer_chars: Optional[int] = None, model: str = "llama") -> dict:
    """out/model (checkpoint + tokenizer, as on the Hub) and out/data (the chat rows); model: a key
    of EXAMPLES (llama, mixtral, qwen3_moe)."""
    model_dir = os.path.join(directory, "model")
    paths = dict(model=model_dir)
    config = LlamaConfig(**EXAMPLES[model])
    paths.update(example_data.make_example(directory, num_conversations=num_conversations,
                                           vocab_size=config.vocab_size, seed=seed,
                                           tokenizer_chars=tokenizer_chars))
    write_checkpoint(model_dir, config, seed=seed, max_shard_bytes=4 * 2 ** 20)
    copy_tokenizer(paths["tokenizer"], model_dir)    # the tokenizer beside the weights, as on the Hub
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", default="out/example")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(EXAMPLES), default="llama",
                        help="a small Llama (default) or mixture of experts")
    args = parser.parse_args(argv)
    for what, path in make_example(args.directory, args.seed, model=args.model).items():
        print(f"{what:>10}: {path}")
    config, home = ("finetune.yaml", "out/example") if args.model == "llama" else \
        ("finetune_moe.yaml", "out/example_moe")
    print(f"next: {next_command(args.directory, config, home)}")


def next_command(directory: str, config: str, home: str) -> str:
    """The command that fine-tunes what was just written: configs/finetune*.yaml reads `home`
    (out/example), so another directory is named by --base_model and --datasets."""
    command = f"torchrun --nproc-per-node 8 train.py configs/{config}"
    if os.path.normpath(directory) == os.path.normpath(home):
        return command
    rows = os.path.join(directory, "chat.jsonl")
    return (f"{command} --base_model {os.path.join(directory, 'model')} "
            f"--datasets '[{{path: {rows}, type: chat_template}}]'")


if __name__ == "__main__":
    main()

r"""Export a minipar checkpoint (sharded or full, from any layout) as a Hugging Face directory.

    python -m minipar.training.checkpoint.export out/default/step-300 out/default/hf-step-300
    python -m minipar.training.checkpoint.export out/finetune/step-100 out/finetune/hf-100 \
        --tokenizer out/example/model

Runs on one process: the checkpoint's manifest holds the model config, every shard file is read,
the full tensors are rebuilt by HF name (save_load.py does the resharding), and
`models/hf_checkpoint.py:save_pretrained` writes config.json + model.safetensors, which
`transformers.LlamaForCausalLM.from_pretrained` loads. Training runs export at the end by
themselves (`export_hf: true`); this is the same, on request, for any saved step.

The tokenizer beside it: --tokenizer DIR copies that directory's tokenizer files; without it, the
run's own (the checkpoint's saved config: tokenizer_config, else base_model), and for a byte-level
run (neither set) the byte tokenizer that `AutoTokenizer.from_pretrained(hf_dir)` loads
(tokenizer.py: save_byte_tokenizer).
"""
from __future__ import annotations

import argparse

from minipar.training.checkpoint import save_load as ckpt
from minipar.training.checkpoint.verify import read_manifest
from minipar.training.data.tokenizer import save_byte_tokenizer
from models.hf_checkpoint import save_pretrained
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig


def export_checkpoint(checkpoint_dir: str, hf_dir: str, tokenizer: str = None) -> str:
    manifest = read_manifest(checkpoint_dir)     # refuses a partial or foreign directory, naming it
    config = manifest.get("model_config")
    if not config:
        raise ValueError(f"{checkpoint_dir}: the manifest has no model_config, cannot rebuild the model")
    model = LlamaForCausalLM(LlamaConfig.from_dict(config))
    extra = ckpt.load_checkpoint(checkpoint_dir, model, None, model.pgm)   # verifies sizes and checksums
    save_pretrained(model, hf_dir)
    saved = (extra or {}).get("config") or {}   # the run's config, as train.py saved it
    tokenizer = tokenizer or saved.get("tokenizer_config") or saved.get("base_model")
    if tokenizer:                                # e.g. the base_model the run fine-tuned
        ckpt.copy_tokenizer(tokenizer, hf_dir)
    elif saved:                                  # a byte-level run: its 256-id tokenizer
        save_byte_tokenizer(hf_dir)
    return hf_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description="Export a minipar checkpoint as a Hugging Face directory.")
    parser.add_argument("checkpoint", help="a step-N checkpoint directory")
    parser.add_argument("hf_dir", help="where to write config.json and model.safetensors")
    parser.add_argument("--tokenizer",
                        help="a directory whose tokenizer files to copy beside (default: the run's "
                        "tokenizer_config or base_model; a byte-level run gets its byte tokenizer)")
    args = parser.parse_args(argv)
    print(f"exported {args.checkpoint} to {export_checkpoint(args.checkpoint, args.hf_dir, args.tokenizer)}")


if __name__ == "__main__":
    main()

"""A Hugging Face model directory, read slice by slice (each rank reads only the part it keeps), and
written back (save_pretrained: the whole model, gathered tensor by tensor and written by global
rank 0 into shards as they fill, models/hf_shards.py).

    base_model/
      config.json                                  -> LlamaConfig (Llama, Qwen2/2.5, Mistral,
                                                      Phi-3/4, Qwen3, Gemma 2, Gemma 3 text,
                                                      Mixtral, Qwen3-MoE; architecture, activation
                                                      and RoPE checked: models/hf_config.py)
      model.safetensors                            one file, or the sharded form:
      model-00001-of-00002.safetensors ...         + model.safetensors.index.json {"weight_map":
      model.safetensors.index.json                     {tensor name: file name}}

A safetensors file is an 8-byte header length, a JSON header ({name: dtype, shape, byte offsets})
and the raw tensors back to back. `safe_open` memory-maps the file and parses only the header, and
`get_slice(name)[a:b]` copies out just rows a..b of one tensor; nothing else of the file is read.
So a rank that keeps the TP slice `full.chunk(tp, dim)[t]` of a tensor reads exactly that slice:

    q_proj.weight (H*hd, d)   column-parallel, dim 0:  rows  [t*H*hd/tp, (t+1)*H*hd/tp)   contiguous
    o_proj.weight (d, H*hd)   row-parallel, dim 1:     columns of every row               strided
    norm weights, row biases  replicated:              the whole (small) tensor

and under ZeRO-3 it reads only the tensors that overlap its flat shard (zero3's shard_from_source).
An MoE checkpoint stores one tensor per expert and projection, minipar one stacked (E, ...) tensor
per projection (the names: models/hf_names.py): the reader stacks the experts, reading only those
of an expert-parallel rank's share when asked for one, and save_pretrained writes them back one by one.
Phi-3's fused qkv_proj / gate_up_proj are read part by part (a part's tp slice is a run of the
fused tensor's rows) and fused again on export.
Each read opens the file, copies the slice and closes it again, so the memory map never keeps pages
of tensors that belong to other ranks resident (benchmarks/bench_load.py measures the peak).

Everything that can be wrong is found from config.json and the headers alone, before the process
groups exist, and raised as a ValueError on every rank: another architecture, an unsupported RoPE
scaling, a missing or unexpected tensor, a shape that does not match the config, a dtype other than
bf16/fp16/fp32, a config.json or shard index that is not JSON (the file, line and column), a
.safetensors file that is truncated or damaged (its header does not parse or does not cover the
file: safetensors checks that much; flipped bytes inside a tensor go unseen, there is no checksum).
Each says what to do: re-download or re-export the model. The one architecture check (model_type
and class of a family minipar builds, its activation) is read_hf_config's, which the planner's --model uses
too (Llama only there).

A run that added tokens resizes the vocabulary (resize_vocab(): models/resize_vocab.py): check()
then expects the file's rows, and source() gives embed_tokens / lm_head with the new rows.

Tied embeddings: the model has one `model.embed_tokens.weight`; a checkpoint that also stores
`lm_head.weight` loads (transformers ignores it too), as do stale `rotary_emb.inv_freq` buffers.
The core imports this file without transformers: nothing here needs it.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open

from minipar.config_files import read_json
from models.hf_config import FAMILIES, activation_problem
from models.hf_names import fused_rows, hub_name, hub_shape_map, stacked_expert
from models.hf_shards import INDEX, MAX_SHARD_BYTES, SINGLE, HeldBytes, ShardWriter, hub_items
from models.llama_config import LlamaConfig
from models.resize_vocab import VocabResize

ARCHITECTURE = "LlamaForCausalLM"
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# files of a tokenizer that an export copies next to the weights (whatever the tokenizer kind)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


# what to do about a damaged file of a Hugging Face directory, said with every refusal of one
REFETCH = "re-download the model, or re-export it (save_pretrained / minipar's export_hf)"


def read_hf_config(path: str, where: str, families=("llama",)) -> dict:
    """A config.json as a dict, refused (ValueError naming `where`) unless it is a decoder of one of
    `families` (model_type keys of llama_config.FAMILIES): the one architecture check of train.py's
    base_model (every family minipar builds) and the planner's --model (Llama only)."""
    d = read_json(path, REFETCH)             # invalid JSON: the file, line and column
    if not isinstance(d, dict):
        raise ValueError(f"{path} holds a {type(d).__name__}, not a model config mapping; {REFETCH}")
    kind = d.get("model_type", "llama")
    archs = d.get("architectures") or [FAMILIES.get(kind, ARCHITECTURE)]
    if kind not in families or archs != [FAMILIES[kind]]:
        names = ", ".join(f"{FAMILIES[f]} (model_type {f!r})" for f in families)
        raise ValueError(f"{where} is a {'/'.join(map(str, archs))} (model_type {kind!r}); minipar "
                         f"loads only {names} checkpoints here")
    problem = activation_problem(d)        # SwiGLU's silu, or Gemma's GeGLU (gelu_pytorch_tanh)
    if problem:
        raise ValueError(f"{where}: {problem}")
    return d


def read_config(directory: str) -> LlamaConfig:
    """DIR/config.json -> LlamaConfig; refuses another architecture or an unsupported RoPE."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"base_model {directory!r}: {path} not found; a Hugging Face model directory "
                                f"holds config.json and model.safetensors (or its sharded form)")
    d = read_hf_config(path, f"base_model {directory!r}", tuple(FAMILIES))
    try:
        return LlamaConfig.from_dict(d)
    except (ValueError, TypeError) as err:
        raise ValueError(f"base_model {directory!r}: config.json: {err}") from None


def _read_header(path: str, directory: str, tensors: dict) -> None:
    """Add the tensors of one safetensors file's header to `tensors`; a truncated or damaged file
    (safetensors: "incomplete metadata", "invalid header length") is one line naming it."""
    try:
        with safe_open(path, framework="pt") as f:          # parses the header only
            for key in f.keys():
                sl = f.get_slice(key)
                tensors[key] = (path, tuple(sl.get_shape()), sl.get_dtype())
    except SafetensorError as err:
        reason = str(err).removeprefix("Error while deserializing header: ")
        raise ValueError(f"base_model {directory!r}: {path} is truncated or damaged ({reason}, "
                         f"{os.path.getsize(path)} bytes); {REFETCH}") from None


class HFCheckpoint:
    """The directory's config and tensor index (name -> file, shape, dtype), from the headers only."""

    def __init__(self, directory: str):
        self.directory = directory
        self.config = read_config(directory)
        self.vocab_resize: Optional[VocabResize] = None    # resize_vocab's, once a run adds tokens
        index_path, single = os.path.join(directory, INDEX), os.path.join(directory, SINGLE)
        if os.path.isfile(index_path):
            index = read_json(index_path, REFETCH)
            weight_map = (index.get("weight_map") if isinstance(index, dict) else None) or {}
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            weight_map, files = None, [SINGLE]
        else:
            raise FileNotFoundError(f"base_model {directory!r}: neither {SINGLE} nor {INDEX} found (only "
                                    f"safetensors checkpoints load; "
                                    f"convert .bin files with transformers first)")
        self.tensors: Dict[str, Tuple[str, tuple, str]] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"base_model {directory!r}: {INDEX} names {name}, which is missing")
            _read_header(path, directory, self.tensors)
        if weight_map is not None:
            lost = sorted(k for k, v in weight_map.items() if self.tensors.get(k, (None,))[0] !=
                          os.path.join(directory, v))
            if lost:
                raise ValueError(f"base_model {directory!r}: {INDEX} places {len(lost)} tensors "
                                 f"in files that "
                                 f"do not hold them, e.g. {lost[:3]}")

    @property
    def nbytes(self) -> int:
        size = {"BF16": 2, "F16": 2, "F32": 4}
        total = 0
        for _, shape, dtype in self.tensors.values():
            n = size.get(dtype, 4)
            for s in shape:
                n *= s
            total += n
        return total

    def resize_vocab(self, resize: VocabResize) -> None:
        """From now on the model has resize.new vocabulary rows (tokens a run added): config.vocab_size
        follows, check() expects the file's resize.old rows, source() makes the new ones
        (models/resize_vocab.py)."""
        self.vocab_resize = resize
        self.config = dataclasses.replace(self.config, vocab_size=resize.new)

    def check(self, model) -> None:
        """Refuse (ValueError) a checkpoint whose tensors are not exactly this model's parameters.
        `model` may be built on the meta device; its tp_full_shape are compared. Local, no collective."""
        resize = self.vocab_resize
        want = hub_shape_map(((n, resize.file_shape(n, tuple(p.tp_full_shape)) if resize else
                               tuple(p.tp_full_shape)) for n, p in model.named_parameters()),   # tied once
                             self.config.model_type)
        where = f"base_model {self.directory!r}"
        missing = sorted(set(want) - set(self.tensors))
        ignorable = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        extra = sorted(n for n in set(self.tensors) - set(want)
                       if n not in ignorable and not n.endswith("rotary_emb.inv_freq"))
        if missing:
            raise ValueError(f"{where} lacks {len(missing)} tensors the config implies, e.g. {missing[:3]} "
                             f"(config.json and the weights disagree, or the file is incomplete)")
        if extra:
            raise ValueError(f"{where} has {len(extra)} tensors this model does not have, e.g. {extra[:3]} "
                             f"(another architecture, or attention_bias/mlp_bias/tie_word_embeddings unset)")
        for n, shape in want.items():
            _, got, dtype = self.tensors[n]
            if got != shape:
                raise ValueError(f"{where}: {n} has shape {got}, config.json implies {shape}: the weights "
                                 f"do not match the config")
            if dtype not in DTYPES:
                raise ValueError(f"{where}: {n} is stored as {dtype}; only {', '.join(DTYPES)} load "
                                 f"(quantized checkpoints are not supported)")

    def source(self, tp, device=None):
        """The weight source of this checkpoint: SlicedReader, its vocabulary resized if asked."""
        reader = SlicedReader(self, tp, device)
        return reader if self.vocab_resize is None else self.vocab_resize.wrap(reader, tp)


class SlicedReader:
    """The weight source (models/llama_init.py) of a checked HFCheckpoint: this rank's TP slice of
    any tensor, read with get_slice; returned in the file's dtype (the caller casts). A stacked
    expert weight is read expert by expert (models/hf_names.py) and stacked; `experts=(first,
    count)` (an expert-parallel rank's share) reads only those experts' tensors."""

    def __init__(self, ckpt: HFCheckpoint, tp, device=None):
        self.ckpt, self.tp = ckpt, tp
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.bytes_read = 0

    def tp_local(self, name: str, full_shape, tp_split_dim: Optional[int], experts=None) -> torch.Tensor:
        kind = self.ckpt.config.model_type
        if stacked_expert(name):              # experts are whole on every tp rank: no tp slice
            first, count = experts if experts is not None else (0, full_shape[0])
            return torch.stack([self._read(hub_name(name, kind, j), full_shape[1:], None)
                                for j in range(first, first + count)])
        fused = fused_rows(name, self.ckpt.config)     # Phi-3's q/k/v, gate/up: rows of one tensor
        if fused is not None:
            return self._read(fused[0], full_shape, tp_split_dim, row0=fused[1])
        return self._read(hub_name(name, kind), full_shape, tp_split_dim)

    def _read(self, name: str, full_shape, tp_split_dim: Optional[int], row0: Optional[int] = None
              ) -> torch.Tensor:
        """This rank's tp slice of tensor `name` (of full_shape), or, with row0, of its rows
        [row0, row0 + full_shape[0]) (a part of a fused tensor)."""
        path, shape, _ = self.ckpt.tensors[name]
        full_shape = tuple(full_shape)
        fits = shape == full_shape if row0 is None else \
            (shape[1:] == full_shape[1:] and row0 + full_shape[0] <= shape[0])
        if not fits:
            raise ValueError(f"{path}: {name} has shape {shape}, the model expects {full_shape}")
        index = [slice(None)] * len(shape)
        lo = row0 or 0
        if row0 is not None:
            index[0] = slice(row0, row0 + full_shape[0])
        if tp_split_dim is not None and self.tp.size > 1:
            n = full_shape[tp_split_dim] // self.tp.size
            lo = lo if tp_split_dim == 0 else 0
            index[tp_split_dim] = slice(lo + self.tp.rank * n, lo + (self.tp.rank + 1) * n)
        with safe_open(path, framework="pt") as f:   # opened per tensor: the map is released at once
            sl = f.get_slice(name)
            t = sl[tuple(index)] if any(i != slice(None) for i in index) else sl[:]
        self.bytes_read += t.numel() * t.element_size()
        return t.to(self.device)


def save_pretrained(model, directory: str, full=None, max_shard_bytes: int = MAX_SHARD_BYTES,
                    meter: Optional[HeldBytes] = None) -> list:
    """Write `model` as a Hugging Face directory: config.json + model.safetensors, or shards of at
    most max_shard_bytes and their index (fp32, HF names; lm_head.weight left out when tied, as
    transformers saves it); returns the weight files written (on global rank 0; [] elsewhere).
    Collective: every rank calls it. The model is gathered one full tensor at a time
    (model.full_state_items: over tp, the ZeRO-3 shards, the pipeline stages in turn) and global
    rank 0 moves each to the host and into the open shard as it comes (models/hf_shards.py), so
    neither the device nor the host ever holds the whole model. `full`: these {HF name: full
    tensor} instead of gathering the model's (then nothing is collective), or an iterable of
    (name, tensor) items (collective if they are: a merged LoRA model's). `meter`: an accounting
    hook (hf_shards.HeldBytes) shown every tensor the export makes."""
    if full is None:
        items = model.full_state_items(meter)
    else:
        items = iter(full.items() if isinstance(full, dict) else full)
    writer = ShardWriter(directory, max_shard_bytes, meter) if model.pgm.global_rank == 0 else None
    for name, t in hub_items(items, model.config.model_type, model.config.tie_word_embeddings):
        if writer is not None:                # the other ranks only take part in the gathers
            writer.add(name, t)
        del t                                 # nothing here outlives its turn
    if writer is None:
        return []
    files = writer.close()
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model.config.to_hf_dict(), f, indent=2)
    return files

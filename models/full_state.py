"""The whole model's tensors, out of and into a parallel model: what a checkpoint in Hugging Face's
names needs when no rank holds a whole parameter. LlamaForCausalLM's full_state_dict,
full_state_items, load_full_state_dict and from_pretrained call these (models/llama.py).

Each parameter carries how it was cut, set by the layer that cut it: `tp_split_dim` (tensor
parallelism, minipar/tensor_parallel/parallelize.py) and `ep_split_dim` (an MoE's stacked experts,
minipar/expert_parallel/sharding.py). A rank's tensor is one block of the full one along each:

    parameter                      full shape      this rank keeps          tp_split_dim
    embed_tokens / lm_head         (V, d)          rows V/tp                0 (vocab)
    q/k/v_proj, gate/up_proj       (out, d)        rows out/tp              0 (column-parallel)
    o_proj, down_proj              (d, in)         columns in/tp            1 (row-parallel)
    norms (and row biases)         (d,)            the whole tensor         None (replicated)
    an MoE's stacked experts       (E, ...)        E/ep experts, whole      None; ep_split_dim 0

Out (gather): owned_full(p) = ep_gather(tp_gather(p)): an all-gather over tp along tp_split_dim,
then one over ep along ep_split_dim; the tensor is the same on every rank. Cost per tensor: its
full size, (tp-1)/tp of it over the wire in the tp all-gather (and (ep-1)/ep in the ep one); a
replicated tensor costs nothing and is copied, so that what leaves never shares the live
parameter's memory. Under ZeRO-3 no rank even holds its tp slice: minipar/zero3/state_dicts.py
first all-gathers each unit's flat shards over dp_shard_cp, then does the same tp/ep gathers. A
pipeline stage holds only its layers; minipar/pipeline_parallel/stage.py gathers its own like
this and then broadcasts each tensor over pp, stage after stage (stream_over_stages).

full_state_items streams: one full tensor at a time (a ZeRO-3 unit at a time), so an export
(models/hf_checkpoint.py save_pretrained) moves each to the host and frees it before the next is
gathered, and neither the device nor the host ever holds the whole model. full_state_dict is the
same items in one dict. Both are collectives: every rank must take every item, in order.

In (slice): load_full_state_dict cuts each full tensor to this rank's block: shard_tensor along
tp_split_dim (full.chunk(tp, dim)[tp.rank]), then ep_shard along ep_split_dim. No communication:
every rank holds the full dict and keeps its block; the names and shapes are checked against the
model (p.tp_full_shape) first, so a checkpoint of another shape is refused before any copy.
from_pretrained never makes the full tensors at all: it builds the model on the meta device and
each rank reads only its slice from the safetensors files (models/hf_checkpoint.py, through
models/llama_init.py materialize). No communication either.
"""
from __future__ import annotations

from typing import Optional

import torch

from minipar import tensor_parallel as tpl
from minipar.expert_parallel.sharding import ep_gather, ep_shard
from minipar.mesh import ProcessGroupManager
from minipar.zero3 import ShardedStateDicts

from .hf_checkpoint import HFCheckpoint
from .llama_init import materialize
from .resize_vocab import VocabResize


def full_state_dict(model) -> dict:
    """{HF name: full tensor}, gathered over tp and ep (and over the ZeRO-3 shards if sharded).
    Collective: every rank must call it."""
    if getattr(model, "zero3", None) is not None:
        return ShardedStateDicts(model.zero3).full_state_dict()
    return dict(full_state_items(model))


def full_state_items(model, meter=None):
    """The full state dict one (HF name, full tensor) at a time, on the model's device, each
    gathered when asked for (a ZeRO-3 unit at a time, in unit order): what an export streams to
    the host. Collective: every rank must take every item. `meter`: an accounting hook
    (models/hf_shards.py HeldBytes) shown every tensor made."""
    if getattr(model, "zero3", None) is not None:
        yield from ShardedStateDicts(model.zero3).iter_full([s.detach() for s in model.zero3.shards], meter)
        return
    for n, p in model.named_parameters():
        yield n, owned_full(p, model.pgm, meter)


def owned_full(p, pgm, meter=None) -> torch.Tensor:
    """A parameter's full tensor (gathered over tp, and ep for an expert weight), never sharing
    the parameter's memory (copied when nothing was gathered)."""
    t = ep_gather(tpl.gather_tensor(p.detach(), p.tp_split_dim, pgm.tp), getattr(p, "ep_split_dim", None),
                  pgm.ep)
    t = t.clone() if t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() else t
    if meter is not None:
        meter.track(t)
    return t


@torch.no_grad()
def load_full_state_dict(model, full: dict, source: str = "state dict"):
    """Slice full HF tensors into this rank's shards. Refuses missing keys and wrong shapes."""
    if getattr(model, "zero3", None) is not None:
        return ShardedStateDicts(model.zero3).load_full_state_dict(full)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(full))
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} parameters of this model, e.g. {missing[:3]}")
    for name, p in params.items():
        t = full[name]
        if tuple(t.shape) != tuple(p.tp_full_shape):
            raise ValueError(f"{source}: {name} has shape {tuple(t.shape)}, this model expects "
                             f"{tuple(p.tp_full_shape)}: the checkpoint is of another model shape")
        p.copy_(ep_shard(tpl.shard_tensor(t.to(p.dtype), p.tp_split_dim, model.pgm.tp),
                         getattr(p, "ep_split_dim", None), model.pgm.ep))


def from_pretrained(model_class, directory: str, pgm: Optional[ProcessGroupManager] = None,
                    device=None, vocab_size: Optional[int] = None, mean_resizing: bool = False,
                    seed: int = 0):
    """A `model_class` (LlamaForCausalLM) loaded from a Hugging Face directory (config.json +
    model.safetensors, or its sharded form): built on the meta device, then each tensor read as
    this rank's TP slice only. `vocab_size`: the vocabulary resized as a run that added tokens had
    it (models/resize_vocab.py: new rows the mean, or N(0, initializer_range) drawn from `seed`)."""
    ckpt = HFCheckpoint(directory)
    c = ckpt.config
    if vocab_size is not None and vocab_size != c.vocab_size:
        ckpt.resize_vocab(VocabResize(c.vocab_size, vocab_size, mean_resizing, c.initializer_range, seed))
    model = model_class(ckpt.config, pgm, device="meta")
    ckpt.check(model)
    materialize(model, ckpt.source(model.pgm.tp, device or torch.device("cpu")))
    return model

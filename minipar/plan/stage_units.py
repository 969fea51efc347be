"""What one pipeline stage holds, for the planner: which layers (stages), its parameters' sizes
(stage_tensors) and its ZeRO-3 units (stage_units), the units each model chunk runs (chunk_units),
and the sum a tied embedding costs (tied_sum). No communication; pipeline_stage.py replays them.

    stage 0 (first)   [embedding] + its layers          units: <root> (empty), embed_tokens, layers
    stage k (middle)  its layers                         units: <root> (empty), layers
    last              its layers + norm + lm_head        units: <root> = norm + lm_head, layers

Tied embeddings (tie_word_embeddings; minipar/pipeline_parallel/tied_ends.py): where the two ends
meet on one rank (zbv's rank 0) the embedding joins the root, E + norm, as at pp 1. Where they are
apart the last stage holds a COPY of E, the embedding module kept for its lm_head: its tensors are
E, its layers, the norm (E first, in the stage's parameter order); under ZeRO-3 its root is E
alone and its final norm a unit of its own after the layers, so that both ends' E shards cover the
same elements. Per step the two copies' gradients are all-reduced over pp_ends (the first and the
last pp rank): E's fp32 gradient, V/tp x d x 4 B, or its shard under ZeRO-3; a frozen base (LoRA)
has none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from minipar.pipeline_parallel.schedules import chunk_stages
from minipar.pipeline_parallel.stage import stage_chunks

from . import model as pm
from .inputs import Layout, ModelShape, Options
from .model import Unit


@dataclass
class Stage:
    """Stage `rank` of the pipeline: the global layer indices of each of its model chunks."""
    rank: int
    chunks: List[List[int]]
    first: bool
    last: bool
    copy: bool = False      # a tied model's last stage, the first elsewhere: its own copy of E (tied_ends.py)

    @property
    def num_layers(self) -> int:
        return sum(len(c) for c in self.chunks)


def stages(model: ModelShape, pipe) -> List[Stage]:
    """Every stage of `pipe` (pipeline_stage.py's Pipeline), in pp rank order."""
    layers = list(pipe.layers) if pipe.layers is not None else None
    last = pipe.pp * pipe.virtual_stages - 1
    placed = [chunk_stages(pipe.schedule, pipe.pp, r, pipe.virtual_stages) for r in range(pipe.pp)]
    return [Stage(r, stage_chunks(model.num_hidden_layers, pipe.pp, r, pipe.virtual_stages, layers,
                                  pipe.schedule), 0 in placed[r], last in placed[r],
                  model.tie_word_embeddings and last in placed[r] and 0 not in placed[r])
            for r in range(pipe.pp)]


def stage_tensors(model: ModelShape, layout: Layout, st: Stage) -> List[int]:
    """TP-local element counts of the stage's parameters, in its parameter order (a tied copy of
    the embedding first, as the stage keeps the embedding module)."""
    emb, layer, head = model.tensors(layout.tp)
    return (emb if st.first or st.copy else []) + layer * st.num_layers + (head if st.last else [])


def stage_units(model: ModelShape, layout: Layout, st: Stage) -> List[Unit]:
    """ZeRO-3 units as fully_shard builds them on the stage: the root first (empty off the last).
    Tied: where both ends meet, the embedding joins the root (E + norm), as at pp 1; a copy
    stage's root is E alone and its final norm a unit of its own, last (tied_ends.py)."""
    emb, layer, head = model.tensors(layout.tp)
    tied = model.tie_word_embeddings
    if st.copy:
        root = Unit("<root>", sum(emb), len(emb), "root")
    elif tied and st.first and st.last:
        root = Unit("<root>", sum(emb) + sum(head), len(emb) + len(head), "root")
    else:
        root = Unit("<root>", sum(head) if st.last else 0, len(head) if st.last else 0, "root")
    out = [root]
    if st.first and not (tied and st.last):
        out.append(Unit("model.embed_tokens", sum(emb), len(emb), "embedding"))
    out += [Unit(f"model.layers.{i}", sum(layer), len(layer)) for c in st.chunks for i in c]
    return out + ([Unit("model.norm", sum(head), len(head))] if st.copy else [])


def chunk_units(us: List[Unit], st: Stage, c: int) -> List[Unit]:
    by = {u.name: u for u in us}
    emb = by.get("model.embed_tokens")
    seq = [us[0]] + ([emb] if emb is not None and st.first and c == 0 else [])
    norm = [by["model.norm"]] if st.copy and c == len(st.chunks) - 1 else []   # called after the layers
    return seq + [by[f"model.layers.{i}"] for i in st.chunks[c]] + norm


def tied_sum(model: ModelShape, layout: Layout, st: Stage, opts: Options) -> Tuple[int, int]:
    """(calls, bytes) of this stage's all-reduce of a tied embedding's gradient per step: one, of
    E's fp32 gradient (its ZeRO-3 shard: E alone in its unit on both ends), on the first and last
    stage when they are apart and E is trained; else none."""
    if not (model.tie_word_embeddings and st.first != st.last and not opts.lora_r):
        return 0, 0
    emb, N = sum(model.tensors(layout.tp)[0]), layout.dp_shard * layout.cp
    return 1, 4 * (pm._padded(emb, N) // N if layout.sharded else emb)

"""The reference Llama decoder, with Hugging Face's names: written for one process, then made
tensor-parallel from outside (minipar/tensor_parallel/parallelize.py), as the table shows.

    input_ids (b, s)
      embed_tokens            VocabParallelEmbedding          -> h (b, s, d)   [(b, s/tp, d) under SP]
      layers[i] x L           LlamaDecoderLayer (models/llama_layer.py): ZeRO-3 and checkpointing wrap it
        h = h + o_proj(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = input_layernorm(h)
        h = h + down_proj(silu(gate_proj(n)) * up_proj(n))                  n = post_attention_layernorm(h)
            or h + moe(n), the mixture of experts (models/moe.py), in Mixtral's and Qwen3-MoE's layers;
            Qwen3's q and k go through q_norm / k_norm (RMSNorm per head) before RoPE; Gemma's
            layers norm each sublayer's output too (sandwich norms) and scale its embeddings by
            sqrt(d) (the family's named differences: models/llama_config.py)
      norm                    RMSNorm (Gemma 2: then the logits soft-capped, c * tanh(logits / c))
      lm_head                 ColumnParallelLinear (vocab rows) -> local logits (b, s, V/tp)
      loss                    vocab_parallel_cross_entropy: sum over tokens / num_items_in_batch
                              (+ an MoE's load-balancing loss, models/moe_aux.py)

Where the parallelisms plug in (all through `pgm`, passed explicitly; pgm=None is one process):
  tp  the decoder is built plain (nn.Embedding, nn.Linear: models/llama_layer.py knows no tp), on
      the meta device, and then parallelize(model, pgm.tp, sequence_parallel, async_overlap)
      swaps its layers: q/k/v and gate/up column-parallel (each rank keeps heads/tp query heads,
      kv_heads/tp KV heads, intermediate/tp MLP columns); o and down row-parallel (one all-reduce
      each); the vocabulary split in the embedding and the lm_head. With sequence_parallel the
      residual stream between them is split along the sequence instead of replicated. The
      constructor does it (tensor_parallel=False keeps the plain model: minipar/compose.py calls
      parallelize itself); at tp 1 the same classes run with a one-rank group, sending nothing.
      The loss and the logits' gather read pgm.tp here; the full tensors' gather and slicing
      for checkpoints (full_state_dict, load_full_state_dict), models/full_state.py.
  cp  attention runs as ring attention over pgm.cp (cp_impl ring), as Ulysses' two all-to-alls
      (ulysses), or as Ulysses inside pgm.cp_ulysses and the ring over pgm.cp_ring (usp); the
      sequence arrives in the zigzag layout (or contiguous, cp_layout) and
      position_ids carry the true positions, so RoPE is right on every chunk.
  packing  document_ids (b, s), one id per token, keep attention inside each packed example (a
      block-diagonal causal mask, run per document from the ids' boundaries on the host:
      context_parallel/documents.py), and
      position_ids restart at each example, so a packed row computes what its examples alone do.
  dp / ZeRO-3 act on the parameters from outside (minipar.data_parallel, minipar.zero3).

Initialisation is layout-independent: every full tensor is drawn from `seed` in parameter order
(normal(0, initializer_range) as HF does, ones for the norms, zeros for biases) and then sliced for
this rank, so a 1-rank and a 16-rank run start from the same weights. `device="meta"` builds the
model without storage; models/llama_init.py then fills only what this rank keeps, from the seed or
from a Hugging Face checkpoint (models/hf_checkpoint.py). Labels arrive already shifted (label[t] is
the token at t + 1), because under cp the next token of a chunk may live on another rank.
The shape and its config.json keys are models/llama_config.py; the rotary tables, models/rope.py.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from minipar import comm
from minipar import tensor_parallel as tpl
from minipar.context_parallel import AttentionLog, Documents, sequence_positions
from minipar.mesh import ProcessGroupManager
from minipar.tensor_parallel.parallelize import parallelize

from . import full_state  # the whole model's tensors out (gathered) and in (sliced)
from .activation_checkpoint import ActivationCheckpointing  # full, or selective (per op / every n-th)
from .hf_checkpoint import save_pretrained  # HF's files: the writer
from .llama_config import LlamaConfig  # the shape, HF's config.json keys
from .llama_init import SeededInit, local_from_source, materialize
from .llama_layer import LayerSettings, LlamaDecoderLayer, RMSNorm  # one decoder layer: attention, MLP or MoE
from .moe_aux import PipelineAux, add_aux_loss
from .rope import rotary_tables
from .tied_weights import tie_weights  # lm_head sharing the embedding's weight

_META = torch.device("meta")


class LlamaModel(nn.Module):
    """The decoder body, and the four pieces every forward is made of, so that the whole model and a
    pipeline stage (which holds only some of the layers) run the same code:

        embed(input_ids)                     -> h (b, s, d)        the first (virtual) stage only
        rotary(position_ids, dtype)          -> cos, sin           every stage: positions never travel
        run_layers(h, cos, sin, layers)      -> h                  a run of decoder layers, in order
        head_loss(h, lm_head, labels, n)     -> loss               the last stage only
    """

    def __init__(self, config: LlamaConfig, pgm: ProcessGroupManager):
        super().__init__()
        # the parallel settings, read from the config once here: the layers are built with them
        self.settings = settings = LayerSettings.of(pgm.config)
        self.sequence_parallel = pgm.config.sequence_parallel   # the stream split over tp (parallelize)
        self.config, self.pgm = config, pgm
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, pgm, i, settings)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=config.norm_offset)
        # which attention kernel each path ran, printed once per run (rank 0; other ranks their fallbacks)
        self.attention_log = AttentionLog(echo=pgm.global_rank == 0)
        for layer in self.layers:
            layer.self_attn.attention_log = self.attention_log

    def embed(self, input_ids):
        """The embedding rows of input_ids; Gemma's times sqrt(hidden_size), the scale rounded to the
        embedding's dtype first, as transformers does (sqrt(3072) = 55.43 is 55.5 in bf16)."""
        h = self.embed_tokens(input_ids)
        scale = self.config.embedding_scale
        return h if scale is None else h * torch.tensor(scale, dtype=h.dtype, device=h.device)

    def rotary(self, position_ids, dtype):
        """cos, sin (b, s, rotary_dim) at the true positions; for Gemma 3 (rope_kinds 2) stacked
        (2, b, s, rotary_dim): the global layers' (rope_theta, rope_scaling), then the local ones'
        (rope_local_base_freq, unscaled). Each layer picks its own (LlamaAttention.project)."""
        cfg = self.config
        tables = rotary_tables(position_ids, cfg.rotary_dim, cfg.rope_theta, dtype, cfg.rope_scaling)
        if cfg.rope_kinds == 1:
            return tables
        local = rotary_tables(position_ids, cfg.rotary_dim, cfg.rope_local_base_freq, dtype)
        return torch.stack([tables[0], local[0]]), torch.stack([tables[1], local[1]])

    def run_layers(self, h, cos, sin, layers, document_ids=None, checkpointing=False):
        """h through `layers` (decoder layers of this body), in order. checkpointing: an
        ActivationCheckpointing (models/activation_checkpoint.py: full keeps only each layer's
        input and runs its forward again in backward; selective keeps the matmul and attention
        outputs, or checkpoints every n-th layer), True for full, or False."""
        policy = ActivationCheckpointing() if checkpointing is True else checkpointing
        if torch.is_tensor(document_ids):
            # packed documents: their boundaries to the host once per micro-batch (one all-gather
            # over cp, one copy), so no attention block of any layer syncs (documents.py)
            document_ids = Documents.gather(document_ids, self.pgm.cp, self.settings.cp_layout)
        for layer in layers:
            if policy and policy.applies(layer.layer_idx) and self.training and torch.is_grad_enabled():
                h = policy(layer, h, cos, sin, document_ids)
            else:
                h = layer(h, cos, sin, document_ids)
        return h

    def local_logits(self, h, lm_head):
        """Final norm, then this rank's vocabulary rows: (b, s, V/tp), never the full logits.
        Gemma's final_logit_softcapping c (Gemma 2's 30): c * tanh(logits / c), elementwise, so each rank caps
        its own rows before the vocab-parallel loss (no communication)."""
        logits = lm_head(self.norm(h))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def head_loss(self, h, lm_head, labels, num_items_in_batch):
        """sum of the token losses (vocab-parallel cross-entropy) / num_items_in_batch; or, when
        num_items_in_batch is a per-sequence objective (it has `sequence_loss`: minipar/dpo/
        objective.py), its loss of this rank's per-row sums of token log-probs (b,)."""
        logits = self.local_logits(h, lm_head)
        if hasattr(num_items_in_batch, "sequence_loss"):
            token_loss = tpl.vocab_parallel_cross_entropy(logits, labels, self.pgm.tp, reduction="none")
            return num_items_in_batch.sequence_loss(-token_loss.sum(-1), labels)
        loss_sum = tpl.vocab_parallel_cross_entropy(logits, labels, self.pgm.tp, reduction="sum")
        return loss_sum / num_items_in_batch


class LlamaForCausalLM(nn.Module):
    # What ZeRO-3 gathers and frees as one unit (as transformers' _no_split_modules names what must
    # not be split across devices): the embedding and each decoder layer; the root keeps the rest.
    zero3_unit_classes = (tpl.VocabParallelEmbedding, LlamaDecoderLayer)
    # The Linear layers a LoRA adapter may sit on (minipar/lora/adapter.py; PEFT's target_modules
    # names): every projection of a decoder layer, which Axolotl's lora_target_linear means
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    @classmethod
    def lora_targets_of(cls, config: LlamaConfig) -> Tuple[str, ...]:
        """The lora_target_modules that some layer of `config` has (minipar/lora/adapter.py's
        lora_targets of the built model, known from the config): the attention's always, the MLP's
        where a layer keeps the dense one. A mixture-of-experts layer stacks its experts' weights
        and routes with a bare (E, d) weight (models/moe.py), no Linear, as transformers 5 does."""
        dense = any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        return cls.lora_target_modules if dense else cls.lora_target_modules[:4]

    def __init__(self, config: LlamaConfig, pgm: Optional[ProcessGroupManager] = None, seed: int = 0,
                 device: Optional[str] = None, tensor_parallel: bool = True):
        """device="meta": shapes only, no storage and no init; fill it with llama_init.materialize
        or fully_shard(..., init=source), which keep only this rank's TP slice / ZeRO-3 shard.
        tensor_parallel=False: the plain model, on the meta device only, for a caller that applies
        parallelize (minipar/tensor_parallel/parallelize.py) itself and then tie_weights()."""
        super().__init__()
        self.config = config
        self.pgm = pgm if pgm is not None else ProcessGroupManager.local()
        self.pgm.config.validate_model(config)
        if not tensor_parallel and (device is None or torch.device(device) != _META):
            raise ValueError(f"LlamaForCausalLM(tensor_parallel=False) builds on the meta device only "
                             f"(device={device!r}): pass device='meta', then parallelize and materialize")
        with torch.device("meta"):        # the plain decoder: shapes only, drawn from the seed below
            self.model = LlamaModel(config, self.pgm)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:    # HF's tie: one Parameter (parallelize keeps it one)
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False
        self.moe_metrics = None
        # what a pipeline carries between stages for the load-balancing loss (None: nothing; also when
        # every layer keeps the dense MLP, so that no stage divides by a count of zero MoE layers)
        any_moe = any(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        self.pipeline_aux = PipelineAux(config, self.pgm, self.model.sequence_parallel) \
            if config.num_local_experts and config.router_aux_loss_coef > 0 and any_moe else None
        if not tensor_parallel:
            return
        c = self.pgm.config
        parallelize(self, self.pgm.tp, c.sequence_parallel, c.tp_async_overlap)   # the tp layers
        self.tie_weights()
        if device is None or torch.device(device) != _META:    # this rank's slices, from the seed
            materialize(self, SeededInit(self, seed, device=device or torch.empty(0).device))

    def tie_weights(self):
        """A tied lm_head (tie_word_embeddings): the same (V/tp, d) rows as the embedding on every
        layout, its gradient summed in place (models/tied_weights.py). Called after parallelize."""
        if self.config.tie_word_embeddings:
            tie_weights(self.lm_head, self.model.embed_tokens)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        init = SeededInit(self, seed)            # full tensors from the seed, in parameter order
        for name, p in self.named_parameters():
            p.copy_(local_from_source(init, name, p, self.pgm.ep))

    def gradient_checkpointing_enable(self, mode: str = "full", option="op"):
        """Checkpoint the decoder layers: mode full, or selective with option op or n (every n-th layer)."""
        self.gradient_checkpointing = ActivationCheckpointing(mode, option)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, position_ids=None, labels=None, num_items_in_batch=None, document_ids=None,
                aux_weight=None):
        """Logits (labels None) or the loss: cross-entropy / num_items_in_batch, plus, for an MoE,
        router_aux_loss_coef * aux_weight * the load-balancing loss of this micro-batch
        (models/moe_aux.py; aux_weight None is 1/dp), whose figures land in self.moe_metrics."""
        pgm, body = self.pgm, self.model
        if position_ids is None:
            position_ids = sequence_positions(input_ids.shape[1] * pgm.cp.size, pgm.cp,
                                              body.settings.cp_layout, device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
        h = body.embed(input_ids)
        cos, sin = body.rotary(position_ids, h.dtype)
        h = body.run_layers(h, cos, sin, body.layers, document_ids, self.gradient_checkpointing)
        if labels is None:
            return tpl.gather_from_tp_region(body.local_logits(h, self.lm_head), pgm.tp, dim=-1)
        if num_items_in_batch is None:
            # The mean over every dp_cp rank's labels, not this rank's: DDP and ZeRO-3 SUM gradients
            # over dp_cp, so a local mean would make them dp_cp times too large. One all-reduce of
            # the label count (every rank of dp_cp must then call forward); the trainer passes
            # num_items_in_batch and skips it.
            num_items_in_batch = (labels != -100).sum()
            if pgm.dp_cp.size > 1:
                num_items_in_batch = comm.all_reduce(num_items_in_batch.clone(), pgm.dp_cp)
            num_items_in_batch = num_items_in_batch.clamp(min=1)
        loss = body.head_loss(h, self.lm_head, labels, num_items_in_batch)
        loss, self.moe_metrics = add_aux_loss(loss, body.layers, self.config, pgm, aux_weight,
                                              body.sequence_parallel)
        return loss

    # ------------------------------------------------------------------ state dicts
    # The full tensors out and in (gathered over tp, ep, the ZeRO-3 shards; sliced back): models/full_state.py
    def full_state_dict(self) -> dict:
        """{HF name: full tensor} (full_state.full_state_dict). Collective: every rank must call it."""
        return full_state.full_state_dict(self)

    def full_state_items(self, meter=None):
        """(HF name, full tensor) one at a time (full_state.full_state_items). Collective."""
        return full_state.full_state_items(self, meter)

    def load_full_state_dict(self, full: dict, source: str = "state dict"):
        """Slice full HF tensors into this rank's shards (full_state.load_full_state_dict)."""
        return full_state.load_full_state_dict(self, full, source)

    @classmethod
    def from_pretrained(cls, directory: str, pgm: Optional[ProcessGroupManager] = None,
                        device=None, vocab_size: Optional[int] = None, mean_resizing: bool = False,
                        seed: int = 0) -> "LlamaForCausalLM":
        """Load a Hugging Face directory, each tensor read as this rank's slice only
        (full_state.from_pretrained; `vocab_size`: resized as a run that added tokens had it)."""
        return full_state.from_pretrained(cls, directory, pgm, device, vocab_size, mean_resizing, seed)

    def save_pretrained(self, directory: str):
        """Write config.json + model.safetensors (global rank 0 writes; every rank must call)."""
        save_pretrained(self, directory)

"""The planner's question: a model shape, a layout, a batch and the run's options. Whether that
layout can run the model at all is feasible.py's; the counts that answer it are model.py's,
activation_bytes.py's and collective_counts.py's.

    ModelShape  from a Hugging Face config.json or minipar's LlamaConfig: d, f, L, H, K, D, V, and
                tensors(tp): the TP-local element counts of every parameter, in the model's order
                (root-before-layers [embedding], one layer [9 tensors, + Qwen2's q/k/v biases,
                q/k norms, Gemma's two norms...], root-after-layers [norm, lm_head]), the list
                every memory and ledger count is summed from; and what the families change in
                a layer's attention: each layer's sliding window, Gemma 2's capped logits
                (masked(i, S): the layer attends through a dense mask, models/llama_layer.py)
    Layout      dp_replicate R x dp_shard S x cp C x tp T (+ sequence_parallel), and how attention
                crosses cp: cp_impl ring | ulysses | usp with cp_ulysses_size u (resolved by the
                trainer's own rule, ParallelismConfig.ulysses_size: 1 under ring, C under ulysses);
                sizes() gives the process groups the trainer builds: tp, cp, its two parts
                cp_ulysses (u consecutive cp ranks) and cp_ring (C / u, every u-th), dp_shard_cp
                (N = S C, ZeRO-3's shard group), dp_replicate, dp_cp (DDP's group when nothing is sharded)
    Batch       global_batch_size, micro_batch_size, sequence_len: b rows per dp rank per forward,
                M = global / (dp b) micro-batches per step
    Options     compute dtype, ZeRO-3's prefetch / reshard_after_forward / sync_each_batch,
                activation checkpointing, LoRA's rank and targets (and how another trainer runs)

minipar/trainer/prediction.py's from_train_config asks the question of a train.py config (the
product reads the planner, never the other way), read as the trainer reads it: the family's defaults
through LlamaConfig.from_dict, the vocabulary the run's tokenizer sets (read_train_config).

Pure data: no process group, no tensor, no communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from minipar.config import ParallelismConfig
from models.llama_config import LlamaConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GROUPS = ("tp", "cp", "cp_ulysses", "cp_ring", "dp_shard_cp", "dp_replicate", "dp_cp")
# the Options that time a step as another trainer runs it (below); minipar's own runs leave them off
OTHER_TRAINER_FIELDS = ("fused_kernels", "sac_every_other_matmul", "distributed_optimizer", "tp_comm_overlap",
                        "gather_once_per_step", "cp_all_gather_kv")


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False                 # Qwen3, Gemma 3: a (D,) RMSNorm weight for q, one for k per layer
    sandwich_norms: bool = False          # Gemma: two more (d,) norms per layer (the MLP's in and out)
    capped_attention: bool = False        # Gemma 2: soft-capped scores, computed explicitly (no fused kernel)
    # biases (LlamaConfig's qkv_bias, attention_bias, mlp_bias): Qwen2's on q/k/v_proj (column-parallel,
    # split over tp); attention_bias's on o_proj too, mlp_bias's on gate/up/down (o and down: (d,),
    # replicated over tp, their gradients summed over tp under SP)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # each layer's sliding window W (LlamaConfig.attention_window: Mistral, Phi-3, Qwen2's and Gemma's
    # windowed layers), None where the layer attends causally; () when no layer has one
    windows: Tuple[Optional[int], ...] = ()
    # a mixture of experts (models/moe.py; minipar/plan/moe.py counts it): E experts of width F,
    # top-k per token, in the layers `moe_layers` (Mixtral: all); 0 experts is dense
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: Tuple[int, ...] = ()
    norm_topk_prob: bool = False

    @property
    def norms_per_layer(self) -> int:
        """The (d,) RMSNorms of a decoder layer: input and post-attention, and Gemma's two more."""
        return 4 if self.sandwich_norms else 2

    @property
    def replicated_per_layer(self) -> int:
        """The (d,) tensors of a dense decoder layer replicated over tp whose gradients SP sums over tp
        (tensor_parallel's sequence_parallel_weight): the norms, and o_proj's and down_proj's biases."""
        return self.norms_per_layer + self.o_bias + self.mlp_bias

    def attention_window(self, i: int) -> Optional[int]:
        """Layer i's sliding window (None: causal): models/flops.py asks this of a shape."""
        return self.windows[i] if self.windows else None

    def masked(self, i: int, sequence_len: int) -> bool:
        """Whether layer i attends through a dense mask (models/llama_layer.py's masked path): a window
        that binds (W < the whole sequence) or capped logits. Then cp all-gathers K/V over the whole
        cp group (context_parallel/window_attention.py) instead of its ring or all-to-alls."""
        w = self.attention_window(i)
        return self.capped_attention or (w is not None and w < sequence_len)

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """models/flops.py asks this of a shape: layer i's feed-forward is the mixture of experts."""
        return i in self.moe_layers

    @classmethod
    def from_dict(cls, d: dict) -> "ModelShape":
        """From a Hugging Face config.json or minipar's LlamaConfig fields (the sizes must be there)."""
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if not isinstance(d.get(k), int)]
        if missing:
            raise ValueError(f"the model config lacks (or has no integer for) {', '.join(missing)}: a Llama "
                             f"config.json has them (configs/models/llama-3.1-8b.json)")
        heads = d["num_attention_heads"]
        kind = d.get("model_type") or "llama"
        c = LlamaConfig.from_dict(d)        # the trainer's own reading: each family's defaults and windows
        moe, extra = {}, {}
        if kind in ("mixtral", "qwen3_moe"):     # E, k, F and which layers
            moe = dict(num_local_experts=c.num_local_experts, num_experts_per_tok=c.num_experts_per_tok,
                       moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=bool(c.norm_topk_prob),
                       moe_layers=tuple(i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)))
        elif kind in ("gemma2", "gemma3_text"):  # Gemma's defaults (head_dim, tied)
            d = dict(d, head_dim=c.head_dim, tie_word_embeddings=c.tie_word_embeddings)
            extra = dict(sandwich_norms=True, capped_attention=c.attention_softcap is not None)
        windows = tuple(c.attention_window(i) for i in range(c.num_hidden_layers))
        extra.update(qkv_bias=c.qkv_bias, o_bias=c.attention_bias, mlp_bias=c.mlp_bias,
                     windows=windows if any(w is not None for w in windows) else ())
        return cls(d["vocab_size"], d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"], heads,
                   d.get("num_key_value_heads") or heads, d.get("head_dim") or d["hidden_size"] // heads,
                   bool(d.get("tie_word_embeddings", False)), kind in ("qwen3", "qwen3_moe", "gemma3_text"),
                   **moe, **extra)

    def tensors(self, tp: int, ep: int = 1) -> Tuple[List[int], List[int], List[int]]:
        """TP-local element counts of (root-before-layers, one layer, root-after-layers) tensors,
        in the model's parameter order. An MoE layer ends in the router (E, d) and this ep rank's
        stacked experts, 3 x (E/ep, F, d), not split over tp (minipar/plan/moe.py)."""
        d, f, D, V = self.hidden_size, self.intermediate_size, self.head_dim, self.vocab_size
        q, kv = self.num_attention_heads * D // tp, self.num_key_value_heads * D // tp
        qb, ob, mb = self.qkv_bias, self.o_bias, self.mlp_bias      # each weight, then its bias
        layer = [d, d * q] + [q] * qb + [d * kv] + [kv] * qb + [d * kv] + [kv] * qb + [q * d] + [d] * ob \
            + [D, D] * self.qk_norm + [d] + [d, d] * self.sandwich_norms
        if self.is_moe:
            E, F = self.num_local_experts, self.moe_intermediate_size
            layer += [E * d] + [E // ep * F * d] * 3
        else:
            fl = f // tp
            layer += [d * fl] + [fl] * mb + [d * fl] + [fl] * mb + [fl * d] + [d] * mb
        head = [d] + ([] if self.tie_word_embeddings else [V // tp * d])
        return [V // tp * d], layer, head

    def lora_tensors(self, tp: int, r: int, targets) -> List[int]:
        """TP-local element counts of one layer's LoRA adapters (A, B per target, minipar/lora/):
        a column-parallel target keeps A (r, in) whole and B (out/tp, r); a row-parallel one
        (o_proj, down_proj) A (r, in/tp) and B (out, r) whole."""
        d, f, D = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * D, self.num_key_value_heads * D
        shapes = dict(q_proj=(d, q, False), k_proj=(d, kv, False), v_proj=(d, kv, False), o_proj=(q, d, True),
                      gate_proj=(d, f, False), up_proj=(d, f, False), down_proj=(f, d, True))
        out = []
        for name in targets:
            n_in, n_out, row = shapes[name]
            out += [r * n_in // tp, n_out * r] if row else [r * n_in, n_out // tp * r]
        return out

    def num_params(self) -> int:
        """All parameters of the full model (tied ones once)."""
        emb, layer, head = self.tensors(1)
        return sum(emb) + self.num_hidden_layers * sum(layer) + sum(head)


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    cp_impl: str = "ring"                  # ring | ulysses | usp (config.py's CP_IMPLS)
    cp_ulysses_size: Optional[int] = None  # USP's Ulysses group; None: the impl's default
    ep: int = 1                            # expert parallelism: ep consecutive ranks of dp_shard_cp

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def sharded(self) -> bool:         # the trainer runs ZeRO-3 exactly when dp_shard x cp > 1
        return self.dp_shard * self.cp > 1

    def ulysses_size(self) -> int:
        """u, the ranks of one Ulysses group: the trainer's rule (ValueError where it refuses)."""
        return ParallelismConfig(cp_size=self.cp, cp_impl=self.cp_impl,
                                 cp_ulysses_size=self.cp_ulysses_size).ulysses_size()

    def sizes(self) -> Dict[str, int]:
        u = self.ulysses_size()           # under ring the mesh's trivial parts: 1 and cp
        return dict(tp=self.tp, cp=self.cp, cp_ulysses=u, cp_ring=self.cp // u,
                    dp_shard_cp=self.dp_shard * self.cp, dp_replicate=self.dp_replicate,
                    dp_cp=self.dp_replicate * self.dp_shard * self.cp, ep=self.ep,
                    edp=self.dp_shard * self.cp // self.ep)

    def __str__(self) -> str:
        impl = ""
        if self.cp > 1 and self.cp_impl != "ring":     # ring's string stays what it always was
            impl = " ulysses" if self.cp_impl == "ulysses" else f" usp u {self.cp_ulysses_size}"
        return (f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp {self.cp}{impl} x tp "
                f"{self.tp}" + (" +SP" if self.sp else "") + (f" (ep {self.ep})" if self.ep > 1 else ""))


@dataclass(frozen=True)
class Batch:
    global_batch_size: int
    micro_batch_size: Optional[int]   # rows per dp rank per forward; None: global / dp, no accumulation
    sequence_len: int

    def micro(self, layout: Layout) -> int:
        dp = layout.dp_replicate * layout.dp_shard
        return self.micro_batch_size or max(1, self.global_batch_size // dp)

    def micro_steps(self, layout: Layout) -> int:
        dp = layout.dp_replicate * layout.dp_shard
        return max(1, self.global_batch_size // (dp * self.micro(layout)))


@dataclass(frozen=True)
class Options:
    dtype: str = "bfloat16"        # compute dtype; masters, grads and AdamW states stay fp32
    prefetch: int = 1
    reshard_after_forward: bool = True
    sync_each_batch: bool = True   # ZeRO-3: reduce-scatter every micro-batch (false: once per step)
    # True (full), False, or "selective" with selective_ac_option "op" or n (every n-th layer):
    # models/activation_checkpoint.py, counted by activation_bytes.py's activations and recompute_shares
    gradient_checkpointing: Union[bool, str] = False
    selective_ac_option: Union[str, int] = "op"
    # compile: true (minipar/regional_compile.py): the decoder layers' compute at time_model.py's
    # COMPILE_SPEEDUP (torchtitan's measured gain)
    compile: bool = False
    # adapter: lora (minipar/lora/): rank r > 0 on these projections; the base frozen (no gradient,
    # no optimizer state), the adapters whole over dp. 0: every weight trained
    lora_r: int = 0
    lora_targets: Tuple[str, ...] = ()
    # the config's optimizer: its state bytes per tensor (minipar/optim_bnb.py's state_bytes): AdamW's
    # 8 B per element, bitsandbytes' 8-bit ~2 B (adamw_bnb_8bit; fp32 under 4096 elements)
    optimizer: str = "adamw_torch"
    # gloo (a CPU run): reduce_scatter_tensor works on a copy of its input, so a unit's flat gradient
    # is held twice while it reduce-scatters (NCCL: never); peak.py's end of backward counts it
    reduce_scatter_copies_input: bool = False
    # rl: dpo's reference (reference_cost.py): "" none, "lora" (adapters off: one more forward per
    # micro-batch), "precomputed" (one forward pass over the data before training) or "frozen" (a
    # frozen copy of the weights in memory, sharded like them, and one more forward per micro-batch)
    dpo_reference: str = ""
    # how ANOTHER trainer runs the same step (time only; minipar's own runs leave them at the defaults;
    # time_model.py and overlap.py price them, each with its source): fused memory-bound kernels
    # (torch.compile, Transformer Engine); torchtitan's per-op selective AC, which recomputes every
    # second matmul of a layer; Megatron-LM's distributed optimizer and --tp-comm-overlap; ZeRO-3
    # gathering each layer once per step (PyTorch's pipelining with reshard_after_forward False);
    # the Llama 3 paper's all-gather context parallelism
    fused_kernels: bool = False
    sac_every_other_matmul: bool = False
    distributed_optimizer: bool = False
    tp_comm_overlap: bool = False
    gather_once_per_step: bool = False
    cp_all_gather_kv: bool = False


def param_bytes(layout: Layout, opts: Options) -> int:
    """Bytes of a parameter as minipar computes with it, and so of its gradient and of the residual
    stream: ZeRO-3 gathers the weights in the compute dtype; without it they stay fp32 masters and
    bf16 runs under autocast, which casts a matmul's inputs and output but keeps the stream fp32."""
    return DTYPE_BYTES[opts.dtype] if layout.sharded else 4

"""ParallelismConfig: how many ranks each of the five dimensions gets.

The world is a grid of ranks (see mesh.py for the layout): pp_size pipeline stages, each a 4D grid

    world_size = pp_size x dp_replicate_size x dp_shard_size x cp_size x tp_size

    pp_size             pipeline stages; each holds a contiguous run of layers   (pipeline parallel)
    dp_replicate_size   copies of the model; gradients all-reduced            (DDP, HSDP's outer dim)
    dp_shard_size       ZeRO-3 shards; params/grads/optimizer states split    (FSDP, HSDP's inner dim)
    cp_size             the sequence split; attention as ring attention       (context parallel)
    tp_size             weight matrices and heads split; activations reduced  (tensor parallel)

Expert parallelism, ep_size (or the YAML key `expert_parallel_size`, in the style of Axolotl's
*_size keys; accelerate has no name for it, torchtitan calls it expert_parallel_degree), adds no
ranks: it borrows them from dp_shard x cp, as torchtitan does. ep consecutive ranks of a dp_shard_cp group
hold E/ep experts each and exchange tokens; ep must divide dp_shard_size x cp_size (mesh.py's ep and
edp groups, expert_parallel/dispatch.py).

The names are HF accelerate's `ParallelismConfig`, and the training config's too
(TrainConfig.parallelism() builds this one; trainer/config/schema.py takes Axolotl's YAML names as
their aliases); sizes may also come from accelerate's environment variables
PARALLELISM_CONFIG_{PP,DP_REPLICATE,DP_SHARD,CP,TP}_SIZE. A dp_shard_size left unset (None) takes
whatever is left of the world after the other three, as Axolotl does, so
`torchrun --nproc-per-node 8 train.py --tensor_parallel_size 2` shards over the remaining 4.

Nothing here communicates: every check runs on every rank before the first collective, so a
config that cannot work raises the same ValueError everywhere instead of hanging the job.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

ENV_PREFIX = "PARALLELISM_CONFIG_"
# outermost first (the grid order of mesh.py); pp_size is the dataclass's last field, so that the
# positional ParallelismConfig(dp_replicate, dp_shard, cp, tp) of a 4D layout still reads the same
SIZE_FIELDS = ("pp_size", "dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")
CP_LAYOUTS = ("zigzag", "contiguous")
# How attention crosses the cp ranks (context_parallel/): K/V blocks round a ring, two all-to-alls
# that trade the sequence split for a head split (Ulysses), or Ulysses inside groups of
# cp_ulysses_size ranks and the ring across them (USP)
CP_IMPLS = ("ring", "ulysses", "usp")
# the attention kernels a run may force (context_parallel/kernel_choice.py BACKENDS)
ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


@dataclass
class ParallelismConfig:
    dp_replicate_size: Optional[int] = None
    dp_shard_size: Optional[int] = None
    cp_size: Optional[int] = None
    tp_size: Optional[int] = None
    # Megatron sequence parallelism inside the tp group (activations split along the sequence
    # between the tensor-parallel regions); only meaningful when tp_size > 1.
    sequence_parallel: bool = False
    # pipeline stages, the outermost dimension (minipar.pipeline_parallel)
    pp_size: Optional[int] = None
    # The column-parallel linears' backward launches the input-gradient collective before the
    # weight-gradient matmul and waits after it (tensor_parallel/async_linear.py); tp_size > 1 only.
    tp_async_overlap: bool = False
    # How cp splits the sequence: "zigzag" (balanced, the default) or "contiguous" (rank c keeps
    # chunk c of cp: the textbook split, causal work unbalanced). context_parallel/ring_attention.py.
    cp_layout: str = "zigzag"
    # cp_impl "ring" (ring_attention.py), "ulysses" or "usp" (ulysses.py); cp_ulysses_size is the
    # Ulysses group of USP (u consecutive cp ranks, so a node's), resolved to 1 for ring and cp for
    # ulysses; the ring then runs over cp / u
    cp_impl: str = "ring"
    cp_ulysses_size: Optional[int] = None
    # the attention kernel (context_parallel/kernel_choice.py): auto, or a forced flash | cudnn |
    # efficient | math, refused (ValueError) where it cannot run
    attention_backend: str = "auto"
    # expert parallelism: the experts of each MoE layer split over ep ranks borrowed from
    # dp_shard x cp (not a factor of the world size); None = 1
    ep_size: Optional[int] = None

    def __post_init__(self):
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelismConfig.{name} must be a positive integer or None, "
                                 f"got {value!r}")
        if self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"ParallelismConfig.cp_layout must be one of {CP_LAYOUTS}, "
                             f"got {self.cp_layout!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"ParallelismConfig.attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.cp_impl not in CP_IMPLS:
            raise ValueError(f"ParallelismConfig.cp_impl must be one of {CP_IMPLS}, got {self.cp_impl!r}")
        for name in ("cp_ulysses_size", "ep_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ParallelismConfig.{name} must be a positive integer or None, "
                                 f"got {value!r}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, **overrides) -> "ParallelismConfig":
        """Sizes from accelerate's environment variables; explicit (non-None) overrides win."""
        values = {}
        for name in SIZE_FIELDS:
            raw = os.environ.get(ENV_PREFIX + name.upper())
            if raw is not None and raw.strip() != "":
                try:
                    values[name] = int(raw)
                except ValueError:
                    raise ValueError(f"environment variable {ENV_PREFIX + name.upper()}={raw!r} "
                                     f"is not an integer")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    # ------------------------------------------------------------------ sizes
    @property
    def sizes(self) -> dict:
        return {name: getattr(self, name) for name in SIZE_FIELDS}

    @property
    def total_size(self) -> int:
        """Product of the five sizes, unset ones counted as 1."""
        total = 1
        for value in self.sizes.values():
            total *= value or 1
        return total

    def _describe(self) -> str:
        ep = f", ep_size={self.ep_size}" if (self.ep_size or 1) > 1 else ""
        return ", ".join(f"{k}={v}" for k, v in self.sizes.items()) + ep

    def resolve(self, world_size: int) -> "ParallelismConfig":
        """A copy with every size set, checked against the world size.

        Unset pp/dp_replicate/cp/tp become 1; an unset dp_shard takes the remainder of the world.
        """
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        fixed = {k: (v if v is not None else 1) for k, v in self.sizes.items() if k != "dp_shard_size"}
        others = fixed["pp_size"] * fixed["dp_replicate_size"] * fixed["cp_size"] * fixed["tp_size"]
        shard = self.dp_shard_size
        if shard is None:
            if world_size % others != 0:
                raise ValueError(
                    f"cannot fit the parallel sizes ({self._describe()}) to world size {world_size}: "
                    f"pp_size x dp_replicate_size x cp_size x tp_size = {others} "
                    f"does not divide {world_size}, so "
                    f"dp_shard_size cannot take the remainder. Launch a multiple of {others} processes "
                    f"or change the sizes.")
            shard = world_size // others
        resolved = dataclasses.replace(self, dp_shard_size=shard, **fixed)
        if resolved.total_size != world_size:
            raise ValueError(
                f"parallel sizes do not multiply to the world size: {resolved._describe()} multiply to "
                f"{resolved.total_size}, but the world size is {world_size}. Change the sizes so that "
                f"pp_size x dp_replicate_size x dp_shard_size x cp_size x tp_size = {world_size}, leave "
                f"dp_shard_size unset to take the remainder, or launch {resolved.total_size} processes.")
        if resolved.sequence_parallel and resolved.tp_size == 1:
            resolved = dataclasses.replace(resolved, sequence_parallel=False)
        if resolved.tp_async_overlap and resolved.tp_size == 1:
            resolved = dataclasses.replace(resolved, tp_async_overlap=False)
        # ep is checked against dp_shard x cp by validate_model (with the model's problems, in one
        # error) and by mesh.all_groups (expert_problems), not here
        return dataclasses.replace(resolved, cp_ulysses_size=resolved.ulysses_size(),
                                   ep_size=resolved.ep_size or 1)

    def expert_problems(self, model_config=None) -> list:
        """What stops the experts being split over ep (a resolved config): ep not dividing
        dp_shard x cp and, given a model, E not divisible by ep, top-k > E, ep > 1 on a dense model."""
        ep, problems = self.ep_size or 1, []
        borrowed = (self.dp_shard_size or 1) * (self.cp_size or 1)
        if borrowed % ep:
            problems.append(f"expert_parallel_size={ep} does not divide dp_shard_size x "
                            f"context_parallel_size = {self.dp_shard_size or 1} x {self.cp_size or 1} = "
                            f"{borrowed} (EP borrows its ranks from them): choose one of "
                            f"{_divisors(borrowed)}")
        if model_config is None:
            return problems
        experts = num_experts(model_config)
        top_k = getattr(model_config, "num_experts_per_tok", None)
        if not experts:
            if ep > 1:
                problems.append(f"expert_parallel_size={ep} needs a Mixture-of-Experts model, and this "
                                f"model is dense (no num_local_experts): set expert_parallel_size 1")
            return problems
        if experts % ep:
            problems.append(f"the {experts} experts cannot be split over expert_parallel_size={ep}: "
                            f"choose one of {_divisors(experts)}")
        if top_k is not None and not 1 <= top_k <= experts:
            problems.append(f"num_experts_per_tok={top_k} must lie in 1 ... {experts} (the number of "
                            f"experts): each token picks top-k distinct experts")
        return problems

    def ulysses_size(self) -> int:
        """u, the ranks of one Ulysses group: 1 under ring (or cp 1), cp under ulysses, and under usp
        cp_ulysses_size, which must divide cp (u = cp is pure Ulysses, u = 1 the pure ring)."""
        cp = self.cp_size or 1
        if cp == 1 or self.cp_impl == "ring":
            return 1
        if self.cp_impl == "ulysses":
            if self.cp_ulysses_size not in (None, cp):
                raise ValueError(f"cp_ulysses_size={self.cp_ulysses_size} with cp_impl ulysses: the Ulysses "
                                 f"group is the whole cp group ({cp}); use cp_impl usp to nest it in a ring")
            return cp
        u = self.cp_ulysses_size
        if u is None or cp % u:
            raise ValueError(f"cp_impl usp needs cp_ulysses_size dividing context_parallel_size={cp} (the "
                             f"Ulysses group inside a node, the ring across: one of {_divisors(cp)}), "
                             f"got {u}")
        return u

    # ------------------------------------------------------------------ model checks
    def validate_model(self, model_config, sequence_len: Optional[int] = None) -> None:
        """Check that the model and sequence can be split this way; raise a ValueError that says
        which value to change. `model_config` needs HF-style fields (num_attention_heads, ...)."""
        tp = self.tp_size or 1
        cp = self.cp_size or 1
        problems = []
        heads = model_config.num_attention_heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        vocab = model_config.vocab_size
        if heads % tp:
            problems.append(f"num_attention_heads={heads} is not divisible by tp_size={tp}: "
                            f"choose a tp_size that "
                            f"divides {heads} (one of {_divisors(heads)}) or change num_attention_heads")
        if kv_heads % tp:
            problems.append(f"num_key_value_heads={kv_heads} is not divisible by tp_size={tp}: "
                            f"choose a tp_size that divides {kv_heads} (one of {_divisors(kv_heads)}) "
                            f"or change num_key_value_heads")
        if vocab % tp:
            nearest = (vocab + tp - 1) // tp * tp
            problems.append(f"vocab_size={vocab} is not divisible by tp_size={tp}: "
                            f"pad vocab_size to {nearest} "
                            f"or choose a tp_size that divides {vocab}")
        if model_config.intermediate_size % tp:
            problems.append(f"intermediate_size={model_config.intermediate_size} "
                            f"is not divisible by tp_size={tp}: "
                            f"change intermediate_size to a multiple of {tp}")
        if sequence_len is not None:
            check_sequence_len(sequence_len, cp, problems)
            if self.sequence_parallel and tp > 1 and (sequence_len // cp) % tp:
                problems.append(f"sequence_parallel needs the local sequence length "
                                f"(sequence_len / cp_size = "
                                f"{sequence_len // cp}) divisible by tp_size={tp}: change sequence_len")
        cap = getattr(model_config, "attention_softcap", None)     # Gemma 2's attn_logit_softcapping
        if cap is not None and self.attention_backend in ("flash", "efficient", "cudnn"):
            problems.append(f"attention_backend {self.attention_backend} cannot soft-cap attention logits "
                            f"(model_type {model_config.model_type!r}, attn_logit_softcapping={cap}): no "
                            f"fused kernel takes the cap; use attention_backend auto or math (Axolotl: "
                            f"flash_attention false, attn_implementation eager), which compute its scores "
                            f"explicitly")
        problems += self.expert_problems(model_config)
        if problems:
            raise ValueError("the model cannot be split with " + self._describe() + ":\n  - "
                             + "\n  - ".join(problems))


def num_experts(model_config) -> int:
    """E of an MoE model config (Mixtral's num_local_experts, Qwen3-MoE's num_experts); 0 if dense."""
    return getattr(model_config, "num_local_experts", None) or getattr(model_config, "num_experts", None) or 0


def check_sequence_len(sequence_len: int, cp: int, problems: Optional[list] = None) -> None:
    """Zigzag context parallelism cuts each sequence into 2*cp equal chunks."""
    if sequence_len % (2 * cp) == 0:
        return
    lower = sequence_len // (2 * cp) * (2 * cp)
    upper = lower + 2 * cp
    nearest = [n for n in (lower, upper) if n > 0]
    msg = (f"sequence length {sequence_len} is not divisible by 2 * cp_size = {2 * cp} (zigzag context "
           f"parallelism cuts it into {2 * cp} equal chunks): use sequence_len "
           f"{' or '.join(map(str, nearest))}, or another cp_size")
    if problems is None:
        raise ValueError(msg)
    problems.append(msg)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]

"""The process-group manager: the 5D grid of ranks and its groups, built by hand.

Every rank has five coordinates (p, r, s, c, t) = (pp, dp_replicate, dp_shard, cp, tp) and sits at

    global_rank = (((p * R + r) * S + s) * C + c) * T + t

so tp varies fastest (neighbouring ranks, the same node, the fastest links: TP talks every layer)
and pp slowest: pipeline stages usually span nodes, and they only pass activations between
neighbours (torchtitan puts pp outermost too). Within one stage the grid is the 4D one,
`((r * S + s) * C + c) * T + t`, offset by p * R * S * C * T; with pp = 1 every rank and group is
what it was without pipeline parallelism. For R=S=C=T=2 on 16 ranks (one stage):

    rank:  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    r:     0  0  0  0  0  0  0  0  1  1  1  1  1  1  1  1
    s:     0  0  0  0  1  1  1  1  0  0  0  0  1  1  1  1
    c:     0  0  1  1  0  0  1  1  0  0  1  1  0  0  1  1
    t:     0  1  0  1  0  1  0  1  0  1  0  1  0  1  0  1

A group of a dimension holds the ranks that differ only in that coordinate (tp group of rank 5:
[4, 5]; cp group: [5, 7]; with pp = 2 on 32 ranks, the pp group of rank 5 is [5, 21]). Three
flattened groups let several coordinates vary at once, all INSIDE one stage (p fixed), because
they serve the model state and the batch, which are per stage:

    dp           (r, s)      which samples of the global batch a rank reads
    dp_shard_cp  (s, c)      the ZeRO-3 shard group: params are replicated over cp, so shard over it too
    dp_cp        (r, s, c)   averaging the loss over every token of the global batch

`pgm.pp` is the chain of stages a micro-batch flows through: pgm.pp.next_rank / prev_rank are the
neighbouring stages' global ranks (a ring, which the interleaved schedule uses: the last stage
feeds the first one's second model chunk), is_first_stage / is_last_stage say where this rank is.
`pgm.world` is every rank (the few calls that span the whole job).

`torch.distributed.new_group` is collective over the whole world: every rank must call it for
every group, members or not, in the same order. So each rank walks all groups of all dimensions
in one fixed order, creates each, and keeps the ones that contain it. Groups with the same members
(dp_shard_cp and dp_shard when cp = 1, say) are created once and shared.

    python -m minipar.mesh --pp 2 --dp-replicate 2 --dp-shard 2 --cp 2 --tp 2
    python -m minipar.mesh --cp 4 --tp 2 --cp-impl usp --cp-ulysses 2     (+ cp_ulysses, cp_ring)

prints the whole grid and every group without launching anything (--ep N adds ep and edp). Two
more groups split each cp group for USP (cp_impl usp, context_parallel/ulysses.py): cp_ulysses,
u = cp_ulysses_size consecutive cp ranks, and cp_ring, the cp / u ranks at the same place in each
(under ring both are trivial: cp_ulysses of one rank, cp_ring = cp).

Expert parallelism borrows its ranks from dp_shard_cp (config.py's ep_size must divide its D =
dp_shard x cp ranks, as torchtitan does) and splits each dp_shard_cp group in two the same way:

    ep     ep consecutive ranks of dp_shard_cp: each holds E/ep experts of every MoE layer, and they
           exchange tokens (expert_parallel/dispatch.py)
    edp    the D/ep ranks at the same place in each ep group: they hold the same experts, so they
           are the experts' ZeRO-3 shard group (the rest of the model shards over dp_shard_cp)

For dp_shard 4, ep 2 (ranks 0-3): ep [0, 1] [2, 3], edp [0, 2] [1, 3]. Attention, norms, router
and embeddings see the grid exactly as without ep.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from . import comm
from .cli import fail, positive_ints
from .config import ParallelismConfig

COORDS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# dimension name -> coordinates that vary inside one of its groups
DIMENSIONS: Dict[str, Tuple[str, ...]] = {
    "pp": ("pp",),
    "dp_replicate": ("dp_replicate",),
    "dp_shard": ("dp_shard",),
    "cp": ("cp",),
    "tp": ("tp",),
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# USP's two parts of a cp group, by position in it (u = cp_ulysses_size, config.py): the Ulysses
# group holds u consecutive cp ranks (neighbours in the grid, so one node's when u fits in one),
# the ring group the cp / u ranks at the same place in each Ulysses group. cp rank c = r * u + j
# sits in Ulysses group r at index j, and in ring group j at index r.
CP_PARTS: Dict[str, str] = {"cp_ulysses": "u consecutive cp ranks", "cp_ring": "every u-th cp rank"}
# expert parallelism's two parts of a dp_shard_cp group, by position in it (ep = ep_size): dp_shard_cp
# index i = a * ep + j sits in ep group a at index j (it holds expert block j), and in edp group j
EP_PARTS: Dict[str, str] = {"ep": "ep consecutive dp_shard_cp ranks",
                            "edp": "every ep-th dp_shard_cp rank: the same experts"}
# the first and last stage of each pipeline (Megatron's embedding group): a tied embedding's two
# copies sum their gradients over it (pipeline_parallel/tied_ends.py); one rank when pp = 1
PARTS: Dict[str, str] = {**CP_PARTS, **EP_PARTS, "pp_ends": "the first and last pp rank"}


def _shape(config: ParallelismConfig) -> Tuple[int, int, int, int, int]:
    """(P, R, S, C, T), outermost first."""
    return (config.pp_size, config.dp_replicate_size, config.dp_shard_size, config.cp_size, config.tp_size)


def rank_of(coords: Tuple[int, ...], shape: Tuple[int, ...]) -> int:
    """The global rank at `coords` in a grid of `shape` (outermost first, the last varies fastest):
    (p, r, s, c, t) in (P, R, S, C, T), or a 4D (r, s, c, t) in (R, S, C, T), which is stage 0."""
    rank = 0
    for c, n in zip(coords, shape):
        rank = rank * n + c
    return rank


def coords_of(rank: int, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The inverse of rank_of: as many coordinates as `shape` has dimensions."""
    out = []
    for n in reversed(shape):
        out.append(rank % n)
        rank //= n
    return tuple(reversed(out))


def all_groups(config: ParallelismConfig) -> Dict[str, List[List[int]]]:
    """Every group of every dimension as sorted lists of global ranks; pure arithmetic, no torch."""
    shape = _shape(config)
    n = len(COORDS)
    out: Dict[str, List[List[int]]] = {}
    for name, varying in DIMENSIONS.items():
        vary = [COORDS.index(v) for v in varying]
        fixed = [i for i in range(n) if i not in vary]
        groups = []
        for fixed_vals in itertools.product(*(range(shape[i]) for i in fixed)):
            members = []
            for vary_vals in itertools.product(*(range(shape[i]) for i in vary)):
                coords = [0] * n
                for i, v in zip(fixed, fixed_vals):
                    coords[i] = v
                for i, v in zip(vary, vary_vals):
                    coords[i] = v
                members.append(rank_of(tuple(coords), shape))
            groups.append(sorted(members))
        out[name] = groups
    u = config.cp_ulysses_size or 1                # each cp group is sorted, so in cp order
    out["cp_ulysses"] = [g[k * u:(k + 1) * u] for g in out["cp"] for k in range(len(g) // u)]
    out["cp_ring"] = [g[j::u] for g in out["cp"] for j in range(u)]
    problems = config.expert_problems()
    if problems:
        raise ValueError(problems[0])
    ep = config.ep_size or 1
    out["ep"] = [g[a * ep:(a + 1) * ep] for g in out["dp_shard_cp"] for a in range(len(g) // ep)]
    out["edp"] = [g[j::ep] for g in out["dp_shard_cp"] for j in range(ep)]
    out["pp_ends"] = [sorted({g[0], g[-1]}) for g in out["pp"]]
    return out


class MeshDim:
    """One dimension as seen by one rank: its group, its rank in it, the members' global ranks."""

    def __init__(self, name: str, ranks: List[int], global_rank: int, group):
        self.name = name
        self.ranks = list(ranks)
        self.size = len(ranks)
        self.rank = self.ranks.index(global_rank)
        self.global_rank = global_rank
        self.group = group

    # The ring neighbours; used by context parallelism (K/V travel rank -> next_rank).
    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]

    # For pgm.pp: where this rank's stage sits in the pipeline.
    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def __repr__(self) -> str:
        return f"{self.name}(rank {self.rank}/{self.size}, ranks {self.ranks})"


class ProcessGroupManager:
    """All groups of this rank, as attributes: pgm.tp, pgm.cp, pgm.dp_shard_cp, ...

    Needs an initialised default process group (see minipar.init). Pass it explicitly to every
    parallel piece; there is no module-level singleton. `timeout` is how long a collective on any
    of the groups waits for its peers before it fails (torch's new_group does not inherit the
    default group's: without it every group would wait 30 minutes for a stuck rank).
    """

    def __init__(self, config: ParallelismConfig, backend: Optional[str] = None,
                 timeout: Optional[datetime.timedelta] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ProcessGroupManager needs torch.distributed initialised first: call "
                               "minipar.init(config), or torch.distributed.init_process_group()")
        world_size, rank = dist.get_world_size(), dist.get_rank()
        self.config = config.resolve(world_size)
        self.world_size, self.global_rank = world_size, rank
        self.grid_shape = _shape(self.config)          # (P, R, S, C, T)
        self.shape = self.grid_shape[1:]               # the 4D grid of one stage, (R, S, C, T)
        self.coords = dict(zip(COORDS, coords_of(rank, self.grid_shape)))

        created: Dict[Tuple[int, ...], object] = {}
        mine: Dict[str, List[int]] = {}
        for name, groups in all_groups(self.config).items():  # same order on every rank
            for members in groups:
                key = tuple(members)
                if key not in created and (len(members) > 1 or name not in PARTS):
                    created[key] = dist.new_group(ranks=members, backend=backend, timeout=timeout)
                if rank in members:
                    mine[name] = members
        for name, members in mine.items():     # (a PARTS group of one needs no torch group)
            setattr(self, name, MeshDim(name, members, rank, created.get(tuple(members))))
        # every rank, over the default group: for the few calls that span the whole job
        # (checkpoint agreement, the closing memory summary)
        self.world = MeshDim("world", list(range(world_size)), rank, None)
        if world_size > 1:
            # gloo connects a new group's members lazily in the background of new_group: a rank
            # that races ahead (or exits) could leave a peer's connection half made. One barrier
            # makes "every group exists on every rank" true when the constructor returns.
            comm.barrier(self.world)

    @classmethod
    def local(cls) -> "ProcessGroupManager":
        """A world of one without torch.distributed: every dimension has size 1 and no group, so
        the parallel layers run as their plain twins. What a model built with pgm=None uses."""
        self = cls.__new__(cls)
        self.config = ParallelismConfig().resolve(1)
        self.world_size, self.global_rank = 1, 0
        self.grid_shape, self.shape = (1, 1, 1, 1, 1), (1, 1, 1, 1)
        self.coords = dict.fromkeys(COORDS, 0)
        for name in list(DIMENSIONS) + list(PARTS) + ["world"]:
            setattr(self, name, MeshDim(name, [0], 0, None))
        return self

    @property
    def dims(self) -> Dict[str, MeshDim]:
        return {name: getattr(self, name) for name in DIMENSIONS}    # (+ cp_ulysses, cp_ring, ep, edp)

    @property
    def is_first_stage(self) -> bool:
        return self.pp.is_first

    @property
    def is_last_stage(self) -> bool:
        return self.pp.is_last

    def __repr__(self) -> str:
        coords = " ".join(f"{k}={v}" for k, v in self.coords.items())
        shape = "x".join(map(str, self.grid_shape))
        lines = [f"ProcessGroupManager(rank {self.global_rank} of {self.world_size}, grid "
                 f"pp x dp_replicate x dp_shard x cp x tp = {shape}, coords {coords}"]
        lines += [f"  {d!r}" for d in self.dims.values()]
        return "\n".join(lines) + ")"


def describe_grid(config: ParallelismConfig) -> str:
    """The whole grid and every group, as text (what `python -m minipar.mesh` prints)."""
    world = config.total_size
    config = config.resolve(world)
    shape = _shape(config)
    lines = [f"grid pp x dp_replicate x dp_shard x cp x tp = {'x'.join(map(str, shape))} = {world} ranks",
             "global_rank = (((p * R + r) * S + s) * C + c) * T + t", "",
             "rank  " + "  ".join(f"{c:>12}" for c in COORDS)]
    for rank in range(world):
        lines.append(f"{rank:>4}  " + "  ".join(f"{v:>12}" for v in coords_of(rank, shape)))
    for name, groups in all_groups(config).items():
        varying = "varying " + ", ".join(DIMENSIONS[name]) if name in DIMENSIONS else PARTS[name]
        lines += ["", f"{name} groups (size {len(groups[0])}, {varying}):"]
        lines += ["  " + " ".join(str(g) for g in groups)]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Print minipar's rank grid and its groups.")
    for flag in ("--pp", "--dp-replicate", "--dp-shard", "--cp", "--tp"):     # the five sizes
        parser.add_argument(flag, type=int, default=1)
    parser.add_argument("--cp-impl", choices=("ring", "ulysses", "usp"), default="ring")
    parser.add_argument("--cp-ulysses", type=int, default=None, help="USP's Ulysses group size")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel ranks, borrowed from dp_shard x cp")
    args = parser.parse_args(argv)
    try:                                            # a bad size: one line, exit 2 (cli.py)
        positive_ints(args, dict(pp="pipeline stages", dp_replicate="replicas", dp_shard="ZeRO-3 shards",
                                 cp="context-parallel ranks", tp="tensor-parallel ranks",
                                 ep="expert-parallel ranks"))
        config = ParallelismConfig(args.dp_replicate, args.dp_shard, args.cp, args.tp, pp_size=args.pp,
                                   cp_impl=args.cp_impl, cp_ulysses_size=args.cp_ulysses, ep_size=args.ep)
        text = describe_grid(config)
    except ValueError as err:
        return fail(err)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""rl: dpo in the trainer: the DPO step of minipar/dpo_step.py on the run's pairs, its reference,
and the evaluation on held-out pairs. trainer.py holds one DPORun when the config has rl: dpo.

    DPORun(trainer)        DPOStep(trainer.step, dpo_beta, dpo_loss_type, reference, label_smoothing=
                           dpo_label_smoothing) with the reference of config/rl_keys.py's
                           reference_of: 'lora' (the adapters
                           switched off, one more forward per micro-batch), 'precomputed', or
                           'frozen' (a frozen copy of the starting weights on the run's layout,
                           dpo_reference.frozen_copy: built here from base_model, or the seed, at
                           every start, so a resume's copy is the first run's; one more forward
                           per micro-batch, nothing in the checkpoint)
    precompute()           the precomputed reference: one forward pass over the train and held-out
                           pairs with the STARTING weights, in batches of global_batch_size pairs
                           (the last one filled up with pairs again, their numbers dropped), each
                           all-gathered over dp; (P, 2) floats kept on the host of every rank in the
                           PairData (2 floats per pair). With adapter: lora it runs with the
                           adapters off. It runs in the constructor, at every start, BEFORE a resume
                           loads its checkpoint: the starting weights (base_model, or the seeded
                           initialisation) and the data are the same, so a resumed run gets the
                           numbers the first run used (nothing is stored in the checkpoint). They
                           are cached with the prepared data, keyed by everything they depend on
                           (data/reference_cache.py): global rank 0 looks, then broadcasts a flag
                           and, when found, the numbers, so a rerun skips the pass; after a pass it
                           writes them
    step(global batch)     (2G, T) rows c_0, r_0, ... and their (2G,) reference -> DPOStep: the loss,
                           grad norm, lr, and TRL's metrics as device tensors (train_loop.py reads
                           them with the loss, in one copy)
    evaluate()             the mean DPO loss over eval_batches whole batches of held-out pairs (one
                           micro-batch per rank, forward only) and TRL's eval metrics
                           (eval_rewards/accuracies, ...), summed like the SFT eval loss

Communication beyond the step's: the reference pass's forwards and one all-gather of 2G floats
per batch over dp (once per start; from the cache instead: two broadcasts over the world per split,
a flag then 2P floats); an evaluation's forwards, and per batch one all-reduce of 6
numbers (the metrics), then one of the loss over dp_cp (and pp).
"""
from __future__ import annotations

import time
from typing import Dict, Tuple

import torch

from minipar import comm
from minipar.batch_split import windows
from minipar.dpo import METRICS
from minipar.dpo_reference import frozen_copy
from minipar.dpo_step import DPOStep
from minipar.lora import adapters_off
from minipar.trainer.config.rl_keys import reference_of
from minipar.trainer.data import reference_cache

SAYS = {"lora": "the base with the adapters off, one more forward per micro-batch",
        "precomputed": "precomputed before training",
        "frozen": "a frozen copy of the starting weights, one more forward per micro-batch"}


class DPORun:
    """The DPO step, its reference and its evaluation, for a trainer (trainer.py) of an rl run."""

    def __init__(self, trainer):
        self.t, self.cfg, self.pgm = trainer, trainer.cfg, trainer.pgm
        self.reference = reference_of(self.cfg)
        ref_model = frozen_copy(trainer.parallel, self.cfg.model, trainer.run.base_model, trainer.log) \
            if self.reference == "frozen" else None
        self.dpo = DPOStep(trainer.step, self.cfg.dpo_beta, self.cfg.dpo_loss_type, self.reference, ref_model,
                           label_smoothing=self.cfg.dpo_label_smoothing)
        self.data = trainer.run.datasets              # data/preference.py PairRun: train, val
        smooth = f", label smoothing {self.cfg.dpo_label_smoothing:g}" if self.cfg.dpo_label_smoothing else ""
        trainer.log(f"rl: dpo ({self.cfg.dpo_loss_type}, beta {self.cfg.dpo_beta:g}{smooth}), reference: "
                    + SAYS[self.reference])
        if self.reference == "precomputed":
            self.precompute()

    def precompute(self) -> None:
        t0, G = time.time(), self.cfg.global_batch_size
        splits = [d for d in (self.data.train, self.data.val) if d is not None]
        got = self._cached(splits)
        self.from_cache = got is not None
        what = f"loaded from {self.cache_file}" if got is not None else "precomputed"
        if got is None:
            got = [self._pass(data, G) for data in splits]
            if self.pgm.global_rank == 0 and reference_cache.save(self.cache_file, self.cache_inputs, got):
                what += f" and cached in {self.cache_file}"
        for data, ref in zip(splits, got):
            data.ref_logps = ref
        pairs = sum(d.num_rows for d in splits)
        self.t.log(f"reference log-probs of {pairs} pairs {what} in {time.time() - t0:.1f} s (the starting "
                   f"weights', at every start, before a resume)")

    def _cached(self, splits):
        """The cache's numbers on every rank, or None: global rank 0 computes the key and reads;
        a flag, then each split's (P, 2), broadcast over the world."""
        pgm, device = self.pgm, self.t.device
        self.cache_inputs = self.cache_file = got = None
        found = torch.zeros(1, device=device)
        if pgm.global_rank == 0:
            self.cache_inputs = reference_cache.cache_inputs(self.cfg, pgm.config, self.t.run.base_model,
                                                             splits, device.type)
            self.cache_file = reference_cache.cache_path(self.cfg, self.cache_inputs)
            got = reference_cache.load(self.cache_file, self.cache_inputs, [d.num_rows for d in splits])
            found.fill_(float(got is not None))
        comm.broadcast(found, pgm.world)
        if not found.item():
            return None
        out = []
        for i, data in enumerate(splits):
            t = got[i].to(device) if got is not None else torch.empty(data.num_rows, 2, device=device)
            out.append(comm.broadcast(t, pgm.world).cpu())
        return out

    def _pass(self, data, G: int) -> torch.Tensor:
        """(P, 2) reference log-probs of a split, in batches of G pairs (the last one filled up), the
        step's eval_window of them in each forward pass (under pp: pipelined)."""
        out = torch.empty(data.num_rows, 2)
        for group in windows(range(0, data.num_rows, G), self.t.step.eval_window):
            index = torch.cat([torch.arange(first, first + G) for first in group]) % data.num_rows
            gb = data.take(index)                      # the last batch filled up
            got = self._reference_pass(gb["input_ids"], gb["labels"], len(group)).view(len(group), G, 2)
            for k, first in enumerate(group):
                n = min(G, data.num_rows - first)
                out[first:first + n] = got[k, :n]
        return out

    def _reference_pass(self, ids, labels, num_batches: int) -> torch.Tensor:
        if self.cfg.adapter == "lora":                # the reference of a LoRA run: adapters off
            with adapters_off(self.t.model):
                return self.dpo.precompute_reference(ids, labels, num_batches=num_batches)
        return self.dpo.precompute_reference(ids, labels, num_batches=num_batches)

    def step(self, gb: Dict[str, torch.Tensor]) -> dict:
        return self.dpo(gb["input_ids"], gb["labels"], gb.get("ref_logps"))

    @torch.no_grad()
    def evaluate(self) -> Tuple[float, Dict[str, float]]:
        """(mean held-out DPO loss, {eval_rewards/...: mean}) over whole batches; collective."""
        cfg, step, device = self.cfg, self.t.step, self.t.device
        model = self.t.model
        total = torch.zeros((), dtype=torch.float64, device=device)
        sums = torch.zeros(len(METRICS), dtype=torch.float64, device=device)
        count, val = 0, self.data.val.batches(cfg.global_batch_size, cfg.eval_batches)
        for group in windows(val, step.eval_window):      # down the pipeline together
            micro = [self.dpo.local(gb["input_ids"], gb["labels"], gb.get("ref_logps"), num_micro=1)[0]
                     for gb in group]
            objectives = [self.dpo.objective([mb], cfg.global_batch_size) for mb in micro]
            if self.reference != "precomputed":
                self.dpo.reference_logps(micro)
            model.eval()
            shares = step.eval_loss(micro, objectives)
            for k, objective in enumerate(objectives):     # in batch order: one at a time's numbers
                total += shares[k]
                sums += torch.stack(list(objective.metrics(device).values()))
            count += len(group)
        for group in step.loss_groups:
            comm.all_reduce(total, group)
        model.train()
        got = (torch.cat([total.reshape(1), sums]) / max(count, 1)).tolist()
        return got[0], {f"eval_{name}": v for name, v in zip(METRICS, got[1:])}

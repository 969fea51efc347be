"""Scoring text on any layout: summed log-probabilities, perplexity, multiple-choice accuracy.

Everything here is one quantity, the summed log-probability of some tokens of a row given the
tokens before them, computed by the training composition's forward (compose.Step.eval_loss), so it
runs on every layout the trainer runs on (dp, ZeRO-3, tp + SP, cp, pp, ep):

    row = context + continuation ids, right-padded to a common length L (a multiple of 2 cp tp)
    labels[t] = ids[t + 1] where t + 1 is a continuation token, else -100
    eval_loss(batch, n_items=1) = this rank's share of - sum log p(continuation | context)

One row per dp rank per batch (B = dp): each rank's share is its own row's (summed over cp and pp),
so a vector with the share in slot dp_rank, summed over Step.loss_groups (dp_cp, pp), gives every
row's value on every rank: one small all-reduce per call beside the forward's own collectives. A
call scores Step.eval_window such batches (each padded to its own length), under pp pipelined: the
stages work on consecutive batches at once.

lm-evaluation-harness's loglikelihood form (its `loglikelihood` request):
  split   trailing spaces of the context move to the continuation; continuation ids =
          encode(context + continuation)[len(encode(context)):]; an empty context is the EOS id
  acc     the choice with the highest summed log-probability is the prediction
  acc_norm  the same, each sum divided by its choice's length in characters (lm-eval's)

perplexity: each document cut into windows of `seq_len` predicted tokens (disjoint, stride
seq_len: every token but a document's first predicted once, from the window's earlier tokens);
ppl = exp(sum of NLL / tokens predicted).
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

from minipar import comm
from minipar.batch_split import local_batch, windows


class Scorer:
    """Summed log-probabilities of continuation tokens, through a ParallelModel and its compose.Step."""

    def __init__(self, pm, step):
        self.pm, self.step, self.pgm = pm, step, pm.pgm
        c = self.pgm.config
        self.multiple = 2 * self.pgm.cp.size * (self.pgm.tp.size if c.sequence_parallel else 1)

    def _call(self, batches: List[List[Tuple[List[int], int]]], pad_id: int) -> List[float]:
        """batches: each (ids, first scored position) for each dp rank (fewer: dummy rows); every
        row's sum, batch after batch, from one forward pass over the batches."""
        dp, micro = self.pgm.dp.size, []
        for rows in batches:
            longest = max(len(ids) for ids, _ in rows)
            L = -(-longest // self.multiple) * self.multiple
            input_ids = torch.full((dp, L), pad_id, dtype=torch.long)
            labels = torch.full((dp, L), -100, dtype=torch.long)
            for i, (ids, first) in enumerate(rows):
                t = torch.tensor(ids, dtype=torch.long)
                input_ids[i, :len(ids)] = t
                labels[i, first - 1:len(ids) - 1] = t[first:]      # label[t] is the token at t + 1
            micro.append(local_batch(input_ids, labels, self.pgm, device=self.pm.device))
        was_training = self.pm.model.training
        self.pm.model.eval()
        shares = self.step.eval_loss(micro, 1)           # - sum log p of this rank's row in each batch
        self.pm.model.train(was_training)
        vec = torch.zeros(len(batches), dp, dtype=torch.float64, device=shares.device)
        vec[:, self.pgm.dp.rank] = shares
        for group in self.step.loss_groups:
            comm.all_reduce(vec, group)
        return [-float(v) for rows, row in zip(batches, vec) for v in row[:len(rows)]]

    @torch.no_grad()
    def logprobs(self, rows: Sequence[Tuple[List[int], List[int]]], pad_id: int = 0) -> List[float]:
        """sum log p(continuation | context) for each (context ids, continuation ids); every rank
        must call with the same rows."""
        for ctx, cont in rows:
            if not ctx or not cont:
                raise ValueError(f"a scored row needs a context and a continuation of at least one token, "
                                 f"got {len(ctx)} and {len(cont)} tokens")
        dp, out = self.pgm.dp.size, []
        parts = [[(list(c) + list(x), len(c)) for c, x in rows[k:k + dp]] for k in range(0, len(rows), dp)]
        for part in windows(parts, self.step.eval_window):
            out += self._call(part, pad_id)
        return out


def split_request(tokenizer, context: str, continuation: str, prefix_id=None) -> Tuple[List[int], List[int]]:
    """lm-evaluation-harness's (context ids, continuation ids) of a loglikelihood request."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
    cont = whole[len(ctx):]
    if not ctx:
        if prefix_id is None:
            raise ValueError("an empty context needs an EOS token to stand for it, and this tokenizer "
                             "has none")
        ctx = [prefix_id]
    return ctx, cont


def multiple_choice(scorer: Scorer, tokenizer, rows: List[dict], pad_id: int = 0, prefix_id=None) -> dict:
    """acc and acc_norm over rows {context, choices: [str], gold: int}, and each row's log-probs."""
    requests, owners = [], []
    for i, row in enumerate(rows):
        for choice in row["choices"]:
            requests.append(split_request(tokenizer, row["context"], choice, prefix_id))
            owners.append(i)
    lps = scorer.logprobs(requests, pad_id)
    per_row = [[] for _ in rows]
    for i, lp in zip(owners, lps):
        per_row[i].append(lp)
    acc = acc_norm = 0
    for row, scores in zip(rows, per_row):
        norm = [s / max(len(c), 1) for s, c in zip(scores, row["choices"])]
        acc += int(max(range(len(scores)), key=scores.__getitem__) == row["gold"])
        acc_norm += int(max(range(len(norm)), key=norm.__getitem__) == row["gold"])
    n = max(len(rows), 1)
    return dict(acc=acc / n, acc_norm=acc_norm / n, examples=len(rows), logprobs=per_row)


def perplexity(scorer: Scorer, documents: List[List[int]], seq_len: int, pad_id: int = 0) -> dict:
    """Perplexity of token documents in disjoint windows of seq_len predicted tokens."""
    requests = []
    for doc in documents:
        for start in range(0, len(doc) - 1, seq_len):
            window = doc[start:start + seq_len + 1]
            requests.append((window[:1], window[1:]))
    nll = -sum(scorer.logprobs(requests, pad_id))
    tokens = sum(len(c) for _, c in requests)
    if not tokens:
        raise ValueError("perplexity: no token to predict (every document is shorter than two tokens)")
    return dict(perplexity=math.exp(nll / tokens), nll_per_token=nll / tokens, tokens=tokens)

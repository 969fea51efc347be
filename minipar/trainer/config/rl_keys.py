"""Preference training's keys, as Axolotl and TRL write them, and the reference each run takes.

    Axolotl / TRL                         minipar (TrainConfig)
    rl: dpo                               rl dpo: DPO on `datasets` pairs (minipar/dpo_step.py)
    rl: ipo                               rl dpo, dpo_loss_type ipo (Axolotl's spelling of IPO)
    rl: kto | orpo | simpo | grpo | ...   refused, naming the supported values
    rl_beta  or  dpo_beta                 dpo_beta (the schema's alias: one name in the code; both
                                          given and different: refused)
    dpo_loss_type: sigmoid | robust |     TRL's loss_type (the sigmoid loss of Rafailov et al. 2023,
        hinge | ipo                       robust DPO of Chowdhury et al. 2024, SLiC's hinge, or IPO
                                          of Azar et al. 2023; typed in schema.py, the formulas in
                                          minipar/dpo/objective.py); Axolotl's list of one, [sigmoid],
                                          is read as it; several (TRL's sum of losses) are refused
    dpo_label_smoothing                   TRL's label_smoothing eps, 0 <= eps < 0.5 (schema.py): the
                                          sigmoid loss becomes cDPO's, the robust loss uses it; with
                                          hinge or ipo (TRL ignores it there) eps > 0 is refused
    precompute_ref_log_probs              TRL's: the reference's log-probs of every pair computed in
                                          one pass before training

The reference (docs/dpo.md has what each costs; minipar/dpo_reference.py):

    full fine-tune                        precomputed (the starting weights, one forward pass over
                                          the train and held-out pairs before step 1), unless
                                          precompute_ref_log_probs: false, which builds TRL's
                                          default instead: a frozen copy of the starting weights,
                                          ZeRO-3 sharded like the policy, one more forward per
                                          micro-batch ('frozen')
    adapter: lora                         the base with its adapters switched off, one more forward
                                          per micro-batch; precompute_ref_log_probs: true precomputes
                                          it instead (the adapters-off model before step 1)

translate_rl runs on each source's raw mapping (keys.translate calls it), rl_problems once all
sources are applied (keys.resolve); the keys' types and ranges are schema.py's. Pure Python, no
communication.
"""
from __future__ import annotations

from typing import List, Optional

from minipar.dpo.objective import LOSS_TYPES, SMOOTHED

RL_TYPES = ("dpo",)
RL_ALIASES = {"ipo": ("dpo", "ipo")}     # Axolotl's rl value -> (rl, dpo_loss_type)


def translate_rl(data: dict, problems: List[str]) -> dict:
    """rl: ipo -> rl: dpo + dpo_loss_type: ipo, and dpo_loss_type: [sigmoid] -> sigmoid, in one
    source's mapping."""
    losses = data.get("dpo_loss_type")
    if isinstance(losses, list):
        if len(losses) == 1:
            data["dpo_loss_type"] = losses[0]
        else:
            data.pop("dpo_loss_type")
            problems.append(f"dpo_loss_type {losses}: one loss is trained (TRL's weighted sum of several is "
                            f"not supported); write one of dpo_loss_type: {', '.join(LOSS_TYPES)}")
    if data.get("rl") in RL_ALIASES:
        rl, loss = RL_ALIASES[data["rl"]]
        if data.get("dpo_loss_type", loss) != loss:
            problems.append(f"rl: {data['rl']} contradicts dpo_loss_type: {data['dpo_loss_type']}; use "
                            f"rl: dpo with dpo_loss_type")
        data["rl"], data["dpo_loss_type"] = rl, loss
    return data


def reference_of(cfg) -> Optional[str]:
    """The DPO reference a config asks for: 'precomputed', 'lora' (adapters off), 'frozen' (a frozen
    copy), or None (no rl)."""
    if not cfg.rl:
        return None
    if cfg.adapter == "lora" and not cfg.precompute_ref_log_probs:
        return "lora"
    if cfg.adapter != "lora" and cfg.precompute_ref_log_probs is False:
        return "frozen"
    return "precomputed"


def rl_problems(cfg) -> List[str]:
    """Every problem of the preference keys, one line each (keys.resolve adds them to the file's)."""
    out = []
    if cfg.rl is None:
        given = [k for k, v in (("dpo_loss_type", cfg.dpo_loss_type != "sigmoid"),
                                ("dpo_label_smoothing", cfg.dpo_label_smoothing != 0),
                                ("precompute_ref_log_probs", cfg.precompute_ref_log_probs is not None)) if v]
        if given:
            out.append(f"{', '.join(given)} apply to preference training only: set rl: dpo, or remove them")
        return out
    if cfg.rl not in RL_TYPES:
        return [f"rl: {cfg.rl!r} is not supported; supported: {list(RL_TYPES)} (and rl: ipo, DPO with "
                f"dpo_loss_type ipo); remove `rl` for supervised fine-tuning"]
    if cfg.dpo_label_smoothing and cfg.dpo_loss_type not in SMOOTHED:
        out.append(f"dpo_label_smoothing {cfg.dpo_label_smoothing:g} with dpo_loss_type {cfg.dpo_loss_type}: "
                   f"the {cfg.dpo_loss_type} loss takes no label smoothing (TRL ignores it); use "
                   f"dpo_loss_type {' or '.join(SMOOTHED)}, or remove dpo_label_smoothing")
    if not cfg.datasets:
        out.append("rl: dpo trains on preference pairs: set `datasets` to a JSONL file of prompt / chosen / "
                   "rejected rows (Axolotl's chat_template form, or the plain form; docs/dpo.md)")
    if cfg.sample_packing:
        out.append("sample_packing: true with rl: dpo: each side of a pair is one padded row (no packing); "
                   "set sample_packing: false")
    if cfg.pipeline_overlap_steps:
        out.append("pipeline_overlap_steps with rl: dpo is not supported (the pairs' metrics are summed "
                   "over the stages every step); set it to false")
    return out

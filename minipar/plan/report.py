"""The text of `python -m minipar.plan`: one layout, one pipeline (stage by stage), or a search.

Each function turns a plan's plain values (estimate.plan, pipeline.plan_pipeline,
layout_search.search: what --json prints) into the lines a person reads; nothing is computed here
that the plan does not already hold.
"""
from __future__ import annotations

from .inputs import OTHER_TRAINER_FIELDS, ModelShape

GB = 1e9


# what the memory total predicts, said under every report's budget
NOTE_1 = "(the total predicts torch.cuda.max_memory_allocated: the tensors alive at the peak;"
NOTE_2 = " max_memory_reserved adds the allocator's rounding and fragmentation, as the reserve does)"


def _unit(largest: float):
    """(name, bytes) of the decimal unit that shows `largest` with a few digits before the point."""
    for name, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if largest >= size:
            return name, size
    return "B", 1.0


def _optimizer_label(name) -> str:
    if name in (None, "adamw_torch", "adamw_torch_fused"):
        return "optimizer (AdamW m, v fp32 + step)"
    return f"optimizer ({name})"


def describe(p: dict, model: ModelShape) -> str:
    m, t, o = p["memory"], p["time"], p["options"]
    a = m["activations"]
    lines = [f"model: {p['params'] / 1e9:.3f} B parameters ({model.num_hidden_layers} layers, hidden "
             f"{model.hidden_size}, {model.num_attention_heads}/{model.num_key_value_heads} heads, "
             f"vocab {model.vocab_size})",
             f"layout: {p['layout_str']} on {p['world']} GPUs ({p['nodes']} node(s))",
             f"batch: {p['batch']['global_batch_size']} x {p['batch']['sequence_len']} tokens per step, "
             f"micro-batch {p['micro_batch']} row(s) x {p['micro_steps']} step(s) per dp rank; {o['dtype']}, "
             f"prefetch {o['prefetch']}, activation checkpointing "
             f"{_ac(o)}",
             ""]
    if p.get("moe"):        # a mixture of experts: minipar/plan/moe.py
        x = p["moe"]
        per_rank = x["expert_elements_per_rank"]
        lines[-1:] = [f"mixture of experts: {x['experts']} experts, top-{x['top_k']}, in {x['moe_layers']} "
                      f"layers; {x['total_params'] / 1e9:.3f} B parameters, {x['active_params'] / 1e9:.3f} B "
                      f"active per token", f"experts: ep {x['ep']} (each rank {x['experts_per_rank']} per "
                      f"layer), ZeRO-3 over edp {x['edp']}: {per_rank * 16 / 1e9:.3f} GB per rank "
                      f"(16 B x {per_rank:,} elements); all-to-all bytes "
                      f"assume balanced routing", ""]
    other = [k.replace("_", "-") for k in OTHER_TRAINER_FIELDS if o.get(k)]
    if other:               # time_model.py / overlap.py price them; the ledger stays minipar's
        lines[-1:] = [f"timed as another trainer runs the step (--{', --'.join(other)}); the bytes per "
                      f"group below are minipar's own ledger", ""]
    if o.get("lora_r"):     # memory and collectives count LoRA; the FLOPs do not
        lines[-1:] = [f"LoRA r={o['lora_r']} on {', '.join(o['lora_targets'])}: memory and communication "
                      f"count the frozen base and the adapters; compute is a full fine-tune's", ""]
    unit, size = _unit(m["total"])
    lines.append(f"memory per rank ({unit})")
    sharded = p["layout"]["dp_shard"] * p["layout"]["cp"] > 1        # ZeRO-3 over dp_shard_cp
    gathered = f"gathered units ({o['dtype']}: root + {1 + o['prefetch']} units)" \
        if sharded else "gathered units (no ZeRO-3)"
    rows = [("parameters (fp32 masters" + (", 1/N shards)" if sharded else ")"), m["params"]),
            ("gradients (fp32)", m["grads"]), (_optimizer_label(o.get("optimizer")), m["optimizer"]),
            *([("DPO reference: the frozen copy", m["reference"])] if m.get("reference") else []),
            ("= persistent", m["persistent"]), (gathered, m["gathered"]),
            ("accumulated grads (no_sync: fp32, unsharded)", m["accumulated_grads"]),
            ("activations, no checkpointing", a["full"]),
            ("activations, checkpointing (kept / peak)", None),
            *([(f"activations, {_ac(o)} (peak)", a["as_configured"])]
              if o["gradient_checkpointing"] == "selective" else []),
            *[(f"at {k}" + (" (the peak)" if k == m["peak_phase"] else ""), v)
              for k, v in m["phases"].items()],
            ("= total (as chosen)", m["total"])]
    for label, v in rows:
        if v is None:
            kept, peak = a["checkpointed"] / size, a["checkpointed_peak"] / size
            lines.append(f"  {label:<44}{kept:10.3f} / {peak:.3f}")
        else:
            lines.append(f"  {label:<44}{v / size:10.3f}")
    lines.append(f"  {'budget (GPU memory less the reserve)':<44}{m['budget'] / size:10.3f}   "
                 + ("fits" if m["fits"] else "DOES NOT FIT"))
    lines += [f"  {NOTE_1}", f"  {NOTE_2}"]
    unit, size = _unit(max([c["bytes"] for g in p["comm"].values() for c in g["ops"].values()] or [0]))
    lines += ["", "communication per step per rank (buffer: the bytes comm.py's ledger records; "
              "wire: what the rank sends)",
              f"  {'group':<13}{'size':>5}  {'crosses nodes':<14}{'op':<16}{'calls':>7}{'buffer ' + unit:>12}"
              f"{'wire ' + unit:>10}{'est. s':>10}"]
    for group, g in p["comm"].items():
        for i, (op, c) in enumerate(g["ops"].items()):
            head = f"  {group:<13}{g['size']:>5}  {('yes' if g['crosses_nodes'] else 'no'):<14}" if i == 0 \
                else " " * 36
            sec = f"{g['seconds']:10.2e}" if i == 0 else ""
            nbytes, wire = c["bytes"] / size, c["wire_bytes"] / size
            lines.append(f"{head}{op:<16}{c['calls']:>7}{nbytes:12.3f}{wire:10.3f}{sec}")
    a2a = f" + all-to-all {t['all_to_all_s']:.3g}" if t.get("all_to_all_s") else ""   # Ulysses: exposed
    if t.get("moe_s") is not None:                     # ep's exchanges and edp's gathers, exposed
        a2a += f" + MoE ep/edp {t['moe_s']:.3g} + MoE matmuls beyond the dense MLP's {t['moe_matmul_s']:.3g}"
    lines += ["", f"estimated step (the model of minipar/plan/estimate.py): {t['step_s']:.3g} s = compute "
              f"{t['compute_s']:.3g} + tp {_tp(t)}{a2a} + {_hidden(t)}{_reference(t)}; "
              f"{t['tokens_per_s']:,.0f} tokens/s, {_mfu(t)}", _parts(t)]
    return "\n".join(lines)


def _reference(t: dict) -> str:
    """rl: dpo's reference forwards in the step (minipar/plan/reference_cost.py), or its pass before."""
    if t.get("reference_s"):
        return f" + the DPO reference's forwards {t['reference_s']:.3g}"
    if t.get("reference_pass_s_per_batch"):
        return (f" (the DPO reference precomputed before training: "
                f"{t['reference_pass_s_per_batch']:.3g} s per batch)")
    return ""


def _tp(t: dict) -> str:
    """tp's seconds; under --tp-comm-overlap the part the GEMMs do not hide beside it."""
    if t["tp_exposed_s"] == t["tp_s"]:
        return f"{t['tp_s']:.3g}"
    return f"{t['tp_exposed_s']:.3g} (of {t['tp_s']:.3g}, the rest behind the GEMMs)"


def _hidden(t: dict) -> str:
    return (f"what the layers' compute does not hide (minipar/plan/overlap.py) of cp {t['cp_s']:.3g} "
            f"({t['cp_exposed_s']:.3g}) and dp {t['dp_s']:.3g} ({t['dp_exposed_s']:.3g})")


def _mfu(t: dict) -> str:
    return (f"MFU {100 * t['mfu']:.1f} % (causal attention counted half; "
            f"{100 * t['mfu_full_attention']:.1f} % counted whole, as torchtitan and Megatron-LM)")


def _parts(t: dict) -> str:
    return (f"  compute by operation (minipar/plan/time_model.py): GEMMs {t['gemm_s']:.3g} s, attention "
            f"{t['attention_s']:.3g} s, memory-bound (norms, RoPE, SwiGLU, residuals, loss) "
            f"{t['memory_bound_s']:.3g} s, optimizer step {t['optimizer_s']:.3g} s")


def ac_label(o: dict, sep: str = ", ") -> str:
    """A layout's checkpointing as a short suffix: "", ", AC" (every layer) or ", SAC" (selective)."""
    ac = o["gradient_checkpointing"]
    return "" if not ac else f"{sep}{'SAC' if ac == 'selective' else 'AC'}"


def _ac(o: dict) -> str:
    """The options' activation checkpointing in words."""
    ac = o["gradient_checkpointing"]
    if ac == "selective":
        option = o.get("selective_ac_option", "op")
        return "selective per op" if option == "op" else f"selective, every {option}-th layer"
    return "on" if ac else "off"


def describe_pipeline(p: dict, model: ModelShape) -> str:
    """Each stage's line, then the worst stage (the most memory) in full, then the pipeline's time."""
    t = p["time"]
    unit, size = _unit(max(s["memory"]["total"] for s in p["stages"]))
    lines = [f"pipeline: {p['layout_str']} on {p['world']} GPUs; per stage ({unit} per rank; "
             f"activations = per micro-batch x in flight):",
             f"  {'stage':<7}{'layers':<18}{'persistent':>11}{'gathered':>10}{'activations':>12}"
             f"{'in flight':>10}"
             f"{'total':>10}{'sends':>7}"]
    chosen = "checkpointed_peak" if p["options"]["gradient_checkpointing"] else "full"
    for s in p["stages"]:
        m, a = s["memory"], s["activations"]
        layers = "+".join(f"{c[0]}-{c[-1]}" for c in s["layers"]) + (" +emb" if s["first"] else "") + \
            (" +head" if s["last"] else "")
        sends = s["comm"].get("pp", {}).get("ops", {}).get("send", {}).get("calls", 0)
        lines.append(f"  {s['rank']:<7}{layers:<18}{m['persistent'] / size:11.3f}{m['gathered'] / size:10.3f}"
                     f"{a[chosen] / size:12.3f}{a['in_flight']:10d}{m['total'] / size:10.3f}{sends:7d}")
    body = describe(p, model).split("\n")[:-2]        # the 4D step lines do not apply
    body[1] = f"layout: {p['layout_str']} on {p['world']} GPUs ({p['nodes']} node(s)); the worst stage: " \
              f"{p['worst_stage']}, shown below"
    tail = [f"estimated step (minipar/plan/pipeline.py): {t['step_s']:.3g} s = the slowest stage's work "
            f"(stage {t['slowest_stage']}: {t['work_s']:.3g} s) / (1 - bubble {t['bubble']:.3f}) "
            f"+ the sends on the critical path {t['pp_s']:.3g} s{_reference(t)}; "
            f"{t['tokens_per_s']:,.0f} tokens/s, {_mfu(t)}", _parts(t)]
    return "\n".join(body + [""] + lines + ["", *tail])


def describe_search(s: dict, model: ModelShape, top: int = 10) -> str:
    lines = [f"{len(s['ranked'])} of {s['considered']} layouts fit; fastest first "
             f"(est. step s, MFU, GB per rank):"]
    for p in s["ranked"][:top]:
        ac = ac_label(p["options"], " +")
        t = p["time"]
        lines.append(f"  {p['layout_str'] + ac:<66}{t['step_s']:8.3f} s {100 * t['mfu']:5.1f} %"
                     f"{p['memory']['total'] / GB:8.1f} GB")
    if len(s["ranked"]) > top:
        lines.append(f"  ... {len(s['ranked']) - top} more (--top)")
    rec = s["recommended"]
    if rec is None:
        need = s.get("smallest_world")
        where = f"the fewest that fit are {need} GPUs (--world {need})" if need else \
            "none fits up to 4096 GPUs"
        return "\n".join(lines + [f"no layout fits (the persistent state alone is 16 B x "
                                   f"{s['params'] / 1e9:.2f} B "
                                   f"parameters, over all GPUs); {where}, or use a shorter sequence"])
    rules = ", ".join(s["rules_applied"]) or "none"
    slower = rec["time"]["step_s"] / s["ranked"][0]["time"]["step_s"] - 1
    lines += ["", f"recommended: among the layouts within {100 * s['near_tie']:.0f} % of the fastest, "
              f"the placement rules ({rules}), then the fastest, within 1 % of it the most memory free; "
              f"{100 * slower:.1f} % slower than the fastest:", ""]
    return "\n".join(lines) + "\n" + (describe_pipeline if "stages" in rec else describe)(rec, model)

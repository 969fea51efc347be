"""bench_pp.py's tables and figure: what it measured, beside the ideal machine and the formulas.

    tables(args, results, ...)   the results file: side by side per (p, m), against the targets,
                                 per stage, the bytes each step sent against 2 x boundaries x m x bytes(h)
    draw(results, path)          one row per stage, time across, F, B and W in three colours

Each result is bench_pp._measure's: per stage the measured bubble (split into waiting, blocked in a
receive or done before the slowest stage, and the executor's own overhead), the ideal one (the
same action lists through pipeline_parallel.simulate with each stage's measured times, and with
their means), the peak micro-batch chunks held, the bytes saved for backward and sent.
"""
from __future__ import annotations

import torch

from minipar.pipeline_parallel.simulate import theory_bubble

COLOURS = {"F": ("#4c72b0", "#8fb0e0"), "B": ("#55a868", "#a5d6a7"), "W": ("#dd8452", "#f3c19b")}


def tables(args, results, cores, load_start, load_end):
    """The results file's lines (without the figure and the command), from bench_pp's results."""
    act = args.micro_batch * args.seq * args.hidden * 4
    lines = [
        "# Pipeline schedules benchmark (bench_pp.py)", "",
        f"One training step of a Llama (hidden {args.hidden}, p x 2 x {args.layers_per_chunk} layers: "
        f"{args.layers_per_chunk} layer(s) per half stage), micro-batches of {args.micro_batch} x "
        f"{args.seq} tokens, fp32, CPU, gloo, one torch thread per forked rank, torch {torch.__version__}; "
        f"{cores} cores, load average {load_start:.2f} at the start and {load_end:.2f} at the end. "
        f"bytes(h) = {act / 2 ** 20:.2f} MiB. Best of {args.iters} steps. `bubble` is measured (idle / step "
        f"time), `waiting` the part of it blocked in a receive or done before the slowest stage, `overhead` "
        f"the rest (the executor's sends and Python), `ideal` the same action lists simulated with each "
        f"stage's measured mean t_F, t_B, t_W per "
        f"chunk (the table's t columns are their means over stages; the targets' table adds a replay of "
        f"every action's own time), "
        f"`theory` the formula (t_F = t_B = t_W). "
        f"`live` is the peak count of micro-batch chunks held for backward (theory in brackets); `saved` "
        f"the peak bytes autograd held for them; `W` what the split backward kept for W.", "",
        "## Side by side (mean over stages)", "", *summary(results), "", *targets(results),
        *back_to_back(args, results),
        "## Per stage", "",
        "| schedule | p | m | v | stage | step ms | bubble | waiting | ideal | theory | live (theory) "
        "| saved MiB | W MiB | sent MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    totals = []
    for res in results:
        th = theory_bubble(res["schedule"], res["p"], res["m"], res["v"])
        for rank, r in enumerate(res["rows"]):
            lines.append(f"| {res['schedule']} | {res['p']} | {res['m']} | {res['v']} | {rank} | "
                         f"{res['step'] * 1e3:.0f} | {r['bubble']:.3f} | {r['waiting']:.3f} | "
                         f"{r['ideal']:.3f} | {th:.3f} | "
                         f"{r['live']} ({r['peak_theory']}) | {r['saved'] / 2 ** 20:.1f} | "
                         f"{r['held_w'] / 2 ** 20:.1f} | {r['sent'] / 2 ** 20:.2f} |")
        boundaries = boundaries_crossing(res["schedule"], res["p"], res["v"])
        totals.append(f"| {res['schedule']} | {res['p']} | {res['m']} | {res['v']} | "
                      f"{sum(r['sent'] for r in res['rows']) / 2 ** 20:.2f} | "
                      f"2 x {boundaries} x {res['m']} x {act / 2 ** 20:.2f} = "
                      f"{2 * boundaries * res['m'] * act / 2 ** 20:.2f} |")
    lines += ["", "Bytes sent per step over the whole pipeline (ledger) "
              "against 2 x boundaries x m x bytes(h):", "",
              "| schedule | p | m | v | sent MiB | theory MiB |", "|---|---|---|---|---|---|", *totals]
    return lines


def summary(results):
    """Per (p, m): the schedules side by side, mean over stages; ideal idle time over 1F1B's."""
    lines = ["| p | m | schedule | t_F ms | t_B ms | t_W ms | bubble | waiting | overhead | ideal | theory "
             "| waiting / ideal | ideal idle / 1F1B's |", "|---" * 13 + "|"]
    for key in sorted({(r["p"], r["m"]) for r in results}):
        group = [r for r in results if (r["p"], r["m"]) == key]
        base = next((r for r in group if r["schedule"] == "1f1b"), None)
        for r in group:
            n = r["p"]
            bubble, waiting, overhead, ideal = (sum(x[k] for x in r["rows"]) / n
                                                for k in ("bubble", "waiting", "overhead", "ideal"))
            idle = sum(x["ideal_idle"] for x in r["rows"]) / n
            vs = "" if base is None else f"{idle / (sum(x['ideal_idle'] for x in base['rows']) / n):.2f}"
            lines.append(f"| {key[0]} | {key[1]} | {r['schedule']} | {r['t_f'] * 1e3:.1f} | "
                         f"{r['t_b'] * 1e3:.1f} | {r['t_w'] * 1e3:.1f} | {bubble:.3f} | {waiting:.3f} | "
                         f"{overhead:.3f} | {ideal:.3f} | "
                         f"{theory_bubble(r['schedule'], r['p'], r['m'], r['v']):.3f} | "
                         f"{waiting / ideal if ideal > 0 else float('nan'):.2f} | {vs} |")
    return lines


def targets(results):
    """The bars the zero-bubble work is held to. At p = 2 (a core per rank) the measured bubble
    within 1.25x of the ideal one: waiting over the ideal with each stage's mean times (a slower
    stage is the model's split, not the machine), and over a replay of every action's measured time
    (what remains is then the sends' and the executor's cost alone). ZB-H1's ideal idle time at
    most 0.4x 1F1B's, ZB-V's at most 0.15x, simulated at the same mean t_F, t_B, t_W (1F1B's backward
    B + W): the schedules' own bubbles at this model's ratios of F, B and W (the formulas say 1/3
    and 1/6 at t_F = t_B = t_W). ZB-V cannot go below its fill, the last rank's (p - 1) half-stage
    forwards before its first: (p - 1) t_F / 2 against 1F1B's (p - 1)(t_F + t_B + t_W), the floor
    shown beside it."""
    out = ["## Against the targets", "",
           "The measured bubble is the time a stage waits (blocked in a receive, or done before the "
           "slowest stage); the executor's own time (posting sends, Python between actions) is not idle "
           "and is the summary's `overhead`. `replay`: the same lists with every action's measured time.", "",
           "| p | m | schedule | waiting / ideal (p 2: <= 1.25) | waiting / replay "
           "| ideal idle / 1F1B's at the same times (zb_h1 <= 0.40, zbv <= 0.15) | ZB-V's floor |",
           "|---|---|---|---|---|---|---|"]
    for key in sorted({(r["p"], r["m"]) for r in results}):
        for r in (r for r in results if (r["p"], r["m"]) == key):
            n, name = r["p"], r["schedule"]
            waiting, ideal, replay = (sum(x[k] for x in r["rows"]) / n
                                      for k in ("waiting", "ideal", "replay"))

            def judged(x, bar, shown=True):
                return f"{x:.2f}" + (f" {'met' if x <= bar else 'MISSED'}" if shown else "")
            cells = [judged(waiting / ideal, 1.25, key[0] == 2) if ideal > 0 else "",
                     judged(waiting / replay, 1.25, key[0] == 2) if replay > 0 else "", "", ""]
            bar, same = {"zb_h1": 0.40, "zbv": 0.15}.get(name), r["one_f_one_b_idle"]
            if bar is not None and same:
                cells[2] = judged(sum(y["even_idle"] for y in r["rows"]) / n / same, bar)
                if name == "zbv":
                    cells[3] = f"{(n - 1) * r['t_f'] / 2 / same:.2f}"
            out.append(f"| {key[0]} | {key[1]} | {name} | " + " | ".join(cells) + " |")
    return out + [""]


def back_to_back(args, results):
    """The same schedules, --chain steps run back to back with no collective between them: the
    step time then (one step's is the best isolated one), the bubble measured over the chain
    (simulate.steady_state), the chain simulated with each stage's mean times (ideal) and with
    every action's measured time (replay), the formula, and the ideal idle time over 1F1B's back
    to back at the same mean t_F, t_B, t_W."""
    out = ["## Steps back to back", "",
           f"{args.chain} steps run one after the other with no barrier or collective between them, as a "
           "trainer whose stages step their own optimizers runs (minipar's trainer does not: it sums the "
           "loss and the gradient norm over all stages every step, so each of its steps is the one-step "
           "figure above). The fill of a step then overlaps the drain of the one before; only zbv, "
           "whose V ends on rank 0 while the others finish on W's, gains from it "
           "(pipeline_parallel/simulate.py).", "",
           "| p | m | schedule | one step ms | back to back ms | bubble | ideal | replay | theory "
           "| bubble / ideal | bubble / replay "
           "| ideal idle / 1F1B's at the same times (zb_h1 <= 0.40, zbv <= 0.15) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["p"], r["m"])):
        st, n, name = r["steady"], r["p"], r["schedule"]
        bubble = sum(x["bubble"] for x in st["rows"]) / n
        bar = {"zb_h1": 0.40, "zbv": 0.15}.get(name)
        vs = "" if bar is None else f"{st['vs_1f1b']:.2f} {'met' if st['vs_1f1b'] <= bar else 'MISSED'}"
        ratio = [f"{bubble / x:.2f}" if x > 0 else "" for x in (st["ideal"], st["replay"])]
        out.append(f"| {n} | {r['m']} | {name} | {r['step'] * 1e3:.0f} | {st['step'] * 1e3:.0f} | "
                   f"{bubble:.3f} | {st['ideal']:.3f} | {st['replay']:.3f} | "
                   f"{theory_bubble(name, n, r['m'], r['v'], True):.3f} | {ratio[0]} | {ratio[1]} | {vs} |")
    return out + [""]


def draw(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.0 + 0.55 * sum(r["p"] for r in results)),
                             squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        for rank, row in enumerate(res["rows"]):
            for kind, chunk, micro, s, e in row["events"]:
                color = COLOURS[kind][chunk % 2]
                ax.barh(rank, (e - s) * 1e3, left=s * 1e3, color=color, edgecolor="black", linewidth=0.4)
                if (e - s) / res["step"] > 0.012:
                    label = f"{kind}{micro % res['m']}" + ("ab"[chunk] if res["v"] > 1 else "")
                    ax.text((s + e) / 2 * 1e3, rank, label, ha="center", va="center", fontsize=6)
        ax.set_yticks(range(res["p"]), [f"stage {r}" for r in range(res["p"])])
        ax.invert_yaxis()
        bubble, chained = sum(r["bubble"] for r in res["rows"]) / res["p"], res.get("back_to_back", False)
        ax.set_title(f"{res['schedule']}  p={res['p']} m={res['m']}"
                     + (f" v={res['v']}" if res["v"] > 1 else "")
                     + (" back to back: a step every" if chained else ": step")
                     + f" {res['step'] * 1e3:.0f} ms, mean bubble {bubble:.2f} (theory "
                     f"{theory_bubble(res['schedule'], res['p'], res['m'], res['v'], chained):.2f}); "
                     f"F blue, B green, W orange"
                     + (", lighter = chunk b" if res["v"] > 1 else ""), fontsize=8)
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def boundaries_crossing(schedule: str, p: int, v: int) -> int:
    """Boundaries between virtual stages on different ranks: p - 1; v p - 1 interleaved (a ring);
    2 (p - 1) for the V of zbv, whose turn at rank p - 1 stays on the rank."""
    if schedule == "zbv":
        return 2 * (p - 1)
    return v * p - 1

"""The across-lags study's written outputs, from ``vcpo.studies.across_lags.report``'s statistics and the rows:
``stats.json``, ``summary.md`` (tables and the sentences that quote them, generated), ``end_vs_lag.png``
(final accuracy against the lag per arm) and ``time.png`` (validation accuracy against wall-clock time)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from vcpo.studies.evidence_report import (
    arms_table,
    comparison_table,
    draw_ends,
    finish_ends_figure,
    interval,
    p_value,
    points,
    rate_label,
    signed_points,
)
from vcpo.studies.statistics import ALPHA, sign_agrees

# the arms drawn against the lag: (name prefix, label); an arm at lag k is named prefix + "_k{k}"
LAG_LINES = (("vcpo", "VCPO 2e-4 (preset, never retuned)"), ("vcpo_lr1e-4", "VCPO 1e-4"),
             ("seq_tis_lr5e-5", "seq-TIS 5e-5 (tuned at k = 48, frozen)"), ("seq_tis", "seq-TIS 2e-4"))


def steps_text(value: float) -> str:
    return "> 200" if value == math.inf else ("n/a" if not math.isfinite(value) else f"{value:g}")


def steps_table(arms: dict) -> list[str]:
    lines = ["| arm | lag | lr | runs reaching the target | median steps to target |", "|---|---:|---:|---:|---:|"]
    for name, arm in arms.items():
        lines.append(f"| {name} | {arm['lag']} | {rate_label(arm['lr'])} | {arm['reached']}/{arm['n']} | {steps_text(arm['median_steps'])} |")
    return lines


def rates_table(rows: list[dict]) -> list[str]:
    rates = sorted({float(lr) for row in rows for lr in row["ends"]})
    lines = ["| method | lag | " + " | ".join(rate_label(lr) for lr in rates) + " | best |", "|---|---:|" + "---:|" * len(rates) + "---|"]
    for row in rows:
        cells = [points(row["ends"][str(lr)]) if str(lr) in row["ends"] else "" for lr in rates]
        lines.append(f"| {row['method']} | {row['lag']} | " + " | ".join(cells) + f" | {rate_label(row['best_lr'])} |")
    return lines


def common_rate_winners(rows: list[dict]) -> dict[str, set[float]]:
    """Per method tested at more than one lag: its best rate at each lag among the rates tested at all its lags."""
    winners = {}
    for method in sorted({row["method"] for row in rows}):
        mine = [row for row in rows if row["method"] == method]
        if len(mine) < 2:
            continue
        common = set.intersection(*(set(row["ends"]) for row in mine))
        winners[method] = {float(max(common, key=row["ends"].get)) for row in mine}
    return winners


def rate_transfer_sentence(rows: list[dict]) -> str:
    winners = common_rate_winners(rows)
    same = [f"{method} {rate_label(next(iter(best)))}" for method, best in winners.items() if len(best) == 1]
    moved = [method for method, best in winners.items() if len(best) > 1]
    text = (f"Among the rates each method was tested at on every lag, its best is the same at every lag ({', '.join(same)})"
            if same else "")
    if moved:
        text += ("; " if text else "") + f"the best rate changes with the lag for {', '.join(moved)}"
    return text + ": at this scale the premise " + ("does not arise, so the claim is untested here, not refuted." if not moved
                                                    else "arises for those methods.")


def equivalence_lines(results: list[dict]) -> list[str]:
    lines = ["| lag | a - b | pairs | mean, points (90% CI) | TOST p | p (Holm) | verdict |", "|---:|---|---:|---|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['lag']} | {r['a']} - {r['b']} | {r['n']} | {signed_points(r['mean'])} "
                     f"{interval(r['low90'], r['high90'], signed=True)} | {p_value(r['p'])} | {p_value(r.get('p_holm', math.nan))} | "
                     f"{r.get('verdict', 'not tested')} |")
    return lines


def time_lines(results: list[dict]) -> list[str]:
    lines = ["| lag | async VCPO: median steps x s / step = s | sync: median steps x s / step = s | VCPO / sync |",
             "|---:|---|---|---:|"]
    for r in results:
        bound = "> " if r["at_least"] else ""
        lines.append(f"| {r['lag']} | {steps_text(r['median_steps'])} x {r['seconds_per_step']:.3f} = {bound}{r['seconds']:.0f} | "
                     f"{steps_text(r['sync_median_steps'])} x {r['sync_seconds_per_step']:.3f} = {r['sync_seconds']:.0f} | "
                     f"{bound}{r['ratio']:.2f} |")
    return lines


def cell_label(rate: str, lag: int | str) -> str:
    """A search cell by its rate and lag, as tir_search.md's first two columns show them."""
    return f"lr {rate} at lag {lag}"


def outcome_cells(search: dict) -> list[str]:
    """The cells (``cell_label``) of ``search_report``'s outcome."""
    return [cell_label(rate_label(cell["lr"]), cell["lag"]) for cell in search["cells"]]


def written_cells(markdown: str) -> list[str]:
    """The cells (``cell_label``) of a tir_search.md table: its rows start with a rate."""
    rows = [line.strip("| ").split(" | ") for line in markdown.splitlines() if line.startswith("| ") and line[2].isdigit()]
    return [cell_label(rate, lag) for rate, lag, *_ in rows]


def search_lines(search: dict) -> list[str]:
    lines = ["| lr | lag | sync holds | seq-TIS collapses | seq-TIS end / best | VCPO mean step factor | end: sync / seq-TIS / VCPO, % | qualifies |",
             "|---:|---:|---:|---:|---:|---:|---|---|"]
    for c in search["cells"]:
        lines.append(f"| {rate_label(c['lr'])} | {c['lag']} | {c['sync_holds']}/{c['sync_n']} | {c['seq_tis_collapses']}/{c['seq_tis_n']} | "
                     f"{c['seq_tis_end_over_best']:.2f} | {c['vcpo_mean_step_factor']:.3f} | {points(c['sync_end'])} / "
                     f"{points(c['seq_tis_end'])} / {points(c['vcpo_end'])} | {'yes' if c['qualifies'] else 'no'} |")
    if not search["complete"]:
        verdict = "The search is not complete yet: no cell is chosen."
    elif search["chosen"]:
        verdict = f"Chosen cell (the registered rule): lr {rate_label(search['chosen']['lr'])}, k = {search['chosen']['lag']}."
    else:
        verdict = "No cell qualifies: on `tir` at this scale, no tested setting makes seq-TIS break while sync learns."
    return [*lines, "", verdict]


def search_markdown(search: dict) -> str:
    """tables/across_lags/tir_search.md: the complete search and the cell its registered rule chooses."""
    lines = ["# The tool-use search: outcome", "",
             "Written by `python -m vcpo.studies.across_lags search` from `tables/across_lags/runs.jsonl` once the "
             "search's 42 runs were archived, and committed before any confirmatory run. The qualifying rule and its "
             "order are registered in `recipes/sim/across_lags.md` (\"The tool-use search\"): sync holds in 3/3 seeds, "
             "seq-TIS collapses in at least 2/3, VCPO's mean step factor is below 0.95; then the most collapses, the "
             "lowest seq-TIS end over best, the lower rate and lag.", ""]
    return "\n".join([*lines, *search_lines(search)]) + "\n"


def summary_markdown(stats: dict) -> str:
    countdown = stats["countdown"]
    lines = ["# The across-lags study: results", "",
             "Written by `python -m vcpo.studies.across_lags report` from `tables/across_lags/runs.jsonl` (one row per "
             "archived run, with its commit, start time and the command that re-runs it); the pre-registration is "
             f"`recipes/sim/across_lags.md` (commit {stats['registration']['commit'][:10]}). {stats['rows_counted']} of "
             f"{stats['rows']} rows count (started after the registration, from a clean tree). `end` is the final "
             "accuracy on 1,000 Countdown test problems x 4 samples; intervals are 95% unless named.", "", "## Countdown", ""]
    if countdown["missing"]:
        lines += ["Runs not finished yet (left out, never filled in): " + "; ".join(
            f"{name} seeds {', '.join(map(str, seeds))}" for name, seeds in countdown["missing"].items()) + ".", ""]
    lines += arms_table(countdown["arms"]) + ["", "![final accuracy against the lag](end_vs_lag.png)", ""]
    lines += ["Primary: VCPO (2e-4) - seq-TIS (5e-5, frozen) on `end`, paired by seed, Holm over the four lags:", ""]
    lines += comparison_table(countdown["primary"]) + [""]
    lines += ["Secondary: VCPO - seq-TIS, both at 2e-4:", ""] + comparison_table(countdown["same_rate"]) + [""]
    lines += ["Exploratory (not in the registration): the tuned rates against each other, VCPO at 1e-4 - seq-TIS at 5e-5, "
              "Holm over the four lags:", ""] + comparison_table(countdown["tuned"]) + [""]
    lines += ["Exploratory: VCPO at 1e-4 - VCPO at its preset rate, 2e-4:", ""] + comparison_table(countdown["vcpo_rates"]) + [""]
    lines += ["Exploratory: each method's tested rates by lag (mean `end`, %). The transfer claim needs a rate that is "
              "best at one lag and worse at another. " + rate_transfer_sentence(countdown["best_rates"]), ""]
    lines += rates_table(countdown["best_rates"]) + [""]
    lines += [f"Secondary: equivalence of VCPO at its best rate per lag with sync at its best rate (margin "
              f"{100 * countdown['equivalence'][0]['margin']:.0f} points, two one-sided tests):" if countdown["equivalence"] else
              "Secondary: equivalence with sync: no pairs yet.", ""] + equivalence_lines(countdown["equivalence"]) + [""]
    target = countdown["target"]
    if target:
        lines += [f"Steps to sync's accuracy: the target is {points(target['target'])}%, the mean final validation accuracy "
                  f"of `{target['arm']}` (sync at its best rate, n = {target['n']}); evaluations every 25 steps.", ""]
        lines += steps_table(countdown["arms"]) + [""]
    if "time_to_target" in countdown:
        timing = stats["timing"]
        lines += [f"Time to sync's accuracy on two cores (seconds per step from `python -m vcpo.studies.across_lags timing`, "
                  f"{timing['cpu']}, steps {timing['from_step']}-199 of seed 0; async runs concurrent):", ""]
        lines += time_lines(countdown["time_to_target"]) + [""]
        spread = countdown["time_ratio_range"]
        lines += [f"One timing seed, so no interval: with the other sync arm's step time ({', '.join(spread['sync_arms'])}) "
                  f"and over the lags, the ratio spans {spread['low']:.2f}-{spread['high']:.2f}.", "",
                  "![validation accuracy against wall-clock time](time.png)", ""]
    lines += ["## The tool-use search (`tir`, 3 seeds)", ""] + search_lines(stats["tir_search"]) + [""]
    lines += confirm_lines(stats["tir_confirm"], stats["tir_search"]["chosen"])
    return "\n".join(lines)


def confirm_lines(confirm: dict, chosen: dict | None) -> list[str]:
    cell = f"lr {rate_label(chosen['lr'])}, k = {chosen['lag']}" if chosen else "no cell"
    lines = [f"## The tool-use confirmation (`tir` at the chosen cell, {cell}; seeds 10-19)", "",
             "`end` is the final accuracy on 400 held-out problems x 4 samples. Primary: VCPO - seq-TIS; secondary: "
             "VCPO - sync; paired by seed, Holm over the two.", ""]
    if confirm["missing"]:
        lines += ["Runs not finished yet (left out, never filled in): " + "; ".join(
            f"{name} seeds {', '.join(map(str, seeds))}" for name, seeds in confirm["missing"].items()) + ".", ""]
    if confirm["arms"]:
        lines += arms_table(confirm["arms"]) + [""]
    return lines + comparison_table(confirm["comparisons"]) + [""]


def draw_end_vs_lag(stats: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, lags = stats["countdown"]["arms"], stats["countdown"]["lags"]
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for offset, (prefix, label) in zip((0.94, 0.98, 1.02, 1.06), LAG_LINES, strict=True):
        present = [(lag, arms[f"{prefix}_k{lag}"]) for lag in lags if f"{prefix}_k{lag}" in arms]
        if present:
            draw_ends(axis, [lag * offset for lag, _ in present], [a for _, a in present], marker="o", label=label)
    sync_arms = [arm for arm in arms.values() if arm["method"] == "sync"]
    for arm, (color, style) in zip(sync_arms, (("black", "--"), ("grey", ":")), strict=False):  # two rates at most
        axis.axhline(100 * arm["end"], color=color, linestyle=style, linewidth=1.2, label=f"sync {rate_label(arm['lr'])} (k = 0)")
        axis.axhspan(100 * arm["end_low"], 100 * arm["end_high"], alpha=0.08, color=color)
    axis.set_xscale("log", base=2)
    axis.set_xticks(lags, [str(lag) for lag in lags])
    axis.minorticks_off()
    axis.set_xlabel("policy lag k (PipelineRL, pipeline_overlap)")
    finish_ends_figure(figure, axis, arms, "Countdown, 200 steps", path)


def draw_time(stats: dict, rows: list[dict], path: Path) -> None:
    """Per lag: the mean validation curve of async VCPO (2e-4) and of sync at its best rate against the
    wall-clock time of their steps (step x measured seconds per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = stats["countdown"]["time_to_target"]
    figure, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.2), sharey=True, squeeze=False)

    def mean_curve(arm: str) -> tuple[np.ndarray, np.ndarray]:
        curves = [dict(row["validation_curve"]) for row in rows if row["arm"] == arm and row["counts"] and row["study_task"] == "countdown"]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        return np.array(steps), np.array([100 * np.mean([c[s] for c in curves]) for s in steps])

    for axis, result in zip(axes[0], results, strict=True):
        for arm, per_step, label in ((result["sync_arm"], result["sync_seconds_per_step"], "sync"),
                                     (result["arm"], result["seconds_per_step"], "async VCPO 2e-4")):
            steps, accuracy = mean_curve(arm)
            axis.plot(steps * per_step / 60, accuracy, marker=".", label=label)
        axis.axhline(100 * stats["countdown"]["target"]["target"], color="grey", linestyle=":", linewidth=1)
        axis.set_title(f"k = {result['lag']}", fontsize=10)
        axis.set_xlabel("minutes of steps, two cores")
    axes[0][0].set_ylabel("validation accuracy, % (mean over seeds)")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(stats: dict, rows: list[dict], out: Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stats.json").write_text(json.dumps(stats, indent=1, default=float) + "\n")
    (out / "summary.md").write_text(summary_markdown(stats))
    written = ["stats.json", "summary.md"]
    if stats["countdown"]["arms"]:
        draw_end_vs_lag(stats, out / "end_vs_lag.png")
        written.append("end_vs_lag.png")
    if stats["countdown"].get("time_to_target"):
        draw_time(stats, rows, out / "time.png")
        written.append("time.png")
    print(f"wrote {', '.join(str(out / name) for name in written)}")


# -- the prose of docs/studies.md and the README, generated from stats.json --------------------------------------
COMPARISON_ROWS = (  # stats key, a's name prefix (its arm at lag k: prefix + "_k{k}"), label, status
    ("primary", "vcpo", "VCPO 2e-4 (preset) − seq-TIS 5e-5 (tuned at k = 48, frozen)", "registered primary"),
    ("same_rate", "vcpo", "VCPO − seq-TIS, both at 2e-4", "registered secondary"),
    ("tuned", "vcpo_lr1e-4", "VCPO 1e-4 − seq-TIS 5e-5 (tuned against tuned)", "exploratory"),
    ("vcpo_rates", "vcpo_lr1e-4", "VCPO 1e-4 − VCPO 2e-4 (its preset rate)", "exploratory"),
)
END_ROWS = (("seq_tis_lr5e-5", "seq-TIS 5e-5 (tuned at k = 48, frozen)"), ("vcpo", "VCPO 2e-4 (preset)"),
            ("vcpo_lr1e-4", "VCPO 1e-4"), ("seq_tis", "seq-TIS 2e-4"))


def typographic(number: str) -> str:
    return number.replace("-", "−")


def difference_cell(c: dict) -> str:
    """'−3.4 [−5.8, −1.0], Holm p 0.011, 3/10 above' (a typographic minus, as the prose prints it)."""
    return (f"{typographic(signed_points(c['mean']))} {typographic(interval(c['low'], c['high'], signed=True))}, "
            f"Holm p {p_value(c['p_holm'])}, {c['sign_positive']}/{c['sign_n']} above")


def end_cell(arm: dict) -> str:
    collapses = f", {arm['collapses']}/{arm['n']} collapse" if arm["collapses"] else ""
    return f"{points(arm['end'])} {interval(arm['end_low'], arm['end_high'])}{collapses}"


def ends_table(stats: dict) -> list[str]:
    """Countdown's ends by lag, and sync's."""
    countdown, lags = stats["countdown"], stats["countdown"]["lags"]
    arms = countdown["arms"]
    lines = ["| Countdown, `end`, % [95% CI] |" + "".join(f" k = {lag} |" for lag in lags), "|---|" + "---|" * len(lags)]
    for prefix, label in END_ROWS:
        lines.append(f"| {label} |" + "".join(f" {end_cell(arms[f'{prefix}_k{lag}'])} |" for lag in lags))
    syncs = [name for name, arm in arms.items() if arm["method"] == "sync"]
    return lines + ["", "Sync (no lag): " + "; ".join(f"{rate_label(arms[name]['lr'])}: {end_cell(arms[name])}" for name in syncs) + "."]


def differences_table(stats: dict) -> list[str]:
    """Countdown's paired differences by lag: every comparison, its status and its sign test."""
    countdown, lags = stats["countdown"], stats["countdown"]["lags"]
    header = "".join(f" k = {lag} |" for lag in lags)
    lines = ["| paired by seed, points [95% CI], Holm p, seeds where a > b | status |" + header, "|---|---|" + "---|" * len(lags)]
    for key, a_prefix, label, status in COMPARISON_ROWS:
        by_lag = {c["a"]: c for c in countdown[key]}
        lines.append(f"| {label} | {status} |" + "".join(f" {difference_cell(by_lag[f'{a_prefix}_k{lag}'])} |" for lag in lags))
    return lines


def unconfirmed_by_sign(comparisons: list[dict]) -> list[dict]:
    """Comparisons Holm's t-test calls a difference that the exact sign test does not confirm (``sign_agrees``)."""
    return [c for c in comparisons if c.get("p_holm", 1) < ALPHA and not sign_agrees(c)]


def and_joined(items: list[str]) -> str:
    """'12', '12 and 24', '12, 24 and 48'."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def sign_clause(comparisons: list[dict], arms: dict) -> str:
    """Where the sign test confirms per-lag comparisons (their arm a's lag): 'confirmed by a sign test at every lag',
    or 'the sign test confirming it at k = 48 and 96 only'."""
    confirmed = [str(arms[c["a"]]["lag"]) for c in comparisons if sign_agrees(c)]
    if len(confirmed) == len(comparisons):
        return "confirmed by a sign test at every lag"
    return f"the sign test confirming it at k = {and_joined(confirmed)} only" if confirmed else "the sign test confirming it at no lag"


def preset_rate_clause(countdown: dict) -> str:
    """'VCPO at 1e-4 ends above VCPO at 2e-4 at every lag after Holm (+3.0 to +3.9 points, Holm p <= 0.031; the sign
    test confirming it at ...)': the exploratory comparison that says the preset rate is mis-set."""
    rates = countdown["vcpo_rates"]
    return (f"VCPO at 1e-4 ends above VCPO at 2e-4 at every lag after Holm "
            f"({typographic(signed_points(min(c['mean'] for c in rates)))} to {typographic(signed_points(max(c['mean'] for c in rates)))} "
            f"points, Holm p ≤ {p_value(max(c['p_holm'] for c in rates))}; {sign_clause(rates, countdown['arms'])})")


def confirmation_lines(stats: dict) -> list[str]:
    confirm, search = stats["tir_confirm"], stats["tir_search"]
    qualifying = [c for c in search["cells"] if c["qualifies"]]
    chosen = search["chosen"]
    lines = ["| tool use (`tir`), seeds 10-19 | `end`, % [95% CI] | collapses [95% Wilson] | holds [95% Wilson] |",
             "|---|---|---|---|"]
    for name, arm in confirm["arms"].items():
        lines.append(f"| {name} | {points(arm['end'])} {interval(arm['end_low'], arm['end_high'])} | {arm['collapses']}/{arm['n']} "
                     f"[{100 * arm['collapse_low']:.0f}%, {100 * arm['collapse_high']:.0f}%] | {arm['holds']}/{arm['n']} "
                     f"[{100 * arm['holds_low']:.0f}%, {100 * arm['holds_high']:.0f}%] |")
    lines += ["", "| paired by seed | points [95% CI], Holm p, seeds where a > b | sign test p |", "|---|---|---|"]
    for c in confirm["comparisons"]:
        lines.append(f"| {c['a']} − {c['b']} | {difference_cell(c)} | {p_value(c['sign_p'])} |")
    cells = ", ".join(f"lr {rate_label(c['lr'])} at k = {c['lag']}" for c in qualifying)
    lines += ["", f"The search (3 seeds per cell) found {len(qualifying)} qualifying cells ({cells}); its registered rule chose "
                  f"lr {rate_label(chosen['lr'])} at k = {chosen['lag']}, where the confirmation ran."]
    return lines


def verdict_sentences(stats: dict) -> list[str]:
    """What the numbers allow one to say, each sentence computed from them."""
    countdown, times = stats["countdown"], stats["countdown"]["time_to_target"]
    tuned, rates, primary = countdown["tuned"], countdown["vcpo_rates"], countdown["primary"]
    detected = [c for c in tuned if c["p_holm"] < ALPHA]
    spread = countdown["time_ratio_range"]
    equivalence = countdown["equivalence"]
    gaps = [-100 * e["mean"] for e in equivalence]
    low, high = min(t["ratio"] for t in times), max(t["ratio"] for t in times)
    # every comparison a sentence here or in the README quotes, registered or not
    unconfirmed = unconfirmed_by_sign(primary + countdown["same_rate"] + tuned + rates + stats["tir_confirm"]["comparisons"])
    return [
        "- **Does a rate tuned at one lag transfer to the others?** " + rate_transfer_sentence(countdown["best_rates"]),
        f"- Tuned against tuned (exploratory), VCPO and seq-TIS differ detectably at "
        f"{'no lag' if not detected else ', '.join(str(c['lag']) for c in detected)} (Holm p ≥ "
        f"{p_value(min(c['p_holm'] for c in tuned))}). The registered primary, VCPO at its preset rate below seq-TIS at its "
        f"tuned rate at every lag after Holm ({sign_clause(primary, countdown['arms'])}), measures the preset rate: "
        f"{preset_rate_clause(countdown)}, so 2e-4 is mis-set at this scale.",
        f"- Equivalence with sync (margin {100 * equivalence[0]['margin']:.0f} points) is shown at no lag: VCPO at its best "
        f"rate ends {min(gaps):.1f} to {max(gaps):.1f} points below sync at its best rate.",
        f"- Time to sync's accuracy: async VCPO at its preset rate reaches it later, more than {low:.2f}-{high:.2f}x sync's "
        f"time (lower bounds), from one timing seed (no interval); with either sync arm's step time and over the lags the "
        f"ratio spans {spread['low']:.2f}-{spread['high']:.2f}.",
        "- Not confirmed by a sign test (Holm p < 0.05, the exact sign test not rejecting on the same side): "
        + ("; ".join(f"{c['a']} − {c['b']} ({c['sign_positive']}/{c['sign_n']} above, p {p_value(c['sign_p'])})" for c in unconfirmed)
           if unconfirmed else "none") + ".",
    ]


def results_markdown(stats: dict) -> str:
    """docs/studies.md's across-lags results, between its <!-- across_lags_results --> markers."""
    return "\n".join([
        f"**Results** (all {stats['rows_counted']} runs; [tables/across_lags/summary.md](../tables/across_lags/summary.md), "
        "written from the rows by `python -m vcpo.studies.across_lags report`, which also writes this block; n = 10 per "
        "arm, final accuracy on 1,000 Countdown test problems × 4 samples and 400 × 4 on `tir`, 95% t intervals, paired "
        "by seed, Holm-corrected within each row as registered; rows marked exploratory were not registered):", "",
        *ends_table(stats), "", *differences_table(stats), "", *verdict_sentences(stats), "", *confirmation_lines(stats),
    ])


def replace_block(path: Path, marker: str, content: str) -> None:
    """Put ``content`` between ``<!-- marker -->`` and ``<!-- /marker -->`` in ``path``."""
    text = path.read_text()
    start, stop = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(stop, 1)
    path.write_text(f"{head}{start}\n{content}\n{stop}{tail}")

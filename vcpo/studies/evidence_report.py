"""The evidence study's written outputs, from ``vcpo.studies.evidence.report``'s statistics alone:
``stats.json``, ``summary.md`` (tables and the paragraphs that quote them, generated) and ``lr.png``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from vcpo.studies.statistics import ALPHA, detectable_difference

METHOD_LABELS = {"seq_tis_c8": "seq-TIS (c = 8)", "sync": "sync (k = 0)", "vcpo": "VCPO"}
# question 3's controls (recipes/sim/evidence.yaml), drawn apart from their method's learning-rate line
CONTROLS = {"seq_tis_vcpo_mean_lr": ("s", "seq-TIS at VCPO's mean rate"),
            "seq_tis_vcpo_replay": ("D", "seq-TIS replaying VCPO's factor (nominal lr)")}


def rate_label(rate: float) -> str:
    """1.5e-4, not 0.00015."""
    mantissa, exponent = f"{rate:.2e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def points(value: float) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{100 * value:.1f}"


def signed_points(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{100 * value:+.1f}"


def interval(low: float, high: float, signed: bool = False) -> str:
    show = signed_points if signed else points
    return f"[{show(low)}, {show(high)}]"


def p_value(value: float) -> str:
    return "n/a" if not math.isfinite(value) else ("< 0.001" if value < 0.001 else f"{value:.3f}")


def arms_table(arms: dict) -> list[str]:
    lines = ["| arm | method | lr | lag | n | end, % (95% CI) | SD | last quarter, % (95% CI) | collapses (95% Wilson) | holds (95% Wilson) | mean ESS step factor |",
             "|---|---|---:|---:|---:|---|---:|---|---|---|---:|"]
    for name, arm in arms.items():
        holds = (f"{arm['holds']}/{arm['n']} [{100 * arm['holds_low']:.0f}%, {100 * arm['holds_high']:.0f}%]" if "holds" in arm else "-")
        lines.append(
            f"| {name} | {arm['method']} | {arm['lr']:.3g} | {arm['lag']} | {arm['n']} | {points(arm['end'])} "
            f"{interval(arm['end_low'], arm['end_high'])} | {points(arm['end_sd'])} | {points(arm['last_quarter'])} "
            f"{interval(arm['last_quarter_low'], arm['last_quarter_high'])} | {arm['collapses']}/{arm['n']} "
            f"[{100 * arm['collapse_low']:.0f}%, {100 * arm['collapse_high']:.0f}%] | {holds} | {arm['mean_lr_scale']:.3f} |"
        )
    return lines


def run_statistics_table(arms: dict) -> list[str]:
    tools = any("tool_calls_first" in arm for arm in arms.values())
    lines = ["| arm | ESS ratio: mean / min (mean over seeds) | largest gradient norm (any seed) |"
             + (" tool calls per response: first step -> last step | failed calls, last step |" if tools else ""),
             "|---|---|---:|" + ("---|---:|" if tools else "")]
    for name, arm in arms.items():
        line = f"| {name} | {arm['ess_mean']:.3f} / {arm['ess_min']:.3f} | {arm['grad_norm_max']:.2f} |"
        if tools:
            line += (f" {arm['tool_calls_first']:.2f} -> {arm['tool_calls_last']:.2f} | {100 * arm['tool_error_last']:.1f}% |"
                     if "tool_calls_first" in arm else " n/a | n/a |")
        lines.append(line)
    return lines


def holm_first_step_detectable(c: dict, family: int) -> float | None:
    """The smallest difference ``c``'s pairs detect with 90% power at the level Holm's first step tests at (two-sided
    ALPHA / ``family``, the number of tests Holm corrects over), from its paired SD; None where it was not tested, or
    where no effect up to detectable_difference's largest (20 SDs) reaches that power with so few pairs."""
    if "p_holm" not in c or c.get("sd") is None:
        return None
    if c["sd"] == 0:
        return 0.0
    try:
        return detectable_difference(c["sd"], c["n"], ALPHA / family, 0.9)
    except ValueError:  # brentq: no root in its range
        return None


def comparison_table(comparisons: list[dict]) -> list[str]:
    """One Holm family's paired comparisons (``comparisons`` is the family: Holm corrects over its tested ones)."""
    family = sum("p_holm" in c for c in comparisons)
    lines = ["| a - b | pairs | mean difference, points (95% CI) | p | p (Holm) | verdict | SD of the differences | detectable at "
             "90% power, two-sided 0.05 before Holm | detectable at 90% power, two-sided 0.05 / "
             f"{max(family, 1)} (Holm's first step) | sign test: a > b, p |",
             "|---|---:|---|---:|---:|---|---:|---:|---:|---|"]
    for c in comparisons:
        sign = f"{c['sign_positive']}/{c['sign_n']}, {p_value(c['sign_p'])}" if c.get("sign_n") else "-"
        lines.append(
            f"| {c['a']} - {c['b']} | {c['n']} | {signed_points(c['mean'])} {interval(c['low'], c['high'], signed=True)} | "
            f"{p_value(c['p'])} | {p_value(c.get('p_holm', math.nan))} | {c.get('verdict', 'not tested (fewer than 2 pairs)')} | "
            f"{points(c.get('sd'))} | {points(c.get('detectable_90'))} | {points(holm_first_step_detectable(c, family))} | {sign} |"
        )
    return lines


def comparison_sentence(c: dict) -> str:
    if "verdict" not in c:
        return f"{c['a']} - {c['b']}: not tested ({c['n']} pairs)"
    return (f"{c['a']} - {c['b']}: {signed_points(c['mean'])} points {interval(c['low'], c['high'], signed=True)}, "
            f"n = {c['n']} pairs, Holm p = {p_value(c['p_holm'])}: {c['verdict']}")


def predictor_lines(predictor: dict) -> list[str]:
    low, high = predictor["auc_interval"]
    auc = "n/a (needs collapsed and other runs)" if not math.isfinite(predictor["auc"]) else (
        f"{predictor['auc']:.2f} (95% bootstrap {low:.2f}-{high:.2f})")
    leads = predictor["lead_steps"]
    return [
        f"ESS early warning (registered: min sequence-ESS ratio over the first 50 steps, before any fall, <= 0.1), "
        f"{predictor['runs']} runs, {predictor['collapsed']} collapsed: ROC AUC {auc}; "
        f"hits {predictor['hits']}/{predictor['collapsed']}, false alarms {predictor['false_alarms']}/"
        f"{predictor['runs'] - predictor['collapsed']}; lead times (steps from alarm to fall): "
        f"{', '.join(map(str, leads)) if leads else 'none'}.",
        "",
        f"Without the synchronous runs (which cannot collapse from lag), {predictor['lagged_runs']} runs: ROC AUC "
        + ("n/a (needs collapsed and other runs)." if not math.isfinite(predictor["lagged_auc"]) else
           f"{predictor['lagged_auc']:.2f} (95% bootstrap over SFT bases {predictor['lagged_auc_base_interval'][0]:.2f}-"
           f"{predictor['lagged_auc_base_interval'][1]:.2f}); runs on one base are not independent, so this interval is the one to read."),
    ]


def learning_rate_lines(section: dict, arms: dict) -> list[str]:
    lines = ["### Does the adaptive step beat a tuned fixed step?", ""]
    best = section["best_arm"]
    for method, name in best.items():
        arm = arms[name]
        stable = section["stable_range"][method]

        def width_text(rule: dict) -> str:
            return f"{rule['width']:.1f}x ({', '.join(f'{r:.3g}' for r in rule['rates'])})" if rule["rates"] else "none"

        width = f"{width_text(stable['registered'])} as registered; {width_text(stable['same_split'])} on the same split"
        lines.append(f"- {METHOD_LABELS.get(method, method)}: best fixed rate {arm['lr']:.3g} (arm `{name}`, end "
                     f"{points(arm['end'])}% {interval(arm['end_low'], arm['end_high'])}, n = {arm['n']}); stable range "
                     f"among the tested rates ({', '.join(f'{r:.3g}' for r in stable['tested'])}): {width}.")
    edges = [f"{METHOD_LABELS.get(m, m)}'s at the {edge} tested rate" for m, edge in section["best_at_grid_edge"].items() if edge]
    if edges:
        lines.append(f"- Best rates at the edge of their grid (optimum not bracketed): {', '.join(edges)}.")
    lines.append("")
    lines += [f"- {comparison_sentence(c)}." for c in section["comparisons"]]
    lines += ["", "Both at their best tested rate (a second framing, added after the study, not registered):", ""]
    lines += [f"- {comparison_sentence(c)}." for c in section["tuned_against_tuned"]]
    lines += ["", f"Note: {section['note']}; {section['stable_range_note']}."]
    return lines


def summary_markdown(stats: dict) -> str:
    lines = ["# The evidence study: results", "",
             "Written by `python -m vcpo.studies.evidence report` from `tables/evidence/runs.jsonl` (one row per finished "
             "run, with the command that re-runs it); the pre-registration is `recipes/sim/evidence.md`. `end` is the "
             "final test-split accuracy (the primary metric); intervals are 95%.", ""]
    for task, entry in stats["tasks"].items():
        lines += [f"## {task}", ""]
        missing = entry["missing"]
        if missing:
            lines += ["Runs not finished yet (left out, never filled in): " + "; ".join(
                f"{name} seeds {', '.join(map(str, seeds))}" for name, seeds in missing.items()) + ".", ""]
        if not entry["arms"]:
            lines += ["No finished runs yet.", ""]
            continue
        lines += arms_table(entry["arms"]) + [""]
        lines += ["Per run, averaged over the arm's seeds (tool calls: the batch of the first and of the last step):", ""]
        lines += run_statistics_table(entry["arms"]) + [""]
        lines += ["Registered comparisons of `end` (paired by seed, Holm over the family):", ""]
        lines += comparison_table(entry["comparisons"]) + [""]
        lines += ["Secondary: the same comparisons of the last-quarter mean:", ""]
        lines += comparison_table(entry["comparisons_last_quarter"]) + [""]
        lines += predictor_lines(entry["predictor"]) + [""]
        if "learning_rate" in entry:
            lines += learning_rate_lines(entry["learning_rate"], entry["arms"]) + ["", "![end accuracy against learning rate](lr.png)", ""]
    return "\n".join(lines)


def draw_ends(axis, xs: list[float], members: list[dict], **style) -> None:
    """Arms' mean final test accuracy (%) at ``xs`` with their 95% t intervals as error bars."""
    axis.errorbar(xs, [100 * a["end"] for a in members], capsize=3,
                  yerr=[[100 * (a["end"] - a["end_low"]) for a in members], [100 * (a["end_high"] - a["end"]) for a in members]], **style)


def finish_ends_figure(figure, axis, arms: dict, title: str, path: Path) -> None:
    """The y label, a title ending with the largest n, the legend; saved to ``path`` and closed."""
    import matplotlib.pyplot as plt

    axis.set_ylabel("final test accuracy, % (mean, 95% t interval)")
    n = max((a["n"] for a in arms.values()), default=0)
    axis.set_title(f"{title}, up to n = {n} seeds each", fontsize=10)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def draw_learning_rates(stats: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = stats["tasks"].get("countdown", {}).get("arms", {})
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    # each method's points sit a few percent apart along the log axis, so that bars at one rate do not overlap
    for offset, (method, label) in zip((0.92, 1.0, 1.08), METHOD_LABELS.items(), strict=True):
        members = sorted((arm for name, arm in arms.items() if arm["method"] == method and name not in CONTROLS), key=lambda a: a["lr"])
        if not members:
            continue
        draw_ends(axis, [a["lr"] * offset for a in members], members, marker="o", label=label)
    for name, (marker, label) in CONTROLS.items():
        if name in arms:
            draw_ends(axis, [arms[name]["lr"]], [arms[name]], marker=marker, linestyle="none", label=label)
    axis.set_xscale("log")
    rates = sorted({a["lr"] for name, a in arms.items() if name not in CONTROLS})
    if rates:  # ticks at the grid's rates only: the side-by-side offsets are not rates
        axis.set_xlim(rates[0] / 1.6, rates[-1] * 1.6)
        axis.set_xticks(rates, [rate_label(rate) for rate in rates])
        axis.minorticks_off()
    axis.set_xlabel("nominal learning rate (methods side by side at each tested rate)")
    finish_ends_figure(figure, axis, arms, "Countdown, k = 48 (sync k = 0), 200 steps", path)


def write_report(stats: dict, out: Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stats.json").write_text(json.dumps(stats, indent=1, default=float) + "\n")
    (out / "summary.md").write_text(summary_markdown(stats))
    draw_learning_rates(stats, out / "lr.png")
    print(f"wrote {out / 'stats.json'}, {out / 'summary.md'}, {out / 'lr.png'}")

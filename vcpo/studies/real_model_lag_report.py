"""The real model's lag study, reported from its rows (tables/real_model_lag/runs.jsonl and the verl metrics beside it).

    python -m vcpo.studies.real_model_lag report

writes, beside the rows, ``stats.json`` (every number below), ``report.md`` (the tables and the prose, generated from
the statistics), ``ladder.png`` (the learning-rate ladder's runs) and ``curves.png`` (the confirmation's arms: training
reward, held-out accuracy, ESS ratio, lr scale and staleness, each seed faint, the mean bold; the paper's Figs. 2 and
6). The tests and verdicts are those of recipes/real_model_lag.md: ends paired by seed, Holm over the registered
comparisons, a one-sided sign test in the paper's direction, collapse counts with Wilson intervals.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np

from vcpo.locks import write_atomic
from vcpo.reporting.figures import draw_runs
from vcpo.runs import flat_record
from vcpo.studies.readme_results import REAL_MODEL_LAG
from vcpo.studies.statistics import (
    by_pair,
    holm,
    mean_interval,
    paired_difference,
    sign_test,
    sign_test_above,
    wilson_interval,
)
from vcpo.studies.verdicts import AGREES, CLAIMS, DIFFERENCE, HIGHER, OPPOSES, claim_verdict, part_answer

ARM_LABELS = {"sync": "sync", "seq_tis": "seq-TIS", "vcpo": "VCPO"}
# docs/claims.md's rows of the claims this study tests, in the paper's words (vcpo.studies.verdicts.CLAIMS holds the
# comparison that tests each)
PAPER_CLAIMS = {
    9: "On a real model, sequence-level TIS falls behind synchronous training at lag 12 (the paper's GSM8K run, "
       "Qwen2-1.5B at PipelineRL-12: its ESS ratio degrades, then it collapses).",
    10: "On a real model, VCPO stays stable where sequence-level TIS collapses.",
    11: "On a real model, VCPO matches synchronous training's accuracy.",
}
GPU_TEST = "GSM8K on Qwen2-1.5B at k = 12 (`snakemake --configfile workflows/config/paper.yaml`)"


def run_lines(tables: Path, name: str, metrics_folder: str) -> list[dict]:
    """A run's verl metrics as flat lines (``vcpo.runs.flat_record``), from its gzipped copy."""
    with gzip.open(tables / metrics_folder / f"{name}.jsonl.gz", "rt", encoding="utf-8") as handle:
        return [flat_record(json.loads(line)) for line in handle if line.strip()]


def arm_statistics(rows: list[dict]) -> dict:
    """One arm's runs: the ends with their t interval, the collapses with their Wilson interval, the median of the
    runs' median step times, and the staleness verl recorded (its largest max, and its mean after the pipeline filled)."""
    ends = [row["outcome"]["end"] for row in rows]
    mean, low, high = mean_interval(ends)
    collapsed = sum(row["outcome"]["collapsed"] for row in rows)
    collapse_low, collapse_high = wilson_interval(collapsed, len(rows))
    times = [row["median_step_s"] for row in rows if row["median_step_s"] is not None]
    lag = rows[0]["lag"]
    filled = [mean_staleness for row in rows for step, _, mean_staleness in row["staleness"] if step > lag]
    return {"n": len(rows), "seeds": [row["seed"] for row in rows], "ends": ends, "mean": mean, "low": low, "high": high,
            "collapsed": collapsed, "collapse_low": collapse_low, "collapse_high": collapse_high,
            "median_step_s": float(np.median(times)) if times else None,
            "staleness_max": max((m for row in rows for _, m, _ in row["staleness"]), default=None),
            "staleness_mean_filled": float(np.mean(filled)) if filled else None}


def verdict(comparison: dict, direction: str) -> str:
    """The registered verdict of one comparison (recipes/real_model_lag.md, Verdicts), in docs/claims.md's terms:
    "above" agrees with a Holm p < ALPHA above and a one-sided sign test p < ALPHA; "not_below" (VCPO matches sync)
    fails only where a test of "above" rejects on the other side."""
    if comparison["n"] < 2:
        return "not tested yet (fewer than 2 pairs)"
    answer = part_answer(comparison, DIFFERENCE, HIGHER, sign_p="sign_p_one_sided")
    if direction == "not_below":
        return "not reproduced (detected worse)" if answer == OPPOSES else "reproduced (not detected worse)"
    return {AGREES: "reproduced", OPPOSES: "not reproduced (the other direction)"}.get(
        answer, "not reproduced (no detectable difference)")


def comparisons(arms: dict[str, list[dict]], plan: dict) -> list[dict]:
    """The registered comparisons of the ends, paired by seed, Holm-adjusted together, each with its verdict (marked
    as interim while its pairs are fewer than the registered seeds)."""
    results = []
    for a, b in plan["comparisons"]:
        ends_a = {row["seed"]: row["outcome"]["end"] for row in arms.get(a, [])}
        ends_b = {row["seed"]: row["outcome"]["end"] for row in arms.get(b, [])}
        seeds = sorted(ends_a.keys() & ends_b.keys())
        differences = [ends_a[seed] - ends_b[seed] for seed in seeds]
        result = {"a": a, "b": b, "seeds": seeds, **paired_difference([ends_a[s] for s in seeds], [ends_b[s] for s in seeds])}
        result.update(sign_test(differences), sign_p_one_sided=sign_test_above(differences))
        results.append(result)
    tested = [r for r in results if not math.isnan(r["p"])]
    for result, adjusted in zip(tested, holm([r["p"] for r in tested]), strict=True):
        result["p_holm"] = adjusted
    for result in results:
        result.setdefault("p_holm", math.nan)
        result["verdict"] = verdict(result, plan["paper_direction"][f"{result['a']}-{result['b']}"])
        if 2 <= result["n"] < len(plan["seeds"]):  # Holm's family and the sign test's power are the registered n's
            result["verdict"] += f" so far, {result['n']} of {len(plan['seeds'])} registered pairs"
    return results


def study_statistics(rows: dict[str, dict], design: dict) -> dict:
    ladder = [row for row in rows.values() if row["phase"] == "regime"]
    confirmation = [row for row in rows.values() if row["phase"] == "confirmation"]
    arms = {arm: sorted((row for row in confirmation if row["arm"] == arm), key=lambda row: row["seed"])
            for arm in design["confirmation"]["arms"]}
    return {"ladder": sorted(ladder, key=lambda row: (row["rate"], row["arm"] != "sync")),
            "arms": {arm: arm_statistics(members) for arm, members in arms.items() if members},
            "comparisons": comparisons(arms, design["confirmation"]) if confirmation else [],
            "rate": confirmation[0]["rate"] if confirmation else None,
            "task": confirmation[0]["task"] if confirmation else None,
            "registered_seeds": design["confirmation"]["seeds"]}


# ------------------------------------------------------------------------------------------------------- markdown
def percent(value: float | None) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.1f}%"


def points(value: float) -> str:
    return "—" if not math.isfinite(value) else f"{100 * value:+.1f}"


def p_text(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.3f}"


def ladder_markdown(ladder: list[dict]) -> list[str]:
    lines = ["| rate | arm | lag (verl, max) | held-out: step 0 → best → end | min ESS ratio | collapsed | sync improves | "
             "median step | load at start, finish |", "|---:|---|---:|---|---:|---|---|---:|---|"]
    for row in ladder:
        o = row["outcome"]
        lag = max((m for _, m, _ in row["staleness"]), default=0)
        ess = "—" if o["ess_min"] is None else f"{o['ess_min']:.3f}"
        lines.append(f"| {row['rate']:g} | {row['arm']} | {lag} | {percent(o['base'])} → {percent(o['best'])} → "
                     f"{percent(o['end'])} | {ess} | {'yes' if o['collapsed'] else 'no'} | "
                     f"{('yes' if o['improves'] else 'no') if row['arm'] == 'sync' else '—'} | {row['median_step_s']:.1f} s | {load_text(row)} |")
    return lines


def load_text(row: dict) -> str:
    """The machine's one-minute load when the run started and finished (its step times are the machine's, shared);
    rows recorded before the load was kept say so."""
    if "load_at_start" not in row:
        return "not recorded"
    return f"{row['load_at_start']:.1f}, {row['load_at_finish']:.1f}"


def end_interval(s: dict) -> str:
    """An arm's mean end's 95% t interval in points, '[19.7, 35.7]'; empty for one run."""
    return f"[{100 * s['low']:.1f}, {100 * s['high']:.1f}]" if math.isfinite(s["low"]) else ""


def collapse_count(s: dict) -> str:
    """'1 of 4 [4.6%, 69.9%]': an arm's collapses with their Wilson interval."""
    return f"{s['collapsed']} of {s['n']} [{percent(s['collapse_low'])}, {percent(s['collapse_high'])}]"


def arms_markdown(arms: dict) -> list[str]:
    lines = ["| arm | runs | end, mean [95% t CI] | collapsed [95% Wilson] | staleness: max, mean after filling | "
             "median step |", "|---|---:|---|---|---|---:|"]
    for arm, s in arms.items():
        stale = "—" if s["staleness_max"] is None else f"{s['staleness_max']}, {s['staleness_mean_filled']:.2f}"
        step = "—" if s["median_step_s"] is None else f"{s['median_step_s']:.1f} s"
        lines.append(f"| {ARM_LABELS[arm]} | {s['n']} | {percent(s['mean'])} {end_interval(s) or '(one run)'} | "
                     f"{collapse_count(s)} | {stale} | {step} |")
    return lines


def comparison_sentence(c: dict) -> str:
    label = f"{ARM_LABELS[c['a']]} − {ARM_LABELS[c['b']]}"
    if c["n"] < 2:
        return f"{label}: {c['n']} {'pair' if c['n'] == 1 else 'pairs'} so far; {c['verdict']}."
    return (f"{label}: {points(c['mean'])} points [{points(c['low'])}, {points(c['high'])}] over {c['n']} "
            f"seeds, Holm p = {p_text(c['p_holm'])}, {c['sign_positive']} of {c['sign_n']} seeds above (one-sided sign "
            f"test p = {p_text(c['sign_p_one_sided'])}): {c['verdict']}.")


def arm_sentence(arm: str, s: dict) -> str:
    """'seq-TIS ends 29.2% [-12.0, 70.5] over 2 seeds, collapses in 0 of 2 [0.0%, 65.8%]'."""
    interval = f" {end_interval(s)}" if end_interval(s) else ""
    return (f"{ARM_LABELS[arm]} ends {percent(s['mean'])}{interval} over {s['n']} {'seed' if s['n'] == 1 else 'seeds'}, "
            f"collapses in {collapse_count(s)}")


def claims_markdown(statistics: dict) -> str:
    """docs/claims.md's rows of the claims this study tests: what it measured and the verdict by claims.md's rule."""
    lagged = [s for s in statistics["arms"].values() if s["staleness_max"]]
    lag = (f"verl's staleness max {max(s['staleness_max'] for s in lagged)}, mean after filling "
           f"{min(s['staleness_mean_filled'] for s in lagged):.2f}") if lagged else "no lagged run yet"
    setting = (f"SmolLM2-135M-Instruct on `{statistics['task']}`, lr {statistics['rate']:g}, k = 12 ({lag}), greedy "
               "held-out accuracy on 200 test problems at step 60") if statistics["arms"] else None
    comparisons = by_pair(statistics["comparisons"])
    lines = ["| # | the paper's claim | measured here | verdict | where a GPU would test it |", "|---:|---|---|---|---|"]
    for claim in CLAIMS:
        if claim.parts and claim.parts[0].study == REAL_MODEL_LAG:
            pair = claim.parts[0].pair
            arms = "; ".join(arm_sentence(arm, statistics["arms"][arm]) for arm in pair if arm in statistics["arms"])
            measured = f"{setting}: {arms}." if arms else "No confirmation run of these arms yet."
            comparison = comparisons.get(pair)
            tested = comparison_sentence(comparison) if comparison else "no pair yet."
            lines.append(f"| {claim.number} | {PAPER_CLAIMS[claim.number]} | {measured} The registered "
                         f"comparison, {tested} (`tables/real_model_lag/stats.json`) | "
                         f"{claim_verdict(claim, {REAL_MODEL_LAG: statistics})} | {GPU_TEST} |")
    return "\n".join(lines)


def report_markdown(statistics: dict, regime: dict | None) -> str:
    parts = ["# The real model's policy-lag study", "",
             "SmolLM2-135M-Instruct through verl's trainer on CPU, as registered in recipes/real_model_lag.md. "
             "Generated by `python -m vcpo.studies.real_model_lag report` from tables/real_model_lag/runs.jsonl.", "",
             "## The learning-rate ladder (one seed per cell)", ""]
    parts += ladder_markdown(statistics["ladder"]) if statistics["ladder"] else ["No ladder run has finished yet."]
    parts += ["", f"Chosen rate: {regime['rate']:g} ({regime['by']})." if regime else "The ladder has not decided yet.",
              "", "![ladder](ladder.png)" if statistics["ladder"] else "", "", "## The confirmation", ""]
    if statistics["arms"]:
        parts += [f"At rate {statistics['rate']:g}; each run's end is its step-60 greedy accuracy on 200 test problems.",
                  "", *arms_markdown(statistics["arms"]), "",
                  *(f"- {comparison_sentence(c)}" for c in statistics["comparisons"]), "", "![curves](curves.png)"]
    else:
        parts.append("No confirmation run has finished yet.")
    return "\n".join(parts) + "\n"


def write_report(tables: Path, rows: dict[str, dict], design: dict, metrics_folder: str) -> dict:
    statistics = study_statistics(rows, design)
    regime_file = tables / "regime.json"
    regime = json.loads(regime_file.read_text()) if regime_file.exists() else None
    if statistics["ladder"]:
        groups: dict[str, list[list[dict]]] = {}
        for row in statistics["ladder"]:
            label = f"{ARM_LABELS[row['arm']]} lr {row['rate']:g}"
            groups.setdefault(label, []).append(run_lines(tables, row["name"], metrics_folder))
        draw_runs(groups, tables / "ladder.png", "The learning-rate ladder: sync (lag 0) and seq-TIS (lag 12), seed 100")
    if statistics["arms"]:
        confirmation = [row for row in rows.values() if row["phase"] == "confirmation"]
        groups = {ARM_LABELS[arm]: [run_lines(tables, row["name"], metrics_folder) for row in confirmation if row["arm"] == arm]
                  for arm in statistics["arms"]}
        draw_runs(groups, tables / "curves.png", f"The confirmation at rate {statistics['rate']:g}: each seed faint, "
                  "the mean bold")
    write_atomic(tables / "stats.json", json.dumps(statistics, indent=2) + "\n")
    write_atomic(tables / "report.md", report_markdown(statistics, regime))
    return statistics

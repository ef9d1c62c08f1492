"""Figures and tables of the study in the regime: like VCPO Figures 2 and 4-6, the component ablation,
every method at the regime's lag, the seq-TIS lag sweep, and ESS as a predictor of collapse.

    python -m vcpo.studies.regime_report RUNS --regime recipes/sim/regime.yaml --out tables/regime_study

Writes ``core.png`` (sync, seq-TIS, VCPO: held-out accuracy, train reward, ESS ratio, KL, gradient norm
with min-max bands over seeds), ``ablation.png``, ``methods.png``, ``lag_sweep.png``, ``summary.md``
(per method: accuracy start / best / end, ESS, gradient norm), ``outcomes.md`` (every run judged by the
pre-registered criteria of ``vcpo.studies.stability``, with the ESS lead time) and ``outcomes.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vcpo.cli import shrink_problem
from vcpo.locks import write_atomic
from vcpo.provenance import output_record, utc_now
from vcpo.recipes import run_path
from vcpo.reporting.figures import draw_curves, draw_lag_sweep
from vcpo.reporting.run_data import read_metrics, series, summary_rows
from vcpo.runs import LR_SCALE, SEQ_ESS_RATIO, VAL_ACCURACY
from vcpo.sim.config import load_config_file
from vcpo.studies.plots import summary_markdown
from vcpo.studies.stability import ESS_ALARM, judge_root, markdown

CORE = ["sync", "seq_tis_c8", "vcpo"]
ABLATION = ["seq_tis_c8", "tis_ess", "tis_opob", "vcpo"]
METHOD_ROWS = [
    "seq_tis_c2", "seq_mis_c2", "seq_mis_c8", "token_tis_c2", "token_tis_c8", "token_mis_c2", "token_mis_c8",
    "geo_tis_c2", "geo_tis_c8", "geo_mis_c2", "geo_mis_c8", "dsv32_mis", "m2po", "gspo", "otb", "fp16", "low_lr",
    "kl_in_reward", "vaco", "p3o", "vespo", "topr",
]
SWEEP_LAGS = [0, 2, 4, 8, 12, 24, 48]
PANELS = [VAL_ACCURACY, "critic/score/mean", SEQ_ESS_RATIO, "rollout_corr/kl", "actor/grad_norm"]


def _spec(title: str, paper: str, task: str, lag: int, methods: list[str], panels: list[str], regime: str) -> dict:
    return {"title": title, "paper": f"{paper}  |  {regime}", "kind": "curves", "task": task, "lag": lag,
            "methods": methods, "panels": panels}


def ess_predictor(rows: list[dict]) -> dict:
    """Collapsed runs with their ESS lead (steps from ESS <= 0.1 to the accuracy's fall); for runs that
    did not collapse, how many still had an ESS alarm (false alarms)."""
    collapsed = [row for row in rows if row["outcome"].collapsed]
    held = [row for row in rows if not row["outcome"].collapsed and row["lag"] > 0]
    return {
        "ess_alarm": ESS_ALARM,
        "collapsed": [
            {"method": r["method"], "lag": r["lag"], "seed": r["seed"], "ess_alarm_step": r["outcome"].ess_alarm_step,
             "fall_step": r["outcome"].fall_step, "lead_steps": r["outcome"].ess_lead}
            for r in collapsed
        ],
        "not_collapsed_async_runs": len(held),
        "false_alarms": sum(r["outcome"].ess_alarm_step is not None for r in held),
    }


def predictor_markdown(result: dict) -> str:
    lines = [
        f"ESS as a predictor (alarm: `{SEQ_ESS_RATIO}` <= {result['ess_alarm']}; fall: the first evaluation "
        "after the best at <= half the best accuracy)",
        "",
        "| collapsed run | lag | seed | ESS alarm at step | accuracy fell by step | lead (steps) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["collapsed"]:
        lines.append(f"| {r['method']} | {r['lag']} | {r['seed']} | {r['ess_alarm_step']} | {r['fall_step']} | {r['lead_steps']} |")
    lines += ["", f"Runs with lag > 0 that did not collapse: {result['not_collapsed_async_runs']}; "
              f"of these, {result['false_alarms']} had an ESS ratio <= {result['ess_alarm']} at some step (false alarms)."]
    return "\n".join(lines) + "\n"


def ess_mean_markdown(rows: list[dict], runs: Path) -> str:
    """Each lagged run's mean ESS ratio over its steps (and the ESS rule's mean learning-rate scale)
    beside its outcome, sorted by the mean ESS ratio: the ESS ratio as a graded predictor."""
    table = []
    for row in rows:
        lines = read_metrics(runs / run_path(row["task"], row["method"], row["lag"], row["seed"]))
        _, ess = series(lines, SEQ_ESS_RATIO)
        _, scale = series(lines, LR_SCALE)
        table.append((float(ess.mean()), row, float(scale.mean()) if scale.size else 1.0))
    lines = [
        "| run | seed | mean ESS ratio | mean lr scale | end / best | collapsed |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for ess, row, scale in sorted(table, key=lambda item: item[0]):
        o = row["outcome"]
        lines.append(f"| {row['method']} | {row['seed']} | {ess:.3f} | {scale:.2f} | {o.end / o.best:.2f} | {'yes' if o.collapsed else 'no'} |")
    return "\n".join(lines) + "\n"


def run_steps(rows: list[dict]) -> dict[str, int]:
    """Each judged run's steps, named by method, lag and seed as outcomes.json lists it."""
    return {f"{row['method']} at lag {row['lag']} seed {row['seed']}": row["steps"] for row in rows}


def keep_every_run(outcomes: Path, rows: list[dict]) -> None:
    """SystemExit in one line, nothing written, when ``rows`` lack a run the outcomes file ``outcomes`` judged or hold
    one over fewer steps (a runs folder without every run, a fresh clone's)."""
    if outcomes.exists() and (problem := shrink_problem(outcomes, run_steps(json.loads(outcomes.read_text())["runs"]),
                                                         run_steps(rows), "pass --out for a folder of your own",
                                                         rows="runs", unit="steps")):
        raise SystemExit(f"error: {problem}")


def report(runs: Path, regime: Path, out: Path) -> list[Path]:
    started = utc_now()
    config = load_config_file(regime)
    task, lag = config.task, config.lag
    rows = [row for row in judge_root(runs, task) if row["lag"] in (0, lag) or row["method"] == "seq_tis_c8"]
    keep_every_run(out / "outcomes.json", rows)
    out.mkdir(parents=True, exist_ok=True)
    label = config.extra.get("label")
    name = f"{regime}" + (f" ({label})" if label else "")
    written = [
        draw_curves(_spec("Sequence TIS under lag against sync and VCPO", "like VCPO Figures 2, 4-6", task, lag, CORE,
                          PANELS, name), runs, "smoke", out / "core.png", seeds="core"),
        draw_curves(_spec("Component ablation: TIS, + ESS step size, + OPOB, both (VCPO)", "like VCPO Figure 8", task,
                          lag, ABLATION, PANELS[:3] + ["actor/grad_norm"], name), runs, "smoke", out / "ablation.png",
                    seeds="core"),
        draw_curves(_spec("Every method at the regime's lag (one seed)", "like VCPO Figures 4, 10-13", task, lag,
                          ["sync", "seq_tis_c8", "vcpo", *METHOD_ROWS], [VAL_ACCURACY, SEQ_ESS_RATIO],
                          name), runs, "smoke", out / "methods.png", seeds="all"),
        draw_lag_sweep({"title": "Sequence TIS (c = 8) against the policy lag", "paper": f"beyond the paper  |  {name}",
                        "kind": "lag_sweep", "task": task, "lags": SWEEP_LAGS, "methods": ["seq_tis_c8"]},
                       runs, "smoke", out / "lag_sweep.png"),
    ]
    methods = ["sync", "seq_tis_c8", "vcpo", "tis_ess", "tis_opob", *METHOD_ROWS]
    summary = out / "summary.md"
    write_atomic(summary, f"Regime: `{name}` (task {task}, lag {lag}).\n\n" + summary_markdown(summary_rows(runs, task, lag, methods)))
    predictor = ess_predictor([row for row in rows if row["lag"] == lag])
    write_atomic(
        out / "outcomes.md", f"Regime: `{name}`. Every run judged by the pre-registered criteria (`vcpo/studies/stability.py`).\n\n"
        + markdown(rows) + "\n" + predictor_markdown(predictor)
        + "\nThe mean ESS ratio of each run at the regime's lag, sorted, beside its outcome:\n\n"
        + ess_mean_markdown([row for row in rows if row["lag"] == lag], runs)
    )
    write_atomic(out / "outcomes.json", json.dumps({
        "regime": name,
        "runs": [{**{k: v for k, v in row.items() if k != "outcome"}, **vars(row["outcome"]),
                  "holds": row["outcome"].holds, "collapsed": row["outcome"].collapsed} for row in rows],
        "ess_predictor_at_regime_lag": predictor,
        "provenance": output_record(started),  # the code's commit, when the report ran, and the CPU
    }, indent=1) + "\n")
    return [*written, summary, out / "outcomes.md", out / "outcomes.json"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vcpo.studies.regime_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--regime", type=Path, default=Path("recipes/sim/regime.yaml"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.runs.is_dir():
        parser.error(f"no runs folder at {args.runs}")
    for path in report(args.runs, args.regime, args.out):
        print(path)


if __name__ == "__main__":
    main()

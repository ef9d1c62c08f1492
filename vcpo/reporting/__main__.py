"""python -m vcpo.reporting {figure,table1,hyperparams} ...: write a table or figure, print its path.

python -m vcpo.reporting figure ID --runs RUNS --scale smoke|paper --out PNG [--task T]... [--lag K]
                                [--seeds core|all] [--measured JSON]
python -m vcpo.reporting table1 --runs RUNS --scale smoke|paper --out MD [--task PAPER_TASK[=RUN_TASK]]... [--lag K]
                               [--lag-map PAPER_LAG=LAG]...
python -m vcpo.reporting hyperparams --out DIR
python -m vcpo.reporting curves RUN [RUN ...] --out PNG
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from vcpo.reporting.figures import MEASURED_KINDS, SCALES, draw_figure, draw_runs
from vcpo.reporting.hyperparams import write_hyperparams
from vcpo.reporting.run_data import read_metrics
from vcpo.reporting.specs import figure_specs
from vcpo.reporting.table1 import write_table1


def task_map(entries: list[str] | None) -> dict[str, str] | None:
    """``PAPER_TASK[=RUN_TASK]`` entries (also comma-separated) as paper task -> the task its runs used."""
    if not entries:
        return None
    pairs = [entry.split("=", 1) for item in entries for entry in item.split(",") if entry]
    return {pair[0]: pair[-1] for pair in pairs}


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if _draws_runs(args) and not args.runs.is_dir():
        parser.error(f"--runs {args.runs}: no such folder (RUNS/<task>/<method>/lag<k>/seed<s>/)")
    if args.command == "figure":
        print(
            draw_figure(args.id, args.runs, args.scale, args.out, args.task, args.lag, args.seeds, args.measured)
        )
    elif args.command == "curves":
        missing = [str(run) for run in args.run if not run.is_dir()]
        if missing:
            parser.error(f"no such run folder: {', '.join(missing)}")
        groups = {run.resolve().name: [read_metrics(run)] for run in args.run}
        print(draw_runs(groups, args.out, args.title or ", ".join(groups)))
    elif args.command == "table1":
        lag_map = {int(paper): int(scaled) for paper, scaled in (pair.split("=") for pair in args.lag_map or [])}
        print(write_table1(args.runs, args.scale, args.out, task_map(args.task), args.lag, lag_map))
    else:
        for path in write_hyperparams(args.out):
            print(path)


def _bad_lag_map(text: str):
    raise argparse.ArgumentTypeError(f"{text!r} is not PAPER_LAG=LAG (two integers)")


def _draws_runs(args: argparse.Namespace) -> bool:
    if args.command == "figure":
        return figure_specs()[args.id]["kind"] not in MEASURED_KINDS
    return args.command == "table1"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vcpo.reporting", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    figure = commands.add_parser("figure", help="draw a figure of vcpo/reporting/figures.yaml")
    figure.add_argument("id", choices=tuple(figure_specs()), help="figure id of vcpo/reporting/figures.yaml")
    table1 = commands.add_parser("table1", help="VCPO Table 1 as markdown + JSON")
    for sub in (figure, table1):
        sub.add_argument("--runs", type=Path, required=True, help="RUNS/<task>/<method>/lag<k>/seed<s>/")
        sub.add_argument("--scale", choices=tuple(SCALES), required=True, help="label, and CPU- or GPU-hours")
        sub.add_argument("--out", type=Path, required=True)
        sub.add_argument("--lag", type=int, help="replace the paper lag (sync runs stay at lag 0)")
    figure.add_argument("--task", action="append", help="replace the paper task(s); repeat or comma-separate")
    figure.add_argument(
        "--seeds",
        choices=("core", "all"),
        default="all",
        help="core: only the seeds every drawn run has; all: every seed found",
    )
    figure.add_argument(
        "--measured",
        type=Path,
        help="kind overhead: benchmarks/opob_overhead.py --json output; kind grad_norm_proxy: python -m vcpo.studies.grad_norms output",
    )
    table1.add_argument(
        "--task",
        action="append",
        help="PAPER_TASK[=RUN_TASK] rows to include (default: all three, runs under the same name)",
    )
    table1.add_argument(
        "--lag-map",
        action="append",
        type=lambda text: text if re.fullmatch(r"\d+=\d+", text) else _bad_lag_map(text),
        help="PAPER_LAG=LAG: a published lag and the lag of this scale's async runs (repeat; other lags kept)",
    )
    curves = commands.add_parser("curves", help="a run folder's curves (training reward, held-out accuracy, ESS "
                                 "ratio, lr scale, staleness, KL) to a PNG; several runs in one figure")
    curves.add_argument("run", type=Path, nargs="+", help="run folder(s) with metrics.jsonl (either backend)")
    curves.add_argument("--out", type=Path, required=True)
    curves.add_argument("--title", default=None)
    hyper = commands.add_parser("hyperparams", help="VCPO Tables 2-5 from the recipes")
    hyper.add_argument("--out", type=Path, required=True, help="folder for table2.md ... table5.md")
    return parser


if __name__ == "__main__":
    main()

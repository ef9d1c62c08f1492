"""``python -m vcpo.data build <task> --out DIR [--source PATH] [--size N] [--split S] [--seed K]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vcpo.cli import output_folder_problem
from vcpo.data.build import build, splits_for_source
from vcpo.data.datasets import DATASETS, get_dataset
from vcpo.data.sources import HubUnavailableError


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if problem := output_folder_problem(Path(args.out)):
        parser.error(f"--out {args.out}: {problem}")
    task = get_dataset(args.task)
    written = []
    try:
        for split in [args.split] if args.split else splits_for_source(task, args.source):
            print(f"building {task.name}/{split} from {args.source or task.hub_id or 'Reasoning Gym'}")
            for path in build(task.name, args.out, split=split, source=args.source, size=args.size, seed=args.seed):
                manifest = json.loads(path.with_name(f"{path.stem}.manifest.json").read_text(encoding="utf-8"))
                print(f"  wrote {manifest['rows']} rows to {path}")
                written.append((path, manifest))
    except (HubUnavailableError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"done: {len(written)} file(s), {sum(manifest['rows'] for _, manifest in written)} rows")
    for path, manifest in written:
        print(f"  {manifest['split']:<10} {manifest['rows']:>6} rows  sha256 {manifest['sha256'][:12]}  {path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vcpo.data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("build", help="write <out>/<task>/<split>.parquet and a manifest beside it")
    command.add_argument("task", choices=list(DATASETS))
    command.add_argument("--out", required=True, help="output folder")
    command.add_argument("--source", help="local json/jsonl/parquet copy instead of the Hugging Face hub")
    command.add_argument("--split", help="one split only (default: every split of the task)")
    command.add_argument("--size", type=int, help="rows to keep (Countdown: puzzles to generate, split 90/10)")
    command.add_argument("--seed", type=int, default=0, help="subset seed (Countdown: generation seed)")
    return parser


if __name__ == "__main__":
    sys.exit(main())

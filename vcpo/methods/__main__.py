"""``python -m vcpo.methods list`` prints every method preset; ``show NAME`` prints one, resolved."""

from __future__ import annotations

import argparse
import sys

import yaml

from vcpo.methods import aliases, get_method, list_methods, loss_info


def _format_params(params: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in params.items()) or "-"


def _step_size(spec: dict) -> str:
    rule = spec["step_size"]
    return "constant" if rule["rule"] == "constant" else f"ESS {_format_params(rule.get('params', {}))}"


def _setting(spec: dict) -> str:
    parts = [spec["precision"]]
    if "max_lag" in spec:
        parts.append(f"lag {spec['max_lag']}")
    if "kl_in_reward_beta" in spec:
        parts.append(f"KL-in-reward {spec['kl_in_reward_beta']:g}")
    return ", ".join(parts)


def _rows() -> list[list[str]]:
    rows = []
    for method in list_methods():
        spec = method.spec
        advantage = spec["advantage"]
        rows.append([
            method.name,
            method.loss_name,
            loss_info(method.loss_name).weight,
            _format_params(method.loss_params),
            f"{advantage['estimator']} ({_format_params(advantage['params'])})",
            _step_size(spec),
            f"{spec['optimizer']['lr']:g}",
            _setting(spec),
            spec["source"],
        ])
    return rows


def print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, ["-" * w for w in widths] + ["-" * len(header[-1])], *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vcpo.methods", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="one line per method preset")
    show = commands.add_parser("show", help="one preset with `extends` resolved, as YAML")
    show.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "list":
        header = ["method", "loss", "weight / mask", "loss params", "baseline", "step size", "lr", "setting", "source"]
        print_table(_rows(), header)
        for alias, target in aliases().items():
            print(f"alias: {alias} = {target}")
    else:
        try:
            method = get_method(args.name)
        except ValueError as error:
            parser.error(str(error))
        yaml.safe_dump(method.spec, sys.stdout, sort_keys=False, allow_unicode=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

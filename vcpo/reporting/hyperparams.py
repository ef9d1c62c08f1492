"""VCPO Tables 2-5 (App. F) and the table of tasks regenerated from the recipes the runs are launched with,
never retyped.

Table 2 is ``recipes/optimizer.yaml`` plus the learning rate of the method presets; Tables 3-5 are the
``paper:`` sections of ``recipes/tasks/*.yaml``, one column per task that names the table (MATH and
Countdown share Table 4). So a recipe edit shows up in the tables, and a table that disagrees with the
paper points at the recipe to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vcpo.data.datasets import get_dataset
from vcpo.methods import get_method
from vcpo.recipes import load_folder, load_tasks, read_yaml, recipes_dir
from vcpo.rewards import reward_kind

# Row label of each task ``paper:`` key, in the paper's order.
TASK_ROWS = {
    "model": "Model",
    "lr_warmup_steps": "Learning rate warmup steps",
    "lr_stable_steps": "Learning rate stable steps",
    "lr_decay_steps": "Learning rate decay steps",
    "temperature": "Generation temperature",
    "max_prompt_length": "Max prompt token length",
    "max_response_length": "Response length",
    "max_turns": "Max assistant turns",
    "prompts_per_batch": "Number of prompts per batch",
    "completions_per_prompt": "Number of completions per prompt",
    "training_steps": "Number of training steps",
    "max_lag": "Max staleness (PipelineRL-k)",
    "sampler_gpus": "Number of sampler GPUs",
    "trainer_gpus": "Number of trainer GPUs",
    "gpu": "GPU",
    "max_is_ratio": "Max IS ratio (TIS c)",
    "rho_on": "On-policy ESS ratio rho_on (Eq. 5)",
}
# Rows the paper prints that follow from the others: label -> how.
DERIVED_ROWS = {
    "Batch size (effective)": lambda p: p["prompts_per_batch"] * p["completions_per_prompt"],
    "Total prompts seen": lambda p: p["prompts_per_batch"] * p["training_steps"],
    "Total episodes": lambda p: p["prompts_per_batch"] * p["completions_per_prompt"] * p["training_steps"],
}
OPTIMIZER_ROWS = {
    "optimizer": "Optimizer",
    "weight_decay": "Weight decay",
    "betas": "AdamW beta1, beta2",
    "eps": "AdamW epsilon",
    "grad_clip": "Gradient clipping",
    "entropy_coeff": "Entropy coefficient",
    "kl_coef": "KL coefficient",
}


def fmt(value: Any) -> str:
    """Values as the paper prints them: lists joined by '/', floats in short form."""
    if isinstance(value, list | tuple):
        return "/".join(fmt(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def markdown(title: str, header: list[str], rows: list[list[str]], source: str) -> str:
    lines = [f"# {title}", "", f"Generated from {source}.", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "---|" * len(header))
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def table2() -> str:
    """VCPO Table 2: the optimiser settings every experiment shares."""
    spec = read_yaml(recipes_dir() / "optimizer.yaml")
    rows = [
        [
            "Learning rate",
            f"{fmt(get_method('seq_tis_c8').spec['optimizer']['lr'])} (method presets; low_lr: "
            f"{fmt(get_method('low_lr').spec['optimizer']['lr'])})",
        ]
    ]
    rows.append(["Warmup steps", "the task's (Tables 3-5)"])
    rows += [[label, fmt(spec[key])] for key, label in OPTIMIZER_ROWS.items()]
    return markdown(
        f"{spec['table']}: optimisation hyper-parameters",
        ["Hyper-parameter", "Value"],
        rows,
        "recipes/optimizer.yaml and recipes/methods/{seq_tis_c8,low_lr}.yaml",
    )


def task_tables() -> dict[str, str]:
    """VCPO Tables 3-5: table name -> markdown, one column per task recipe naming that table."""
    by_table: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, (_, spec) in load_folder(recipes_dir() / "tasks").items():
        by_table.setdefault(spec["table"], []).append((name, spec))
    tables = {}
    for table, tasks in sorted(by_table.items()):
        papers = [spec["paper"] for _, spec in tasks]
        rows = [
            [label, *(fmt(p.get(key, "-")) for p in papers)]
            for key, label in TASK_ROWS.items()
            if any(key in p for p in papers)
        ]
        rows += [[f"{label} (derived)", *(fmt(rule(p)) for p in papers)] for label, rule in DERIVED_ROWS.items()]
        header = ["Hyper-parameter", *(name for name, _ in tasks)]
        sources = ", ".join(f"recipes/tasks/{name}.yaml" for name, _ in tasks)
        tables[table] = markdown(
            f"{table}: training hyper-parameters ({', '.join(s['title'] for _, s in tasks)})", header, rows, sources
        )
    return tables


def tasks_table() -> str:
    """Each paper task (``recipes/tasks``) with its data, reward, evaluation benchmarks and the tasks that
    train in its place on CPU: the simulator's and verl's trainer's (``-``: none)."""
    rows = []
    for name, recipe in load_tasks().items():
        data = recipe.spec["data"]
        rewards = sorted({reward_kind(get_dataset(split.split("/")[0]).data_source) for split in data["train"]})
        rows.append([
            f"`{name}`", recipe.spec["title"], ", ".join(data["train"]), ", ".join(data["val"]), ", ".join(rewards),
            ", ".join(recipe.benchmarks), *(recipe.spec["stand_in"].get(where, "-") for where in ("sim", "verl_cpu")),
        ])
    header = ["task", "paper setting", "training data", "validation data", "reward", "benchmarks", "sim stand-in",
              "verl CPU stand-in"]
    return markdown("The paper's tasks", header, rows, "recipes/tasks/*.yaml")


def write_hyperparams(out_dir: Path) -> list[Path]:
    """Write ``table2.md`` ... ``table5.md`` (named by the paper table number) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = {read_yaml(recipes_dir() / "optimizer.yaml")["table"]: table2(), **task_tables()}
    written = []
    for table, text in tables.items():
        path = out_dir / f"table{table.split()[-1]}.md"
        path.write_text(text)
        written.append(path)
    return written

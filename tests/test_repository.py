"""The repository's shape: the README's two fresh-machine commands (CI runs the test one verbatim); the package's
import structure (no cycles, each first-level module and each simulator module importing only those below it,
vcpo.core without a framework, the verl user's modules without the `repro` extra, vcpo.sim.config a leaf that reads
no file on import, no sys.path edits); docs/ALGORITHMS.md holding every section the code cites and nothing
pointing at shared/; every benchmark script importing; and `python -m vcpo.evaluation` running from the wheel."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_the_two_fresh_machine_commands():
    fresh_machine = (ROOT / "README.md").read_text().split("## Fresh machine", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.+?)\n```", fresh_machine, flags=re.S)
    assert len(commands) == 2
    main_job, tests = commands
    assert "torch==2.13.0" in main_job and "snakemake" in main_job
    assert main_job.index("torch==2.13.0") < main_job.index("pip install -e")
    assert "pytest" in tests and tests.index("torch==2.13.0") < tests.index("pip install -e")


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = readme_commands()[1]
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci_lines[-1] == test_command


def test_core_imports_no_framework():
    """vcpo.core is pure PyTorch: importing it loads neither verl nor transformers."""
    import subprocess
    import sys

    script = "import sys, vcpo.core; print(sorted(m for m in ('verl', 'transformers', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_product_points_at_its_own_docs_not_at_the_developers_shared_folder():
    """Users' clones have no shared/: the method spec and the design live in docs/, and every file that
    cites a section of the spec finds it there."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    texts = {name: (ROOT / name).read_text(errors="ignore") for name in tracked if (ROOT / name).is_file()}
    assert [name for name, text in texts.items() if re.search(r"shared/(docs|papers)", text)] == []
    spec = (ROOT / "docs" / "ALGORITHMS.md").read_text()
    sections = {int(number) for number in re.findall(r"^## (\d+)\.", spec, flags=re.M)}
    cited = {int(n) for text in texts.values() for group in re.findall(r"docs/ALGORITHMS\.md (§[\d§, -]+)", text)
             for n in re.findall(r"\d+", group)}
    assert cited and cited <= sections, f"cited sections missing from docs/ALGORITHMS.md: {sorted(cited - sections)}"


# The package's layers, lowest first: a first-level module imports only modules before it (docs/DESIGN.md).
LAYERS = [
    "vcpo", "vcpo.upstream", "vcpo.core", "vcpo.cli", "vcpo.locks", "vcpo.lifetimes", "vcpo.provenance", "vcpo.resident_memory", "vcpo.runs", "vcpo.recipes", "vcpo.local_models", "vcpo.methods", "vcpo.rewards", "vcpo.tools",
    "vcpo.actor_memory", "vcpo.verl_contract", "vcpo.data", "vcpo.evaluation", "vcpo.verl_plugin", "vcpo.launch", "vcpo.sim", "vcpo.reporting",
    "vcpo.studies", "vcpo.workflow_plan",
]  # fmt: skip


def import_graph() -> dict[str, set[str]]:
    """module -> the vcpo modules it imports (anywhere in the file, type-checking imports included)."""
    import ast

    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in (ROOT / "vcpo").rglob("*.py")}
    graph = {}
    for module, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    imported.add(name)
        graph[module] = imported
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, found = {}, {}, [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while (other := stack.pop()) != node:
                component.append(other)
            if component:
                found.append(sorted([node, *component]))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_two_files_of_the_package_import_each_other_in_a_circle():
    assert cycles(import_graph()) == []


def test_the_first_level_modules_import_only_the_layers_below_them():
    def layer(module):
        return ".".join(module.split(".")[:2])

    wrong = sorted(
        f"{module} imports {other}"
        for module, imported in import_graph().items()
        for other in imported
        if layer(other) != layer(module) and LAYERS.index(layer(other)) > LAYERS.index(layer(module))
    )
    assert set(map(layer, import_graph())) <= set(LAYERS)
    assert wrong == []


# A simulator run is set up in one direction: its settings (vcpo.sim.config, a leaf), the sampler and the tasks,
# then the base built on them, then the settings checked against those registries (vcpo.sim.validation fills in the
# task's defaults once), then the learner and the trainer that composes them.
SIM_ORDER = [
    "vcpo.sim.config", "vcpo.sim.rollout", "vcpo.sim.tasks", "vcpo.sim.heldout", "vcpo.sim.base", "vcpo.sim.validation",
    "vcpo.sim.learner",
    "vcpo.sim.concurrent", "vcpo.sim.run_folder", "vcpo.sim.train", "vcpo.sim.sweep", "vcpo.sim.__main__",
    # the pre-registered commands' aliases of moved studies (they run vcpo.studies.* by name, importing nothing)
    "vcpo.sim.evidence", "vcpo.sim.across_lags", "vcpo.sim.stability",
]  # fmt: skip


def test_the_simulators_modules_import_only_those_before_them():
    graph = import_graph()
    modules = {m for m in graph if m.startswith("vcpo.sim.")}
    assert modules == set(SIM_ORDER), modules ^ set(SIM_ORDER)
    wrong = sorted(f"{module} imports {other}" for module in SIM_ORDER for other in graph[module]
                   if other in modules and SIM_ORDER.index(other) > SIM_ORDER.index(module))
    assert wrong == []


def test_a_verl_user_imports_the_losses_engine_rewards_and_tool_without_the_reproduction_stack():
    """`pip install vcpo` (no extras) covers these: none of them loads a package of the `repro` extra."""
    import subprocess
    import sys

    script = (
        "import sys, vcpo.core, vcpo.methods, vcpo.rewards, vcpo.tools, vcpo.verl_plugin, vcpo.verl_plugin.engine, "
        "vcpo.launch, vcpo.evaluation; print(sorted(m for m in ('snakemake', 'reasoning_gym', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_the_evaluation_entry_point_runs_from_the_wheel(tmp_path):
    """The wheel carries `python -m vcpo.evaluation` and the benchmark settings it reads (as vcpo/_recipes)."""
    import os
    import subprocess
    import sys
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path)], check=True, timeout=600)
    (wheel,) = tmp_path.glob("vcpo-*.whl")
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    assert (unpacked / "vcpo" / "evaluation" / "__main__.py").is_file()
    assert (unpacked / "vcpo" / "_recipes" / "benchmarks.yaml").is_file()
    # outside the checkout, with only the wheel's files on the path: its help lists the benchmark file's names
    result = subprocess.run([sys.executable, "-m", "vcpo.evaluation", "--help"], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(unpacked)}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "--benchmarks" in result.stdout
    probe = "import vcpo.evaluation.__main__ as m; print(m.BENCHMARKS_FILE)"
    located = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(unpacked)}, check=True).stdout
    assert located.strip() == str(unpacked / "vcpo" / "_recipes" / "benchmarks.yaml")


@pytest.mark.parametrize("script", sorted(path.name for path in (ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_script_imports(script):
    """No test runs every benchmark end to end: a name a refactoring renamed fails here, not for the next
    person who measures something."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"benchmark_{script[:-3]}", ROOT / "benchmarks" / script)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_no_script_or_module_edits_the_import_path():
    """One way to reach shared code: imports from the installed package (the engine's CPU harness lives in
    vcpo.verl_plugin.cpu.standalone), never a sys.path edit; the sandbox's bootstrap, which puts the
    program's own folder on the program's path, is the exception."""
    editors = [
        str(path.relative_to(ROOT))
        for folder in ("vcpo", "benchmarks", "workflows")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if ("sys.path.insert" in path.read_text() or "sys.path.append" in path.read_text())
    ]
    assert editors == ["vcpo/tools/_sandbox_child.py"]


def test_the_simulators_config_is_a_leaf_that_reads_no_file_when_imported():
    """vcpo.sim.config imports none of the trainer's modules and reads no recipe until a config is made."""
    code = ("import sys; opened = []; "
            "sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == 'open' else None); "
            "import vcpo.sim.config; "
            "print([path for path in opened if '/recipes/' in path]); "
            "print(sorted(m for m in sys.modules if m.startswith('vcpo.sim.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.split("\n")[:2] == ["[]", "['vcpo.sim.config']"]


def test_every_function_level_import_of_a_vcpo_module_says_why():
    """An import of a vcpo module inside a function (an optional dependency, an import cost) carries its reason: a
    comment on its line or the line before its group; everything else is imported at the top of its module."""
    import ast

    unexplained = []
    for path in sorted((ROOT / "vcpo").rglob("*.py")):
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vcpo"):
                    above = node.lineno - 2
                    while above >= 0 and lines[above].lstrip().startswith(("from vcpo", "import ")):
                        above -= 1  # the rest of its group
                    if "#" not in lines[node.lineno - 1] and not lines[above].lstrip().startswith("#"):
                        unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert unexplained == []


def test_no_document_code_or_table_carries_a_machine_path():
    """README, docs/, recipes/, vcpo/, benchmarks/ and the tables' Markdown name no folder of one machine (a home or
    root user's folder, a checkout's absolute path): a reader's machine has others. Raw run records (JSON, logs)
    stay as they were recorded."""
    import re

    machine = re.compile(rf"(/root/|/home/\w|/Users/\w|/work/|/check/|{re.escape(str(ROOT))})")
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "recipes").rglob("*"),
             *(ROOT / "vcpo").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "tables").rglob("*.md")]
    found = [f"{path.relative_to(ROOT)}:{number}" for path in files if path.is_file()
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if machine.search(line)]
    assert not found, found


def test_a_function_over_80_lines_says_why_beside_it():
    """A reader holds a function in one screen: one over 80 lines has a comment block above it that starts
    "# Over 80 lines" and says why it is one piece."""
    import ast

    unexplained = []
    for path in sorted((ROOT / "vcpo").rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                above = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 2
                while above >= 0 and lines[above].startswith("#") and not lines[above].startswith("# Over 80 lines"):
                    above -= 1
                if above < 0 or not lines[above].startswith("# Over 80 lines"):
                    unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert unexplained == []


def test_what_the_readmes_commands_write_is_ignored_and_no_committed_file_is():
    """Every folder a README command writes into (--out, --data-dir, --report: runs/smollm2 holds a GB of checkpoints)
    is ignored by git, so that `git add` of a change does not take a run with it; the ignore rules catch no committed
    file (the tables' archived run folders, tables/*/runs/, stay tracked)."""
    written = [value for block in readme_commands()
               for value in re.findall(r"--(?:out|data-dir|report)[ =](\S+)", block)]
    assert {"runs/smollm2", "runs/smollm2/eval", "data", "results/smoke/report.html"} <= set(written), written
    probes = [f"{path}/probe" for path in written]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(probes),
                             capture_output=True, text=True).stdout.split()
    assert sorted(ignored) == sorted(probes)
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    caught = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input=tracked,
                            capture_output=True, text=True).stdout.split()
    assert caught == []

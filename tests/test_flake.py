"""flake.nix parses, and its outputs evaluate offline against a stub nixpkgs (tests/fixtures/nix/).

CI has no network to fetch nixpkgs, so `nix develop` itself is not run: these tests check the flake's
syntax, its structure (a CPU `default` and a `gpu` shell per Linux system), the attributes it takes
from nixpkgs (the stub has only real ones), and its shell hooks (bash syntax, and the venv logic run
in a scratch directory). They need `nix-instantiate` (Debian: nix-bin; .ci/run installs it).
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAKE = ROOT / "flake.nix"
EVAL = ROOT / "tests" / "fixtures" / "nix" / "eval-flake.nix"
SYSTEMS = {"x86_64-linux", "aarch64-linux"}

NIX_INSTANTIATE = shutil.which("nix-instantiate")
pytestmark = pytest.mark.skipif(
    NIX_INSTANTIATE is None, reason="nix-instantiate not installed (Debian: apt-get install nix-bin)"
)


def nix_instantiate(*args):
    # dummy:// : nothing is built or copied, and no nix daemon or writable /nix is needed.
    return subprocess.run(
        [NIX_INSTANTIATE, "--store", "dummy://", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


@pytest.fixture(scope="module")
def shells():
    result = nix_instantiate("--eval", "--strict", "--json", str(EVAL), "--arg", "flake", str(FLAKE))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def readme_test_command():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)[1]


def test_flake_parses():
    result = nix_instantiate("--parse", str(FLAKE))
    assert result.returncode == 0, result.stderr


def test_every_linux_system_has_a_cpu_and_a_gpu_shell(shells):
    assert set(shells) == SYSTEMS
    for system in SYSTEMS:
        assert set(shells[system]) == {"default", "gpu"}


def test_default_shell_is_python_312_with_the_ci_install(shells):
    for system in SYSTEMS:
        shell = shells[system]["default"]
        assert {"python3-3.12", "git", "gcc-wrapper"} <= set(shell["packages"])
        assert not shell["config"].get("allowUnfree")
        hook = shell["shellHook"]
        # The same pins as README's test command and .ci/run, in the same order.
        assert "pip install torch==2.13.0" in readme_test_command()
        assert hook.index(".venv/bin/pip install torch==2.13.0") < hook.index('.venv/bin/pip install -e ".[test]"')
        assert "[gpu" not in hook
        assert "stub-gcc-lib/lib:/nix/store/stub-zlib/lib" in hook  # libstdc++ and zlib for the wheels


def test_gpu_shell_adds_cuda_and_the_gpu_extra(shells):
    for system in SYSTEMS:
        shell = shells[system]["gpu"]
        assert {"python3-3.12", "git", "gcc-wrapper", "cudatoolkit"} <= set(shell["packages"])
        assert shell["config"].get("allowUnfree") is True
        hook = shell["shellHook"]
        assert '.venv/bin/pip install -e ".[gpu,test]"' in hook
        assert "torch==2.13.0" not in hook  # the gpu extra picks the CUDA torch
        assert "CUDA_HOME=/nix/store/stub-cudatoolkit" in hook
        assert "libcuda.so.1" in hook


def test_snakemake_comes_from_the_project_environment(shells):
    """No shell brings its own snakemake: the venv's is used, so the installed project (with the extras the
    shells install) must require it."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    snakemake = [Requirement(text) for text in requires("vcpo") if Requirement(text).name == "snakemake"]
    # the reproduction extra brings it, and so does the test extra that every shell installs
    for extra in ("repro", "test"):
        assert any(r.specifier.contains("9.0") and r.marker.evaluate({"extra": extra}) for r in snakemake), extra
    for system in SYSTEMS:
        for shell in shells[system].values():
            assert not any("snakemake" in package for package in shell["packages"])


def test_shell_hooks_are_valid_bash(shells):
    for system in SYSTEMS:
        for name, shell in shells[system].items():
            result = subprocess.run(["bash", "-n", "-c", shell["shellHook"]], capture_output=True, text=True)
            assert result.returncode == 0, f"{system}.{name}: {result.stderr}"


def run_hook(hook, cwd):
    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}  # pytest may run in .venv
    script = hook + '\necho "VIRTUAL_ENV=${VIRTUAL_ENV:-}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=cwd, env=env, timeout=60)


def test_hook_leaves_a_venv_from_another_python_alone(shells, tmp_path):
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    result = run_hook(shells["x86_64-linux"]["default"]["shellHook"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "made by another Python" in result.stderr
    assert "VIRTUAL_ENV=\n" in result.stdout  # not activated, and nothing installed into it
    assert not (tmp_path / ".venv" / ".flake-shell").exists()


def test_hook_does_not_mix_cpu_and_gpu_venvs(shells, tmp_path):
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "pyvenv.cfg").write_text("home = /nix/store/stub-python3-3.12/bin\n")
    (tmp_path / ".venv" / ".flake-shell").write_text("gpu\n")
    result = run_hook(shells["x86_64-linux"]["default"]["shellHook"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "set up by the gpu shell" in result.stderr
    assert "VIRTUAL_ENV=\n" in result.stdout


FAKE_PYTHON = """#!/bin/sh
# `python3 -m venv .venv` as Python 3.12 from the stub nixpkgs would make it; its pip only logs.
mkdir -p .venv/bin
echo "home = /nix/store/stub-python3-3.12/bin" > .venv/pyvenv.cfg
printf '#!/bin/sh\\necho "pip $*" >> .venv/pip.log\\nexit ${FAKE_PIP_STATUS:-0}\\n' > .venv/bin/pip
chmod +x .venv/bin/pip
echo 'export VIRTUAL_ENV=$PWD/.venv' > .venv/bin/activate
"""


@pytest.mark.parametrize(
    "name, installs",
    [
        ("default", ["pip install torch==2.13.0", "pip install -e .[test]"]),
        ("gpu", ["pip install -e .[gpu,test]"]),
    ],
)
def test_hook_installs_once_then_activates(shells, tmp_path, monkeypatch, name, installs):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    project = tmp_path / "project"
    project.mkdir()
    hook = shells["x86_64-linux"][name]["shellHook"]

    monkeypatch.setenv("FAKE_PIP_STATUS", "1")  # a failed install is neither activated nor recorded
    result = run_hook(hook, project)
    assert "VIRTUAL_ENV=\n" in result.stdout
    assert not (project / ".venv" / ".flake-shell").exists()

    monkeypatch.setenv("FAKE_PIP_STATUS", "0")
    for entry in (1, 2):  # the second entry reuses the venv
        (project / ".venv" / "pip.log").unlink(missing_ok=True)
        result = run_hook(hook, project)
        assert result.returncode == 0, result.stderr
        assert f"VIRTUAL_ENV={project}/.venv\n" in result.stdout
        assert (project / ".venv" / ".flake-shell").read_text() == f"{name}\n"
        if entry == 1:
            assert (project / ".venv" / "pip.log").read_text().splitlines() == installs
        else:
            assert not (project / ".venv" / "pip.log").exists()

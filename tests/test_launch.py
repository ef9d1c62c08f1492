"""vcpo.launch: every paper run composes with verl 0.9.1's Hydra config and carries the paper's values."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from vcpo.launch import (
    LaunchError,
    check,
    compose,
    load_tasks,
    make_run,
    overrides,
    run_environment,
)
from vcpo.launch.__main__ import main
from vcpo.methods import get_method, list_methods, step_rule
from vcpo.recipes import read_yaml, recipes_dir

SNAPSHOTS = Path(__file__).parent / "snapshots"
REPO = recipes_dir().parent

# VCPO App. F, typed here from the paper once more on purpose: the recipes must agree with it.
PAPER = {
    "gsm8k": dict(model="Qwen/Qwen2-1.5B", prompts=8, n=8, prompt=1024, response=2048, steps=400, warmup=5, k=12),
    "math": dict(model="Qwen/Qwen2.5-7B", prompts=32, n=16, prompt=2048, response=4096, steps=400, warmup=0, k=10),
    "countdown": dict(model="Qwen/Qwen2.5-7B", prompts=32, n=16, prompt=2048, response=4096, steps=400, warmup=0, k=10),
    "simpletir": dict(model="Qwen/Qwen2.5-7B", prompts=128, n=16, prompt=2048, response=12288, steps=200, warmup=0, k=2),
}


@functools.cache
def resolved(task: str, method: str, *extra: str, lag: int | None = None):
    """Composed and checked once per test session (each compose takes about a second)."""
    run = make_run(task, method, lag)
    config = compose(run, list(extra))
    check(run, config, check_paths=False)
    return run, config


def test_every_paper_task_is_a_recipe():
    assert sorted(load_tasks()) == sorted(PAPER)


@pytest.mark.parametrize("task", sorted(PAPER))
def test_show_config_carries_the_papers_values_under_verls_keys(task):
    paper = PAPER[task]
    _, config = resolved(task, "vcpo")
    actor, rollout, optim = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout, None
    optim = actor.optim
    assert config.actor_rollout_ref.model.path == paper["model"]
    assert optim.lr == pytest.approx(1e-6)  # Table 2
    assert optim.weight_decay == pytest.approx(0.1)
    assert list(optim.betas) == [0.9, 0.999]
    assert optim.override_optimizer_config.eps == pytest.approx(1e-8)
    assert optim.clip_grad == pytest.approx(1.0)
    assert actor.entropy_coeff == 0 and actor.use_kl_loss is False
    assert optim.lr_warmup_steps == paper["warmup"] and optim.lr_scheduler_type == "constant"
    assert optim.total_training_steps == paper["steps"] == config.trainer.total_training_steps
    assert config.data.train_batch_size == paper["prompts"] == actor.ppo_mini_batch_size
    assert rollout.n == paper["n"] and rollout.temperature == 1.0
    assert config.data.max_prompt_length == paper["prompt"] and config.data.max_response_length == paper["response"]
    assert config.trainer.v1.trainer_mode == "separate_async"
    assert config.trainer.v1.sampler.max_off_policy_threshold == paper["k"] + 1  # lag <= threshold - 1
    assert config.trainer.v1.separate_async.parameter_sync_step == 1 and actor.ppo_epochs == 1
    assert actor.policy_loss.loss_mode == "seq_tis" and actor.policy_loss.method == "vcpo"
    assert get_method(actor.policy_loss.method).loss_params["hi"] == 8.0  # max IS ratio
    assert config.algorithm.rollout_correction.bypass_mode is True


def test_the_multi_turn_task_runs_the_sandbox_tool_for_five_turns():
    _, config = resolved("simpletir", "vcpo")
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable is True and multi_turn.max_assistant_turns == 5
    assert Path(multi_turn.tool_config_path) == REPO / "recipes/tools/python_sandbox.yaml"
    assert Path(multi_turn.tool_config_path).is_file()
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent"


def test_countdown_inherits_table_4_from_math_and_changes_only_the_data():
    tasks = load_tasks()
    assert tasks["countdown"].paper == tasks["math"].paper
    assert tasks["countdown"].spec["data"]["train"] == ["countdown/train"]


def test_each_tasks_benchmarks_and_stand_ins_name_real_ones_and_a_cpu_stand_in_builds_offline():
    from vcpo.data import DATASETS
    from vcpo.sim.tasks import SIM_TASKS

    benchmarks = read_yaml(REPO / "recipes" / "benchmarks.yaml")["benchmarks"]
    tasks = load_tasks()
    for name, task in tasks.items():
        assert set(task.benchmarks) <= set(benchmarks), name
        assert task.stand_in("sim") in SIM_TASKS, name
        if "verl_cpu" in task.spec["stand_in"]:
            cpu = tasks[task.stand_in("verl_cpu")]
            assert all(DATASETS[split.split("/")[0]].hub_id is None for split in cpu.spec["data"]["train"]), name
    with pytest.raises(ValueError, match="task 'simpletir' has no verl_cpu stand-in"):
        tasks["simpletir"].stand_in("verl_cpu")


def test_sync_is_the_colocated_synchronous_trainer_on_all_gpus():
    run, config = resolved("gsm8k", "sync")
    assert run.lag == 0 and config.trainer.v1.trainer_mode == "sync"
    assert config.trainer.n_gpus_per_node == 6 + 2 and config.actor_rollout_ref.hybrid_engine is True


def test_a_lag_sweep_changes_only_the_lag_keys():
    base = overrides(make_run("math", "seq_tis_c8", 10))
    swept = overrides(make_run("math", "seq_tis_c8", 4))
    changed = sorted({a.split("=")[0] for a, b in zip(base, swept, strict=True) if a != b})
    assert changed == [
        "trainer.default_local_dir",
        "trainer.experiment_name",
        "trainer.v1.sampler.max_off_policy_threshold",
        "trainer.v1.separate_async.num_warmup_batches",
    ]


@pytest.mark.parametrize(
    ("task", "method", "rho_on"),
    [("simpletir", "vcpo", 0.55), ("math", "vcpo", 1.0), ("gsm8k", "tis_ess", 1.0), ("gsm8k", "tis_opob", None)],
)
def test_ess_and_opob_methods_select_the_engine(task, method, rho_on):
    run, config = resolved(task, method)
    actor = config.actor_rollout_ref.actor
    assert config.actor_rollout_ref.model.model_type == "vcpo_language_model" and actor.strategy == "fsdp2"
    assert actor.policy_loss.get("rho_on") == rho_on  # Table 5: 0.55 multi-turn, else the preset's 1.0
    # OPOB trains in verl's default mixed precision, in the preset's dtype, as every other method
    assert "mixed_precision" not in actor.fsdp_config and actor.fsdp_config.dtype == "bfloat16"
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES == "vcpo.verl_plugin.engine"
    assert run_environment(run)["VERL_USE_EXTERNAL_MODULES"] == "vcpo.verl_plugin.engine"


def test_methods_without_ess_or_opob_run_verls_own_engine():
    run, config = resolved("gsm8k", "seq_tis_c8")
    assert "model_type" not in config.actor_rollout_ref.model and "VERL_USE_EXTERNAL_MODULES" not in run_environment(run)
    assert config.actor_rollout_ref.actor.fsdp_config.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("method", "key", "value"),
    [
        ("low_lr", "actor_rollout_ref.actor.optim.lr", 1e-7),
        ("fp16", "actor_rollout_ref.actor.fsdp_config.dtype", "float16"),
        ("fp16", "actor_rollout_ref.rollout.dtype", "float16"),
        ("kl_in_reward", "algorithm.use_kl_in_reward", True),
        ("kl_in_reward", "algorithm.kl_ctrl.kl_coef", 0.001),
        ("gspo", "actor_rollout_ref.actor.policy_loss.loss_mode", "gspo"),
        ("gspo", "actor_rollout_ref.actor.clip_ratio_low", 3e-4),
        ("grpo", "actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
        ("otb", "algorithm.adv_estimator", "optimal_token_baseline"),
        ("seq_mis_c2", "actor_rollout_ref.actor.policy_loss.method", "seq_mis_c2"),
        ("p3o_two_anchor", "algorithm.rollout_correction.bypass_mode", False),
        ("p3o_two_anchor", "algorithm.rollout_correction.rollout_is", "token"),
    ],
)
def test_method_presets_reach_verls_keys(method, key, value):
    _, config = resolved("gsm8k", method)
    got = OmegaConf.select(config, key)
    assert got == (pytest.approx(value) if isinstance(value, float) else value)


@pytest.mark.slow
def test_every_task_method_pair_composes_and_instantiates_verls_dataclasses():
    for task in load_tasks():
        for method in list_methods():
            run, config = resolved(task, method.name)
            assert config.trainer.experiment_name == run.name


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--task", "nope", "--method", "vcpo"], "unknown task 'nope' (--task)"),
        (["--task", "gsm8k", "--method", "nope"], "unknown method 'nope'"),
        (["--task", "gsm8k", "--method", "sync", "--lag", "3"], "fixes the policy lag to 0"),
        (["--task", "math", "--method", "vcpo", "actor_rollout_ref.rollout.tensor_model_parallel_size=8"],
         "actor_rollout_ref.rollout.tensor_model_parallel_size=8 must divide the 4 rollout GPUs"),
        (["--task", "math", "--method", "vcpo", "data.train_batch_size=30"],
         "data.train_batch_size=30 is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size=32"),
        (["--task", "math", "--method", "vcpo", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
         "separate_async needs data.train_batch_size (32) = trainer.v1.separate_async.parameter_sync_step"),
        (["--task", "gsm8k", "--method", "sync", "actor_rollout_ref.rollout.n=3", "data.train_batch_size=3",
          "actor_rollout_ref.actor.ppo_mini_batch_size=3"],
         "must be divisible by the 8 data-parallel trainer GPUs"),
        (["--task", "math", "--method", "vcpo", "trainer.use_v1=false"], "legacy trainer replaces"),
        (["--task", "math", "--method", "vcpo", "no_such_key=1"], "verl's Hydra config rejects the overrides"),
        (["--task", "gsm8k", "--method", "vcpo", "actor_rollout_ref.actor.policy_loss.rho_on=-0.5"],
         "actor_rollout_ref.actor.policy_loss.rho_on: rho_on must be a positive finite number (an ESS ratio), got -0.5"),
    ],
)
def test_invalid_runs_fail_before_launch_naming_the_key(argv, message, capsys):
    assert main([*argv, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_launch_refuses_more_gpus_than_visible_and_missing_data(tmp_path, capsys):
    assert main(["--task", "math", "--method", "vcpo", "--gpus", "4", "--output-dir", str(tmp_path)]) == 2
    assert "the run needs 8 GPUs" in capsys.readouterr().err
    argv = ["--task", "math", "--method", "vcpo", "--gpus", "8", "--data-dir", str(tmp_path), "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"data.train_files: {tmp_path}/math/train.parquet" in err and "math500/test.parquet" in err
    assert not (tmp_path / "math").exists()  # nothing written before the checks pass


def launch_math(tmp_path, monkeypatch, *extra: str, method: str = "vcpo") -> tuple[int, list]:
    """``python -m vcpo.launch`` of math into ``tmp_path`` (empty data files, verl not started): its exit code and the
    commands it would have started."""
    import vcpo.launch.__main__ as launcher

    for split in ("math/train", "math500/test", "math/test"):
        (tmp_path / split).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f"{split}.parquet").write_bytes(b"")
    started = []
    monkeypatch.setattr(launcher.subprocess, "call", lambda command, env: started.append(command) or 0)
    monkeypatch.setattr(launcher, "check_gpu_packages", lambda config: None)  # this machine has no flash-attn
    # a 7B actor on 2 trainer GPUs needs more than an H100's memory (vcpo.launch.memory): an H200's
    argv = ["--task", "math", "--method", method, "--gpus", "8", "--data-dir", str(tmp_path), "--output-dir", str(tmp_path),
            "--gpu-memory-gb", "141", *extra]
    return main(argv), started


@pytest.mark.parametrize(("method", "overrides", "gpus"), [("vcpo", [], 8), ("sync", [], 8), ("vcpo", ["trainer.n_gpus_per_node=2"], 6)])
def test_a_launch_records_the_gpus_of_the_config_it_started(tmp_path, monkeypatch, method, overrides, gpus):
    """launch.json's ``gpus`` (what the tables cost runs by) is the launched config's layout, user
    overrides included; the workflow's resource is the recipe's layout."""
    code, started = launch_math(tmp_path, monkeypatch, *(["--", *overrides] if overrides else []), method=method)
    assert code == 0 and len(started) == 1
    lag = 0 if method == "sync" else 10
    launch = json.loads((tmp_path / "math" / method / f"lag{lag}" / "seed0" / "launch.json").read_text())
    assert launch["gpus"] == gpus and launch["command"] == started[0]
    assert make_run("math", method).gpus == 8


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` but its lock, by path: what a refused launch must leave as it was."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file() and path.name != ".lock"}


def test_a_launch_into_a_folder_that_holds_a_run_resumes_it_or_is_refused(tmp_path, monkeypatch, capsys):
    """The same launch again is verl's to resume (the paper recipes resume); the run launched with other settings, a
    folder whose run has no readable launch record, or one another launch holds, is refused in one line with nothing
    written, unless --overwrite, which starts over without the earlier run's metrics and checkpoints."""
    from vcpo.locks import run_folder_lock

    folder = tmp_path / "math" / "vcpo" / "lag10" / "seed0"
    code, started = launch_math(tmp_path, monkeypatch)
    assert code == 0 and len(started) == 1
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "checkpoints" / "global_step_1").mkdir(parents=True)
    (folder / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    assert launch_math(tmp_path, monkeypatch) == (0, started)  # resumed

    def refused(*extra: str) -> str:
        before = folder_files(folder)
        code, started = launch_math(tmp_path, monkeypatch, *extra)
        error = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[validate_config]")]
        assert code == 2 and started == [] and len(error) == 1 and folder_files(folder) == before, error
        return error[0]

    other = "trainer.total_training_steps=50"
    assert refused(other) == (f"error: {folder} holds this run launched with other settings: pass --overwrite to remove "
                              "its launch.json, metrics.jsonl, checkpoints and start over, or use another folder")
    with run_folder_lock(folder):
        assert refused().startswith(f"error: {folder} is in use by process {os.getpid()} on ")
    code, started = launch_math(tmp_path, monkeypatch, "--overwrite", other)
    assert code == 0 and started[0][-1] == other and json.loads((folder / "launch.json").read_text())["command"] == started[0]
    assert not (folder / "metrics.jsonl").exists() and not (folder / "checkpoints").exists()
    (folder / "launch.json").write_text("{")  # cut short
    assert "holds a run without a readable launch record: pass --overwrite to remove its launch.json " in refused(other)


def test_dry_run_prints_the_exact_command(capsys):
    assert main(["--task", "gsm8k", "--method", "vcpo", "--seed", "1", "--dry-run"]) == 0
    printed = capsys.readouterr().out.replace(str(REPO), "<repo>")
    snapshot = SNAPSHOTS / "launch_gsm8k_vcpo_seed1.txt"
    assert printed == snapshot.read_text(), f"dry-run output changed; if intended, rewrite {snapshot}"


def test_show_config_is_verls_resolved_yaml(capsys):
    assert main(["--task", "countdown", "--method", "seq_tis_c2", "--show-config"]) == 0
    config = OmegaConf.create(capsys.readouterr().out)
    assert config.actor_rollout_ref.actor.policy_loss.method == "seq_tis_c2"
    assert config.data.train_files == ["data/countdown/train.parquet"]
    assert config.trainer.default_local_dir == "results/verl/countdown/seq_tis_c2/lag10/seed0/checkpoints"


def test_both_backends_train_with_the_same_table_2():
    """The verl run's composed optimizer settings and the simulator's defaults are the same values."""
    from vcpo.sim.config import SimConfig

    optim = dict(item.split("=", 1) for item in overrides(make_run("gsm8k", "vcpo")) if "actor.optim." in item)
    prefix = "actor_rollout_ref.actor.optim."
    sim = SimConfig()
    assert float(optim[prefix + "weight_decay"]) == sim.weight_decay == 0.1
    assert [float(b) for b in optim[prefix + "betas"].strip("[]").split(",")] == list(sim.betas) == [0.9, 0.999]
    assert float(optim[prefix + "clip_grad"]) == sim.grad_clip == 1.0
    assert float(optim[prefix + "override_optimizer_config"].split(":")[1].strip(" }")) == sim.eps == 1e-8


def test_a_wsd_decay_phase_is_refused(monkeypatch):
    run = make_run("gsm8k", "vcpo")
    monkeypatch.setitem(run.task.spec["paper"], "lr_decay_steps", 10)
    with pytest.raises(LaunchError, match="paper.lr_decay_steps=10"):
        overrides(run)


@pytest.mark.parametrize(
    "override, named",
    [
        ("actor_rollout_ref.model.model_type=null", "+actor_rollout_ref.model.model_type=vcpo_language_model (got None)"),
        ("actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.strategy=fsdp2 (got fsdp)"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=geo_tis", "loss_mode=seq_tis (got geo_tis)"),
        ("actor_rollout_ref.actor.loss_agg_mode=token-mean", "loss_agg_mode=seq-mean-token-mean (got token-mean)"),
    ],
)
def test_the_engine_is_rechecked_after_the_users_overrides(override, named):
    run = make_run("math", "vcpo")
    config = compose(run, [override])
    with pytest.raises(LaunchError, match="needs the vcpo engine") as error:
        check(run, config, check_paths=False)
    assert named in str(error.value)


def test_a_method_without_the_engine_needs_none_of_it():
    run = make_run("math", "seq_tis_c8")
    check(run, compose(run, ["actor_rollout_ref.actor.strategy=fsdp"]), check_paths=False)


def test_a_lag_the_run_cannot_reach_is_refused():
    with pytest.raises(LaunchError, match=r"--lag: a lag of 100000 cannot be reached in a run of 400 steps .* \(task 'math'\)"):
        make_run("math", "vcpo", 100000)
    shorter = make_run("math", "vcpo", 12)
    with pytest.raises(LaunchError, match=r"num_warmup_batches=12 \(the lag k\) exceeds trainer.total_training_steps=10"):
        check(shorter, compose(shorter, ["trainer.total_training_steps=10"]), check_paths=False)


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor_rollout_ref.actor.policy_loss.loss_mode=seq_tiss", "loss_mode='seq_tiss' is not a registered policy loss"),
        ("actor_rollout_ref.actor.optim.lr=abc", "actor_rollout_ref.actor.optim.lr='abc' must be a finite number > 0"),
        ("actor_rollout_ref.actor.optim.weight_decay=-0.1", "optim.weight_decay=-0.1 must be a finite number >= 0"),
    ],
)
def test_the_users_overrides_are_checked_beyond_hydra(override, message):
    run = make_run("gsm8k", "seq_tis_c8")
    with pytest.raises(LaunchError, match=re.escape(message)):
        check(run, compose(run, [override]), check_paths=False)


@pytest.mark.parametrize("method", [m.name for m in list_methods() if step_rule(m).active])
def test_the_dry_run_admits_fsdp1_for_the_ess_step_size_only(method, capsys):
    """One rule (StepRule.strategies), read by the engine and by the launcher's check: OPOB needs FSDP2, the
    ESS step size runs on either."""
    code = main(["--task", "math", "--method", method, "--dry-run", "--", "actor_rollout_ref.actor.strategy=fsdp"])
    error = capsys.readouterr().err
    if step_rule(method).opob:
        assert code == 2 and "actor_rollout_ref.actor.strategy=fsdp2 (got fsdp)" in error
    else:
        assert code == 0, error


def test_a_composition_is_read_back_from_the_cache_equal_and_keyed_by_overrides_and_verls_files(tmp_path, monkeypatch):
    import shutil

    import vcpo.launch as launch
    import vcpo.launch.composition

    monkeypatch.setenv("VCPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(vcpo.launch.composition, "verl_config_dir", lambda: tmp_path / "verl")
    shutil.copytree(_verl_configs(), tmp_path / "verl")
    run = launch.make_run("countdown", "vcpo", 10, 0, "/data", "/out")
    composed = launch.compose(run)
    assert len(list((tmp_path / "cache" / "verl-configs").iterdir())) == 1
    cached = launch.compose(run)
    assert cached == composed and OmegaConf.is_struct(cached) and OmegaConf.to_yaml(cached) == OmegaConf.to_yaml(composed)
    with pytest.raises(Exception, match="nonesuch"):
        cached.actor_rollout_ref.nonesuch  # struct mode, as Hydra returns it
    [entry] = (tmp_path / "cache" / "verl-configs").iterdir()
    entry.write_text(entry.read_text()[:100])  # a truncated entry: composed again and rewritten whole
    assert launch.compose(run) == composed and json.loads(entry.read_text())
    assert launch.compose(run, ["actor_rollout_ref.actor.optim.lr=3e-6"]).actor_rollout_ref.actor.optim.lr == 3e-6
    before = launch.composed_cache_file(launch.overrides(run))
    (tmp_path / "verl" / "ppo_trainer.yaml").write_text((tmp_path / "verl" / "ppo_trainer.yaml").read_text() + "\n")
    launch.verl_configs_fingerprint.cache_clear()  # read once per process
    assert launch.composed_cache_file(launch.overrides(run)) != before  # verl's files changed: composed anew


def _verl_configs() -> Path:
    import verl

    return Path(verl.__file__).parent / "trainer" / "config"


@pytest.mark.parametrize("task", ["gsm8k", "math", "simpletir"])
def test_the_megatron_strategy_composes_verls_megatron_trainer_with_the_authors_layout(task, capsys):
    """`-- actor_rollout_ref.actor.strategy=megatron`: verl's Megatron trainer config, the task's layout from
    recipes/megatron.yaml (the authors' scripts) for actor and reference, Table 2's Adam constants where
    verl's Megatron optimizer takes them, bf16 on the Megatron engine (tis_ess: the vcpo engine without OPOB)."""
    assert main(["--task", task, "--method", "tis_ess", "--dry-run", "--", "actor_rollout_ref.actor.strategy=megatron"]) == 0
    printed = capsys.readouterr().out
    assert "python -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer" in printed
    layout = read_yaml(REPO / "recipes/megatron.yaml")["tasks"][task]["layout"]
    run = make_run(task, "tis_ess", strategy="megatron")
    config = compose(run)
    check(run, config, check_paths=False)
    for role in ("actor", "ref"):
        megatron = config.actor_rollout_ref[role].megatron
        assert {key: megatron[key] for key in layout} == layout
    assert config.actor_rollout_ref.actor.strategy == "megatron" and config.actor_rollout_ref.actor.megatron.dtype == "bfloat16"
    assert "transformer_impl" not in config.actor_rollout_ref.actor.megatron.override_transformer_config  # Transformer Engine's
    adam = config.actor_rollout_ref.actor.optim.override_optimizer_config
    sim = __import__("vcpo.sim.config", fromlist=["SimConfig"]).SimConfig()
    assert (adam.adam_beta1, adam.adam_beta2, adam.adam_eps) == (*sim.betas, sim.eps)
    assert config.actor_rollout_ref.ref.megatron.param_offload is True


@pytest.mark.parametrize("task", ["gsm8k", "math", "countdown", "simpletir"])
def test_opob_on_megatron_composes_megatrons_local_layers_over_the_authors_parallel_sizes(task, capsys):
    """A method with OPOB on Megatron: the task's TP/PP/CP, megatron's local layer spec (mbridge), the padded layout,
    no sequence parallelism (the torch norms refuse it; mbridge's own default turned off too), attention recomputed in
    the backward, one sequence per micro-batch; nothing the engine refuses; the dry run says what it costs."""
    from vcpo.launch import megatron_setup
    from vcpo.recipes import read_yaml
    from vcpo.verl_contract import megatron_opob_refusals

    layout = read_yaml(REPO / "recipes/megatron.yaml")["tasks"][task]["layout"]
    run = make_run(task, "vcpo", strategy="megatron")
    config = compose(run)
    # SimpleTIR's 14,336-token sequences project above its B200's 180 GB, which the dry run refuses naming what fits
    # (tests/test_opob_memory.py); here its composition is checked on a larger GPU
    memory = 240.0 if task == "simpletir" else None
    check(run, config, check_paths=False, gpu_memory=memory)
    actor, ref = config.actor_rollout_ref.actor, config.actor_rollout_ref.ref
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        assert actor.megatron[key] == ref.megatron[key] == layout[key]
    transformer = actor.megatron.override_transformer_config
    assert (transformer.transformer_impl, transformer.sequence_parallel, transformer.recompute_granularity) == ("local", False, "selective")
    assert transformer.masked_softmax_fusion is False  # its kernel is apex's or Megatron-LM's, not megatron-core's
    assert ref.megatron.pad_bshd_to_minibatch_max is False
    assert (actor.megatron.sequence_parallel, ref.megatron.sequence_parallel, config.actor_rollout_ref.model.use_remove_padding) == (False,) * 3
    assert (actor.megatron.use_mbridge, actor.megatron.vanilla_mbridge) == (True, True)
    assert (actor.use_dynamic_bsz, actor.ppo_micro_batch_size_per_gpu) == (False, 1)
    assert megatron_opob_refusals(megatron_setup(config)) == []
    larger = ["--gpu-memory-gb", str(memory)] if memory else []
    assert main(["--task", task, "--method", "vcpo", "--dry-run", *larger, "--", "actor_rollout_ref.actor.strategy=megatron"]) == 0
    printed = capsys.readouterr().out
    assert "no sequence parallelism, local attention, recomputed in the backward" in printed
    assert re.search(r"# megatron's local layers .* \d\.\d\dx the matmul FLOPs of fused attention", printed)


MEGATRON = "actor_rollout_ref.actor.megatron"


@pytest.mark.parametrize(
    "overrides, named",
    [
        # what megatron itself would refuse, for every method (tis_ess: no OPOB)
        ([f"{MEGATRON}.tensor_model_parallel_size=8"], f"{MEGATRON}.tensor_model_parallel_size x pipeline_model_parallel_size"),
        (["trainer.n_gpus_per_node=8", f"{MEGATRON}.tensor_model_parallel_size=8"],
         f"{MEGATRON}.tensor_model_parallel_size=8 must divide the model's 28 attention heads and 4 key/value heads"),
        (["trainer.n_gpus_per_node=32", f"{MEGATRON}.tensor_model_parallel_size=1", f"{MEGATRON}.pipeline_model_parallel_size=32"],
         f"{MEGATRON}.pipeline_model_parallel_size=32 exceeds the model's 28 layers"),
        ([f"{MEGATRON}.expert_model_parallel_size=2"], f"{MEGATRON}.expert_model_parallel_size=2 on a dense model"),
    ],
)
def test_a_megatron_layout_that_cannot_fit_is_refused_at_dry_run(overrides, named, capsys):
    for method in ("tis_ess", "vcpo"):
        assert main(["--task", "math", "--method", method, "--dry-run", "--", "actor_rollout_ref.actor.strategy=megatron", *overrides]) == 2
        assert named in capsys.readouterr().err


# every setting OPOB on Megatron cannot run with (vcpo.verl_contract.megatron_opob_refusals), the override that asks for
# it, and the key the one-line refusal names with what to set instead
OPOB_MEGATRON_REFUSALS = [
    (["actor_rollout_ref.model.use_remove_padding=true"], "actor_rollout_ref.model.use_remove_padding=false"),
    ([f"++{MEGATRON}.override_transformer_config.transformer_impl=transformer_engine"],
     f"++{MEGATRON}.override_transformer_config.transformer_impl=local"),
    ([f"{MEGATRON}.vanilla_mbridge=false"], f"{MEGATRON}.vanilla_mbridge=true"),
    ([f"++{MEGATRON}.override_transformer_config.sequence_parallel=true"], f"++{MEGATRON}.override_transformer_config.sequence_parallel=false"),
    (["actor_rollout_ref.model.use_fused_kernels=true"], "actor_rollout_ref.model.use_fused_kernels=false"),
    (["trainer.n_gpus_per_node=8", f"{MEGATRON}.pipeline_model_parallel_size=2", f"{MEGATRON}.virtual_pipeline_model_parallel_size=2"],
     f"{MEGATRON}.virtual_pipeline_model_parallel_size=null"),
    (["trainer.n_gpus_per_node=8", f"{MEGATRON}.context_parallel_size=2"], f"{MEGATRON}.context_parallel_size=1"),
    ([f"++{MEGATRON}.override_transformer_config.calculate_per_token_loss=true"],
     f"++{MEGATRON}.override_transformer_config.calculate_per_token_loss=false"),
    ([f"++{MEGATRON}.override_ddp_config.overlap_grad_reduce=true"], f"++{MEGATRON}.override_ddp_config.overlap_grad_reduce=false"),
    ([f"{MEGATRON}.dtype=float16"], f"{MEGATRON}.dtype=bfloat16"),
    (["trainer.n_gpus_per_node=8", f"{MEGATRON}.pipeline_model_parallel_size=2",
      f"++{MEGATRON}.override_transformer_config.recompute_granularity=full"],
     f"++{MEGATRON}.override_transformer_config.recompute_granularity=selective"),
]


@pytest.mark.parametrize("overrides, named", OPOB_MEGATRON_REFUSALS, ids=[named.rpartition(".")[2] for _, named in OPOB_MEGATRON_REFUSALS])
def test_what_opob_on_megatron_cannot_run_is_refused_at_dry_run_by_its_key(overrides, named, capsys):
    argv = ["--task", "math", "--dry-run", "--", "actor_rollout_ref.actor.strategy=megatron", *overrides]
    assert main(["--method", "vcpo", *argv]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: OPOB ('vcpo') on Megatron cannot run with this config; set ") and named in error
    assert len(error.strip().splitlines()) == 1
    main(["--method", "tis_ess", *argv])  # the ESS step size alone is not OPOB's to refuse
    assert "OPOB" not in capsys.readouterr().err


def test_the_refusals_are_the_engines_own():
    """The launcher's dry run and the engine's first OPOB step judge one MegatronSetup by one function; every rule of
    it is walked above."""
    from vcpo.verl_contract import MegatronSetup, megatron_opob_refusals

    runs = MegatronSetup(packed=False, fused_kernels=False, transformer_impl="local", vanilla_mbridge=True, sequence_parallel=False,
                         virtual_pipeline=None, context_parallel=1, pipeline_parallel=2, per_token_loss=False,
                         overlap_grad_reduce=False, dtype="bfloat16", recompute_granularity="selective")
    assert megatron_opob_refusals(runs) == []
    fields = {"packed": True, "fused_kernels": True, "transformer_impl": "transformer_engine", "vanilla_mbridge": False,
              "sequence_parallel": True, "virtual_pipeline": 2, "context_parallel": 2, "per_token_loss": True,
              "overlap_grad_reduce": True, "dtype": "float16", "recompute_granularity": "full"}
    assert len(fields) == len(OPOB_MEGATRON_REFUSALS)
    for name, value in fields.items():
        assert len(megatron_opob_refusals(dataclasses.replace(runs, **{name: value}))) == 1, name
    assert megatron_opob_refusals(dataclasses.replace(runs, recompute_granularity="full", pipeline_parallel=1)) == []
    # a selective recompute reruns watched layers too, unless it is core attention's alone (megatron's default list)
    assert len(megatron_opob_refusals(dataclasses.replace(runs, recompute_modules=("core_attn", "mlp")))) == 1
    assert megatron_opob_refusals(dataclasses.replace(runs, recompute_modules=("core_attn",))) == []


def test_a_strategy_the_launcher_does_not_compose_is_refused():
    with pytest.raises(LaunchError, match=r"actor_rollout_ref.actor.strategy=veomni: vcpo.launch composes fsdp2\|fsdp\|megatron"):
        make_run("math", "vcpo", strategy="veomni")


@pytest.mark.parametrize(("override", "shown"), [
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=-1", "-1"),
    ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=0", "0"),
    ("actor_rollout_ref.actor.megatron.context_parallel_size=0", "0"),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=abc", "'abc'"),
    ("data.train_batch_size=abc", "'abc'"),
    ("actor_rollout_ref.rollout.n=0", "0"),
])
def test_a_layout_or_batch_integer_below_one_is_refused_naming_its_key(override, shown, capsys):
    """Every integer of the layout and batch is checked before anything is computed from it: a negative TP once
    projected negative memory (rc 0) and a zero PP divided by zero; now one line naming the key, exit 2."""
    code = main(["--task", "math", "--method", "vcpo", "--dry-run", "--", "actor_rollout_ref.actor.strategy=megatron",
                 override])
    key = override.split("=")[0]
    assert code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {key}={shown}: must be a positive integer")


@pytest.mark.parametrize("size", ["tensor_model_parallel_size=-1", "pipeline_model_parallel_size=-2"])
def test_a_real_launch_of_a_negative_layout_writes_nothing_and_starts_nothing(tmp_path, monkeypatch, capsys, size):
    """A TP of -1 once wrote launch.json and reached verl with --gpus 8: refused before the run folder is made."""
    code, started = launch_math(tmp_path, monkeypatch, "--", "actor_rollout_ref.actor.strategy=megatron",
                                f"actor_rollout_ref.actor.megatron.{size}")
    assert (code, started) == (2, []) and not list(tmp_path.rglob("launch.json"))
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: actor_rollout_ref.actor.megatron.{size}: must be a positive integer")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "abc"])
def test_a_gpu_memory_or_gpu_count_that_is_not_above_zero_is_refused(value, capsys):
    for option in ("--gpu-memory-gb", "--gpus"):
        with pytest.raises(SystemExit) as stopped:
            main(["--task", "math", "--method", "vcpo", "--dry-run", option, value])
        assert stopped.value.code == 2 and option in capsys.readouterr().err


@pytest.mark.parametrize(("lag", "override", "message"), [
    (12, "trainer.v1.sampler.max_off_policy_threshold=4", "max_off_policy_threshold=4, but the run's lag is 12"),
    (12, "trainer.v1.separate_async.num_warmup_batches=2", "num_warmup_batches=2, but the run's lag is 12"),
    (0, "trainer.v1.trainer_mode=separate_async", "trainer_mode='separate_async', but the run's lag is 0"),
])
def test_the_lag_is_set_by_lag_alone_not_by_the_keys_it_sets(lag, override, message, capsys):
    """A run folder named lag<k> runs lag k: an override of a key the asynchrony mapping sets (the replay buffer's
    threshold once ran unchecked) is refused in one line naming it and --lag."""
    assert main(["--task", "math", "--method", "vcpo", "--lag", str(lag), "--dry-run", "--", override]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in line and "give the lag with --lag" in line


def test_a_users_added_key_that_is_a_typo_of_verls_is_refused_naming_the_key_it_resembles(capsys):
    """`+trainer.total_trainng_steps=10` once ran with rc 0 and the key unused (Hydra suggests `+` for a key it does
    not know); a new key unlike any beside it (`+ray_kwargs.ray_init.address`) is the user's to add."""
    argv = ["--task", "math", "--method", "vcpo", "--dry-run", "--"]
    assert main([*argv, "+trainer.total_trainng_steps=10"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: +trainer.total_trainng_steps: verl has no such key, but has trainer.total_training_steps (a '+' adds "
        "a new key, which verl would not read)")
    assert main([*argv, "+ray_kwargs.ray_init.address=local"]) == 0

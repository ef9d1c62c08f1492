"""verl 0.9.1's own PPO trainer, end to end on CPU, through ``vcpo.verl_plugin.cpu`` (no verl file patched).

The slow tests run ``python -m vcpo.launch.cpu`` (which runs ``python -m verl.trainer.main_ppo`` with
the recipe's Hydra overrides: Ray, TaskRunnerV1, the V1 trainer, FSDP2 on gloo, the ``hf`` rollout
replica, the agent loop, the reward loop, TransferQueue) on a tiny model, and check verl's own outputs:
the metrics its file logger wrote and the checkpoint it saved. The fast tests check the plugin pieces
directly: the CPU platform, the rollout server's log-probs and weight sync, and that verl's Hydra config
accepts every override of the recipe.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from vcpo.launch.console import VERL_LOG

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 480


# ----------------------------------------------------------------------------------------------- helpers
@contextmanager
def ray_cluster_slot(alone: bool = False) -> Iterator[None]:
    """Hold the test run's lock on Ray clusters, shared by the tiny model's runs and taken alone by the real model's.

    Each cluster starts some fifteen Ray workers of about 0.45 GB each; the real model's adds its 4.5 GB trainer, its
    weights in the checkpoint worker and the rollout server, and a 2 GiB object store. Beside a second cluster on the
    other pytest worker that passed Ray's kill threshold (95% of 24 GiB) in CI, which then killed both runs."""
    with open(Path(tempfile.gettempdir()) / "vcpo-tests-ray-cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield


def run_cpu_recipe(out: Path, *args: str, alone: bool = False, cwd: Path = REPO, first_step: int = 1) -> tuple[list[dict], str]:
    """Run the launcher in its own process group (with the Ray cluster to itself when ``alone``); returns (metrics
    per step, verl's own output). ``first_step``: the first step the launch trains (a resumed run's is after its
    checkpoint's)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "vcpo.launch.cpu", "--out", str(out), *args]
    with ray_cluster_slot(alone):
        proc = subprocess.Popen(
            command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher, verl's driver and the Ray cluster it started
            output, _ = proc.communicate()
            pytest.fail(f"verl CPU run exceeded {RUN_TIMEOUT_S}s; last output:\n{output[-6000:]}")
    (out / "run.log").write_text(output)
    assert proc.returncode == 0, f"verl CPU run failed (rc={proc.returncode}); last output:\n{output[-6000:]}"
    metrics_file = out / "metrics.jsonl"
    assert metrics_file.exists(), f"verl's file logger wrote no {metrics_file}"
    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    check_console(output, out, max(record["step"] for record in records), first_step)
    return records, (out / VERL_LOG).read_text()


def check_console(output: str, out: Path, steps: int, first_step: int = 1) -> None:
    """The launcher's terminal: one line per training step from ``first_step`` and the closing lines; verl's own output
    (its config, its workers' warnings, the platform fallback) only in main_ppo.log."""
    lines = output.splitlines()
    assert [line.split("/")[0] for line in lines if re.match(r"step +[1-9]", line)] == [
        f"step {step:>{len(str(steps))}}" for step in range(first_step, steps + 1)], output[-3000:]
    assert f"done: metrics {out / 'metrics.jsonl'}" in output and "last checkpoint: " in output
    assert "No supported accelerator" not in output and "'loss_mode'" not in output
    assert len(lines) < 40, output[-3000:]


def finite(record: dict, key: str) -> float:
    assert key in record["data"], f"step {record['step']}: metric {key!r} missing; has {sorted(record['data'])}"
    value = float(record["data"][key])
    assert math.isfinite(value), f"step {record['step']}: {key}={value}"
    return value


# Metrics only vcpo's losses emit (vcpo/core/ratios.py, vcpo/core/losses.py): verl's own losses and its
# "bypass_mode" loss (the one the legacy trainer substitutes) do not.
VCPO_LOSS_METRICS = ("actor/is_weight_mean", "actor/is_weight_max", "actor/is_weight_min", "actor/kept_token_frac")
STALENESS = "training/off_policy/trajectory_staleness/max"


def check_training_steps(records: list[dict], steps: int) -> None:
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for record in records:
        for key in ("actor/pg_loss", "actor/loss", "actor/grad_norm", "critic/score/mean", *VCPO_LOSS_METRICS):
            finite(record, key)
        assert finite(record, "actor/grad_norm") > 0, "the dense reward term should give a non-zero gradient"
        assert finite(record, "response_length/mean") > 0


def check_on_policy_log_probs(record: dict, tolerance: float = 1e-4) -> None:
    """Bypass mode: old_log_probs = rollout_log_probs, so on-policy weights are 1 up to float32 noise (the rollout's
    padded generate against the trainer's packed forward)."""
    for key in ("actor/is_weight_max", "actor/is_weight_min"):
        assert abs(finite(record, key) - 1.0) < tolerance, (record["step"], key, record["data"][key])


def check_checkpoint(out: Path, step: int) -> None:
    ckpt = out / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)
    actor = ckpt / f"global_step_{step}" / "actor"
    assert any(actor.glob("model_world_size_1_rank_0.pt")), sorted(p.name for p in actor.iterdir())
    assert (actor / "huggingface" / "config.json").exists()


# --------------------------------------- the end-to-end runs' checks (tests/test_reproduction.py runs them)
OPOB_METRICS = ("actor/opob_baseline", "actor/seq_grad_norm_mean", "actor/seq_grad_norm_max", "actor/seq_grad_norm_min")


def check_vcpo_lag1_run(records: list[dict], output: str, steps: int, on_policy_tolerance: float = 1e-4) -> None:
    """A vcpo run at lag 1 (PipelineRL-1 on ``separate_async``: a trainer worker and a standalone ``hf``
    rollout replica, weights synced through the object-store checkpoint engine after every step), run by
    verl's trainer with the vcpo engine: seq-TIS, OPOB in the backward, the ESS step size. ``output``: its log;
    ``on_policy_tolerance``: how far from 1 float32 noise may move an on-policy sequence weight."""
    check_training_steps(records, steps)
    assert "'loss_mode': 'seq_tis'" in output and "'model_type': 'vcpo_language_model'" in output
    staleness = [int(finite(r, STALENESS)) for r in records]
    assert staleness == [0] + [1] * (steps - 1), f"after the warm-up batch every step trains on lag-1 data: {staleness}"
    for record, lag in zip(records, staleness, strict=True):
        if lag == 0:  # bypass mode: old_log_probs = rollout log-probs, so on-policy weights are 1
            check_on_policy_log_probs(record, on_policy_tolerance)
        else:
            assert abs(finite(record, "actor/is_weight_mean") - 1.0) > on_policy_tolerance, record["data"]
        scale = finite(record, "actor/lr_scale")  # the ESS rule scaled this step's learning rate
        assert 0.0 < scale <= 1.0 + 1e-9
        assert math.isclose(finite(record, "actor/effective_lr"), scale * finite(record, "actor/lr"), rel_tol=1e-6)
        norms = [finite(record, key) for key in OPOB_METRICS[1:]]
        assert norms[2] <= norms[0] <= norms[1] and norms[1] > 0, norms  # OPOB's per-sequence gradient norms
        finite(record, OPOB_METRICS[0])
        assert finite(record, "actor/opob_packed") == 1.0  # on verl's packed (remove-padding) micro-batches
        assert finite(record, "actor/rollout_corr/seq_ess_ratio") <= 1.0 + 1e-9
    assert min(finite(r, "actor/lr_scale") for r in records[1:]) < 1.0


def check_sync_run(records: list[dict], steps: int) -> None:
    """A sync run (lag 0: verl's V1 ``sync`` trainer, colocated), seq-TIS c = 8: on-policy every step."""
    check_training_steps(records, steps)
    for record in records:
        assert int(finite(record, STALENESS)) == 0
        check_on_policy_log_probs(record)


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_from_it_with_its_optimizer_by_the_same_command(tmp_path):
    """A 2-step vcpo run at lag 1 with --keep-optimizer, cut back to its step-1 checkpoint (as if killed before the
    second was saved), launched again by the same command: verl trains step 2 alone (the console prints it alone), from
    step 1's Adam state (the saved state has taken 2 steps: a fresh optimizer's would have taken 1), and
    metrics.jsonl keeps the first launch's step 1 beside the relaunch's step 2."""
    import torch

    out = tmp_path / "run"
    args = ("--method", "vcpo", "--lag", "1", "--steps", "2", "--save-every", "1", "--keep-optimizer")
    first, output = run_cpu_recipe(out, *args)
    check_vcpo_lag1_run(first, output, 2)
    checkpoints = out / "checkpoints"
    shutil.rmtree(checkpoints / "global_step_2")
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("1")
    resumed, _ = run_cpu_recipe(out, *args, first_step=2)
    assert "verl resumes this run from its checkpoint of step 1 " in (out / "run.log").read_text()
    assert [record["step"] for record in resumed] == [1, 2] and resumed[0] == first[0]
    check_training_steps(resumed, 2)
    assert int(finite(resumed[1], STALENESS)) == 1
    check_checkpoint(out, 2)
    [optimizer_file] = (checkpoints / "global_step_2" / "actor").glob("optim_world_size_1_rank_0.pt")
    adam = torch.load(optimizer_file, weights_only=False)["state"]
    assert {float(state["step"]) for state in adam.values()} == {2.0}


# ------------------------------------------------------------------------------------------------- fast
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from vcpo.local_models import save_random_model

    return save_random_model(tmp_path_factory.mktemp("tiny") / "model")


def test_cpu_platform_answers_verls_device_questions():
    from vcpo.verl_plugin.cpu.platform import PlatformCPU

    platform = PlatformCPU()
    assert (platform.device_name, platform.communication_backend_name(), platform.ray_resource_name()) == (
        "cpu",
        "gloo",
        "GPU",
    )
    assert platform.current_device() == "cpu" and not platform.is_platform_available(use_smi_check=True)
    module = platform.device_module
    module.empty_cache(), module.synchronize(), module.set_device(0)
    free, total = module.mem_get_info()
    assert 0 < free <= total
    state = module.get_rng_state()
    module.set_rng_state(state)


def test_hf_server_log_probs_are_the_models_and_weight_sync_loads_tied_weights(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    from vcpo.verl_plugin.cpu.rollout import HFRolloutServer, RolloutMode

    config = {"prompt_length": 16, "response_length": 8, "dtype": "float32", "seed": 0}
    server = HFRolloutServer(config, {"local_path": str(tiny_model)}, RolloutMode.HYBRID)
    asyncio.run(server.launch_server())
    prompt = [5, 17, 42, 99]
    params = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "logprobs": True}
    out = asyncio.run(server.generate(prompt_ids=prompt, sampling_params=dict(params), request_id="r"))
    assert out.stop_reason == "completed" and 1 <= len(out.token_ids) <= 8 and len(out.log_probs) == len(out.token_ids)

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=1e-4, rtol=1e-4)

    # the trainer's per-tensor weights include the tied lm_head; after a sync the server samples from them
    other = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.01)
    named = list(other.state_dict().items())
    assert "lm_head.weight" in dict(named)
    assert server.update_weights(named, global_steps=7) == len(named)
    for name, tensor in other.state_dict().items():
        torch.testing.assert_close(server.model.state_dict()[name], tensor)
    out = asyncio.run(server.generate(prompt_ids=prompt, sampling_params=dict(params), request_id="r2"))
    assert out.extra_fields["global_steps"] == 7


def test_hf_server_abort_pauses_and_resume_reopens():
    from vcpo.verl_plugin.cpu.rollout import HFRolloutServer, RolloutMode

    async def scenario():
        server = HFRolloutServer({"prompt_length": 4, "response_length": 4}, {}, RolloutMode.HYBRID)
        result = await server.abort_all_requests(reject_request=True)
        rejected = await server.generate(prompt_ids=[1], sampling_params={}, request_id="x")
        await server.resume_generation()
        return result, rejected, server._submission_paused

    result, rejected, paused = asyncio.run(scenario())
    assert result["aborted_count"] == 0 and rejected.stop_reason == "aborted" and not paused


@pytest.mark.parametrize(("method", "lag", "mode"), [("vcpo", 1, "separate_async"), ("sync", None, "sync")])
def test_cpu_run_is_the_launch_run_with_cpu_sizes(tmp_path, capsys, method, lag, mode):
    from vcpo.launch.cpu import main
    from vcpo.verl_plugin.cpu.recipe import write_data

    paths = write_data(tmp_path / "data")
    argv = ["--out", str(tmp_path), "--method", method, "--model", "m", "--train", str(paths["train"])]
    argv += ["--val", str(paths["val"]), *(["--lag", str(lag)] if lag is not None else []), "--print"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    env, _, command = printed.partition(" /")
    assert "VERL_PLATFORM=cpu" in env and "VERL_USE_EXTERNAL_MODULES=vcpo.verl_plugin.cpu" in env
    assert f"trainer.v1.trainer_mode={mode}" in command and "actor_rollout_ref.rollout.name=hf" in command
    assert f"+actor_rollout_ref.actor.policy_loss.method={method}" in command
    if method == "vcpo":  # the engine is loaded after the CPU platform, in the driver and in every Ray worker
        assert "VERL_USE_EXTERNAL_MODULES=vcpo.verl_plugin.cpu,vcpo.verl_plugin.engine" in env
        assert "env_vars.VERL_USE_EXTERNAL_MODULES='\"'\"'vcpo.verl_plugin.cpu,vcpo.verl_plugin.engine" in command


def test_printing_the_command_writes_nothing(tmp_path, capsys):
    """--print with nothing given: the command names the random model and the prompts a run would write under --out,
    and neither they nor --out itself are written."""
    from vcpo.launch.cpu import main

    out = tmp_path / "run"
    assert main(["--out", str(out), "--method", "vcpo", "--print"]) == 0
    command = capsys.readouterr().out
    assert f"actor_rollout_ref.model.path={out / 'model'}" in command and f"{out / 'data' / 'train.parquet'}" in command
    assert not out.exists()


def test_the_real_model_trains_its_registered_task_by_default(tmp_path, capsys, monkeypatch):
    """--model smollm2-135m-instruct without --train / --val: the task, reward, lengths, group, temperature and
    validation of recipes/real_model_launch.yaml, each the last of its key in the command (so it is what verl
    reads); --save-every sets the checkpoint interval; with --print nothing is written."""
    import vcpo.launch.cpu as launcher
    from vcpo.recipes import read_yaml, recipes_dir

    monkeypatch.setattr(launcher, "packaged_model", lambda name, **_: tmp_path / "cache" / name)
    default = read_yaml(recipes_dir() / launcher.PRETRAINED_DEFAULT)
    out, training = tmp_path / "run", default["training"]
    argv = ["--out", str(out), "--model", "smollm2-135m-instruct", "--lag", "12", "--steps", "60", "--save-every", "20"]
    assert launcher.main([*argv, "--print"]) == 0
    words = shlex.split(capsys.readouterr().out)

    def last(key: str) -> str:
        return [word.split("=", 1)[1] for word in words if word.startswith(f"{key}=")][-1]

    folder = out / "data" / default["task"]
    assert last("data.train_files") == f"[{folder / 'train.parquet'}]"
    problems = training["validation"]["problems"]
    assert last("data.val_files") == f"[{folder / f'val_{problems}.parquet'}]"
    assert (last("actor_rollout_ref.rollout.temperature"), last("data.max_response_length")) == (
        str(training["temperature"]), str(training["max_response_length"]))
    assert (last("actor_rollout_ref.rollout.n"), last("data.train_batch_size")) == (
        str(training["responses_per_prompt"]), str(training["prompts_per_step"]))
    assert last("reward.reward_manager.name") == "EndAwareRewardManager"
    assert last("+reward.custom_reward_function.reward_kwargs.answer_format") == default["answer_format"]
    assert (last("trainer.test_freq"), last("trainer.save_freq")) == (str(training["validation"]["every"]), "20")
    assert not out.exists()


def test_printing_a_pretrained_models_command_fetches_nothing(tmp_path, capsys, monkeypatch):
    """--print with a pretrained model not in the (empty) model cache: the command names the folder the model would
    have, a note says it is not fetched yet, and nothing is downloaded or written."""
    import vcpo.local_models
    from vcpo.launch.cpu import main

    def no_download(*args, **kwargs):
        raise AssertionError("--print fetched the model")

    monkeypatch.setenv("VCPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(vcpo.local_models, "_build", no_download)
    out = tmp_path / "run"
    assert main(["--out", str(out), "--model", "smollm2-135m-instruct", "--print"]) == 0
    printed = capsys.readouterr()
    folder = tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    assert f"actor_rollout_ref.model.path={folder}" in shlex.split(printed.out)
    notes = [line for line in printed.err.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: smollm2-135m-instruct is not fetched yet: the command reads it from {folder}, where a launch "
                     "without --print fetches it (or `python -m vcpo.local_models fetch smollm2-135m-instruct`)"]
    assert not folder.exists() and not out.exists()


def test_the_real_models_run_is_named_and_recorded_by_the_task_that_trains(tmp_path, capsys, monkeypatch, tiny_model_dir):
    """--model smollm2-135m-instruct without --train / --val trains its registered task: launch.json's task and verl's
    experiment_name say so (the task recipe it launches with is recorded beside it); --task naming that task is taken,
    --task naming another is refused in one line with nothing written; a folder holding an earlier run's record (task
    gsm8k, no recipe) is read and named as another run."""
    import vcpo.launch.cpu as launcher
    from vcpo.recipes import read_yaml, recipes_dir

    registered = read_yaml(recipes_dir() / launcher.PRETRAINED_DEFAULT)["task"]
    monkeypatch.setattr(launcher, "packaged_model", lambda name, **_: tiny_model_dir)
    benchmarks = []
    monkeypatch.setattr(launcher, "run_quietly", lambda command, env, out, steps, benchmark: benchmarks.append(benchmark) or 0)
    out = tmp_path / "run"
    argv = ["--out", str(out), "--model", "smollm2-135m-instruct"]
    assert launcher.main(argv) == 0
    assert benchmarks == [registered]  # the closing lines' evaluation command: the benchmark of its held-out split
    record = json.loads((out / "launch.json").read_text())
    assert (record["task"], record["recipe"]) == (registered, "gsm8k")
    assert f"trainer.experiment_name={registered}-vcpo-lag1-seed0" in record["command"]
    assert launcher.main([*argv[:2], "--out", str(tmp_path / "named"), *argv[2:], "--task", registered, "--print"]) == 0
    capsys.readouterr()
    other = tmp_path / "other"
    assert launcher.main(["--out", str(other), "--model", "smollm2-135m-instruct", "--task", "countdown"]) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[validate_config]")]
    assert error == [f"error: --task countdown: smollm2-135m-instruct without --train / --val trains its registered task "
                     f"{registered} (recipes/{launcher.PRETRAINED_DEFAULT}); leave --task out, or give --train and --val"]
    assert not other.exists()
    earlier = {key: value for key, value in record.items() if key != "recipe"} | {"task": "gsm8k"}
    (out / "launch.json").write_text(json.dumps(earlier))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert launcher.main(argv) == 2
    assert f"{out} holds another run (gsm8k, vcpo at lag 1, seed 0)" in capsys.readouterr().err


def test_the_lag_studys_command_launches_its_task_recipe_with_its_own_prompts(tmp_path, capsys, monkeypatch):
    """The real model's lag study launches `--task gsm8k --model smollm2-135m-instruct --train ... --val ...` (its own
    prompts): that command still builds, and records the task recipe it names, as its earlier runs' launch.json do."""
    import vcpo.launch.cpu as launcher
    from vcpo.data import load_rows
    from vcpo.studies import real_model_lag as study

    monkeypatch.setattr(launcher, "packaged_model", lambda name, **_: tmp_path / "cache" / name)
    design, task = read_yaml_design(), "sums_2digit_brief"
    command, out = study.real_model_run_command("vcpo", 12, 100, {**design["training"], "max_response_length": 64,
                                                "temperature": 1.0}, task, "lenient", load_rows(task, "test")[:4],
                                                tmp_path / "run", tmp_path / "data")
    cut = command.index("--")
    assert command[command.index("--task") + 1] == "gsm8k"
    assert launcher.main([*command[3:cut], "--print", *command[cut:]]) == 0
    words = shlex.split(capsys.readouterr().out)
    assert "trainer.experiment_name=gsm8k-vcpo-lag12-seed100" in words
    assert f"data.train_files=[{tmp_path / 'data' / task / 'train.parquet'}]" in words


def read_yaml_design() -> dict:
    from vcpo.recipes import read_yaml, recipes_dir

    return read_yaml(recipes_dir() / "real_model_lag.yaml")


@pytest.mark.parametrize("keep", [False, True])
def test_checkpoints_keep_the_optimizers_state_and_resume_only_when_asked(tmp_path, capsys, keep):
    """Without --keep-optimizer the checkpoints hold the weights (sharded and Hugging Face) and no optimizer state, and
    verl does not resume from them; with it, the launcher's contents (optimizer included) and verl's resume."""
    from vcpo.launch.cpu import main
    from vcpo.recipes import read_yaml, recipes_dir

    argv = ["--out", str(tmp_path / "run"), "--method", "vcpo", "--print", *(["--keep-optimizer"] if keep else [])]
    assert main(argv) == 0
    words = shlex.split(capsys.readouterr().out)
    settings = {key: value for key, _, value in (word.partition("=") for word in words if "=" in word)}  # the last wins
    launcher = read_yaml(recipes_dir() / "verl.yaml")["chosen"]["actor_rollout_ref.actor.checkpoint.save_contents"]["value"]
    saved = settings["actor_rollout_ref.actor.checkpoint.save_contents"].strip("[]").split(",")
    assert "optimizer" in launcher and saved == (launcher if keep else [c for c in launcher if c != "optimizer"])
    assert settings.get("trainer.resume_mode", "auto") == ("auto" if keep else "disable")


def test_a_relaunch_resumes_only_a_run_verl_resumes_and_overwrite_starts_over(tmp_path, capsys, monkeypatch, tiny_model_dir):
    """A CPU run's folder: the same command again is refused while verl would start the run over (its checkpoints keep
    no optimizer state), another run or other settings always, in one line with nothing written; --overwrite starts over;
    a run with --keep-optimizer is resumed by the same command."""
    from test_launch import folder_files

    import vcpo.launch.cpu as launcher
    from vcpo.verl_plugin.cpu.recipe import write_data

    started = []
    monkeypatch.setattr(launcher, "run_quietly", lambda command, env, out, steps, **_: started.append(command) or 0)
    paths = write_data(tmp_path / "data")
    out = tmp_path / "run"
    argv = ["--out", str(out), "--model", str(tiny_model_dir), "--train", str(paths["train"]), "--val", str(paths["val"])]

    def refused(*extra: str) -> str:
        before, launched = folder_files(out), len(started)
        assert launcher.main([*argv, *extra]) == 2
        error = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[validate_config]")]
        assert len(error) == 1 and len(started) == launched and folder_files(out) == before, error
        return error[0]

    assert launcher.main(argv) == 0 and len(started) == 1
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert refused() == (f"error: {out} holds this run, which verl would start over (trainer.resume_mode=disable), not "
                         "resume: pass --overwrite to remove its launch.json, metrics.jsonl and start over, or use another folder")
    assert refused("--method", "sync").startswith(f"error: {out} holds another run (gsm8k, vcpo at lag 1, seed 0): pass ")
    assert f"{out} holds this run launched with other settings: " in refused("--keep-optimizer")
    assert launcher.main([*argv, "--keep-optimizer", "--overwrite"]) == 0 and not (out / "metrics.jsonl").exists()
    assert launcher.main([*argv, "--keep-optimizer"]) == 0 and len(started) == 3  # verl resumes it
    assert json.loads((out / "launch.json").read_text())["command"] == started[-1]


def test_a_resumed_run_keeps_the_metrics_of_the_steps_it_does_not_redo(tmp_path, capsys, monkeypatch, tiny_model_dir):
    """verl's file logger starts metrics.jsonl anew ("wb") when a relaunch resumes: the steps up to the checkpoint it
    resumes from are kept (a step after it, which the relaunch redoes, is the relaunch's), the relaunch's validation of
    the checkpoint's step is joined to that step's record, and its steps follow; while it runs the file holds the
    relaunch's records only (what the console prints)."""
    import vcpo.launch.cpu as launcher
    from vcpo.verl_plugin.cpu.recipe import write_data

    def line(step: int, **data: float) -> str:
        return json.dumps({"step": step, "data": data}) + "\n"

    seen_while_running = []

    def verl_resumes(command, env, out, steps, **_):
        seen_while_running.append((out / "metrics.jsonl").exists())
        with open(out / "metrics.jsonl", "wb") as handle:  # as verl's FileLogger
            handle.write((line(2, **{"val-core/x/acc/mean@1": 0.5}) + line(3, score=0.3) + line(4, score=0.4)).encode())
        return 0

    monkeypatch.setattr(launcher, "run_quietly", verl_resumes)
    paths = write_data(tmp_path / "data")
    out = tmp_path / "run"
    argv = ["--out", str(out), "--model", str(tiny_model_dir), "--train", str(paths["train"]), "--val", str(paths["val"]),
            "--keep-optimizer", "--steps", "4"]
    assert launcher.main(argv) == 0  # the first launch: its own records, nothing set aside
    first = line(1, score=0.1) + line(2, score=0.2) + line(3, score=0.25)
    (out / "metrics.jsonl").write_text(first)
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2\n")  # step 3 ran, its checkpoint did not
    capsys.readouterr()
    assert launcher.main(argv) == 0
    assert "verl resumes this run from its checkpoint of step 2 " in capsys.readouterr().out
    assert seen_while_running == [False, False]
    records = [json.loads(text) for text in (out / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "data": {"score": 0.1}}, {"step": 2, "data": {"val-core/x/acc/mean@1": 0.5, "score": 0.2}},
                       {"step": 3, "data": {"score": 0.3}}, {"step": 4, "data": {"score": 0.4}}]
    assert not (out / "metrics.resumed.jsonl").exists()


@pytest.mark.parametrize("ending", ["failed", "interrupted"])
def test_a_failed_or_interrupted_runs_checkpoints_say_their_weights_dtype(tmp_path, capsys, monkeypatch, tiny_model_dir,
                                                                         ending):
    """verl labels a checkpoint bfloat16 whatever its weights: the launcher relabels them however its run ends (a
    failure's exit code, Ctrl-C), and a checkpoint a kill cut short (a torn config) is left as it is without hiding
    how the run ended."""
    import torch
    from safetensors.torch import save_file

    import vcpo.launch.cpu as launcher
    from vcpo.verl_plugin.cpu.recipe import write_data

    def verl_saves_then_ends(command, env, out, steps, **_):
        for step, config in ((1, json.dumps({"model_type": "qwen2", "dtype": "bfloat16"})), (2, '{"model_ty')):
            weights = out / "checkpoints" / f"global_step_{step}" / "actor" / "huggingface"
            weights.mkdir(parents=True)
            save_file({"w": torch.zeros(2)}, weights / "model.safetensors")
            (weights / "config.json").write_text(config)
        if ending == "interrupted":
            raise KeyboardInterrupt
        return 1

    monkeypatch.setattr(launcher, "run_quietly", verl_saves_then_ends)
    paths = write_data(tmp_path / "data")
    out = tmp_path / "run"
    argv = ["--out", str(out), "--model", str(tiny_model_dir), "--train", str(paths["train"]), "--val", str(paths["val"])]
    if ending == "interrupted":
        with pytest.raises(KeyboardInterrupt):
            launcher.main(argv)
    else:
        assert launcher.main(argv) == 1
    checkpoint = out / "checkpoints" / "global_step_{}" / "actor" / "huggingface" / "config.json"
    assert json.loads(Path(str(checkpoint).format(1)).read_text())["dtype"] == "float32"
    assert Path(str(checkpoint).format(2)).read_text() == '{"model_ty'


def test_a_launch_builds_its_run_once_and_writes_its_model_and_prompts_once(tmp_path, capsys, monkeypatch):
    """One composition, one check (one line of verl's validate_config), and the random model and prompts written once,
    in the run folder, after which the files the run reads are checked: a --train that is not there is refused."""
    import vcpo.launch.cpu as launcher
    from vcpo.verl_plugin.cpu import recipe

    calls: dict[str, int] = {}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(launcher, "compose", counted("compose", launcher.compose))
    monkeypatch.setattr(launcher, "check", counted("check", launcher.check))
    monkeypatch.setattr(launcher, "write_random_model", counted("model", lambda folder: folder.mkdir(parents=True)))
    monkeypatch.setattr(recipe, "write_data", counted("prompts", recipe.write_data))
    benchmarks = []
    monkeypatch.setattr(launcher, "run_quietly", lambda command, env, out, steps, benchmark: benchmarks.append(benchmark) or 0)
    out = tmp_path / "run"
    assert launcher.main(["--out", str(out)]) == 0
    assert benchmarks == [None]  # a random model's prompts: no held-out benchmark for the closing lines to name
    printed = capsys.readouterr()
    assert calls == {"compose": 1, "check": 1, "model": 1, "prompts": 1}
    assert (printed.out + printed.err).count("[validate_config]") == 1
    assert (out / "model").is_dir() and (out / "data" / "train.parquet").exists() and (out / "launch.json").exists()
    argv = ["--out", str(tmp_path / "other"), "--train", str(tmp_path / "none.parquet"), "--val", str(tmp_path / "none.parquet")]
    assert launcher.main(argv) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[validate_config]")]
    assert error == [f"error: missing files (build data with `python -m vcpo.data build <task> --out DATA_DIR`): "
                     f"data.train_files: {tmp_path / 'none.parquet'}; data.val_files: {tmp_path / 'none.parquet'}"]
    assert not (tmp_path / "other" / "launch.json").exists()


def test_the_shaped_reward_adds_the_dense_term():
    from vcpo.verl_plugin.cpu.recipe import shaped_reward

    reward = shaped_reward("gsm8k", "#### 7", "7")
    assert reward["score"] == pytest.approx(1.0 + 0.1 * 1 / 6) and reward["acc"]


def readme_real_model_commands() -> list[list[str]]:
    """The README's four commands of the real model's path (fetch, train, evaluate, curves), as argument lists."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("A real pretrained model on CPU", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line.split("#", 1)[0]) for line in block.strip().splitlines()]
    assert [command[2] for command in commands] == ["vcpo.local_models", "vcpo.launch.cpu", "vcpo.evaluation",
                                                   "vcpo.reporting"], commands
    return commands


def smallest(command: list[str], **values: str) -> list[str]:
    """``command`` with each ``--key value`` of ``values`` replaced, or appended when it has none."""
    command = [sys.executable, *command[1:]]
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if flag in command:
            command[command.index(flag) + 1] = value
        else:
            command += [flag, value]
    return command


@pytest.mark.slow
def test_the_readmes_real_model_path_fetches_trains_evaluates_and_draws(tmp_path):
    """The README's real-model commands verbatim but for their sizes (2 steps at lag 1 without the held-out validation,
    2 problems x 1 sample): the model fetched (or found in the cache), verl's trainer runs VCPO on the registered task
    with the console's lines, the checkpoint it wrote says its weights' dtype and is what the evaluation loads, the
    evaluation's accuracy is the mean of its samples rescored by vcpo.rewards, and the curves are drawn."""
    from PIL import Image

    from vcpo.data import load_rows
    from vcpo.rewards import RESPONSE_ENDED, compute_score
    from vcpo.runs import verl_hf_checkpoint, weights_dtype

    fetch, train, evaluate, curves = readme_real_model_commands()
    subprocess.run([sys.executable, *fetch[1:]], cwd=tmp_path, check=True, timeout=600)
    run = tmp_path / train[train.index("--out") + 1]
    # the registered task's sparse reward may leave 2 steps' every advantage 0: no check here needs a gradient
    args = smallest(train, steps="2", lag="1")[3:]
    del args[args.index("--out") : args.index("--out") + 2]
    records, output = run_cpu_recipe(run, *args, "--", "trainer.val_before_train=false", "trainer.test_freq=-1",
                                     alone=True, cwd=tmp_path)
    assert [record["step"] for record in records] == [1, 2]
    assert [int(finite(record, STALENESS)) for record in records] == [0, 1]
    for record in records:
        for key in ("actor/lr_scale", "actor/rollout_corr/seq_ess_ratio", *VCPO_LOSS_METRICS, *OPOB_METRICS):
            finite(record, key)
    assert "'loss_mode': 'seq_tis'" in output and "'model_type': 'vcpo_language_model'" in output
    weights = verl_hf_checkpoint(run)
    assert weights == run / "checkpoints" / "global_step_2" / "actor" / "huggingface"
    config = json.loads((weights / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == weights_dtype(weights) == "float32"

    subprocess.run(smallest(evaluate, limit="2", n="1"), cwd=tmp_path, check=True, timeout=600)
    out = tmp_path / evaluate[evaluate.index("--out") + 1]
    benchmark = evaluate[evaluate.index("--benchmarks") + 1]
    summary = json.loads((out / "summary.json").read_text())
    assert (tmp_path / summary["model"]).resolve() == weights.resolve()
    result = summary["results"][benchmark]
    samples = [json.loads(line) for line in (out / benchmark / "samples.jsonl").read_text().splitlines()]
    assert result["num_problems"] == len(samples) == 2
    problems = load_rows(result["task"], result["split"])[:2]  # one sample each, in the problems' order
    rescored = [compute_score(problem["data_source"], sample["completion"], sample["ground_truth"],
                              {RESPONSE_ENDED: not sample["truncated"]}, answer_format=result["answer_format"])["acc"]
                for problem, sample in zip(problems, samples, strict=True)]
    assert result["mean_at_n"] == pytest.approx(sum(map(bool, rescored)) / 2)

    drawn = subprocess.run(smallest(curves), cwd=tmp_path, capture_output=True, text=True, check=True, timeout=300)
    image = Image.open(tmp_path / drawn.stdout.strip().splitlines()[-1]).convert("L")  # printed relative to its cwd
    assert image.size[0] > 1000 and len(set(image.getdata())) > 10  # a drawn figure, not a blank canvas


def test_sampled_tokens_follow_the_filtered_distribution_and_report_the_unfiltered_log_prob():
    """sample_next_tokens against a float64 reference: with top-k 3 and top-p 0.8 on known logits (one row where top-p
    drops the third of the top 3, one where it keeps two of them), tokens outside the kept set never come, kept ones come at their renormalised probabilities (within 4 standard errors over 40,000
    draws), and the log-prob returned is log softmax(logits / T) of the drawn token, before any truncation."""
    import torch

    from vcpo.verl_plugin.cpu.rollout import sample_next_tokens

    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0], [0.0, 3.0, 0.1, 0.2, 2.9, -5.0]])
    temperature, draws = 0.9, 40_000
    reference = torch.softmax(logits.double() / temperature, -1)
    expected = torch.zeros_like(reference)
    for row in range(2):  # top-k 3, then (as vLLM) top-p 0.8 of the top 3 renormalised: a token stays while the
        order = torch.argsort(reference[row], descending=True)[:3]  # tokens ranked above it hold no more than 0.8
        top = reference[row, order] / reference[row, order].sum()
        kept, held = [], 0.0
        for token, share in zip(order.tolist(), top.tolist(), strict=True):
            if held > 0.8:
                break
            kept.append(token)
            held += share
        expected[row, kept] = reference[row, kept] / reference[row, kept].sum()
    generator = torch.Generator().manual_seed(0)
    tokens, log_probs = sample_next_tokens(logits.repeat(draws // 2, 1), temperature, 3, 0.8, generator)
    for row in range(2):
        drawn = tokens[row::2]
        frequency = torch.bincount(drawn, minlength=6).double() / drawn.numel()
        error = (expected[row] * (1 - expected[row]) / drawn.numel()).sqrt()
        assert torch.all((frequency - expected[row]).abs() <= 4 * error + 1e-12), (row, frequency, expected[row])
        assert torch.all(frequency[expected[row] == 0] == 0)
        torch.testing.assert_close(log_probs[row::2].double(), reference[row].log()[drawn], atol=1e-5, rtol=0)
    greedy, greedy_log_probs = sample_next_tokens(logits, 0.0, -1, 1.0)
    assert greedy.tolist() == [0, 1]
    torch.testing.assert_close(greedy_log_probs.double(), torch.log_softmax(logits.double(), -1)[[0, 1], [0, 1]])


def test_concurrent_requests_decode_as_one_batch_with_each_alone_greedy_tokens(tiny_model_dir, monkeypatch):
    """Requests that arrive together (three prompts of different lengths, two responses each, as verl's agent loop
    sends a step's) decode as one left-padded batch that shares each prompt's prefill, and give every request the
    greedy tokens and log-probs it gets decoded alone (a batch of one)."""
    import torch

    from vcpo.verl_plugin.cpu.rollout import HFRolloutServer, RolloutMode

    prompts = [[5, 17, 42, 99, 7, 8], [11, 3], [60, 61, 62]]
    params = {"temperature": 0.0, "logprobs": True}

    def decode(max_batch: int):
        monkeypatch.setenv("VCPO_HF_ROLLOUT_MAX_BATCH", str(max_batch))
        server = HFRolloutServer({"prompt_length": 8, "response_length": 6, "dtype": "float32"}, {"local_path": str(tiny_model_dir)},
                                 RolloutMode.HYBRID)
        asyncio.run(server.launch_server())
        batches = []
        decode_batch = server._decode_batch
        server._decode_batch = lambda requests: batches.append(len(requests)) or decode_batch(requests)

        async def together():
            return await asyncio.gather(*[server.generate(prompt_ids=prompt, sampling_params=dict(params), request_id=f"{i}{j}")
                                          for i, prompt in enumerate(prompts) for j in range(2)])

        return asyncio.run(together()), batches

    batched, batch_sizes = decode(64)
    alone, alone_sizes = decode(1)
    assert batch_sizes == [6] and alone_sizes == [1] * 6
    for together, single in zip(batched, alone, strict=True):
        assert together.token_ids == single.token_ids and together.stop_reason == "completed"
        torch.testing.assert_close(torch.tensor(together.log_probs), torch.tensor(single.log_probs), atol=1e-4, rtol=0)
    assert batched[0].token_ids == batched[1].token_ids  # greedy: a prompt's two responses agree


def test_a_weight_sync_waits_for_every_submitted_training_prompt(monkeypatch):
    """HFReplica.abort_all_requests (what verl's checkpoint manager calls before a sync) returns only once verl's
    TransferQueue holds no pending or running training prompt, and then aborts as verl's replica does."""
    from vcpo.verl_plugin.cpu import rollout

    listings = iter([
        {"train": {"a": {"is_prompt": True, "status": "running", "global_steps": 3},
                   "b": {"is_prompt": True, "status": "pending", "global_steps": 4},
                   "a_0": {"status": "finished", "global_steps": 3}}},
        {"train": {"a": {"is_prompt": True, "status": "finished", "global_steps": 3},
                   "b": {"is_prompt": True, "status": "running", "global_steps": 4}}},
        {"train": {"a": {"is_prompt": True, "status": "finished", "global_steps": 3},
                   "b": {"is_prompt": True, "status": "failure", "global_steps": 4}}},
    ])
    seen, aborted = [], []

    async def kv_list(partition):
        return next(listings)

    async def unfinished():
        counts = await original()
        seen.append(counts)
        return counts

    class Server:
        class abort_all_requests:  # noqa: N801 (a Ray method handle)
            @staticmethod
            async def remote(reject_request):
                aborted.append(reject_request)

    import transfer_queue

    monkeypatch.setattr(transfer_queue, "async_kv_list", kv_list)
    original = rollout.unfinished_train_prompts
    monkeypatch.setattr(rollout, "unfinished_train_prompts", unfinished)
    replica = object.__new__(rollout.HFReplica)
    replica.servers, replica.replica_rank, replica.DRAIN_POLL_S = [Server()], 0, 0.0
    asyncio.run(replica.abort_all_requests())
    assert seen == [{3: 1, 4: 1}, {4: 1}, {}] and aborted == [False]

    # prompts nothing will answer: past the timeout the sync goes on (and aborts them) rather than hang the run
    async def never_answered():
        return {7: 4}

    monkeypatch.setattr(rollout, "unfinished_train_prompts", never_answered)
    replica.DRAIN_TIMEOUT_S = 0.0
    asyncio.run(replica.abort_all_requests(reject_request=True))
    assert aborted == [False, True]


def test_the_reward_manager_tells_an_ended_response_from_a_cut_one(tiny_model_dir):
    """EndAwareRewardManager's rule on verl's right-padded responses: ended when the last unmasked token is the
    tokenizer's or the generation config's end of sequence; cut when it is any other token; an empty response is cut."""
    import torch
    from transformers import AutoTokenizer

    from vcpo.verl_plugin.reward import end_token_ids, response_ended

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ends = end_token_ids(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ends == {tokenizer.eos_token_id, im_end}  # the random model's: <|endoftext|> and <|im_end|>
    prompt_mask = [0, 1, 1]
    pad = tokenizer.pad_token_id
    cases = [([7, 8, im_end, pad], [1, 1, 1, 0], True), ([7, 8, 9, 10], [1, 1, 1, 1], False),
             ([7, im_end, 9, pad], [1, 1, 1, 0], False), ([pad] * 4, [0] * 4, False)]
    for response, mask, ended in cases:
        assert response_ended(torch.tensor(response), torch.tensor(prompt_mask + mask), ends) is ended, response

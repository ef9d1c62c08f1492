"""execution=concurrent: generation in its own process while the learner trains, with the serial run's
metrics (timings aside), through checkpoints and resumes; schedules that cannot overlap are refused."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vcpo.local_models import save_random_model
from vcpo.runs import METRICS_FILE
from vcpo.sim.config import ConfigError, SimConfig, apply_overrides
from vcpo.sim.run_folder import RunFolder
from vcpo.sim.train import TIMING_PREFIXES, Trainer
from vcpo.sim.validation import validate

SMALL = {
    "steps": 9,
    "prompts_per_step": 2,
    "responses_per_prompt": 2,
    "micro_batch_size": 4,
    "max_response_tokens": 8,
    "update_tokens": 3,
    "eval_every": 4,
    "eval_problems": 4,
    "warmup_steps": 0,
    "checkpoint_every": 2,
    "progress": False,
    "lag": 3,
    "method": "vcpo",
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(save_random_model(tmp_path_factory.mktemp("base"), hidden_size=32, num_layers=1))


def config(base, out, **changes) -> SimConfig:
    return apply_overrides(SimConfig(), {**SMALL, "base": base, "out": str(out)} | changes)


def results(out: Path) -> list[dict]:
    """Every metrics line without the fields that measure the machine."""
    lines = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith(TIMING_PREFIXES)} for line in lines]


class Stop(Exception):
    pass


def run_stopped_after(trainer: Trainer, lines: int, monkeypatch) -> None:
    """Run until ``lines`` metrics lines are written, then stop as an exception would (a crash, Ctrl-C)."""
    written = []
    log = RunFolder.log

    def stopping(self, metrics):
        log(self, metrics)
        written.append(metrics["step"])
        if len(written) == lines:
            raise Stop

    with monkeypatch.context() as patch:
        patch.setattr(RunFolder, "log", stopping)
        with pytest.raises(Stop):
            trainer.run()


@pytest.mark.parametrize("lag_model", ["fixed", "pipeline_overlap"])
def test_a_concurrent_run_logs_the_serial_runs_metrics_through_a_resume(base, tmp_path, lag_model, monkeypatch):
    serial = Trainer(config(base, tmp_path / "serial", lag_model=lag_model)).run()
    out = tmp_path / "concurrent"
    run_stopped_after(Trainer(config(base, out, lag_model=lag_model, execution="concurrent")), 5, monkeypatch)
    assert len(results(out)) == 5  # steps 0-4 logged, the checkpoint after step 3 (every 2)
    Trainer(config(base, out, lag_model=lag_model, execution="concurrent")).run()
    assert results(out) == results(serial)
    steps = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines() if "timing_s/step" in line]
    # each side's share is logged: generation, rewards and its wait for weights; the learner's wait for batches
    assert all(line["timing_s/wait_gen"] >= 0 and line["timing_s/gen_wait_weights"] >= 0 and line["timing_s/gen"] > 0 for line in steps)
    recorded, serial_recorded = json.loads((out / "config.json").read_text()), json.loads((serial / "config.json").read_text())
    assert (recorded["execution"], recorded["cores"], serial_recorded["cores"]) == ("concurrent", 2, 1)
    when = ("started", "finished", "attempts")  # provenance: the two runs differ in time, not in settings
    assert ({k: v for k, v in {**recorded, "execution": "serial", "cores": 1, "out": None}.items() if k not in when}
            == {k: v for k, v in {**serial_recorded, "out": None}.items() if k not in when})


def test_serial_and_concurrent_execution_resume_each_other(base, tmp_path, monkeypatch):
    """The execution is not a result-changing setting: a serial run resumed concurrently ends the same."""
    reference = Trainer(config(base, tmp_path / "reference", lag_model="fixed")).run()
    out = tmp_path / "switched"
    run_stopped_after(Trainer(config(base, out, lag_model="fixed")), 3, monkeypatch)
    Trainer(config(base, out, lag_model="fixed", execution="concurrent")).run()
    assert results(out) == results(reference)


@pytest.mark.parametrize(
    "changes",
    [
        {"method": "sync", "lag": 0, "lag_model": "fixed"},
        {"lag_model": "pipeline"},
        {"lag_model": "minibatch"},
        {"lag_model": "fixed", "lag": 0},
    ],
    ids=["sync", "pipeline", "minibatch", "lag-0"],
)
def test_a_schedule_that_cannot_overlap_is_refused_naming_the_key(base, tmp_path, changes):
    with pytest.raises(ConfigError, match="config key 'execution'.*needs a lag model whose generation can overlap"):
        validate(config(base, tmp_path / "run", execution="concurrent", **changes))


def test_the_generators_failure_is_raised_in_the_learner_with_its_traceback(base, tmp_path, monkeypatch):
    produce = Trainer.produce

    def failing(self, step):
        if step == 2:
            raise ValueError("the sampler broke")
        return produce(self, step)

    monkeypatch.setattr(Trainer, "produce", failing)
    trainer = Trainer(config(base, tmp_path / "run", lag_model="fixed", execution="concurrent"))
    with pytest.raises(RuntimeError, match=r"(?s)generator process failed at step 2.*ValueError: the sampler broke"):
        trainer.run()
    assert len(results(tmp_path / "run")) == 2 and trainer.generator_process is None


def child_pids(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()]


@pytest.mark.slow
def test_killing_the_learner_ends_the_generator_and_the_run_resumes(base, tmp_path):
    """SIGKILL the learner mid-run: its generator process ends with it (no orphan), and a restart ends
    with the uninterrupted serial run's metrics."""
    settings = [f"{k}={v}" for k, v in {**SMALL, "steps": 14, "lag_model": "pipeline_overlap"}.items()] + [f"base={base}", "threads=1"]
    command = [sys.executable, "-m", "vcpo.sim", "train", *settings]
    subprocess.run([*command, f"out={tmp_path / 'serial'}"], check=True, capture_output=True)
    out = tmp_path / "concurrent"
    process = subprocess.Popen([*command, f"out={out}", "execution=concurrent"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not ((out / METRICS_FILE).exists() and len((out / METRICS_FILE).read_text().splitlines()) >= 6):
        time.sleep(0.02)
    generators = child_pids(process.pid)
    assert generators, "no generator process"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 60  # a guard against a hang only: left alone, the generator waits for weights forever
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in generators):
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                   for pid in generators), "the generator outlived its learner"
    subprocess.run([*command, f"out={out}", "execution=concurrent"], check=True, capture_output=True)
    assert results(out) == results(tmp_path / "serial")


@pytest.mark.slow
def test_the_tool_use_task_runs_concurrently_with_the_serial_metrics(tmp_path, monkeypatch):
    """tir from its SFT base (multi-turn, the sandboxed tool, tool metrics from the generator process), with
    a resume in the middle: the serial run's metrics."""
    settings = {"task": "tir", "method": "vcpo", "lag": 2, "lag_model": "pipeline_overlap", "steps": 6, "eval_every": 3,
                "eval_problems": 10, "warmup_steps": 1, "checkpoint_every": 2, "progress": False}
    serial = Trainer(apply_overrides(SimConfig(), {**settings, "out": str(tmp_path / "serial")})).run()
    out = tmp_path / "concurrent"
    concurrent = apply_overrides(SimConfig(), {**settings, "out": str(out), "execution": "concurrent"})
    run_stopped_after(Trainer(concurrent), 3, monkeypatch)
    Trainer(concurrent).run()
    assert results(out) == results(serial)
    assert all(line["tool/calls_per_response"] > 0 for line in results(out) if "tool/calls_per_response" in line)




def test_more_than_one_thread_per_side_is_refused_naming_the_key(base, tmp_path):
    """A forked generator hangs in OpenMP's first parallel region when the learner ran with more threads."""
    for threads in (0, 2, 8):
        with pytest.raises(ConfigError, match=rf"config key 'threads': execution=concurrent runs each side on one thread.*got threads={threads}"):
            validate(config(base, tmp_path / "run", lag_model="fixed", execution="concurrent", threads=threads))


def test_a_reader_killed_holding_the_weights_lock_ends_the_publish_within_a_poll():
    """The weights' lock taken by a process that then dies: publish gives up at its first look, after one POLL_S,
    with GeneratorDied."""
    import multiprocessing

    from vcpo.sim.concurrent import GeneratorDied, SharedWeights

    context = multiprocessing.get_context("fork")
    weights = SharedWeights({"w": torch.zeros(3)}, 2, context)
    weights.publish(0, {"w": torch.ones(3)})
    holder = context.Process(target=lambda: (weights.lock.acquire(), os.kill(os.getpid(), signal.SIGKILL)))
    holder.start()
    holder.join()
    looks = []

    def reader_alive():
        looks.append(holder.is_alive())
        return looks[-1]

    with pytest.raises(GeneratorDied, match="died holding the weights' lock"):
        weights.publish(1, {"w": torch.full((3,), 2.0)}, reader_alive)
    assert looks == [False]


def test_the_generator_killed_while_it_waits_for_weights_ends_the_learner(base, tmp_path, monkeypatch):
    """The learner holds step 2's update until the generator waits for θ_2, then SIGKILLs it: the learner's next wait
    ends within seconds with GeneratorDied (before, a killed waiter could block the publish forever)."""
    from vcpo.sim.concurrent import GeneratorDied, SharedWeights

    get = SharedWeights.get

    def waiting(self, version):  # the generator says when it starts to wait for a version not yet published
        if int(self.versions[version % len(self.slots)]) != version:
            os.kill(os.getppid(), signal.SIGUSR1)
        return get(self, version)

    monkeypatch.setattr(SharedWeights, "get", waiting)
    waits = []
    signal.signal(signal.SIGUSR1, lambda *_: waits.append(time.monotonic()))
    train_step = Trainer.train_step

    def killing(self):
        if self.step == 2:
            deadline = time.monotonic() + 60
            while not waits and time.monotonic() < deadline:
                time.sleep(0.01)
            assert waits, "the generator never waited for weights"
            os.kill(self.generator_process.process.pid, signal.SIGKILL)
            self.generator_process.process.join()
        return train_step(self)

    monkeypatch.setattr(Trainer, "train_step", killing)
    trainer = Trainer(config(base, tmp_path / "run", lag_model="pipeline_overlap", execution="concurrent", lag=1, steps=6))
    try:
        with pytest.raises(GeneratorDied, match="the generator process ended \\(exit code -9\\) before step"):
            trainer.run()
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    assert trainer.generator_process is None


def test_the_generator_killed_while_the_learner_works_ends_the_learner_there(base, tmp_path, monkeypatch):
    """Between its waits the learner may train, evaluate or checkpoint for minutes on a loaded machine: the generator's
    death ends it where it is. Here step 2's work would run on for ten minutes; the kill ends it with GeneratorDied,
    the run's folder resumable as after any crash."""
    from vcpo.sim.concurrent import GeneratorDied

    train_step, worked = Trainer.train_step, []

    def working_on(self):
        if self.step == 2:
            os.kill(self.generator_process.process.pid, signal.SIGKILL)
            deadline = time.monotonic() + 600  # a guard against a hang only: without the interrupt the work runs to it
            while time.monotonic() < deadline:
                sum(range(1000))
            worked.append("to its end")
        return train_step(self)

    monkeypatch.setattr(Trainer, "train_step", working_on)
    trainer = Trainer(config(base, tmp_path / "run", lag_model="fixed", execution="concurrent"))
    with pytest.raises(GeneratorDied, match=r"^the generator process ended \(exit code -9\) before step 2's batch$"):
        trainer.run()
    assert worked == [] and trainer.generator_process is None and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    monkeypatch.setattr(Trainer, "train_step", train_step)
    Trainer(config(base, tmp_path / "run", lag_model="fixed", execution="concurrent")).run()
    assert results(tmp_path / "run") == results(Trainer(config(base, tmp_path / "serial", lag_model="fixed")).run())


@pytest.mark.slow
def test_the_command_line_says_in_one_line_that_the_generator_died_and_how_to_resume(base, tmp_path):
    settings = [f"{k}={v}" for k, v in {**SMALL, "steps": 40, "lag_model": "pipeline_overlap"}.items()] + [f"base={base}", "threads=1"]
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "vcpo.sim", "train", *settings, f"out={out}", "execution=concurrent"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not ((out / METRICS_FILE).exists() and len((out / METRICS_FILE).read_text().splitlines()) >= 3):
        time.sleep(0.02)
    os.kill(child_pids(process.pid)[0], signal.SIGKILL)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1
    assert stderr.strip().splitlines()[-1].startswith("error: the generator process ended (exit code -9) before step")
    assert stderr.strip().splitlines()[-1].endswith("the same command resumes it")

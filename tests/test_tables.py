"""vcpo.reporting from hand-made run outputs of both backends, with answers computed by hand."""

import json

import pytest

from vcpo.recipes import base_path
from vcpo.reporting import figure_specs, read_metrics, runs_needed
from vcpo.reporting.__main__ import main
from vcpo.reporting.figures import draw_figure
from vcpo.reporting.specs import validate_spec
from vcpo.reporting.table1 import table1_data
from vcpo.studies.grad_norms import main as grad_norms_main


def write_lines(folder, lines):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def sim_run(root, task, method, lag, seed, accuracy, step_seconds, final=None, cores=None):
    """A simulator run: flat lines, evaluation at steps 0 and 2 (10 s each, inside the step's time), and when
    ``final`` is given the final evaluation's line and ``final/eval.json``; ``config.json`` with ``cores``."""
    folder = root / task / method / f"lag{lag}" / f"seed{seed}"
    lines = []
    for step in range(3):
        line = {"step": step, "timing_s/step": step_seconds, "rollout_corr/seq_ess_ratio": 0.9, "actor/grad_norm": 1.0}
        if step in accuracy:
            line |= {"val/accuracy": accuracy[step], "timing_s/testing": 10.0}
        lines.append(line)
    if final is not None:
        lines.append({"step": 3, "val/accuracy": final, "timing_s/testing": 10.0})
    write_lines(folder, lines)
    if final is not None:
        (folder / "final").mkdir()
        (folder / "final" / "eval.json").write_text(json.dumps({"step": 3, "val/accuracy": final}))
    if cores is not None:
        (folder / "config.json").write_text(json.dumps({"cores": cores, "cpu": "Hand-made CPU"}))
    return folder


def write_evaluation(folder, **accuracy):
    """python -m vcpo.evaluation's summary.json under folder/eval, one mean@n per benchmark."""
    (folder / "eval").mkdir(parents=True)
    summary = {"results": {name: {"mean_at_n": value} for name, value in accuracy.items()}}
    (folder / "eval" / "summary.json").write_text(json.dumps(summary))


def verl_run(root, task, method, lag, seed):
    folder = root / task / method / f"lag{lag}" / f"seed{seed}"
    write_lines(
        folder,
        [
            {"step": 0, "data": {"val-core/math500/acc/mean@4": 0.4}},
            {"step": 1, "data": {"timing_s/step": 1800.0, "actor/grad_norm": 0.5, "actor/rollout_corr/seq_ess_ratio": 0.3}},
            {"step": 2, "data": {"timing_s/step": 1800.0, "val-core/math500/acc/mean@4": 0.6}},
        ],
    )
    write_evaluation(folder, math500=0.7)
    command = [
        "python",
        "trainer.nnodes=1",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=4",
    ]
    (folder / "launch.json").write_text(json.dumps({"task": task, "gpus": 8, "command": command}))
    return folder


def test_reader_flattens_both_formats(tmp_path):
    sim = sim_run(tmp_path, "countdown", "vcpo", 2, 0, {0: 0.1, 2: 0.3}, 1.0)
    assert read_metrics(sim)[0] == {
        "step": 0,
        "timing_s/step": 1.0,
        "rollout_corr/seq_ess_ratio": 0.9,
        "actor/grad_norm": 1.0,
        "val/accuracy": 0.1,
        "timing_s/testing": 10.0,
    }
    verl = read_metrics(verl_run(tmp_path, "math", "vcpo", 10, 0))
    assert [line["step"] for line in verl] == [0, 1, 2]
    # verl's trainer logs the actor's rollout_corr/* under actor/: read under the names the figures draw
    assert verl[1] == {"step": 1, "timing_s/step": 1800.0, "actor/grad_norm": 0.5,
                       "actor/rollout_corr/seq_ess_ratio": 0.3, "rollout_corr/seq_ess_ratio": 0.3}  # fmt: skip
    assert verl[2]["val/accuracy"] == 0.6 and verl[2]["val-core/math500/acc/mean@4"] == 0.6


def test_table1_smoke_numbers(tmp_path):
    sim_run(tmp_path, "countdown", "sync", 0, 0, {0: 0.1, 2: 0.3}, 60.0, final=0.4, cores=1)
    sim_run(tmp_path, "countdown", "sync", 0, 1, {0: 0.2, 2: 0.3}, 120.0, final=0.6, cores=1)
    sim_run(tmp_path, "countdown", "vcpo", 4, 0, {0: 0.1, 2: 0.55}, 30.0, cores=2)  # unfinished: last val/accuracy
    data = table1_data(tmp_path, "smoke", {"countdown": "countdown"}, lag=4)
    row = data["tasks"]["countdown"]
    assert row["base"] == {"mean": pytest.approx(0.15), "min": 0.1, "max": 0.2, "n": 2}
    assert row["sync"]["accuracy"] == {"mean": pytest.approx(0.5), "min": 0.4, "max": 0.6, "n": 2}
    assert row["sync"]["steps"]["mean"] == 3 and row["async"]["steps"]["mean"] == 2
    # wall-clock: 3 steps (their evaluations inside) + the final evaluation's 10 s; core-hours: x the cores held
    assert row["sync"]["wall_hours"]["min"] == pytest.approx((3 * 60 + 10) / 3600)
    assert row["sync"]["hours"]["max"] == pytest.approx((3 * 120 + 10) / 3600)
    assert row["async"]["wall_hours"]["mean"] == pytest.approx(3 * 30 / 3600)
    assert row["async"]["hours"]["mean"] == pytest.approx(2 * 3 * 30 / 3600)
    # time to sync's mean final accuracy (0.5): seed 1 of sync at its final evaluation, after its 3 steps;
    # seed 0 never; VCPO at its step-2 evaluation, after 2 steps of 30 s and that evaluation's 10 s
    assert row["target"] == pytest.approx(0.5) and (row["sync"]["reached"], row["async"]["reached"]) == (1, 1)
    assert row["sync"]["hours_to_target"]["mean"] == pytest.approx((3 * 120 + 10) / 3600)
    assert row["async"]["hours_to_target"]["mean"] == pytest.approx((2 * 30 + 10) / 3600)
    assert row["async"]["accuracy"]["mean"] == 0.55 and row["async"]["lag"] == 4
    assert row["paper"]["sync"] == {"accuracy": 38.4, "steps": 400, "gpu_hours": 143.2}
    assert row["paper_lag"] == 10  # recipes/tasks/countdown.yaml paper.max_lag, Table 1's k
    # without --lag the async row is read at the recipe's lag (no second copy of it to disagree with)
    assert table1_data(tmp_path, "smoke", {"countdown": "countdown"})["tasks"]["countdown"]["async"]["lag"] == 10

    out = tmp_path / "tables" / "table1.md"
    main(
        ["table1", "--runs", str(tmp_path), "--scale", "smoke", "--out", str(out), "--task", "countdown", "--lag", "4"]
    )
    text = out.read_text()
    assert "smoke scale" in text and "| Base | 15.0% (10.0-20.0) | 1.6% |" in text
    assert "| Sync (k=0) [paper k=0] | 50.0% (40.0-60.0) | 38.4% | 3 | 400 |" in text
    assert "Wall-clock minutes (ours) | Core-minutes (ours) | GPU hours (paper)" in text  # smoke runs take minutes
    assert "| 1.17 [1/1] | seed0 |" in text and "6.17 [1/2]" in text  # minutes to sync's accuracy [reached/seeds]
    assert "Async VCPO / sync: wall-clock 0.32, core-minutes 0.64 (paper, GPU-hours: 0.63)" in text  # 90 / 280 s
    assert "Machine: Hand-made CPU." in text
    written = json.loads(out.with_suffix(".json").read_text())
    assert written["tasks"]["countdown"]["sync"]["seeds"] == ["seed0", "seed1"]
    # each run's provenance as its config.json recorded it (these hand-made runs recorded only their CPU), and the
    # table's own: the code, when it was written, the CPU
    assert written["tasks"]["countdown"]["sync"]["runs"][1] == {"seed": "seed1", "provenance": {
        "commit": None, "dirty": None, "started": None, "finished": None, "cpu": "Hand-made CPU"}}
    assert {"commit", "dirty", "start", "finish", "cpu"} <= set(written["provenance"])
    assert written["provenance"]["start"] <= written["provenance"]["finish"]


def test_table1_maps_each_tasks_published_lag_to_this_scales(tmp_path):
    """The smoke workflow's lags (10 -> 48) apply to Countdown's published k = 10 and leave SimpleTIR's
    k = 2 alone; the accuracy column names the simulator task a paper task maps to."""
    sim_run(tmp_path, "countdown", "vcpo", 48, 0, {0: 0.1, 2: 0.3}, 60.0)
    sim_run(tmp_path, "tir", "vcpo", 2, 0, {0: 0.4, 2: 0.8}, 60.0)
    out = tmp_path / "table1.md"
    main(["table1", "--runs", str(tmp_path), "--scale", "smoke", "--out", str(out), "--task", "countdown",
          "--task", "simpletir=tir", "--lag-map", "10=48", "--lag-map", "12=48"])  # fmt: skip
    data = json.loads(out.with_suffix(".json").read_text())["tasks"]
    assert (data["countdown"]["async"]["lag"], data["simpletir"]["async"]["lag"]) == (48, 2)
    assert data["simpletir"]["async"]["accuracy"]["mean"] == 0.8
    text = out.read_text()
    assert "| Countdown (ours) |" in text and "| tir held-out (ours) | AIME 2025 (paper) |" in text
    with pytest.raises(SystemExit):
        main(["table1", "--runs", str(tmp_path), "--scale", "smoke", "--out", str(out), "--lag-map", "10:48"])


def test_table1_paper_scale_uses_evaluation_and_gpu_hours(tmp_path):
    verl_run(tmp_path, "math", "vcpo", 10, 0)
    row = table1_data(tmp_path, "paper", {"math": "math"})["tasks"]["math"]
    assert row["async"]["accuracy"]["mean"] == 0.7  # eval/summary.json, benchmark math500
    assert row["async"]["hours"]["mean"] == pytest.approx(1.0 * 8)  # one wall-clock hour on 4 + 4 GPUs
    assert row["sync"]["accuracy"] is None and row["base"] is None  # no sync run: reported missing


def test_a_verl_base_row_is_the_base_model_evaluation_never_verls_step_0_validation(tmp_path):
    verl_run(tmp_path, "math", "sync", 0, 0)  # step-0 validation 0.4 at verl's sampling settings
    assert table1_data(tmp_path, "paper", {"math": "math"})["tasks"]["math"]["base"] is None
    write_evaluation(tmp_path / base_path("math"), math500=0.25, math=0.5)  # python -m vcpo.evaluation of the base model
    row = table1_data(tmp_path, "paper", {"math": "math"})["tasks"]["math"]
    assert row["base"] == {"mean": 0.25, "min": 0.25, "max": 0.25, "n": 1}  # MATH-500, Table 1's benchmark
    assert row["sync"]["accuracy"]["mean"] == 0.7


def test_hyperparameter_tables_come_from_the_recipes(tmp_path):
    main(["hyperparams", "--out", str(tmp_path)])
    table2, table3 = (tmp_path / "table2.md").read_text(), (tmp_path / "table3.md").read_text()
    assert "VCPO Table 2" in table2 and "| Learning rate | 1e-06" in table2 and "| Weight decay | 0.1 |" in table2
    assert "VCPO Table 3" in table3 and "| Number of prompts per batch | 8 |" in table3
    assert "| Batch size (effective) (derived) | 64 |" in table3 and "| Max IS ratio (TIS c) | 2/8 |" in table3
    table4 = (tmp_path / "table4.md").read_text()
    assert "| Hyper-parameter | countdown | math |" in table4 and "| Response length | 4096 | 4096 |" in table4
    assert "max_turns" not in table4 and "| Max assistant turns | 5 |" in (tmp_path / "table5.md").read_text()


def test_runs_needed():
    specs = figure_specs()
    assert runs_needed(specs["fig5"]) == [
        ("countdown", "sync", 0),
        ("countdown", "seq_tis_c8", 10),
        ("countdown", "vcpo", 10),
        ("math", "sync", 0),
        ("math", "seq_tis_c8", 10),
        ("math", "vcpo", 10),
    ]
    assert runs_needed(specs["fig1"], task="arithmetic", lag=2) == [
        ("arithmetic", "sync", 0),
        ("arithmetic", "seq_tis_c8", 2),
        ("arithmetic", "vcpo", 2),
    ]
    assert runs_needed(specs["fig5"], task=["countdown,arithmetic"], lag=3)[-1] == ("arithmetic", "vcpo", 3)
    assert runs_needed(specs["lag_sweep"])[:2] == [("gsm8k", "sync", 0), ("gsm8k", "seq_tis_c8", 2)]
    assert runs_needed(specs["fig3"]) == []


def test_unknown_method_raises_naming_the_figure():
    spec = {
        "title": "t",
        "paper": "p",
        "kind": "curves",
        "task": "gsm8k",
        "lag": 2,
        "methods": ["vcpo", "nope"],
        "panels": ["val/accuracy"],
    }
    with pytest.raises(ValueError, match=r"figure figX: unknown method\(s\) \['nope'\]"):
        validate_spec("figX", spec)


def test_figure_with_missing_runs_names_them_and_the_config_file_of_the_drawn_ones(tmp_path, monkeypatch):
    sync = sim_run(tmp_path, "countdown", "sync", 0, 0, {0: 0.1, 2: 0.3}, 1.0)
    vcpo = sim_run(tmp_path, "countdown", "vcpo", 2, 0, {0: 0.1, 2: 0.2}, 1.0)
    sim_run(tmp_path, "countdown", "gspo", 2, 0, {0: 0.1, 2: 0.2}, 1.0)  # not in Figure 5: its file is not named
    (sync / "config.json").write_text(json.dumps({"config_file": "recipes/sim/regime.yaml"}))
    (vcpo / "config.json").write_text(json.dumps({"config_file": None}))
    (tmp_path / "countdown/gspo/lag2/seed0/config.json").write_text(json.dumps({"config_file": "other.yaml"}))
    notes = []
    import vcpo.reporting.figures as figures

    original, drawn = figures.label_figure, []
    monkeypatch.setattr(figures, "label_figure", lambda fig, *args: notes.append(args) or original(fig, *args))
    monkeypatch.setattr(figures, "save", lambda fig, out: drawn.append(fig) or out)
    draw_figure("fig5", tmp_path, "smoke", tmp_path / "fig5.png", task="countdown", lag=2)
    # the accuracy panel draws sync and VCPO at their evaluation steps, with their values; nothing of GSPO
    accuracy = next(ax for ax in drawn[0].axes if "accuracy" in ax.get_ylabel() + ax.get_title())
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in accuracy.get_lines()
             if not line.get_label().startswith("_")}
    assert lines == {"sync (k=0), 1 seed": ([0, 2], [0.1, 0.3]), "vcpo, 1 seed": ([0, 2], [0.1, 0.2])}, lines
    title, paper, scale, missing, sources = notes[0]
    assert paper == "VCPO Figure 5" and scale == "smoke"
    assert missing == ["Missing runs (not drawn): countdown/seq_tis_c8/lag2"]
    assert sources == ["recipes/sim/regime.yaml"]


def test_figures_without_data_say_so(tmp_path, monkeypatch):
    import vcpo.reporting.figures as figures

    drawn = []
    monkeypatch.setattr(figures, "save", lambda fig, out: drawn.append(fig) or out)
    for figure, says in (("fig4", "No data"), ("lag_sweep", "No data"), ("fig3", "No data"), ("fig14", "not produced at paper scale")):
        draw_figure(figure, tmp_path / "empty", "paper", tmp_path / f"{figure}.png")
        texts = " ".join(text.get_text() for text in drawn[-1].texts)
        assert says in texts and not drawn[-1].axes, (figure, texts)


def test_fig14_without_a_finished_sync_run_says_so(tmp_path, monkeypatch):
    import vcpo.reporting.figures as figures

    drawn = []
    monkeypatch.setattr(figures, "save", lambda fig, out: drawn.append(fig) or out)
    measured = tmp_path / "fig14.json"
    assert grad_norms_main(["--runs", str(tmp_path), "--task", "countdown", "--out", str(measured)]) == 0
    draw_figure("fig14", tmp_path, "smoke", tmp_path / "fig14.png", measured=measured)
    assert "No data: no finished run countdown/sync/lag0/seed*/final" in " ".join(t.get_text() for t in drawn[-1].texts)


@pytest.fixture(scope="module")
def fig14(tmp_path_factory):
    """Figure 14 drawn from a sync run whose final checkpoint is a random tiny model, in float64."""
    from vcpo.local_models import save_random_model

    root = tmp_path_factory.mktemp("runs")
    run = root / "countdown" / "sync" / "lag0" / "seed0"
    write_lines(run, [{"step": 0}])
    config = {"task": "countdown", "learner_dtype": "float64", "temperature": 1.0, "max_response_tokens": 8}
    (run / "config.json").write_text(json.dumps(config))
    save_random_model(run / "final", vocab_size=320, hidden_size=32, num_layers=1)
    measured = root / "fig14.json"
    assert grad_norms_main(["--runs", str(root), "--task", "countdown", "--out", str(measured)]) == 0
    out = draw_figure("fig14", root, "smoke", root / "fig14.png", task="countdown", measured=measured)
    return run, out, json.loads(measured.read_text())


def test_fig14_writes_the_scatter_and_its_numbers(fig14):
    _, out, result = fig14
    assert out.stat().st_size > 0 and result["task"] == "countdown" and result["sequences"] == 32
    for proxy in ("otb_proxy", "opo_length"):
        assert all(-1 <= value <= 1 for value in result[proxy].values()), result[proxy]
    assert all(value > 0 for value in result["exact_sq_norms"] + result["logit_energy_proxy"])


def test_fig14_exact_norms_are_per_sequence_autograd_norms(fig14):
    """The JSON's ||g_i||² equal one backward per sequence on the same (re-sampled, seeded) batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vcpo.core import logit_energy_proxy
    from vcpo.sim.learner import response_log_probs
    from vcpo.sim.tasks import get_sim_task
    from vcpo.studies.grad_norms import sample_responses

    run, _, result = fig14
    model = AutoModelForCausalLM.from_pretrained(run / "final", dtype=torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    problems = get_sim_task("countdown").problems("validation")[:32]
    batch = sample_responses(model, tokenizer, problems, 8, 1.0, seed=0)
    assert batch.mask.sum(-1).tolist() == result["response_tokens"]
    for row in range(3):
        one = batch.rows(row, row + 1)
        model.zero_grad()
        response_log_probs(model, one, 1.0).sum().backward()
        norm = sum(float((p.grad**2).sum()) for p in model.parameters())
        assert norm == pytest.approx(result["exact_sq_norms"][row], rel=1e-6)
        with torch.no_grad():
            logits = model(input_ids=one.input_ids, attention_mask=one.attention_mask, position_ids=one.position_ids)
            logits = logits.logits[:, one.prompt_width - 1 : -1]
        proxy = float(logit_energy_proxy(logits, one.response_ids, one.mask))
        assert proxy == pytest.approx(result["logit_energy_proxy"][row], rel=1e-6)


def test_a_synchronous_preset_is_recognised_by_its_max_lag_not_its_name(tmp_path, monkeypatch):
    """A copy of the sync preset under another name is read at lag 0 and labelled k = 0, like sync."""
    import dataclasses

    import vcpo.methods.presets as methods
    from vcpo.reporting.figures import method_label
    from vcpo.reporting.run_data import run_dirs

    presets = dict(methods._methods())
    presets["oracle"] = dataclasses.replace(presets["sync"], name="oracle")
    monkeypatch.setattr(methods, "_methods", lambda: presets)
    folder = sim_run(tmp_path, "countdown", "oracle", 0, 0, {0: 0.1, 2: 0.3}, 1.0)
    sim_run(tmp_path, "countdown", "seq_tis_c8", 0, 0, {0: 0.1, 2: 0.3}, 1.0)
    assert run_dirs(tmp_path, "countdown", "oracle", 12) == [folder]
    assert run_dirs(tmp_path, "countdown", "seq_tis_c8", 12) == []  # a lagged preset is read at the lag asked for
    assert method_label("oracle", 3) == "oracle (k=0), 3 seeds" and method_label("seq_tis_c8", 1) == "seq_tis_c8, 1 seed"


def test_a_run_folders_curves_are_drawn_from_verls_metrics(tmp_path, capsys):
    """python -m vcpo.reporting curves RUN... --out PNG: each run's training reward, held-out accuracy, ESS ratio, lr
    scale, staleness and KL in one figure (verl's metric names flattened as every reader does); a missing run folder
    is one line naming it."""
    from matplotlib import image

    run = tmp_path / "vcpo_lag12"
    run.mkdir()
    lines = [{"step": 0, "data": {"val-core/gsm8k/acc/mean@1": 0.15}}] + [
        {"step": s, "data": {"critic/score/mean": 0.1 * s, "actor/rollout_corr/seq_ess_ratio": 1 - 0.1 * s,
                             "actor/lr_scale": 0.9, "training/off_policy/trajectory_staleness/max": min(s - 1, 12),
                             "actor/rollout_corr/kl": 0.01 * s}} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    main(["curves", str(run), "--out", str(tmp_path / "curves.png")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "curves.png")
    assert image.imread(tmp_path / "curves.png").shape[1] > 1000
    with pytest.raises(SystemExit):
        main(["curves", str(tmp_path / "absent"), "--out", str(tmp_path / "x.png")])
    assert "no such run folder" in capsys.readouterr().err

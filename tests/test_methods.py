"""Method presets: every row of the paper's comparison exists, resolves and validates."""

import subprocess
import sys

import pytest
import yaml

from vcpo.core.registry import POLICY_LOSSES
from vcpo.methods import default_method, get_method, load_methods
from vcpo.recipes import base_path, recipes_dir

# The method rows the foundation issue asks for: sync; seq/token/geo x TIS/MIS x c in {2, 8};
# DeepSeek-V3.2; M2PO; GSPO; OTB; OPOB-only; fp16; low LR; KL-in-reward; TIS+ESS; TIS+OPOB; VCPO;
# VACO; P3O; VESPO; TOPR; CISPO; SAPO; GRPO/DAPO clip.
REQUIRED = [
    "sync",
    *[f"{level}_{kind}_c{c}" for level in ("seq", "token", "geo") for kind in ("tis", "mis") for c in (2, 8)],
    "dsv32_mis", "m2po", "gspo", "otb", "opob_only", "fp16", "low_lr", "kl_in_reward", "tis_ess", "tis_opob",
    "vcpo", "vaco", "p3o", "vespo", "topr", "cispo", "sapo", "grpo",
]


def test_every_required_method_exists():
    assert set(REQUIRED) <= set(load_methods())


def test_no_method_takes_the_folder_of_the_base_model_evaluation():
    assert base_path("math").name not in load_methods()  # RUNS/<task>/base/eval is no method's run


def test_vcpo_preset_is_the_paper_configuration():
    spec = get_method("vcpo").spec
    assert spec["loss"] == {"name": "seq_tis", "params": {"lo": 0.0, "hi": 8.0}, "agg": "seq-mean-token-mean"}
    assert spec["advantage"] == {"estimator": "opob", "params": {"scope": "group", "variant": "paper", "norm_by_std": True}}
    assert spec["step_size"] == {"rule": "ess", "params": {"form": "sqrt", "rho_on": 1.0, "clamp": True}}
    assert spec["optimizer"]["lr"] == 1e-6 and spec["precision"] == "bf16"


@pytest.mark.parametrize(
    "name,path,value",
    [
        ("seq_tis_c2", ("loss", "params", "hi"), 2.0),
        ("token_mis_c8", ("loss", "params", "lo"), 0.125),
        ("m2po", ("loss", "params", "threshold"), 0.04),
        ("vaco", ("loss", "params", "delta"), 0.05),
        ("low_lr", ("optimizer", "lr"), 1e-7),
        ("fp16", ("precision",), "fp16"),
        ("kl_in_reward", ("kl_in_reward_beta",), 0.001),
        ("sync", ("max_lag",), 0),
        ("grpo", ("loss", "params", "clip_ratio_high"), 0.28),
        ("tis_ess", ("step_size", "rule"), "ess"),
        ("otb", ("advantage", "estimator"), "optimal_token_baseline"),
        ("p3o_two_anchor", ("loss", "params", "kl_log_clamp"), 10.0),
    ],
)
def test_paper_values(name, path, value):
    spec = get_method(name).spec
    for key in path:
        spec = spec[key]
    assert spec == value


def test_extends_replaces_params_and_keeps_other_fields():
    vaco = get_method("vaco").spec
    assert vaco["loss"]["params"] == {"delta": 0.05}  # the parent's lo/hi do not leak in
    assert vaco["optimizer"] == get_method("seq_tis_c8").spec["optimizer"]
    assert not get_method("seq_tis_c2").is_default  # `default` is never inherited


def test_p3o_two_anchor_preset_is_p3o_with_the_second_anchor():
    """P3O §3.1, App. B: no hyper-parameter beyond P3O's; everything else as the P3O preset."""
    two_anchor, p3o = get_method("p3o_two_anchor"), get_method("p3o")
    assert two_anchor.is_default and default_method("p3o_two_anchor") == two_anchor
    assert two_anchor.loss_params == p3o.loss_params
    assert {k: v for k, v in two_anchor.spec.items() if k not in ("name", "title", "source", "loss", "extends")} == {
        k: v for k, v in p3o.spec.items() if k not in ("name", "title", "source", "loss", "extends")
    }
    assert two_anchor.spec["loss"]["agg"] == p3o.spec["loss"]["agg"]
    assert "App. B Eq. 14-15" in two_anchor.spec["source"]


def test_each_core_loss_has_one_default_preset():
    for loss in POLICY_LOSSES:
        assert default_method(loss).loss_name == loss


def write_presets(tmp_path, **presets):
    (tmp_path / "schema.yaml").write_text((recipes_dir() / "methods" / "schema.yaml").read_text())
    for name, spec in presets.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path


BASE = {
    "name": "base", "title": "t", "source": "s", "default": True,
    "loss": {"name": "seq_tis", "params": {"lo": 0.0, "hi": 8.0}, "agg": "token-mean"},
    "advantage": {"estimator": "grpo", "params": {"norm_by_std": True}},
    "step_size": {"rule": "constant"}, "optimizer": {"lr": 1e-6}, "precision": "bf16",
}
ONE_PER_LOSS = {
    f"d_{loss}": {**BASE, "name": f"d_{loss}", "loss": {"name": loss, "params": {p: 1.0 for p in spec.params}, "agg": "token-mean"}}
    for loss, spec in POLICY_LOSSES.items() if loss != "seq_tis"
}


@pytest.mark.parametrize(
    "preset,match",
    [
        ({**BASE, "loss": {**BASE["loss"], "params": {"lo": 0.0}}}, r"missing parameters \['hi'\]"),
        ({**BASE, "loss": {**BASE["loss"], "params": {"lo": 0.0, "hi": 8.0, "c": 2}}}, r"unknown parameters \['c'\]"),
        ({**BASE, "loss": {**BASE["loss"], "name": "ppo"}}, "unknown loss 'ppo'"),
        ({**BASE, "precision": "fp8"}, "precision"),
        ({**BASE, "optimizer": {"lr": 1e-6, "betas": [0.9, 0.99]}}, "optimizer"),
        ({**BASE, "extends": "missing"}, "extends unknown recipe 'missing'"),
        ({**BASE, "name": "other"}, "must equal the file name"),
        (
            {
                **BASE,
                "loss": {**BASE["loss"], "agg": "token-sum"},
                "advantage": {"estimator": "opob", "params": {"scope": "group", "variant": "paper", "norm_by_std": True}},
            },
            r"OPOB supports the loss aggregations .* got agg 'token-sum'",
        ),
        (
            {
                **BASE,
                "loss": {"name": "token_tis", "params": {"lo": 0.0, "hi": 2.0}, "agg": "token-mean"},
                "advantage": {"estimator": "opob", "params": {"scope": "group", "variant": "paper", "norm_by_std": True}},
            },
            r"loss 'token_tis' does not give one. OPOB losses: \['geo_mis', 'geo_tis', 'seq_mis', 'seq_tis'\]",
        ),
        (
            {**BASE, "advantage": {"estimator": "opob", "params": {"scope": "prompt", "variant": "paper", "norm_by_std": True}}},
            r"OPOB scope must be one of \('group', 'batch'\), got 'prompt'",
        ),
    ],
)
def test_invalid_presets_raise_naming_the_file_and_key(tmp_path, preset, match):
    directory = write_presets(tmp_path, base=preset, **ONE_PER_LOSS)
    with pytest.raises(ValueError, match=match) as error:
        load_methods(directory)
    assert "base.yaml" in str(error.value)


def test_a_second_default_for_a_loss_raises(tmp_path):
    directory = write_presets(tmp_path, base=BASE, again={**BASE, "name": "again"}, **ONE_PER_LOSS)
    with pytest.raises(ValueError, match="exactly one preset"):
        load_methods(directory)


def test_cycles_raise(tmp_path):
    directory = write_presets(
        tmp_path, base={**BASE, "extends": "other"}, other={**BASE, "name": "other", "extends": "base", "default": False}, **ONE_PER_LOSS
    )
    with pytest.raises(ValueError, match="cycle"):
        load_methods(directory)


def test_cli_lists_every_method():
    out = subprocess.run([sys.executable, "-m", "vcpo.methods", "list"], capture_output=True, text=True, check=True).stdout
    names = {line.split()[0] for line in out.splitlines()[2:] if not line.startswith("alias:")}
    assert names == {name for name, method in load_methods().items() if method.name == name}
    assert "alias: opob_only = tis_opob" in out.splitlines()
    vcpo_line = next(line for line in out.splitlines() if line.startswith("vcpo "))
    for fragment in ("seq_tis", "lo=0.0, hi=8.0", "opob", "ESS form=sqrt", "1e-06", "VCPO §3.5"):
        assert fragment in vcpo_line


def test_cli_show_prints_the_resolved_preset():
    out = subprocess.run([sys.executable, "-m", "vcpo.methods", "show", "opob_only"], capture_output=True, text=True, check=True).stdout
    assert yaml.safe_load(out)["advantage"]["estimator"] == "opob"


def test_opob_only_is_an_alias_of_tis_opob_so_one_run_serves_both():
    from vcpo.methods import aliases, list_methods
    from vcpo.workflow_plan import plan

    assert get_method("opob_only") is get_method("tis_opob") and get_method("opob_only").name == "tis_opob"
    assert aliases() == {"opob_only": "tis_opob"}
    assert "opob_only" not in {method.name for method in list_methods()}
    paper = yaml.safe_load((recipes_dir().parent / "workflows" / "config" / "paper.yaml").read_text())
    runs = plan(paper).runs
    opob_runs = [run for run in runs if run.method in ("tis_opob", "opob_only")]
    assert len({(run.task, run.lag, run.seed) for run in opob_runs}) == len(opob_runs)


def test_an_alias_holds_only_its_target_and_labels(tmp_path):
    import shutil

    directory = tmp_path / "methods"
    shutil.copytree(recipes_dir() / "methods", directory)
    (directory / "opob_only.yaml").write_text("name: opob_only\ntitle: t\nsource: s\nalias_of: tis_opob\nloss: {agg: token-mean}\n")
    with pytest.raises(ValueError, match="an alias holds only"):
        load_methods(directory)
    (directory / "opob_only.yaml").write_text("name: opob_only\ntitle: t\nsource: s\nalias_of: nothing\n")
    with pytest.raises(ValueError, match="alias_of 'nothing' is not a recipe"):
        load_methods(directory)


def test_the_step_rule_is_read_from_the_preset_once():
    from vcpo.methods import step_rule

    vcpo = step_rule("vcpo")
    assert (vcpo.ess, vcpo.opob, vcpo.rho_on, vcpo.form, vcpo.clamp) == (True, True, 1.0, "sqrt", True)
    assert vcpo.with_rho_on(None) is vcpo and vcpo.with_rho_on(0.55).rho_on == 0.55
    for bad in (-0.5, 0.0, float("nan"), float("inf"), "0.5", True):
        with pytest.raises(ValueError, match="rho_on must be a positive finite number"):
            vcpo.with_rho_on(bad)
    # ρ_ess = 0.25 under the sqrt rule with ρ_on = 1: the step shrinks to sqrt(0.25) = 0.5 (VCPO Eq. 5)
    assert vcpo.lr_scale(0.25) == pytest.approx(0.5) and step_rule("tis_opob").lr_scale(0.25) == 1.0
    assert not step_rule("seq_tis_c8").active and step_rule("opob_only") == step_rule("tis_opob")


def test_the_preset_schemas_enums_are_the_codes_constants():
    """The schema's choices are the ones the code implements, each named once in Python."""
    from vcpo.core.aggregation import LOSS_AGGREGATIONS
    from vcpo.core.ess import STEP_SIZE_RULES
    from vcpo.methods import ADVANTAGE_ESTIMATORS, PRECISION_DTYPES
    from vcpo.recipes import read_yaml, recipes_dir

    schema = read_yaml(recipes_dir() / "methods" / "schema.yaml")

    def enum_of(*path):
        node = schema
        for key in path:
            node = node[key]
        return node["enum"]

    assert enum_of("properties", "loss", "properties", "agg") == list(LOSS_AGGREGATIONS)
    assert enum_of("properties", "advantage", "properties", "estimator") == list(ADVANTAGE_ESTIMATORS)
    assert enum_of("properties", "step_size", "properties", "params", "properties", "form") == list(STEP_SIZE_RULES)
    assert enum_of("properties", "precision") == list(PRECISION_DTYPES)

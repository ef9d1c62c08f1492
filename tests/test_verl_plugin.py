"""The verl plugin: a plain `import verl` registers every loss; hyper-parameters come from verl config."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import verl
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass

from vcpo.core.aggregation import LossAggregation
from vcpo.core.registry import POLICY_LOSSES
from vcpo.methods import default_method, get_method

import reference as ref

NAMES = sorted(POLICY_LOSSES)
PROX_NAMES = [name for name in NAMES if POLICY_LOSSES[name].needs_prox]


def core_loss(name, batch, params, mode="token-mean", prox=None):
    log_prob, behav, advantages, mask = batch
    if POLICY_LOSSES[name].needs_prox:
        params = {**params, "prox_log_prob": prox}
    loss, _ = POLICY_LOSSES[name].fn(log_prob, behav, advantages, mask, agg=LossAggregation(mode), **params)
    return loss


def test_only_p3o_two_anchor_needs_the_proximal_log_probs():
    assert PROX_NAMES == ["p3o_two_anchor"]


def test_plain_import_verl_registers_every_loss_in_a_fresh_interpreter(tmp_path):
    """A new Python process that imports only verl finds every loss through the entry point, and
    each gives the core function's value and gradient."""
    script = textwrap.dedent(
        f"""
        import json, torch, verl
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        old, new, adv, mask, prox = torch.load("batch.pt")
        out = {{}}
        for name in {NAMES!r}:
            log_prob = new.clone().requires_grad_(True)
            # decoupled convention of a loss that needs l^prox: old = l^prox, weights = exp(l^prox - l^b)
            args = (prox, torch.exp(prox - old) * mask) if name in {PROX_NAMES!r} else (old, None)
            loss, metrics = get_policy_loss_fn(name)(args[0], log_prob, adv, mask, "seq-mean-token-mean", None, args[1])
            loss.backward()
            out[name] = [loss.item(), log_prob.grad.tolist(), sorted(metrics)]
        print(json.dumps(out))
        """
    )
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 2
    new = old + 0.2 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 1, generator=g).expand(4, 6).contiguous()
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    prox = new - 0.3 * torch.randn(4, 6, generator=g)
    torch.save((old, new, adv, mask, prox), tmp_path / "batch.pt")
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for name in NAMES:
        log_prob = new.clone().requires_grad_(True)
        params = default_method(name).loss_params
        expected = core_loss(name, (log_prob, old, adv, mask.bool()), params, "seq-mean-token-mean", prox)
        expected.backward()
        assert out[name][0] == pytest.approx(expected.item(), rel=1e-6), name
        torch.testing.assert_close(torch.tensor(out[name][1]), log_prob.grad, rtol=1e-6, atol=1e-8)
        assert log_prob.grad.abs().sum() > 0, name
        assert "actor/all_masked" in out[name][2] and "rollout_corr/seq_ess_ratio" in out[name][2]


def actor_config(*overrides):
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(
            "ppo_trainer",
            overrides=[
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.actor.policy_loss._target_=vcpo.verl_plugin.VcpoPolicyLossConfig",
                *overrides,
            ],
        )
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def call_verl(name, config, batch, mode="token-mean", rollout_is_weights=None):
    log_prob, behav, advantages, mask = batch
    return get_policy_loss_fn(name)(behav, log_prob, advantages, mask, mode, config, rollout_is_weights)


def test_method_and_params_come_from_verl_config():
    batch = ref.random_batch(seed=20, scale=0.5)
    log_prob, behav, _, mask = batch
    seq_ratios = torch.exp(torch.where(mask, log_prob.detach() - behav, 0.0).sum(-1))
    # an upper bound that masks some sequence kept by the preset's [0.5, 2]
    hi = seq_ratios[mask.any(-1) & (seq_ratios > 0.5) & (seq_ratios < 2.0)].max().item() - 1e-6
    config = actor_config(
        "actor_rollout_ref.actor.policy_loss.loss_mode=seq_mis",
        "+actor_rollout_ref.actor.policy_loss.method=seq_mis_c2",
        f"+actor_rollout_ref.actor.policy_loss.params.hi={hi!r}",
    )
    loss, _ = call_verl("seq_mis", config, batch)
    expected = core_loss("seq_mis", batch, {"lo": 0.5, "hi": hi})
    torch.testing.assert_close(loss, expected)
    assert not torch.allclose(expected, core_loss("seq_mis", batch, get_method("seq_mis_c2").loss_params))


def test_default_preset_without_vcpo_config():
    batch = ref.random_batch(seed=21)
    plain = omega_conf_to_dataclass(_plain_actor_config())
    loss, _ = call_verl("m2po", plain, batch)
    torch.testing.assert_close(loss, core_loss("m2po", batch, {"threshold": 0.04}))


def _plain_actor_config():
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    return cfg.actor_rollout_ref.actor


def test_global_batch_info_is_used():
    batch = ref.random_batch(seed=22)
    config = actor_config()
    info = {"dp_size": 2, "batch_num_tokens": 60, "global_batch_size": 10, "loss_scale_factor": None}
    config.global_batch_info.update(info)
    for mode in ["token-mean", "seq-mean-token-mean"]:
        loss, _ = call_verl("vespo", config, batch, mode)
        log_prob, behav, advantages, mask = batch
        expected, _ = POLICY_LOSSES["vespo"].fn(
            log_prob, behav, advantages, mask, agg=LossAggregation(mode, **info), **default_method("vespo").loss_params
        )
        torch.testing.assert_close(loss, expected)


def test_rollout_is_weights_multiply_the_token_loss():
    batch = ref.random_batch(seed=23)
    weights = torch.rand(batch[3].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    config = actor_config()
    weighted, _ = call_verl("topr", config, batch, "token-sum", weights)
    log_prob, behav, advantages, mask = batch
    expected, _ = POLICY_LOSSES["topr"].fn(
        log_prob, behav, advantages, mask, agg=lambda m, k: LossAggregation("token-sum")(m * weights, k)
    )
    torch.testing.assert_close(weighted, expected)


def two_anchor_batch(seed, dtype):
    """A batch, proximal log-probs and verl's decoupled-mode weights exp(l^prox − l^b), 0 at padding."""
    log_prob, behav, advantages, mask = ref.random_batch(seed=seed, dtype=dtype)
    noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    prox = torch.where(mask, log_prob.detach().double() - 0.5 * noise, -torch.inf).to(dtype)
    weights = torch.where(mask, torch.exp(prox - behav), 0.0)
    return (log_prob, behav, advantages, mask), prox, weights


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_two_anchor_decoupled_convention(dtype, rtol, mode):
    """old_log_prob = l^prox and rollout_is_weights = exp(l^prox − l^b): verl's loss equals the core
    function called with (l^b, l^prox), and the weights do not multiply the loss."""
    (log_prob, behav, advantages, mask), prox, weights = two_anchor_batch(seed=25, dtype=dtype)
    config = actor_config()
    float_mask = mask.to(dtype)  # verl's response_mask is a float tensor
    loss, metrics = get_policy_loss_fn("p3o_two_anchor")(prox, log_prob, advantages, float_mask, mode, config, weights)
    (grad,) = torch.autograd.grad(loss, log_prob)
    expected, expected_metrics = POLICY_LOSSES["p3o_two_anchor"].fn(
        log_prob, behav, advantages, mask, agg=LossAggregation(mode), prox_log_prob=prox, **default_method("p3o_two_anchor").loss_params
    )
    (expected_grad,) = torch.autograd.grad(expected, log_prob)
    torch.testing.assert_close(loss, expected, rtol=rtol, atol=rtol * 1e-2)
    torch.testing.assert_close(grad, expected_grad, rtol=rtol, atol=rtol * 1e-2)
    for key in ("actor/p3o_token_ess", "actor/p3o_token_ess_behav", "actor/p3o_token_ess_prox"):
        assert metrics[key] == pytest.approx(expected_metrics[key].item(), rel=rtol), key
    assert 0.0 < metrics["actor/p3o_token_ess_behav"] < 1.0 and 0.0 < metrics["actor/p3o_token_ess_prox"] < 1.0


def test_two_anchor_without_rollout_is_weights_raises():
    (log_prob, behav, advantages, mask), prox, _ = two_anchor_batch(seed=26, dtype=torch.float64)
    with pytest.raises(ValueError, match="decoupled mode.*old_log_prob is the proximal log-prob"):
        call_verl("p3o_two_anchor", actor_config(), (log_prob, prox, advantages, mask))


def test_config_errors_name_the_key():
    batch = ref.random_batch(seed=24)
    wrong_method = actor_config("+actor_rollout_ref.actor.policy_loss.method=m2po")
    with pytest.raises(ValueError, match="policy_loss.method='m2po' is a preset of loss 'm2po'"):
        call_verl("seq_tis", wrong_method, batch)
    unknown_param = actor_config("+actor_rollout_ref.actor.policy_loss.params.c=3")
    with pytest.raises(ValueError, match=r"unknown keys \['c'\]"):
        call_verl("seq_tis", unknown_param, batch)
    missing = actor_config("+actor_rollout_ref.actor.policy_loss.method=seq_tis_c3")
    with pytest.raises(ValueError, match="unknown method 'seq_tis_c3'"):
        call_verl("seq_tis", missing, batch)


@pytest.mark.parametrize("method, needs", [("vcpo", "the ESS step size and OPOB"), ("tis_ess", "the ESS step size"), ("tis_opob", "OPOB")])
def test_a_method_needing_the_engine_refuses_to_train_without_it(method, needs):
    """The loss of an ESS/OPOB preset called outside the vcpo engine (a hand-written command, a dropped
    model_type, the legacy trainer) would train plain seq-TIS: it raises at its first call instead."""
    from vcpo.verl_contract import step_rule_applied

    batch = ref.random_batch(seed=21, scale=0.5)
    config = actor_config("actor_rollout_ref.actor.policy_loss.loss_mode=seq_tis", f"+actor_rollout_ref.actor.policy_loss.method={method}")
    with pytest.raises(RuntimeError, match=rf"needs {needs}.*\+actor_rollout_ref\.model\.model_type=vcpo_language_model"):
        call_verl("seq_tis", config, batch, mode="seq-mean-token-mean")
    with step_rule_applied():  # what the engine and the simulator's learner do around their step
        loss, _ = call_verl("seq_tis", config, batch, mode="seq-mean-token-mean")
    assert torch.isfinite(loss)
    plain = actor_config("actor_rollout_ref.actor.policy_loss.loss_mode=seq_tis", "+actor_rollout_ref.actor.policy_loss.method=seq_tis_c8")
    assert torch.isfinite(call_verl("seq_tis", plain, batch, mode="seq-mean-token-mean")[0])

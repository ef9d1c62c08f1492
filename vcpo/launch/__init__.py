"""A paper run as task × method × lag × seed, composed into verl 0.9.1 Hydra overrides.

``recipes/tasks/<task>.yaml`` holds one experiment's model, data and the values of its paper table
(VCPO Tables 3-5; Table 2 in ``recipes/optimizer.yaml``); ``recipes/methods/<method>.yaml`` holds the
loss, baseline, step-size rule, learning rate and precision. `overrides` turns the pair into the exact
command-line overrides of ``python -m verl.trainer.main_ppo``, each value written once in a recipe;
`compose` resolves them with verl's own Hydra config and `check` validates the result before any GPU
is touched. ``python -m vcpo.launch`` is the command line.

verl seams used (no verl file is patched):
- losses: ``vcpo.verl_plugin`` registers every ``vcpo.core`` loss; a preset is selected by
  ``policy_loss.method``.
- behaviour log-probs: verl 0.9.1's V1 trainer in bypass mode (``algorithm.rollout_correction.
  bypass_mode=true``) sets ``old_log_probs`` = the rollout's per-token log-probs and keeps the
  configured ``loss_mode``, so our losses receive l^μ as ``old_log_prob``. Losses that also need the
  proximal policy (``needs_prox``: P3O two-anchor) run in decoupled mode instead (see the plugin).
- asynchrony, the ESS step size and OPOB: `asynchrony_overrides` and `vcpo.verl_plugin.engine`.

The rooms, one job each: `vcpo.launch.run` (the run model), `vcpo.launch.verl_overrides` (one override builder per
part of verl's config, and the command), `vcpo.launch.composition` (verl's Hydra composition and its cache),
`vcpo.launch.checks` (before any GPU is touched), `vcpo.launch.memory` (the projected memory per GPU),
`vcpo.launch.gpu_packages` (what a real launch imports for its attention, cross-entropy and weight sync). This module
gathers what the command line and the workflow call.
"""


from vcpo.launch.checks import check, check_files, gpus_needed, megatron_setup
from vcpo.launch.composition import (
    OVERWRITE_HELP,
    check_added_keys,
    compose,
    composed_cache_file,
    launch_record,
    launching_into,
    overwriting,
    verl_config_dir,
    verl_configs_fingerprint,
    write_launch_record,
)
from vcpo.launch.run import STRATEGIES, LaunchError, Run, actor_strategy, get_task_recipe, make_run, strategy_of
from vcpo.launch.verl_overrides import (
    asynchrony_overrides,
    command,
    megatron_overrides,
    overrides,
    run_environment,
    shell_command,
)
from vcpo.recipes import load_tasks
from vcpo.verl_contract import EXTERNAL_MODULES

__all__ = [
    "EXTERNAL_MODULES", "OVERWRITE_HELP", "STRATEGIES", "LaunchError", "Run", "actor_strategy", "asynchrony_overrides",
    "check", "check_added_keys", "check_files", "command",
    "compose", "composed_cache_file", "get_task_recipe", "gpus_needed", "launch_record", "launching_into", "load_tasks",
    "make_run", "megatron_overrides", "megatron_setup", "overrides", "overwriting", "run_environment", "shell_command", "strategy_of",
    "verl_config_dir", "verl_configs_fingerprint", "write_launch_record",
]

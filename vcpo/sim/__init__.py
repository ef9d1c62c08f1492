"""The CPU training path: an in-process RL trainer with simulated asynchrony (PipelineRL-k).

- ``config``: the run configuration (``SimConfig``), a leaf; ``validation``: its checks before any work starts
- ``rollout``: generation under the three lag models, per-token behaviour log-probs and versions,
  the multi-turn tool loop
- ``learner``: one optimizer step (verl's loss registry and estimators, vcpo.core's OPOB and ESS rule)
- ``run_folder``: the run folder's life: its lock, checkpoints and resume, config.json's provenance, metrics.jsonl
- ``train``: the models, policy snapshots, evaluation and the loop
- ``tasks``, ``base``, ``evaluate``: tasks a tiny model can learn, SFT-warm-started tiny bases, held-out accuracy

``python -m vcpo.sim train|sweep|keys`` is the command line.
"""

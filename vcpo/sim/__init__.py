"""The CPU training path: an in-process RL trainer with simulated asynchrony (PipelineRL-k).

- ``config``: the run configuration (``SimConfig``), a leaf; ``validation``: its checks before any work starts
- ``rollout``: generation under the three lag models, per-token behaviour log-probs and versions,
  the multi-turn tool loop
- ``learner``: one optimizer step (verl's loss registry and estimators, vcpo.core's OPOB and ESS rule)
- ``train``: the loop, metrics.jsonl, checkpoints and resume
- ``tasks``, ``base``, ``evaluate``: tasks a tiny model can learn, SFT-warm-started tiny bases, held-out accuracy

``python -m vcpo.sim train|sweep|keys`` is the command line.
"""

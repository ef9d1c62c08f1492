"""Reproduction of "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs" (VCPO).

``vcpo.core`` holds every formula as pure PyTorch functions; ``vcpo.methods`` names the presets
(one YAML per method in ``recipes/methods``); ``vcpo.verl_plugin`` registers the losses in verl.
"""

__version__ = "0.1.0"

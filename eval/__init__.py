"""Evaluation entry point: ``python -m eval --help``. The logic lives in ``vcpo.evaluation``."""

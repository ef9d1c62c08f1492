"""Datasets in verl's parquet schema: GSM8K, MATH, MATH-500, AIME 2024/2025, AMC23, DAPO-Math-17k, Countdown.

Each row: ``data_source`` (the task name, which ``vcpo.rewards`` maps to its reward), ``prompt`` (one
user turn), ``ability``, ``reward_model`` ``{"style": "rule", "ground_truth": ...}`` and ``extra_info``
``{"split", "index", "question", "answer"}``. Sources are the Hugging Face hub or a local json, jsonl
or parquet file; Countdown is generated offline with Reasoning Gym.

    python -m vcpo.data build gsm8k --out data --source DATA/gsm8k/test.jsonl
"""

from vcpo.data.build import build, load_rows
from vcpo.data.datasets import DATASETS, DatasetSpec
from vcpo.data.sources import HubUnavailableError

__all__ = ["DATASETS", "HubUnavailableError", "DatasetSpec", "build", "load_rows"]

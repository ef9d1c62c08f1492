"""The paper's tables and figures generated from run outputs (``python -m vcpo.reporting``).

``figures.yaml`` says what each figure needs and shows; ``paper_results.yaml`` holds the paper's
published numbers. The workflow imports ``figure_specs``, ``runs_needed`` and ``read_metrics``.
"""

from vcpo.reporting.run_data import read_metrics
from vcpo.reporting.specs import figure_specs, paper_results, runs_needed

__all__ = ["figure_specs", "paper_results", "read_metrics", "runs_needed"]

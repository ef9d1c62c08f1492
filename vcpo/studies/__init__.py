"""The studies run on the simulator: their designs' runners, tables of runs, statistics and figures.

``statistics`` (intervals, paired tests, Holm, Wilson, ROC AUC, power, equivalence), ``stability`` (the
registered outcome of a run: holds, collapses), ``evidence`` and ``across_lags`` (pre-registered studies,
``recipes/sim/``), ``regime_report``, ``plots`` and ``grad_norms`` (the regime study's figures and Figure
14's measured norms). They sit above the trainer (``vcpo.sim``) and the shared readers (``vcpo.reporting``).
"""

"""``python -m vcpo.sim.evidence``, the command the pre-registrations in ``recipes/sim/`` name: the study now lives
in ``vcpo.studies.evidence`` (``vcpo.sim`` holds the trainer alone), which this runs."""

import runpy

if __name__ == "__main__":
    runpy.run_module("vcpo.studies.evidence", run_name="__main__", alter_sys=True)

#!/usr/bin/env bash
# The CPU-scale study (docs/studies.md): sync, seq-TIS and VCPO with 3 seeds at a high lag, the other
# corrections at that lag, a lag sweep of sequence TIS, then the figures and tables.
#   recipes/sim/study.sh [RUNS_DIR] [FIGURES_DIR]      (extra key=value settings: STUDY_OVERRIDES)
# Every run is resumable and a finished run is skipped, so the script can be re-run after a stop.
set -euo pipefail
RUNS=${1:-results/sim}
FIGURES=${2:-tables/sim_study}
TASK=${TASK:-countdown}
HIGH_LAG=${HIGH_LAG:-12}
JOBS=${JOBS:-2}
read -r -a OVERRIDES <<< "${STUDY_OVERRIDES:-}"

sweep() { python -m vcpo.sim sweep --task "$TASK" --out "$RUNS" --jobs "$JOBS" "$@" "${OVERRIDES[@]}"; }

sweep --methods sync --lags 0 --seeds 0,1,2
sweep --methods seq_tis_c8,vcpo --lags "$HIGH_LAG" --seeds 0,1,2
sweep --methods m2po,gspo,otb,vaco,p3o,vespo --lags "$HIGH_LAG" --seeds 0
sweep --methods seq_tis_c8 --lags 2,4,8,24,48 --seeds 0

mkdir -p "$FIGURES"
python -m vcpo.studies.plots "$RUNS" --task "$TASK" --lag "$HIGH_LAG" --methods sync,seq_tis_c8,vcpo \
  --out "$FIGURES/core_k$HIGH_LAG.png" --table "$FIGURES/core_k$HIGH_LAG.md"
python -m vcpo.studies.plots "$RUNS" --task "$TASK" --lag "$HIGH_LAG" --methods sync,seq_tis_c8,vcpo,m2po,gspo,otb,vaco,p3o,vespo \
  --out "$FIGURES/methods_k$HIGH_LAG.png" --table "$FIGURES/methods_k$HIGH_LAG.md"
python -m vcpo.studies.plots "$RUNS" --task "$TASK" --lags 0,2,4,8,"$HIGH_LAG",24,48 --methods seq_tis_c8 \
  --out "$FIGURES/lag_sweep.png" --table "$FIGURES/lag_sweep.md"

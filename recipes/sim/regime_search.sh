#!/usr/bin/env bash
# The regime search (recipes/sim/regime_search.md): sync and sequence TIS (c = 8) alone, over learning
# rate x policy lag on a tiny base (TASK, default countdown), 200 steps. Seed 0 of every cell first (it is also the
# short-response stability map of seq-TIS), then seeds 1 and 2 of the candidates, in the registered order.
#   recipes/sim/regime_search.sh [RUNS_DIR] [seed0|sync0|seeds12 LR LAG]
# sync0 runs only sync's seed 0 at every lr (the small family's pruning: a cell can pass only where it holds).
# METHOD (default seq_tis_c8) is the lagged method of stage seed0: METHOD=vcpo draws VCPO's stability map.
# Runs land in RUNS_DIR/lr<lr>/<task>/<method>/lag<k>/seed<s>/; finished runs are skipped.
set -euo pipefail
RUNS=${1:-results/regime_search}
STAGE=${2:-seed0}
LRS=${LRS:-1e-4 1.5e-4 2e-4 3e-4}
LAGS=${LAGS:-12,24,48}
JOBS=${JOBS:-2}
TASK=${TASK:-countdown}
METHOD=${METHOD:-seq_tis_c8}
read -r -a EXTRA <<< "${SEARCH_OVERRIDES:-}"  # key=value settings of the family, e.g. model_size=small
COMMON=(--task "$TASK" --steps 200 --jobs "$JOBS" "${EXTRA[@]}")

if [ "$STAGE" = seed0 ]; then
  for lr in $LRS; do
    python -m vcpo.sim sweep "${COMMON[@]}" --methods sync --lags 0 --seeds 0 --out "$RUNS/lr$lr" "reference_lr=$lr"
    python -m vcpo.sim sweep "${COMMON[@]}" --methods "$METHOD" --lags "$LAGS" --seeds 0 --out "$RUNS/lr$lr" "reference_lr=$lr"
  done
elif [ "$STAGE" = sync0 ]; then
  for lr in $LRS; do
    python -m vcpo.sim sweep "${COMMON[@]}" --methods sync --lags 0 --seeds 0 --out "$RUNS/lr$lr" "reference_lr=$lr"
  done
else
  lr=$3 lag=$4
  python -m vcpo.sim sweep "${COMMON[@]}" --methods sync --lags 0 --seeds 1,2 --out "$RUNS/lr$lr" "reference_lr=$lr"
  python -m vcpo.sim sweep "${COMMON[@]}" --methods seq_tis_c8 --lags "$lag" --seeds 1,2 --out "$RUNS/lr$lr" "reference_lr=$lr"
fi

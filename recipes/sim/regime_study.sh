#!/usr/bin/env bash
# The study in the regime (docs/studies.md, "The regime study"): every run starts from recipes/sim/regime.yaml and
# the presets as written (no method gets settings of its own beyond what its preset needs to run).
#   recipes/sim/regime_study.sh [RUNS_DIR] [FIGURES_DIR]
# Every run is resumable and a finished run is skipped, so the script can be re-run after a stop.
set -euo pipefail
REGIME=${REGIME:-recipes/sim/regime.yaml}
RUNS=${1:-results/regime_study}
FIGURES=${2:-tables/regime_study}
JOBS=${JOBS:-2}
TASK=$(python -c "import sys; from vcpo.sim.config import load_config_file; print(load_config_file(sys.argv[1]).task)" "$REGIME")
LAG=$(python -c "import sys; from vcpo.sim.config import load_config_file; print(load_config_file(sys.argv[1]).lag)" "$REGIME")
SWEEP_LAGS=${SWEEP_LAGS:-2,4,8,12,24,48}

sweep() { python -m vcpo.sim sweep --config "$REGIME" --out "$RUNS" --jobs "$JOBS" "$@"; }

# 1. the core comparison and the component ablation, 3 seeds
sweep --methods sync --lags 0 --seeds 0,1,2
sweep --methods seq_tis_c8,vcpo,tis_ess,tis_opob --lags "$LAG" --seeds 0,1,2
# 2. every other method row of the paper and the related methods, one seed
sweep --methods seq_tis_c2,seq_mis_c2,seq_mis_c8,token_tis_c2,token_tis_c8,token_mis_c2,token_mis_c8,geo_tis_c2,geo_tis_c8,geo_mis_c2,geo_mis_c8 --lags "$LAG" --seeds 0
sweep --methods dsv32_mis,m2po,gspo,otb,low_lr,kl_in_reward,vaco,p3o,vespo,topr --lags "$LAG" --seeds 0
sweep --methods fp16 --lags "$LAG" --seeds 0 rollout_dtype=preset  # fp16 is the fp16 sampler against the learner
# 3. the seq-TIS lag sweep, one seed
sweep --methods seq_tis_c8 --lags "$SWEEP_LAGS" --seeds 0

python -m vcpo.studies.regime_report "$RUNS" --regime "$REGIME" --out "$FIGURES"

#!/usr/bin/env bash
# The serving study of issue 52 on the real model, unattended: a profile of SmolLM2, then per workload
# one `bench serve` run (colocated at chunk budgets 128/256/512, 1P+1D streamed, per-request auto; goodput
# by bisection, 80 requests per step, 5 steps) and the planner's prediction beside it.
# Usage: bench/serve_study.sh [OUT_DIR]  (default out/study). Run it on a quiet machine: nothing else
# computing, or every figure is the other work's. About 3 h on 2 quiet cores (docs/benchmarks-serving.md).
set -euo pipefail
OUT=${1:-out/study}
MODEL=${MODEL:-smollm2}
PDSERVE=${PDSERVE:-.venv/bin/pdserve}
export RAY_worker_niceness=0   # Ray's default 15 starves the engines beside any nice-0 process
mkdir -p "$OUT"
COMMON=(--model "$MODEL" --num-requests 80 --search-steps 5 --streamed)

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/study.log"; }

[ -f "$OUT/profile-$MODEL.json" ] || {
  log "profile $MODEL"
  "$PDSERVE" profile --model "$MODEL" --json "$OUT/profile-$MODEL.json" > "$OUT/profile.log" 2>&1
}
for w in long-prompt-long-output short-prompt-long-output long-prompt-short-output mixed trace; do
  if [ "$w" = trace ]; then
    load=(--trace measure/traces/small.jsonl)
  else
    load=(--preset "$w")
  fi
  log "bench serve $w"
  "$PDSERVE" bench serve "${COMMON[@]}" "${load[@]}" --json "$OUT/serve-$w.json" --plot "$OUT/serve-$w.png" \
    > "$OUT/serve-$w.log" 2>&1 || log "bench serve $w exited $? (see $OUT/serve-$w.log)"
  # the plan holds the configurations to the SLOs bench serve measured (its slo), not its own scaling
  slo=($(.venv/bin/python -c "import json,sys; s=json.load(open(sys.argv[1]))['slo']; \
print('--ttft-slo-ms', s['ttft_ms'], '--tpot-slo-ms', s['tpot_ms'])" "$OUT/serve-$w.json" 2>/dev/null || true))
  log "plan $w ${slo[*]:-(its own SLOs: bench serve wrote none)}"
  "$PDSERVE" plan --profile "$OUT/profile-$MODEL.json" "${load[@]}" "${slo[@]}" --rates 0.25,0.5,1,1.5,2,3,4 \
    --json "$OUT/plan-$w.json" --plot "$OUT/plan-$w.png" > "$OUT/plan-$w.log" 2>&1 \
    || log "plan $w exited $? (see $OUT/plan-$w.log)"
done
log "done"

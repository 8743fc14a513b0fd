#!/usr/bin/env bash
# The serving study of issue 52 on the real model, unattended: a profile of SmolLM2, then per workload
# one `bench serve` run (goodput by bisection of every setup) and the planner's prediction beside it,
# held to the SLOs that bench serve measured. Then `pdserve bench report` puts the table in docs.
#
# Usage: bench/serve_study.sh [OUT_DIR]   (default out/study)
#   SIZE=quick (default): each workload at `bench serve --quick`'s size (20 requests per search step,
#     4 steps, colocated at chunk budgets 128 and 512, 1P+1D streamed, per-request: 4 setups); about
#     1.5 h on 2 quiet cores.
#   SIZE=full: 80 requests per step, 5 steps, colocated at 128/256/512 (5 setups); about 3-5 h.
#   SERVE_ARGS: more `bench serve` flags for every workload (e.g. "--search-steps 3").
# Run it on a quiet machine: nothing else computing, or every figure is the other work's.
set -euo pipefail
OUT=${1:-out/study}
MODEL=${MODEL:-smollm2}
SIZE=${SIZE:-quick}
WORKLOADS=${WORKLOADS:-long-prompt-long-output short-prompt-long-output long-prompt-short-output mixed trace}
PDSERVE=${PDSERVE:-.venv/bin/pdserve}
export RAY_worker_niceness=0   # Ray's default 15 starves the engines beside any nice-0 process
mkdir -p "$OUT"
case "$SIZE" in
  quick) COMMON=(--model "$MODEL" --quick) ;;
  full) COMMON=(--model "$MODEL" --num-requests 80 --search-steps 5 --streamed) ;;
  *) echo "SIZE must be quick or full, got $SIZE" >&2; exit 2 ;;
esac
PLAN_RATES=0.05,0.075,0.1,0.15,0.2,0.3,0.4,0.6,0.8,1.2,1.6,2.4,3.2,4.8

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/study.log"; }

[ -f "$OUT/profile-$MODEL.json" ] || {
  log "profile $MODEL"
  "$PDSERVE" profile --model "$MODEL" --json "$OUT/profile-$MODEL.json" > "$OUT/profile.log" 2>&1
}
for w in $WORKLOADS; do
  if [ "$w" = trace ]; then
    load=(--trace measure/traces/small.jsonl)
  else
    load=(--preset "$w")
  fi
  if [ ! -f "$OUT/serve-$w.json" ]; then
    log "bench serve $w ($SIZE${SERVE_ARGS:+, $SERVE_ARGS})"
    # shellcheck disable=SC2086
    "$PDSERVE" bench serve "${COMMON[@]}" ${SERVE_ARGS:-} "${load[@]}" --json "$OUT/serve-$w.json" \
      --plot "$OUT/serve-$w.png" > "$OUT/serve-$w.log" 2>&1 || log "bench serve $w exited $? (see $OUT/serve-$w.log)"
  fi
  # the plan holds the configurations to the SLOs bench serve measured (its slo), not its own scaling
  slo=($(.venv/bin/python -c "import json,sys; s=json.load(open(sys.argv[1]))['slo']; \
print('--ttft-slo-ms', s['ttft_ms'], '--tpot-slo-ms', s['tpot_ms'])" "$OUT/serve-$w.json" 2>/dev/null || true))
  log "plan $w ${slo[*]:-(its own SLOs: bench serve wrote none)}"
  "$PDSERVE" plan --profile "$OUT/profile-$MODEL.json" "${load[@]}" "${slo[@]}" --rates "$PLAN_RATES" \
    --json "$OUT/plan-$w.json" --plot "$OUT/plan-$w.png" > "$OUT/plan-$w.log" 2>&1 \
    || log "plan $w exited $? (see $OUT/plan-$w.log)"
done
log "done"

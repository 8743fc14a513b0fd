#!/bin/bash
# Scale a running cluster up and down under `pdserve bench serve` load, and count what failed.
# One `pdserve up` (1 prefill + 1 decode, tiny model, zmq) on PORT; 240 requests at 3 req/s; after
# 15 s `pdserve scale --prefill 2 --decode 2`, 25 s later back to 1 + 1 (the extra workers leave
# through the drain). Prints the scale replies, the cluster's workers and ledger at rest, and the
# bench's summary (done/failed). Usage: bash bench/scale_under_load.sh [PORT]
set -u
cd "$(dirname "$0")/.."
PORT=${1:-8123}
BIN=.venv/bin
$BIN/pdserve up --prefill 1 --decode 1 --model tiny --port "$PORT" > /tmp/pdserve-scale-up.log 2>&1 &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP' EXIT
for i in $(seq 1 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
echo "cluster up after ${i}s"
$BIN/pdserve bench serve --url "http://127.0.0.1:$PORT" --mode disaggregated --rates 3 --num-requests 240 \
    --json /tmp/pdserve-scale-serve.json > /tmp/pdserve-scale-serve.log 2>&1 &
LOAD=$!
sleep 15; echo "$(date +%T) scale up"; $BIN/pdserve scale --prefill 2 --decode 2 --url "http://127.0.0.1:$PORT"
sleep 25; echo "$(date +%T) scale down"; $BIN/pdserve scale --prefill 1 --decode 1 --url "http://127.0.0.1:$PORT"
wait $LOAD
curl -s "http://127.0.0.1:$PORT/v1/cluster" | $BIN/python -c "import json, sys; d = json.load(sys.stdin); \
print('workers at rest', [(w['name'], w['alive'], w.get('used_blocks')) for w in d['workers']]); \
print('ledger', d['ledger'])"
grep -E "done [0-9]+ failed|^\| disaggregated" /tmp/pdserve-scale-serve.log

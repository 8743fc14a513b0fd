#!/usr/bin/env bash
# The GPU tier in one prepared run on a CUDA machine (what docs/gpu.md records):
# - the CUDA tests: compiled Triton kernels against the torch reference, device-pool migration,
#   the Triton engine's greedy tokens;
# - `pdserve bench kernels` with the device's copy bandwidth, and the kernels' launch-parameter
#   sweep (bench/kernels_sweep.py);
# - `bench engine` on cuda in bf16: the 4-layer bench checkpoint, and a random checkpoint of
#   SmolLM2-135M's shape (the GGUF file is too big to carry to a lent machine);
# - decode steps as CUDA graphs against eager on SmolLM2's shape in bf16 (bench/decode_graphs.py);
# - `bench migrate` between device pools: the host-socket paths (zmq-tcp, zmq-ipc), and the nixl
#   channel (one-sided UCX READ between the registered device pools) beside zmq-tcp.
# Each stage has its own time limit, so one hang costs only its share. Everything lands in $OUT
# (default out/gpu): one log and a JSON per benchmark. Run from the repository root:
#   bash bench/gpu_session.sh            (PY=python3; WHEELS=.whl installs missing packages first)
# On the machine that sends the run (with pip and the network), `bash bench/gpu_session.sh wheels`
# first fills .whl with what the device image lacks for Python 3.12: pyzmq, and nixl with its CUDA 13
# backend. nixl-cu13's wheel is 56 MiB, too big beside the tree for a 64 MiB carry, so it is rewritten
# without nixl_ep_cu13 (expert-parallel kernels, 27 MiB), its C++ headers, scripts and UCX perftest
# (26 MiB left). Name .whl in .git/info/exclude and carry it; then WHEELS=.whl on the device.
set -u
if [ "${1:-}" = wheels ]; then
  W=${WHEELS:-.whl}
  mkdir -p "$W"
  for p in pyzmq==27.1.0 nixl==1.5.1 nixl-cu13==1.5.1; do
    ${PY:-python3} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$W" "$p" || exit 1
  done
  ${PY:-python3} - "$W"/nixl_cu13-*.whl <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
drop = lambda n: n.startswith(("nixl_ep_cu13/", "nixl_cu13.scripts/")) or ".data/" in n or "perftest" in n
with zipfile.ZipFile(path) as zi, zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as zo:
    for i in zi.infolist():
        if drop(i.filename):
            continue
        data = zi.read(i)
        if i.filename.endswith(".dist-info/RECORD"):  # no rows for what was dropped, no blank rows
            data = b"".join(r + b"\n" for r in data.split(b"\n") if r.strip() and not drop(r.decode().split(",")[0]))
        zo.writestr(i, data)
os.replace(path + ".tmp", path)
print(f"{path}: {os.path.getsize(path) / 2**20:.1f} MiB")
EOF
  du -sh "$W"
  exit 0
fi
OUT=${OUT:-out/gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
LOG="$OUT/gpu_session.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

stage() {  # stage NAME SECONDS CMD...: run with a limit and log everything (SKIP="a b" skips stages)
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  case " ${SKIP:-} " in *" $name "*) echo "=== $name: skipped" | tee -a "$LOG"; return ;; esac
  echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
}

if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# nixl-cu13's UCX CUDA modules need libcudart.so.13 by name: torch's wheel brings it, off the loader's path
CUDART=$($PY -c "import glob, os, site, sys; d=[os.path.dirname(f) for p in sys.path+site.getsitepackages()
  for f in glob.glob(os.path.join(p, 'nvidia', '*', 'lib', 'libcudart.so.1*'))+glob.glob(os.path.join(p,
  'nvidia', 'cuda_runtime', 'lib', 'libcudart.so.1*'))]; print(d[0] if d else '')" 2>/dev/null)
[ -n "$CUDART" ] && export LD_LIBRARY_PATH="$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton, transformers, zmq; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'pyzmq', zmq.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name())"; nproc
  $PY -c "import importlib.metadata as m, importlib.util as u, nixl._api; print('nixl', m.version('nixl'),
[b for b in ('nixl_cu13', 'nixl_cu12') if u.find_spec(b)])"
  echo "libcudart for UCX: ${CUDART:-not found}"; } 2>&1 | tee -a "$LOG"

stage tests 150 $PY -m pytest -p no:cacheprovider -p no:benchmark -n 8 --timeout 120 tests/test_triton_attention.py \
  tests/test_transfer_gpu.py tests/test_cuda_graphs.py \
  "tests/test_engine.py::test_triton_backend_gives_the_same_greedy_tokens"
stage kernels 60 $PY -m pdserve_cli.main bench kernels --dtype bfloat16 --json "$OUT/kernels.json"
stage sweep 120 $PY -m bench.kernels_sweep --json "$OUT/kernels_sweep.json"
SMOL=/tmp/smollm2-shape
stage smol_checkpoint 40 $PY -c "from bench.engine_speed import write_random_llama as w; w('$SMOL', vocab=49152,
hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536)"
stage graphs_smol 90 $PY -m bench.decode_graphs --model "$SMOL" --dtype bfloat16 --batches 1,8,32,64 \
  --context 512 --json "$OUT/decode_graphs_smol.json"
stage nixl_tests 60 $PY -m pytest -p no:cacheprovider -p no:benchmark --timeout 50 tests/test_nixl_pool.py \
  tests/test_transfer_nixl.py
stage migrate_nixl 120 $PY -m pdserve_cli.main bench migrate --device cuda --transports nixl,zmq-tcp \
  --kv-shape llama3-8b --tokens 256,2048,4096 --repeats 5 --json "$OUT/migrate_cuda_nixl.json"
stage engine_tiny 60 $PY -m pdserve_cli.main bench engine --device cuda --dtype bfloat16 --preset long \
  --max-batched-tokens 2048 --repeats 5 --json "$OUT/engine_tiny_long.json"
stage engine_tiny_fp32 40 $PY -m pdserve_cli.main bench engine --device cuda --preset long --repeats 1 \
  --max-batched-tokens 2048 --json "$OUT/engine_tiny_long_fp32.json"
stage engine_smol 90 $PY -m pdserve_cli.main bench engine --device cuda --dtype bfloat16 --preset long \
  --model "$SMOL" --max-batched-tokens 2048 --repeats 5 --json "$OUT/engine_smol_long.json"
stage migrate 100 $PY -m pdserve_cli.main bench migrate --device cuda --transports zmq-tcp,zmq-ipc \
  --kv-shape llama3-8b --tokens 256,2048,4096 --repeats 5 --json "$OUT/migrate_cuda.json"
grep -E "^(=== |FAILED|ERROR)|passed|failed|tok/s|median ratio|identical|GB/s|speedup|kernel |T=|eager " "$LOG" | tail -n 90

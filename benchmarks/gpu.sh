#!/usr/bin/env bash
# The GPU comparisons in one command (~14 min on one H100/H200), each part time-boxed so the
# others still run: perf.py's target 6 (an encoder served saturated against the same model
# offline at batch 64), graphs.py (decode steps eager and from CUDA graphs; SHAPE_OF=FOLDER
# adds that config with random weights), servedperf.py eager and with --cuda-graphs (served
# generation against the engine offline) and genperf.py (continuous against static
# batching). Results go to $OUT (default results/gpu).
#
#     bash benchmarks/gpu.sh            # on a machine with CUDA and labserver installed
set -u
out=${OUT:-results/gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log="$out/log.txt"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } >"$log" 2>&1
part() {  # part SECONDS NAME ARGS...: run one benchmark, its output appended to the log
    local s=$1 name=$2; shift 2
    echo "== $name: $*" >>"$log"
    timeout "$s" $py "$@" >>"$log" 2>&1; echo "== $name exit $?" >>"$log"
}
part 170 perf benchmarks/perf.py --device cuda --model bert-base-random --duration 4 --rounds 2 --out "$out/perf.json"
part 120 graphs benchmarks/graphs.py --device cuda ${SHAPE_OF:+--shape-of "$SHAPE_OF"} --out "$out/graphs.json"
part 150 servedperf benchmarks/servedperf.py --device cuda --rounds 2 --warmup 3 --duration 8 --out "$out/servedperf.json"
part 130 servedperf-graphs benchmarks/servedperf.py --device cuda --cuda-graphs --rounds 2 --warmup 3 --duration 8 \
    --out "$out/servedperf-graphs.json"
part 240 genperf benchmarks/genperf.py --device cuda --warmup 10 --duration 20 --out "$out/genperf.json"

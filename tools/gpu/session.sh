#!/bin/bash
# One GPU session as one command, in stages, each under its own time limit, each leaving its log (and JSON) in OUT:
#
#     tools/gpu/session.sh OUT [STAGE...]        # default: install probe engine static-test
#
# Stages: install (the wheels in .whl/ into /tmp/site: the GPU machine is offline), probe (tools/gpu/probe.py),
# engine (tools/bench/engine_gpu.py at Qwen2.5-0.5B's shape, batch 64 and 256), static-test (the CUDA-graph test of
# the static KV batcher), gpu-tests (pytest -m gpu), check (tools/gpu/check.py's train and sync rows), train-real
# (the train row at Qwen2.5-0.5B's shape: #42's <= 1.05x target), runs (its launcher runs: torch engine + trainer,
# colocated LoRA).
# At most 8 files land in OUT (the device tool brings back 8). `--cpu` runs probe and engine on the CPU instead.
set -u
OUT=${1:?usage: tools/gpu/session.sh OUT [STAGE...]}
shift
CPU=""
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
STAGES=${*:-install probe engine static-test}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

stage() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    echo "== $name (limit ${limit} s)"
    timeout -s INT -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "== $name rc=$rc in $((SECONDS - started)) s"
}

for name in $STAGES; do
    case $name in
        install)
            $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                .whl/*.whl > "$OUT/install.log" 2>&1 && echo "== install ok" || { echo "== install FAILED"; tail "$OUT/install.log"; }
            export PYTHONPATH=/tmp/site:$PWD ;;
        probe)
            stage probe 90 $PY -m tools.gpu.probe ${CPU:+--cpu} --json "$OUT/probe.json" ;;
        engine)
            if [ -n "$CPU" ]; then
                stage engine 300 $PY -m tools.bench.engine_gpu --device cpu --shape tiny --batches 4 --longest 32 \
                    --json "$OUT/engine.json"
            else
                stage engine 300 $PY -m tools.bench.engine_gpu --json "$OUT/engine.json"
            fi ;;
        static-test)
            stage static-test 120 $PY -m pytest -q -p no:cacheprovider -n0 -m gpu tests/engines/test_static_batcher_gpu.py ;;
        gpu-tests)
            stage gpu-tests 240 $PY -m pytest -q -p no:cacheprovider -n 4 -m gpu tests ;;
        check)
            stage check 150 $PY -m tools.gpu.check --only train sync --json "$OUT/check.json" ;;
        train-real)
            stage train-real 240 $PY -m tools.gpu.check --only train --train-shape qwen2.5-0.5b \
                --json "$OUT/train-real.json" ;;
        runs)
            stage runs 240 $PY -m tools.gpu.check --only run colocate --json "$OUT/runs.json" ;;
        *)
            echo "unknown stage $name" ;;
    esac
done

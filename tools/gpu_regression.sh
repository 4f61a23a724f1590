#!/usr/bin/env bash
# A refactor's check on one GPU (one call of the device tool): the native tests of this tree, then
# `python -m pallas_ring bench` of another tree (e.g. the commit before the change, exported with
# `git archive COMMIT pallas_ring | tar -x -C OLD`) and of this one, alternating, in one run.
#
#   bash tools/gpu_regression.sh tests [native|conformance]  # native tests (default: both)
#   bash tools/gpu_regression.sh bench OLD [ARGS...]    # bench ARGS: old, new, old, new
#
# Logs go under $OUT (default /tmp/gpu_regression), bench JSON and plots under /tmp.
set -uo pipefail
out=${OUT:-/tmp/gpu_regression}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
mode=${1:-tests}
shift || true

if [[ $mode == tests ]]; then
  which=${1:-both}
  # 8 workers share the GPU (their compiles run on the host's cores): none preallocates it.
  export PALLAS_RING_TEST_GPU=1 PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
  pytest=(python -m pytest -q -p no:cacheprovider -n 8)
  if [[ $which != conformance ]]; then
    "${pytest[@]}" tests/test_pallas_mosaic_gpu.py -k native 2>&1 \
      | tee "$out/tests_mosaic_native.log" | tail -3
  fi
  if [[ $which != native ]]; then
    "${pytest[@]}" tests/test_pallas_mosaic_gpu.py tests/test_pallas_triton.py -k TestPallas 2>&1 \
      | tee "$out/tests_conformance.log" | tail -3
  fi
  exit 0
fi

old=$1
shift
for round in 1 2; do
  for tree in "$old" .; do
    name=$([[ $tree == . ]] && echo new || echo old)
    echo "== round $round: $name ($tree) bench $*"
    PYTHONPATH=$tree python -m pallas_ring bench "$@" --out "/tmp/bench_${name}_$round" 2>&1 \
      | tee "$out/bench_${name}_$round.log" | grep -E "^\|" | grep -v "^|---"
  done
done

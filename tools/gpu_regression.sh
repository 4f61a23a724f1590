#!/usr/bin/env bash
# A refactor's check on one GPU (one call of the device tool): the native tests of this tree, then
# `python -m pallas_ring bench` of another tree (e.g. the commit before the change, exported with
# `git archive COMMIT pallas_ring | tar -x -C OLD`) and of this one, alternating, in one run.
#
#   bash tools/gpu_regression.sh tests [native|conformance|both] [I/N]  # native tests
#   bash tools/gpu_regression.sh bench OLD [ARGS...]    # bench ARGS: old, new, old, new
#
# I/N runs the I-th of N shares of the tests (every N-th in collection order, from the I-th): the
# native Mosaic GPU tests take about 12 minutes on 8 workers of an H100 host, more than one
# command of the device tool may run, so `tests native 1/2` and `tests native 2/2` split them.
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
  share=${2:-1/1}
  # 8 workers share the GPU (their compiles run on the host's cores): none preallocates it.
  export PALLAS_RING_TEST_GPU=1 PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
  pytest=(python -m pytest -q -p no:cacheprovider)
  # run LOG PYTEST_ARGS...: this share of the tests they select, by node id
  run() {
    local log=$1
    shift
    mapfile -t ids < <("${pytest[@]}" --collect-only "$@" 2>/dev/null | grep '::' \
      | awk -v i="${share%/*}" -v n="${share#*/}" '(NR - i) % n == 0')
    echo "== $log: ${#ids[@]} tests (share $share)"
    "${pytest[@]}" -n 8 "${ids[@]}" 2>&1 | tee "$out/$log" | tail -3
  }
  if [[ $which != conformance ]]; then
    run tests_mosaic_native.log tests/test_pallas_mosaic_gpu.py -k native
  fi
  if [[ $which != native ]]; then
    run tests_conformance.log tests/test_pallas_mosaic_gpu.py tests/test_pallas_triton.py \
      -k TestPallas
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

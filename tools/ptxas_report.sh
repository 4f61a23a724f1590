#!/bin/bash
# ptxas's spill report for the Mosaic GPU kernels of one forward+backward (run on a device
# machine; MOSAIC_GPU_DUMP_PTXAS=1):
#
#   tools/ptxas_report.sh SHAPE ["FIELD=VALUE ..." ...]
#
# SHAPE is the first word of a shape of tools/mosaic_gpu_sweep.py's spans (dense, causal, gqa,
# gqa32k, mqa, h64, h256, docs, ...); each further argument is one pallas_mosaic_gpu.Variants
# setting ("" or none: the defaults; "fp8", alone or with fields: the FP8 kernels). Prints, per
# setting, one line per kernel compiled, in order (forward and the fused kernel, the default at
# H <= 128; forward, dQ, dK/dV where the reproducible pair runs, tiles.fused_backward; in FP8 the
# two backward kernels do not depend on each other and XLA may put dK/dV first): its spill
# stores and loads. XLA may compile the program
# twice (JAX 0.11.2 did), so the sequence can repeat. ptxas's "Used N registers" is the launch
# bound (65536 / threads), not what each warpgroup holds after setmaxnreg, so it is left out.
#
# With PTX_TO=DIR (e.g. $OUT/ptx) each kernel's PTX is copied to DIR/SHAPE.SETTING.entry_N.ptx
# (SETTING: the argument's index), for tools/spill_sites.sh on the CPU machine.
set -u
shape=$1; shift
[ $# -eq 0 ] && set -- ""
i=0
for setting in "$@"; do
  echo "== $shape ${setting:-defaults}"
  dump=()
  if [ -n "${PTX_TO:-}" ]; then  # (MOSAIC_GPU_DUMP_TO dumps everything, MLIR passes included)
    tmp=$(mktemp -d); dump=(MOSAIC_GPU_DUMP_TO="$tmp"); mkdir -p "$PTX_TO"
  fi
  env "${dump[@]}" MOSAIC_GPU_DUMP_PTXAS=1 python3 tools/mosaic_gpu_sweep.py calls "$shape" \
      $setting 2>&1 | grep -E "bytes spill stores|Error|error:" | grep -v "^ptxas warning" \
    | awk '{print "  kernel " NR ": " $0}'
  if [ -n "${PTX_TO:-}" ]; then
    for f in "$tmp"/*.ptx; do [ -e "$f" ] && cp "$f" "$PTX_TO/$shape.$i.$(basename "$f")"; done
    rm -rf "$tmp"
  fi
  i=$((i + 1))
done

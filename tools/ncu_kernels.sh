#!/bin/bash
# Profiles the Mosaic GPU kernels of the second forward+backward call of one shape under Nsight
# Compute, with per-instruction warp-stall samples (run on a device machine):
#
#   tools/ncu_kernels.sh OUT_DIR [shape word, default dense] [fp8] [Variants field=value]
#
# Writes OUT_DIR/{fwd,dq,dkv}_sass.csv.gz (the SASS of each kernel with its samples, for
# tools/ncu_stalls.py) and OUT_DIR/ncu_details.csv (speed of light, warp states). Kernels launch
# in the order forward, fused dK/dV (the default at H <= 128); where the reproducible pair runs
# (deterministic=True, docs, h256, fp8: tiles.fused_backward), forward, dQ, dK/dV. (With
# XLA_FLAGS asking for deterministic ops, pass deterministic=True too.)
# With fp8 the two backward kernels do not depend on each other and may launch dK/dV first:
# dK/dV's SASS has the 64x64 wgmmas.
# The clocks are left alone (--clock-control none).
set -u
out=$1; shift
shape=${1:-dense}; shift || true
rep=/tmp/ncu_kernels
kernels="fwd dkv"
case " $shape $* " in
  *" deterministic=False "*|*" fp8_backward=False "*) ;;  # (the fused kernel where it serves)
  *" deterministic=True "*|*" docs "*|*" h256 "*|*" fp8 "*) kernels="fwd dq dkv";;
esac
n=$(echo $kernels | wc -w)
ncu --clock-control none --kernel-name regex:mosaic --launch-skip $n --launch-count $n \
  --section SourceCounters --section WarpStateStats --section SpeedOfLight \
  --section LaunchStats --import-source no -f -o $rep \
  python3 tools/mosaic_gpu_sweep.py calls "$shape" "$@" || exit
ncu -i $rep.ncu-rep --page details --csv > "$out/ncu_details.csv"
i=0
for k in $kernels; do
  ncu -i $rep.ncu-rep --launch-skip $i --launch-count 1 --page source --csv \
    --print-source sass | gzip > "$out/${k}_sass.csv.gz"
  i=$((i + 1))
done
ls -la "$out"

#!/bin/bash
# Where a Mosaic GPU kernel spills, found on the CPU machine from its PTX (dumped on a device
# machine by `PTX_TO=$OUT/ptx tools/ptxas_report.sh ...`):
#
#   tools/spill_sites.sh KERNEL.ptx [CONTEXT]
#
# Assembles the PTX for sm_90a with the CPU machine's ptxas (/usr/local/cuda/bin; the device's
# may be another release, so check that the spill bytes agree with ptxas_report.sh's), prints
# ptxas's spill report, then each spill store and reload of the SASS (STL / LDL) with the CONTEXT
# instructions before it (default 4): what is spilled, and where it is reloaded (in the main
# loop, or once). A PTX experiment (say, a setmaxnreg value edited) costs no device time.
# nvdisasm: `pip install --target /tmp/nvdisasm nvidia-cuda-nvdisasm` (NVDISASM overrides).
set -eu
ptx=$1; context=${2:-4}
nvdisasm=${NVDISASM:-$(ls /tmp/nvdisasm/nvidia/cu*/bin/nvdisasm 2>/dev/null | head -1)}
[ -x "$nvdisasm" ] || { echo "no nvdisasm: pip install --target /tmp/nvdisasm" \
  "nvidia-cuda-nvdisasm, or set NVDISASM" >&2; exit 1; }
cubin=$(mktemp --suffix .cubin); trap 'rm -f "$cubin"' EXIT
/usr/local/cuda/bin/ptxas -arch=sm_90a -v -o "$cubin" "$ptx" 2>&1 | grep -E "spill|registers"
"$nvdisasm" -c "$cubin" | grep -B "$context" -E "(STL|LDL)(\.[A-Z0-9]+)* " \
  | sed -E 's#^ +/\*[0-9a-f]+\*/ +##; s# *(\(\*"[A-Za-z]*"\*\))? *;.*$##'

#!/usr/bin/env bash
# Branch exp/q-slots on one GPU: correctness, ptxas spills, then the sweep (logs under $OUT).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 150 python tools/q_slots_check.py > $OUT/check.log 2>&1; grep -v Warn $OUT/check.log | tail -6
timeout 120 bash tools/ptxas_report.sh causal "" extra_q_slot=True > $OUT/ptxas.log 2>&1; cat $OUT/ptxas.log
timeout 300 python tools/mosaic_gpu_sweep.py spans bwd dense causal gqa extra_q_slot=False,True > $OUT/sweep.log 2>&1
grep -E "batches|one call" $OUT/sweep.log

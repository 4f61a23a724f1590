#!/usr/bin/env bash
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 150 python tools/_s01.py > $OUT/check.log 2>&1; grep -v Warn $OUT/check.log | tail -6
timeout 120 bash tools/ptxas_report.sh causal "" shared_dq_stage=True > $OUT/ptxas.log 2>&1; cat $OUT/ptxas.log
timeout 320 python tools/mosaic_gpu_sweep.py spans bwd dense causal gqa gqa32k shared_dq_stage=False,True > $OUT/sweep.log 2>&1
grep -E "batches|one call" $OUT/sweep.log

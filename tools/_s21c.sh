export PYTHONPATH=. PYTHONUNBUFFERED=1 PALLAS_RING_TEST_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
(python -m pytest -q -p no:cacheprovider -n 8 -rfE --tb=short tests/test_pallas_mosaic_gpu.py -k "native_fused_backward_matches" 2>&1 | tail -15) > $OUT/native.log 2>&1 &
for s in causal h64; do bash tools/ptxas_report.sh $s "" "overlap_softmax=True" "overlap_softmax=True overlap_dq=True" "deterministic=True overlap_softmax=True"; done 2>&1 | tee $OUT/ptxas.log
wait
cat $OUT/native.log

export PYTHONPATH=. NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 200 env PALLAS_RING_TEST_GPU=1 python -m pytest -q -x tests/test_pallas_mosaic_gpu.py -k "native_fused_backward_matches and True" 2>&1 | tail -15 > $OUT/native.log; cat $OUT/native.log
timeout 100 tools/ptxas_report.sh causal "deterministic=False dq_split=False" "deterministic=False dq_split=True" 2>&1 | tee $OUT/ptxas.log
timeout 270 python tools/mosaic_gpu_sweep.py spans bwd dense causal gqa deterministic=False dq_split=False,True > $OUT/spans.log 2>&1; grep -v "^ *$" $OUT/spans.log | tail -40

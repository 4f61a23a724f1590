export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,power.limit --format=csv
python tools/mosaic_gpu_sweep.py spans bwd dense causal gqa h64 overlap_softmax=False,True overlap_dq=False,True 2>&1 | grep -v Warning | tee $OUT/spans.log
python tools/mosaic_gpu_sweep.py spans bwd dense causal deterministic=True overlap_softmax=False,True 2>&1 | grep -v Warning | tee $OUT/spans_pair.log

#!/usr/bin/env bash
# The parity targets on a GPU, as one script for a lent one: FlashAttention-2 with `alibi_slopes` (alibi-flash),
# compiled FlexAttention (alibi-flex-compiled, inference only) and the SDPA path (alibi-sdpa) against
# FlashAttention-2 without a bias (gpt2-flash, the reference of every ratio; target: within 1.05x), bf16, GPT-2
# small's shape; alibi-flash-gpt2-gelu is alibi-flash with GPT-2's unfused GELU (its ratio: attention only);
# alibi-flex-skip is certified key skipping (eps 1e-7) on FlexAttention's fused kernel with per-head
# block masks (random weights: their gain is not a trained model's; bench_skip measures trained ones). Long-lived
# workers with interleaved repeats (a GPU's timings are steady; a fresh process per cell would spend the lease on
# imports and compiles). Results: $OUT (the device tool's folder) or results/benchmarks.
#
#     bash benchmarks/gpu_parity.sh        # needs CUDA, flash-attn and transformers >= 5.24 importable
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-results/benchmarks}
python - <<'EOF'
import importlib.util, sys
import torch
missing = [name for name in ("flash_attn", "hf_alibi") if importlib.util.find_spec(name) is None]
if not torch.cuda.is_available() or missing:
    sys.exit(f"gpu_parity.sh needs a CUDA device (found: {torch.cuda.is_available()}) and these importable: {missing}")
EOF
B="python -m benchmarks.bench_alibi --device cuda --dtype bf16 --n-embd 768 --n-head 12 --n-layer 12 --threads 4
   --reference gpt2-flash --targets parity --warmup 2 --repeats 10 --timeout 300"
$B --suite forward --lengths 512,2048,8192,32768 \
   --contestants gpt2-flash,alibi-flash,alibi-flash-gpt2-gelu,alibi-flex-compiled,alibi-flex-skip,alibi-sdpa \
   --out "$dest/parity_cuda_forward.json" --markdown "$dest/parity_cuda_forward.md"
$B --suite train,generate --train-lengths 512,1024,2048 --train-batch 8 --prefill 512 --decode 64 --gen-batches 1,8 \
   --contestants gpt2-flash,alibi-flash,alibi-flash-gpt2-gelu,alibi-sdpa \
   --out "$dest/parity_cuda_train.json" --markdown "$dest/parity_cuda_train.md"
# Continuous batching on the GPU (transformers' paged cache; FlashAttention-2's varlen and decode fast path with
# alibi_slopes): every request's tokens equal generate()'s, the GPU-marked tests.
python -m pytest -q -m gpu tests/models/alibi/test_continuous_batching.py 2>&1 | tee "$dest/gpu_continuous_batching.txt"

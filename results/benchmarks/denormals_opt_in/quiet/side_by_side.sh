#!/bin/bash
# Quiet side-by-side: base 9693a68 (flush built into attention) against the current build (no flush), one host, back to back.
set -e
OUT=/work/main/results/benchmarks/denormals_opt_in/quiet
mkdir -p $OUT
PY=/work/main/.venv/bin/python
export HF_HUB_OFFLINE=1
fwd() { # $1 tree, $2 name
  (cd $1 && PYTHONPATH=$1 $PY -m benchmarks.bench_alibi --n-embd 512 --n-head 8 --n-layer 4 --threads 2 --targets parity \
    --contestants gpt2-sdpa,alibi-sdpa --suite forward --lengths 8192 --processes 3 --warmup 1 --repeats 2 \
    --out $OUT/fwd_$2.json --markdown $OUT/fwd_$2.md)
}
train() {
  (cd $1 && PYTHONPATH=$1 $PY -m benchmarks.bench_skip --checkpoint /work/ckpt/cpu_demo/alibi/final --forward 0 --decode 0 \
    --train 8192 --processes 2 --repeats 2 --out $OUT/train_$2)
}
stamp() { echo "$1 $(date +%T) $(uptime)" >> $OUT/uptime.txt; }
: > $OUT/uptime.txt
stamp fwd_base; fwd /tmp/base9693 base
stamp fwd_pure; fwd /work/main pure
stamp train_pure; train /work/main pure
stamp train_base; train /tmp/base9693 base
stamp done

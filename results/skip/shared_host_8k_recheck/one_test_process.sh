#!/bin/bash
# The shared-host condition of 2026-12-03 afternoon again: the test suite running beside the 8k prefill.
cd /work/main
OUT=results/skip/shared_host_8k_recheck
mkdir -p $OUT
export HF_HUB_OFFLINE=1 PYTHONPATH=/work/main
(.venv/bin/python -m pytest -q -p no:cacheprovider tests/models tests/conversion > /work/shared_host_pytest.log 2>&1) &
PYT=$!
sleep 45
for run in 1 2; do
  echo "run$run $(date +%T) $(uptime)" >> $OUT/uptime.txt
  .venv/bin/python -m benchmarks.bench_skip --checkpoint /work/ckpt/cpu_demo/alibi/final --forward 8192 --decode 0 \
    --contestants alibi-dense,alibi-skip --processes 4 --repeats 1 --out $OUT/run$run
done
echo "done $(date +%T) $(uptime)" >> $OUT/uptime.txt
pkill -P $PYT; kill $PYT; pkill -f "pytest -q -p no:cacheprovider"

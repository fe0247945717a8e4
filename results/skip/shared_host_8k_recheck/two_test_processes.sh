#!/bin/bash
# Heavier: two test processes beside the 8k prefill (load ~4, as on the afternoon of 2026-12-03).
cd /work/main
OUT=results/skip/shared_host_8k_recheck
export HF_HUB_OFFLINE=1 PYTHONPATH=/work/main
(.venv/bin/python -m pytest -q -p no:cacheprovider tests/models > /work/shared_host_pytest_a.log 2>&1) &
(.venv/bin/python -m pytest -q -p no:cacheprovider tests/conversion tests/experiments > /work/shared_host_pytest_b.log 2>&1) &
sleep 60
for run in 3 4; do
  echo "run$run (two test processes) $(date +%T) $(uptime)" >> $OUT/uptime.txt
  .venv/bin/python -m benchmarks.bench_skip --checkpoint /work/ckpt/cpu_demo/alibi/final --forward 8192 --decode 0 \
    --contestants alibi-dense,alibi-skip --processes 4 --repeats 1 --out $OUT/run$run
done
echo "done $(date +%T) $(uptime)" >> $OUT/uptime.txt
pkill -f "pytest -q -p no:cacheprovider"

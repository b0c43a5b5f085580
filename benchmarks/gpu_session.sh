#!/bin/bash
# On a lent GPU machine (its own torch, no network): make this checkout importable and Dynamo's `fxpipe`
# backend registered without installing (`pip install -e .` there left the entry point unregistered), then run
# the GPU tests and, with "bench", the backend benchmark. Used on an H200 on 2026-11-26 (benchmarks/RESULTS.md).
#   bash benchmarks/gpu_session.sh [bench]        # results under $OUT (or /tmp)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
site=/tmp/fxpipe-site/fxpipe-0.1.dist-info
mkdir -p "$site"
printf 'Metadata-Version: 2.1\nName: fxpipe\nVersion: 0.1\n' > "$site/METADATA"
printf '[torch_dynamo_backends]\nfxpipe = fxpipe.backend:fxpipe_backend\n' > "$site/entry_points.txt"
export PYTHONPATH=$PWD:$(dirname "$site")
nvidia-smi -L
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_backend.py tests/runtime/test_runtime_api.py \
    tests/cli/test_run_device.py 2>&1 | grep -v DEBUG | tee "$OUT/gpu_tests.log" | tail -40
if [ "${1:-}" = bench ]; then
    python3 benchmarks/backend_gpu.py --models gpt-medium --iters 20 --warmup 3 \
        --methods eager fxpipe fxpipe-nograph inductor --json "$OUT/backend_gpu.json" 2>&1 | grep -v DEBUG | tail -12
fi

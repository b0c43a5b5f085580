#!/bin/bash
# On a fresh lent GPU machine (its own torch 2.11+CUDA, no network), from this checkout, in under 8 minutes:
#   1. make the checkout importable and Dynamo's `fxpipe` backend registered without installing (`pip install -e .`
#      there left the entry point unregistered); install any wheels carried in benchmarks/.wheels (git-ignored,
#      filled here by benchmarks/gpu_wheels.sh; the image already has transformers, typer, rich, tabulate, pytest);
#   2. tests: every test marked gpu (`pytest -m gpu` over the files that mark one: the backend's compiled paths in
#      float64 and bf16, the runtime on CUDA, `fxpipe run --device cuda`, the 2-GPU NCCL test, skipped on one GPU);
#   3. bench: benchmarks/backend_gpu.py on HF GPT-2 and Llama configurations (8 x 256 tokens) in fp32 and bf16:
#      eager, torch.compile(model), fxpipe with no options, fxpipe {"stages": 2, "microbatches": 4}, interleaved,
#      median of 15 steps, a table with ratios to torch.compile.
# Usage (device tool: carry ["benchmarks/.wheels"] only if gpu_wheels.sh filled it):
#   bash benchmarks/gpu_session.sh [all|tests|bench]      # logs and JSON under $OUT (else /tmp/fxpipe-gpu)
#   FXPIPE_GPU_TESTS_K="compiled_path or bf16"            # only the GPU tests pytest's -k selects
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fxpipe-gpu}
mkdir -p "$OUT"
what=${1:-all}
start=$SECONDS
site=/tmp/fxpipe-site
mkdir -p "$site/fxpipe-0.1.dist-info"
printf 'Metadata-Version: 2.1\nName: fxpipe\nVersion: 0.1\n' > "$site/fxpipe-0.1.dist-info/METADATA"
printf '[torch_dynamo_backends]\nfxpipe = fxpipe.backend:fxpipe_backend\n' > "$site/fxpipe-0.1.dist-info/entry_points.txt"
if ls benchmarks/.wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        benchmarks/.wheels/*.whl || exit 1
fi
export PYTHONPATH=$PWD:$site
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-$(nproc)}
# FXPIPE_GPU_SMOKE=1: the same steps on a machine without a GPU (the GPU tests skip, the benchmark at smoke sizes)
bench_device="--device cuda"
if [ "${FXPIPE_GPU_SMOKE:-0}" = 1 ]; then bench_device="--device cpu --smoke"; else nvidia-smi -L; fi
python3 -c "import torch, transformers, typer, rich, tabulate; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__)" || exit 1
python3 -c "import torch; assert 'fxpipe' in torch._dynamo.list_backends(), 'fxpipe backend not registered'" || exit 1

if [ "$what" = all ] || [ "$what" = tests ]; then
    files=$(grep -rl "mark.gpu" tests/ --include='test_*.py' | sort)
    echo "== gpu tests: $files"
    # one process (-n 0): the GPU tests share one device
    timeout 300 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -ra --durations=15 \
        -m gpu ${FXPIPE_GPU_TESTS_K:+-k "$FXPIPE_GPU_TESTS_K"} $files 2>&1 | grep -v DEBUG | tee "$OUT/gpu_tests.log" | tail -45
    echo "== tests done at $((SECONDS - start)) s"
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
    echo "== backend benchmark"
    timeout 420 python3 benchmarks/backend_gpu.py $bench_device --models hf-gpt2 hf-llama --precisions fp32 bf16 --iters 15 \
        --warmup 3 --methods eager compile fxpipe fxpipe-2x4 --json "$OUT/backend_gpu.json" 2>&1 | grep -v DEBUG \
        | tee "$OUT/backend_gpu.log" | grep -v '^{' | tail -25
    echo "== bench done at $((SECONDS - start)) s"
fi

#!/usr/bin/env bash
# Every check this project makes on a real GPU, in one run of under 8 minutes on one NVIDIA H200
# (16 cores), the same torch.cuda path that ROCm takes:
#   - tests/gpu: one worker on NCCL against ddp on one GPU (32-true, bf16-mixed, 16-mixed with its
#     gradient scaler, checkpoint contents); two workers sharing the one GPU over gloo (devices=2,
#     Lightning's device parsing on a pinned worker); MonarchModelParallelStrategy at 1x2 (tensor
#     parallel) on the one GPU over gloo; MonarchFSDPStrategy with cpu_offload=True;
#     MeshStatsMonitor's readings and CUDA-event step timer; the warm mesh; the controller never
#     initializing a GPU;
#   - the small and medium benchmarks, monarch against ddp with devices=1;
#   - the 400 MiB model's stages (cold fit to its first step, warm validate and predict), monarch
#     and ddp with devices=1 (benchmarks/run_one.py --scenario stages);
# and writes $OUT/gpu-summary.json and $OUT/gpu-summary.md (with the date and the commit).
#
# usage: bash tests/gpu/prepare.sh here, then on the device, carrying .gpu:
#   bash tests/gpu/run_on_device.sh
# Without .gpu (a GPU machine with the project installed) it runs as it is.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/lightning-monarch-gpu}
mkdir -p "$out"
started=$(date +%s)
if [ -d .gpu ]; then
  bash .gpu/unpack || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python=${PYTHON:-python3}
commit=$(cat .gpu/commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  "$python" -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip, 'lightning', lightning.__version__, 'gpus', torch.cuda.device_count())"
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

echo "== tests/gpu ($(($(date +%s) - started)) s)"
timeout 330 "$python" -m pytest tests/gpu -o addopts="" -v -rA -s -p no:cacheprovider --junitxml="$out/tests.xml" 2>&1 | tee "$out/tests.log"

for size in small medium; do
  echo "== benchmark $size ($(($(date +%s) - started)) s)"
  timeout 120 "$python" -m lightning_monarch benchmark --accelerator gpu --devices 1 --size "$size" --steps 60 --reps 2 \
    --json > "$out/benchmark-$size.json" 2> "$out/benchmark-$size.log"
  tail -3 "$out/benchmark-$size.log"
done

for mode in monarch ddp; do
  echo "== 400 MiB model's stages, $mode ($(($(date +%s) - started)) s)"
  timeout 90 "$python" -m benchmarks.run_one --mode "$mode" --size 400mib --scenario stages --accelerator gpu \
    --devices 1 --out "$out/stages-$mode.json" > "$out/stages-$mode.log" 2>&1
  tail -2 "$out/stages-$mode.log"
done

"$python" tests/gpu/summarize.py "$out" "$commit" "$(($(date +%s) - started))"
cat "$out/gpu-summary.md"

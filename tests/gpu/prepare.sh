#!/usr/bin/env bash
# On this (CPU) machine, before a GPU run: packs what the GPU machine lacks into .gpu/ (under the
# device tool's 64 MiB carry limit) and records the commit the run checks.
#
# The GPU machine has Python 3.12, torch (CUDA) and Lightning, but no torchmonarch, no registry and
# no test runner; ../shared/tools/pack-for-gpu-machine packs torchmonarch and its dependencies, and
# this adds pytest, pytest-timeout, NVML's Python binding (for MeshStatsMonitor's readings) and
# xxhash (the storages of a stage's objects are keyed by their hash; torchmonarch needs it too).
#
# usage (from the project's root):  bash tests/gpu/prepare.sh
# then run on the device, carrying ".gpu":  bash tests/gpu/run_on_device.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
"$root/../shared/tools/pack-for-gpu-machine" > /dev/null
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/wheels \
  pytest pytest-timeout pluggy iniconfig nvidia-ml-py xxhash 2>&1 | grep -v "is ignored" || true
echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo '+uncommitted')" > .gpu/commit
du -sh .gpu

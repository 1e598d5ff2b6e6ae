#!/usr/bin/env bash
# Issue 36's device checks on one NVIDIA GPU, with the machine's own torch / timm / jax: nothing is
# installed; the project is imported from src/. Finishes in a few minutes (sections time themselves).
#   bash benchmarks/device_check.sh               # GPU run, prints Markdown tables
#   bash benchmarks/device_check.sh --cpu-smoke   # the same sections at tiny sizes on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
# JAX (section 3) takes its memory as it needs it, beside torch's, not 75 % of the GPU up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false
exec timeout 360 "${PYTHON:-python3}" benchmarks/device_check.py "$@"

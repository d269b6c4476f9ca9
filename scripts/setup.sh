#!/usr/bin/env bash
# Create (or update) .venv with lightning_pp, its test and plot extras.
#
# torch is installed first, pinned, so pip does not pick a newer multi-GB CUDA build on a CPU
# machine: on the project's CPU machines `torch==2.13.0` resolves to the CPU wheel on disk;
# on a GPU machine it is PyPI's usual CUDA build. Override with TORCH_SPEC="torch==X.Y".
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/pip install -q -e ".[test,plot]"

#!/usr/bin/env bash
# The first thing to run on a machine with a CUDA GPU (about 9 minutes at most): installs the
# project, runs every cuda-marked test and the GPU figures, and prints a summary. The CPU tests
# stay the contract; this proves the CUDA paths (streams, events, symmetric-memory staging).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh > /tmp/lpp_gpu_setup.log 2>&1 || { echo "setup failed (see /tmp/lpp_gpu_setup.log)"; exit 1; }
.venv/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  || { echo "no CUDA device visible to torch"; exit 1; }
export OMP_NUM_THREADS=4
timeout 300 .venv/bin/python -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee /tmp/lpp_gpu_tests.log | tail -25
tests_rc=${PIPESTATUS[0]}
timeout 240 .venv/bin/python benchmarks/bench_gpu.py 2>&1 | tee /tmp/lpp_gpu_bench.log
bench_rc=${PIPESTATUS[0]}
echo "== gpu_check summary: cuda tests exit ${tests_rc}, bench exit ${bench_rc}, $(( $(date +%s) - start ))s"
grep -E "passed|failed|error" /tmp/lpp_gpu_tests.log | tail -1
grep -E "^(plan_overhead|comm_overlap|gpu_compile_step_ratio|gpu_compile_first_step_s):" /tmp/lpp_gpu_bench.log
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]

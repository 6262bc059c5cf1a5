#!/usr/bin/env bash
# One command for a session that has a CUDA GPU: the parity suite on the GPU, then the full benchmark
# set, saving the pytest-benchmark JSON, its summary table and the log.
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR] [extra pytest args for the benchmarks, e.g. -k ngram]
#
# Runs from a checkout without installing (PYTHONPATH), using whatever torch/triton are installed.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-benchmarks/results}
shift || true
mkdir -p "$results"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).lower().replace(' ', '-'))") || {
  echo "no CUDA device visible to torch" >&2
  exit 1
}
stamp="$gpu-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'device', torch.cuda.get_device_name(0))"

python3 -m pytest -q tests -p no:cacheprovider 2>&1 | tee "$results/$stamp-tests.log"
tests_rc=${PIPESTATUS[0]}

python3 -m pytest -q benchmarks -p no:cacheprovider --benchmark-json="$results/$stamp-benchmarks.json" "$@" 2>&1 \
  | tee "$results/$stamp-benchmarks.log"
bench_rc=${PIPESTATUS[0]}
python3 benchmarks/summarize.py "$results/$stamp-benchmarks.json" -o "$results/$stamp-benchmarks.md" || true

echo "tests exit $tests_rc, benchmarks exit $bench_rc; results in $results/$stamp-*"
exit $(( tests_rc || bench_rc ))

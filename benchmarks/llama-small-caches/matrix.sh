#!/usr/bin/env bash
# The whole real-engine matrix of BENCHMARKS.md in one sequence: seeds 1-3, both document roles,
# each label of run.sh (default: PA PA4 SMG SGL RANDOM), then the table (summarize.py).
#   OUT=benchmarks/llama-small-caches-NAME benchmarks/llama-small-caches/matrix.sh [LABEL...]
# About 75 s a run: 30 runs take about 40 minutes. Compile nothing meanwhile (2 cores).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
labels=("$@")
[[ ${#labels[@]} -gt 0 ]] || labels=(PA PA4 SMG SGL RANDOM)
export OUT="${OUT:-$here}"
for seed in 1 2 3; do
  for role in system user; do
    "$here/run.sh" "$role" "$seed" "${labels[@]}"
  done
done
python3 "$here/summarize.py" "$OUT"

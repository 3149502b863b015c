#!/usr/bin/env bash
# The whole real-engine matrix of BENCHMARKS.md in one sequence: seeds 1-3, both document roles,
# each label of run.sh (default: PA PA4 SMG SGL RANDOM), then the table (summarize.py).
#   OUT=benchmarks/llama-small-caches-NAME benchmarks/llama-small-caches/matrix.sh [LABEL...]
# REPEAT=N (default 1) runs the whole matrix N times, each time with the labels' order rotated by
# one (so no label always runs first or last on a cell), files named ROLE-sSEED-LABEL-rK.json;
# summarize.py then gives each cell's median over the repeats. One run of one cell on this 2-core
# machine is not enough to rank two routers at the ceiling: the same build's runs differ by up to
# 25%.
# About 75 s a run: 30 runs take about 40 minutes. Compile nothing meanwhile (2 cores).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
labels=("$@")
[[ ${#labels[@]} -gt 0 ]] || labels=(PA PA4 SMG SGL RANDOM)
export OUT="${OUT:-$here}"
repeat="${REPEAT:-1}"
for ((rep = 1; rep <= repeat; rep++)); do
  turn=$(((rep - 1) % ${#labels[@]}))
  order=("${labels[@]:turn}" "${labels[@]:0:turn}")
  tag=""
  if ((repeat > 1)); then tag="$rep"; fi
  for seed in 1 2 3; do
    for role in system user; do
      REPEAT_TAG="$tag" "$here/run.sh" "$role" "$seed" "${order[@]}"
    done
  done
done
python3 "$here/summarize.py" "$OUT"

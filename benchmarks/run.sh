#!/usr/bin/env bash
# The engine-sim fleet benchmark behind BENCHMARKS.md: every workload with all three strategies,
# long-context with seeds 1-3 on one router and on four, and (seed 1, one router) with the document
# as the system message, and with small caches (8 documents, 3 per engine) in both document roles.
# Each strategy gets a fresh in-process fleet (control plane, data plane(s), 7 engine-sims at
# --time-scale 0.1). About 25 minutes on 2 cores.
# JSON per run in benchmarks/, tables into BENCHMARKS.md (one section per workload, document role,
# cache regime, router count and seed). PREFIXCTL=path runs another build (e.g. an older commit's,
# for a before/after).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PREFIXCTL:-}" ]]; then
  cargo build --release --bin prefixctl
  PREFIXCTL=target/release/prefixctl
fi
bench() { "$PREFIXCTL" bench "$@" --markdown BENCHMARKS.md; }
for seed in 1 2 3; do
  bench --workload long-context --seed "$seed" --out "benchmarks/long-context-seed$seed.json"
  bench --workload long-context --routers 4 --seed "$seed" --out "benchmarks/long-context-4-routers-seed$seed.json"
done
bench --workload long-context --document-role system --seed 1 --out benchmarks/long-context-system-role.json
for role in user system; do
  bench --workload long-context --cache-regime small --document-role "$role" --seed 1 \
    --out "benchmarks/long-context-small-cache-$role-role.json"
done
for w in long-context-calibrated system-prompt-long sharegpt system-prompt-chat autoscale; do
  bench --workload "$w" --seed 1 --out "benchmarks/$w.json"
done

#!/usr/bin/env bash
# Real engines with small caches (BENCHMARKS.md): each run on a freshly started fleet of 4 CPU
# llama-servers whose 4 MiB prompt caches hold 2 of the 8 documents, against the best peers in
# the same session.
#   benchmarks/llama-small-caches/run.sh ROLE SEED LABEL...   (ROLE user|system; LABEL PA, PA4, RANDOM, SMG, SGL,
#   ENVOY: Envoy with the data plane as its endpoint picker; needs `envoy` on PATH; DP: that data
#   plane over HTTP, for comparison)
# PREFIXCTL (default target/release/prefixctl) picks the build; OUT (default this folder) the JSON;
# BENCH_ARGS adds bench flags (e.g. `--text-salt 100`: every label on the same texts); WARMUP and
# DURATION (default 20 and 40 s) the run's length, e.g. `WARMUP=0 DURATION=90` for convergence;
# REPEAT_TAG (set by matrix.sh's REPEAT) names the repeat in the files (ROLE-sSEED-LABEL-rTAG.json).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."
role="$1"; seed="$2"; shift 2
prefixctl="${PREFIXCTL:-$root/target/release/prefixctl}"
out="${OUT:-$here}"
mkdir -p "$out"
fleet="$root/scripts/llama-server/fleet.sh"
for label in "$@"; do
  name="$role-s$seed-$label${REPEAT_TAG:+-r$REPEAT_TAG}"
  "$fleet" stop
  engines="$(CACHE_RAM_MIB=4 "$fleet" start 4 8001)"
  common=(bench --engines "$engines" --workload long-context --cache-regime small --document-role "$role"
    --token-scale 0.1 --prefix-length 1024 --concurrency 4 --warmup "${WARMUP:-20}" --duration "${DURATION:-40}" --seed "$seed"
    --out "$out/$name.json" ${BENCH_ARGS:-})
  peer=()
  case "$label" in
    PA) "$prefixctl" "${common[@]}" --strategies PREFIX_AWARE ;;
    PA4) "$prefixctl" "${common[@]}" --strategies PREFIX_AWARE --routers 4 ;;
    RANDOM) "$prefixctl" "${common[@]}" --strategies RANDOM ;;
    SMG|SGL)
      urls="${engines//,/ }"
      if [[ "$label" == SMG ]]; then
        smg launch --policy cache_aware --host 127.0.0.1 --port 30000 --worker-urls $urls >/tmp/peer-router.log 2>&1 &
      else
        python3 -m sglang_router.launch_router --policy cache_aware --host 127.0.0.1 --port 30000 --worker-urls $urls >/tmp/peer-router.log 2>&1 &
      fi
      peer=($!)
      for _ in $(seq 1 100); do curl -fs http://127.0.0.1:30000/health >/dev/null 2>&1 && break; sleep 0.3; done
      "$prefixctl" "${common[@]}" --router-url http://127.0.0.1:30000 --router-label "$label"
      kill "${peer[0]}" 2>/dev/null || true; wait "${peer[0]}" 2>/dev/null || true
      ;;
    ENVOY|DP)
      # Envoy 1.40 (deploy/envoy/envoy.yaml: listener 8081, picker 9002) with one data plane as its
      # ext_proc endpoint picker, PREFIX_AWARE as the bench's own router would have it.
      bin="$(dirname "$prefixctl")"
      work="$(mktemp -d)"
      "$bin/control-plane" --listen 127.0.0.1:7979 --data-dir "$work/cp" >"$work/cp.log" 2>&1 &
      peer=($!)
      for _ in $(seq 1 100); do grep -q "listening on" "$work/cp.log" && break; sleep 0.1; done
      instances="$(printf '"%s",' ${engines//,/ })"
      "$prefixctl" --control-plane http://127.0.0.1:7979 endpoint-config create --endpoint-config-name bench \
        --production-variants "[{\"VariantName\":\"v1\",\"ModelName\":\"m\",\"Instances\":[${instances%,}],\"RoutingConfig\":{\"RoutingStrategy\":\"PREFIX_AWARE\",\"PrefixAwareRoutingConfig\":{\"PrefixLength\":1024,\"ConcurrencyThreshold\":64}}}]" >/dev/null
      "$prefixctl" --control-plane http://127.0.0.1:7979 endpoint create --endpoint-name bench --endpoint-config-name bench >/dev/null
      "$bin/data-plane" --listen 127.0.0.1:0 --control-plane http://127.0.0.1:7979 --default-endpoint bench \
        --ext-proc-listen 127.0.0.1:9002 >"$work/dp.log" 2>&1 &
      peer+=($!)
      envoy -c "$root/deploy/envoy/envoy.yaml" --disable-hot-restart --concurrency 1 -l warning >"$work/envoy.log" 2>&1 &
      peer+=($!)
      for _ in $(seq 1 100); do curl -fs -o /dev/null http://127.0.0.1:8081/v1/models 2>/dev/null && break; sleep 0.3; done
      dp_addr="$(sed -n 's/^data-plane listening on //p' "$work/dp.log" | head -1)"
      # DP: the same data-plane binary and table, straight over HTTP (Envoy idle): what differs
      # from ENVOY is the front door only
      if [[ "$label" == ENVOY ]]; then url=http://127.0.0.1:8081; else url="http://$dp_addr"; fi
      "$prefixctl" "${common[@]}" --router-url "$url" --router-label "$label"
      # the router's own view (decisions, rules, the engines' reports)
      curl -fs "http://$dp_addr/metrics" >"$out/$name.metrics.txt" 2>/dev/null || true
      kill "${peer[@]}" 2>/dev/null || true; wait "${peer[@]}" 2>/dev/null || true
      ;;
    *) echo "unknown label $label" >&2; exit 2 ;;
  esac
done
"$fleet" stop

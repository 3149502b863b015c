#!/usr/bin/env bash
# Starts (or stops) a local fleet of CPU llama-servers on the tiny random-weight model, for
# `prefixctl bench --engines` and by-hand tries.
#
#   scripts/llama-server/fleet.sh start [N=4] [FIRST_PORT=8001]   # prints the --engines list
#   scripts/llama-server/fleet.sh stop
#
# Builds llama-server once (build.sh) and writes the model once (tiny_model.py). Each server gets
# one thread (-t 1 -tb 1) and one slot (-np 1), so several share a small machine; flash attention
# off (-fa off: on CPU it made cache hits slower); --metrics for its Prometheus counters;
# --cache-ram CACHE_RAM_MIB (default 32) for its prompt cache in RAM, which holds the KV state of
# prompts the slot moved away from. Logs and pids go to $FLEET_DIR (default /tmp/prefix-router-llama).
# Extra llama-server flags can be given in LLAMA_SERVER_ARGS.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
FLEET_DIR="${FLEET_DIR:-/tmp/prefix-router-llama}"
CACHE_RAM_MIB="${CACHE_RAM_MIB:-32}"
CTX="${CTX:-8192}"

case "${1:-}" in
  start)
    n="${2:-4}"
    port="${3:-8001}"
    bin="${LLAMA_SERVER:-$("$here/build.sh")}"
    mkdir -p "$FLEET_DIR"
    model="$FLEET_DIR/tiny-llama.gguf"
    [[ -f "$model" ]] || python3 "$here/tiny_model.py" "$model" >/dev/null
    urls=()
    for ((i = 0; i < n; i++)); do
      p=$((port + i))
      # shellcheck disable=SC2086
      "$bin" -m "$model" --host 127.0.0.1 --port "$p" -t 1 -tb 1 -np 1 -fa off -c "$CTX" \
        --cache-ram "$CACHE_RAM_MIB" --metrics ${LLAMA_SERVER_ARGS:-} >"$FLEET_DIR/llama-$p.log" 2>&1 &
      echo $! >>"$FLEET_DIR/pids"
      urls+=("http://127.0.0.1:$p")
    done
    for u in "${urls[@]}"; do
      for _ in $(seq 1 300); do
        curl -fs "$u/health" >/dev/null 2>&1 && break
        sleep 0.1
      done
      curl -fs "$u/health" >/dev/null || { echo "fleet.sh: $u did not become healthy (see $FLEET_DIR)" >&2; exit 1; }
    done
    (IFS=,; echo "${urls[*]}")
    ;;
  stop)
    if [[ -f "$FLEET_DIR/pids" ]]; then
      while read -r pid; do kill "$pid" 2>/dev/null || true; done <"$FLEET_DIR/pids"
      rm -f "$FLEET_DIR/pids"
    fi
    ;;
  *)
    echo "usage: $0 start [N] [FIRST_PORT] | stop" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Starts (or stops) a local fleet of vLLM engines on this machine's CPUs, serving the tiny
# random-weight Llama, for `prefixctl bench --engines`, the opt-in tests and by-hand tries.
#
#   scripts/vllm-cpu/fleet.sh start [N=2] [FIRST_PORT=8101]   # prints the --engines list
#   scripts/vllm-cpu/fleet.sh stop
#
# Engine i serves HTTP on 127.0.0.1:FIRST_PORT+2i and publishes its KV-cache events (ZMQ PUB, topic
# `kv`) on port+1000 with its replay socket (ROUTER) on port+1001, so a router's
# `prefix_aware_routing_config.kv_events` templates `tcp://{host}:{port+1000}` and
# `tcp://{host}:{port+1001}` fit every engine (HTTP ports step by 2 so that no engine's replay port
# is the next one's event port). vLLM binds the PUB socket on every interface (it binds only
# wildcard endpoints); the rest is loopback.
#
# vLLM comes from install.sh (once; or VLLM_PYTHON, a python that imports vllm) and the model
# from tiny_model.py (once, into MODEL_DIR). Each engine: 1 thread (OMP_NUM_THREADS=1,
# VLLM_CPU_OMP_THREADS_BIND=nobind), 1 GiB for the KV space (VLLM_CPU_KVCACHE_SPACE=1) of which
# it uses CACHE_BLOCKS blocks of 32 tokens (--num-gpu-blocks-override; --block-size 32, as CPU
# attention needs a multiple of 32), prompts up to MAX_MODEL_LEN tokens (default (CACHE_BLOCKS - 1)
# x 32: vLLM wants it below the cache), eager mode, bfloat16, usage.prompt_tokens_details on. About
# a minute to start and 1.5 GB of RAM each. The script waits for every /health (STARTUP_TIMEOUT
# seconds, default 180: engines starting side by side share the cores) and then prints the URLs,
# comma-separated, as its last line on stdout; logs go to stderr and the engines' to FLEET_DIR.
#
# Environment:
#   FLEET_DIR        logs and pids (default /tmp/prefix-router-vllm)
#   MODEL_DIR        the model (default ${PREFIX_ROUTER_CACHE:-$HOME/.cache/prefix-router}/vllm-tiny-llama)
#   CACHE_BLOCKS     KV-cache blocks of 32 tokens per engine (default 120: 3,840 tokens)
#   MAX_MODEL_LEN    the longest prompt + output in tokens (default (CACHE_BLOCKS - 1) x 32)
#   KV_EVENTS        0 to publish no KV events (default 1)
#   SERVED_MODEL     the model id the engines answer to (default tiny-llama)
#   STARTUP_TIMEOUT  seconds to wait for each /health (default 180)
#   VLLM_ARGS        extra api_server flags
# `prefixctl bench --fleet-script` sets CACHE_RAM_MIB (llama-server's prompt-cache size); it means
# nothing to vLLM and is ignored here: size vLLM's caches with CACHE_BLOCKS.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
FLEET_DIR="${FLEET_DIR:-/tmp/prefix-router-vllm}"
MODEL_DIR="${MODEL_DIR:-${PREFIX_ROUTER_CACHE:-$HOME/.cache/prefix-router}/vllm-tiny-llama}"
CACHE_BLOCKS="${CACHE_BLOCKS:-120}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-$(((CACHE_BLOCKS - 1) * 32))}"
KV_EVENTS="${KV_EVENTS:-1}"
SERVED_MODEL="${SERVED_MODEL:-tiny-llama}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-180}"

log() { echo "vllm-cpu/fleet: $*" >&2; }

# Stops every engine this FLEET_DIR started: each runs in its own process group (setsid), so
# the group takes its engine-core child along. TERM, then KILL what is left after 10 s.
stop_fleet() {
  [[ -f "$FLEET_DIR/pids" ]] || return 0
  local pids=()
  while read -r pid; do
    kill -TERM -- "-$pid" 2>/dev/null && pids+=("$pid")
  done <"$FLEET_DIR/pids"
  for _ in $(seq 1 100); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  rm -f "$FLEET_DIR/pids"
}

case "${1:-}" in
  start)
    n="${2:-2}"
    port="${3:-8101}"
    py="${VLLM_PYTHON:-$("$here/install.sh")}"
    mkdir -p "$FLEET_DIR"
    if [[ ! -f "$MODEL_DIR/tokenizer.json" ]]; then
      # written aside and moved in, so fleets started side by side never see half a model
      tmp="$MODEL_DIR.tmp.$$"
      log "writing the tiny model to $MODEL_DIR"
      "$py" "$here/tiny_model.py" "$tmp" >/dev/null
      mkdir -p "$(dirname "$MODEL_DIR")"
      mv -T "$tmp" "$MODEL_DIR" 2>/dev/null || rm -rf "$tmp"
    fi
    stop_fleet
    urls=()
    for ((i = 0; i < n; i++)); do
      p=$((port + 2 * i))
      events=()
      if [[ "$KV_EVENTS" != 0 ]]; then
        events=(--kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\
\"endpoint\":\"tcp://*:$((p + 1000))\",\"replay_endpoint\":\"tcp://127.0.0.1:$((p + 1001))\",\"topic\":\"kv\"}")
      fi
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind \
        HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
        setsid "$py" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
        --served-model-name "$SERVED_MODEL" --host 127.0.0.1 --port "$p" --enforce-eager \
        --dtype bfloat16 --block-size 32 --num-gpu-blocks-override "$CACHE_BLOCKS" \
        --max-model-len "$MAX_MODEL_LEN" --enable-prompt-tokens-details "${events[@]}" \
        ${VLLM_ARGS:-} </dev/null >"$FLEET_DIR/vllm-$p.log" 2>&1 &
      echo $! >>"$FLEET_DIR/pids"
      urls+=("http://127.0.0.1:$p")
    done
    log "started $n engine(s), logs in $FLEET_DIR; waiting up to ${STARTUP_TIMEOUT} s for each /health"
    start=$(date +%s)
    mapfile -t pids <"$FLEET_DIR/pids"
    for i in "${!urls[@]}"; do
      u="${urls[$i]}"
      until curl -fs "$u/health" >/dev/null 2>&1; do
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
          log "$u exited while starting; the end of its log ($FLEET_DIR/vllm-${u##*:}.log):"
          tail -n 20 "$FLEET_DIR/vllm-${u##*:}.log" >&2
          stop_fleet
          exit 1
        fi
        if (($(date +%s) - start > STARTUP_TIMEOUT)); then
          log "$u did not become healthy in ${STARTUP_TIMEOUT} s (see $FLEET_DIR/vllm-${u##*:}.log)"
          stop_fleet
          exit 1
        fi
        sleep 1
      done
    done
    log "healthy after $(($(date +%s) - start)) s"
    (IFS=,; echo "${urls[*]}")
    ;;
  stop)
    stop_fleet
    ;;
  *)
    echo "usage: $0 start [N] [FIRST_PORT] | stop" >&2
    exit 2
    ;;
esac

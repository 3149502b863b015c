#!/usr/bin/env bash
# Builds llama.cpp's llama-server for this machine's CPU, once, and prints the binary's path.
#
# The source comes through PyPI: the llama-cpp-python source distribution vendors the whole of
# llama.cpp (vendor/llama.cpp). Only the llama-server target is built (Release, CPU backend only,
# no HTTPS, no web UI download). The result is cached, so later runs print the path at once:
#   ${PREFIX_ROUTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/prefix-router}/llama-server/<version>/llama-server
# Logs go to stderr; stdout is only the path. Needs cmake, a C++ compiler and pip (cmake and g++
# are installed with apt-get when missing and we are root). JOBS (default 2) bounds the build's
# jobs; on 2 cores the build takes about 7 minutes.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # vendors a llama.cpp with --cache-ram and prompt_tokens_cached_total
CACHE="${PREFIX_ROUTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/prefix-router}"
OUT="$CACHE/llama-server/$VERSION"
BIN="$OUT/llama-server"
JOBS="${JOBS:-2}"

log() { echo "llama-server build: $*" >&2; }

if [[ -x "$BIN" ]]; then
  echo "$BIN"
  exit 0
fi

if ! command -v cmake >/dev/null 2>&1 || ! command -v c++ >/dev/null 2>&1; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing cmake and g++ with apt-get"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ >&2
  else
    log "cmake or a C++ compiler is missing (install them, e.g. apt-get install cmake g++)"
    exit 1
  fi
fi
for tool in cmake c++ python3; do
  command -v "$tool" >/dev/null 2>&1 || { log "$tool is missing"; exit 1; }
done

mkdir -p "$OUT"
WORK="$(mktemp -d "$OUT/work.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)

log "downloading the llama-cpp-python $VERSION source distribution from PyPI"
python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
  "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[[ -f "$SRC/CMakeLists.txt" ]] || { log "no llama.cpp source at $SRC"; exit 1; }

log "configuring (CPU only, Release)"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF \
  -DGGML_OPENCL=OFF -DGGML_BLAS=OFF >&2

log "building llama-server with $JOBS jobs"
cmake --build "$WORK/build" --config Release --target llama-server -j "$JOBS" >&2

cp "$WORK/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
log "built in $(( $(date +%s) - start )) s"
echo "$BIN"

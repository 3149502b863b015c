#!/usr/bin/env bash
# The test command (README, .ci/run): build every binary, run every test, then print one line
# naming each test that skipped and why (test-support's skip policy records them in
# $CARGO_TARGET_DIR/test-skips.txt, default target/). Exits with the status of the build and tests.
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh -- --nocapture`).
#
# First it installs what the tests need with scripts/install-test-deps.sh (quick when installed;
# Python packages in its venv, see there) and exports what that prints (PATH with the venv's bin
# first, LLAMA_SERVER). PREFIX_ROUTER_NO_INSTALL=1 skips the install and uses this machine as it is.
# When the install fails the tests still run (what is missing skips and says so), except under
# CI=true, where it stops here.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
if [ "${PREFIX_ROUTER_NO_INSTALL:-}" = 1 ]; then
  echo "test deps: not installed (PREFIX_ROUTER_NO_INSTALL=1); tests whose tools are missing skip" >&2
else
  deps_env="$(scripts/install-test-deps.sh)"
  deps_status=$?
  eval "$deps_env"
  if [ "$deps_status" != 0 ]; then
    if [ "${CI:-}" = true ]; then
      echo "test deps: scripts/install-test-deps.sh failed (status $deps_status); under CI=true that stops the run" >&2
      exit "$deps_status"
    fi
    echo "test deps: scripts/install-test-deps.sh failed (status $deps_status); running the tests anyway" >&2
  fi
fi
target="${CARGO_TARGET_DIR:-target}"
skips="$target/test-skips.txt"
mkdir -p "$target"
: >"$skips"
cargo build --workspace --bins && cargo test --workspace "$@"
status=$?
if [ -s "$skips" ]; then
  echo "skipped: $(wc -l <"$skips") ($(paste -sd';' "$skips" | sed 's/;/; /g'))"
else
  echo "skipped: none"
fi
exit "$status"

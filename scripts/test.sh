#!/usr/bin/env bash
# The test command (README, .ci/run): build every binary, run every test, then print one line
# naming each test that skipped and why (test-support's skip policy records them in
# $CARGO_TARGET_DIR/test-skips.txt, default target/). Exits with the status of the build and tests.
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh -- --nocapture`).
set -uo pipefail
cd "$(dirname "$0")/.."
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

#!/bin/bash
# Runs every test binary, even after one fails (--no-fail-fast), and ends
# with one line per suite and the name of each failed test, so that a failure
# in one suite neither hides the others' results nor scrolls away.
set -uo pipefail
cargo=${CARGO:-cargo}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$cargo" test --release --locked --workspace --no-fail-fast -- --test-threads=1 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
echo
echo "make test: one line per suite"
awk '
    /^ *Running /  {
        suite = $2; sub(/^.*\//, "", suite)
        # "Running unittests src/lib.rs (target/release/deps/NAME-HASH)"
        if (suite == "unittests") { suite = $4; sub(/^.*\//, "", suite); sub(/-[0-9a-f]+\)$/, "", suite); suite = "unit tests " suite }
    }
    /^ *Doc-tests / { suite = "doc-tests " $2 }
    /^test .* \.\.\. FAILED$/ { failed[suite] = failed[suite] "\n    failed: " $2 }
    /^test result:/ {
        sub(/^test result: /, "")
        sub(/; 0 measured; 0 filtered out/, "")
        printf "  %-28s %s%s\n", suite, $0, failed[suite]
    }
' "$log"
exit "$status"

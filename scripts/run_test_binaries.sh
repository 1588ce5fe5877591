#!/usr/bin/env bash
# Builds every test of the workspace (profile `ci`) and runs the test binaries, several at once,
# as `cargo test` would run them one after another: each in its package's directory, with its
# output kept in a log that is printed when it fails. The doc tests run as one more job.
#
# Why not `cargo test`: it runs the ~60 binaries one at a time, and most of their time is spent
# waiting on servers, faults and clocks, not on the CPU. Binaries that stop or restart a server of
# the shared cluster (or whose assertions are about timing) run afterwards, one at a time, alone
# (`SERIAL` below): while one of them has a replica down, a test next to it would fail for that.
#
# Usage: scripts/run_test_binaries.sh [ARGS...]    ARGS go to every test binary (a name filter,
# `--nocapture`, ...). FLOW_TEST_JOBS (default 3) sets how many binaries run at once; 1 runs
# every binary in turn. Exits non-zero if any binary failed, after running all of them.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$FLOW_REPO_ROOT"

JOBS="${FLOW_TEST_JOBS:-3}"
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || flow_die "FLOW_TEST_JOBS must be a positive integer, not '$JOBS'"

# Test binaries (by target name) that disturb the shared cluster or time what they check.
SERIAL=" fault_suite exactly_once_faults scale_out nats_source nats_stop nats_stalled_pull "

CARGO_ARGS=(--workspace --exclude flow-examples --profile ci)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

flow_log "cargo test ${CARGO_ARGS[*]} --no-run"
cargo test "${CARGO_ARGS[@]}" --no-run --message-format=json-render-diagnostics \
    >"$work/artifacts.json"

# One line per test binary: name, executable, package directory. A test binary is the artifact
# whose profile says `"test":true` (a target's own `"test"` only says whether it has tests); the
# first `"name"` of its line is its target's.
: >"$work/parallel" && : >"$work/serial"
while IFS= read -r line; do
    exe="$(grep -o '"executable":"[^"]*"' <<<"$line" | cut -d'"' -f4 || true)"
    [ -n "$exe" ] || continue
    name="$(grep -o '"name":"[^"]*"' <<<"$line" | head -n1 | cut -d'"' -f4)"
    manifest="$(grep -o '"manifest_path":"[^"]*"' <<<"$line" | cut -d'"' -f4)"
    queue=parallel
    [[ "$SERIAL" == *" $name "* ]] && queue=serial
    printf '%s\t%s\t%s\n' "$name" "$exe" "$(dirname "$manifest")" >>"$work/$queue"
done < <(grep '"reason":"compiler-artifact"' "$work/artifacts.json" |
    grep -E '"profile":\{[^}]*"test":true\}')
[ -s "$work/parallel" ] || flow_die "cargo listed no test binary"

# Runs one binary with the script's arguments; appends `ok|FAILED <seconds>s <name> <log>` to the
# results and prints it.
run_one() {
    local name="$1" exe="$2" dir="$3" log start status args=()
    log="$FLOW_TEST_WORK/$(basename "$exe").log"
    mapfile -t args <"$FLOW_TEST_WORK/args"
    start=$SECONDS
    if (cd "$dir" && "$exe" "${args[@]}") >"$log" 2>&1; then status=ok; else status=FAILED; fi
    printf '%-6s %4ss %s %s\n' "$status" "$((SECONDS - start))" "$name" "$log" |
        tee -a "$FLOW_TEST_WORK/results"
}
# Doc tests cannot be run from a binary; cargo builds and runs them in one job.
run_doc_tests() {
    local log="$FLOW_TEST_WORK/doc-tests.log" start=$SECONDS status
    if cargo test "${CARGO_ARGS[@]}" --doc >"$log" 2>&1; then status=ok; else status=FAILED; fi
    printf '%-6s %4ss %s %s\n' "$status" "$((SECONDS - start))" "doc-tests" "$log" |
        tee -a "$FLOW_TEST_WORK/results"
}
export -f run_one
export FLOW_TEST_WORK="$work"
: >"$work/results"
if [ "$#" -gt 0 ]; then printf '%s\n' "$@" >"$work/args"; else : >"$work/args"; fi

started=$SECONDS
flow_log "running $(wc -l <"$work/parallel") test binaries, $JOBS at a time, and the doc tests"
run_doc_tests &
doc_tests=$!
tr '\t' '\n' <"$work/parallel" | xargs -d '\n' -n 3 -P "$JOBS" bash -c 'run_one "$@"' run_one || true
wait "$doc_tests" || true

flow_log "running $(wc -l <"$work/serial") test binaries that stop servers or time themselves, one at a time"
while IFS=$'\t' read -r name exe dir; do
    run_one "$name" "$exe" "$dir" </dev/null
done <"$work/serial"

failed=0
while read -r status _ name log; do
    [ "$status" = FAILED ] || continue
    failed=$((failed + 1))
    printf '\n========== %s failed; its output: ==========\n' "$name"
    cat "$log"
done <"$work/results"
flow_log "$(wc -l <"$work/results") test jobs in $((SECONDS - started)) s, $failed failed"
[ "$failed" -eq 0 ]

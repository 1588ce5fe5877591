#!/usr/bin/env bash
# Builds the tests of the workspace (profile `ci`) and runs the test binaries as `cargo test`
# would run them one after another, but several at once: each in its package's directory, with
# its output kept in a log that is printed when it fails. The doc tests run as one more job.
#
# Why not `cargo test`: it runs the ~60 binaries one at a time, and most of their time is spent
# waiting on servers, faults and clocks, not on the CPU. Two kinds of binary cannot share the
# machine with other tests:
#   * the fault binaries (FLOW_FAULT_TESTS in lib.sh) stop or restart servers of the shared
#     cluster: while one of them has a replica down, a test next to it would fail for that. They
#     run one at a time, with no other test; nothing they assert is a duration, so they may run
#     while the rest of the workspace builds (scripts/test.sh does).
#   * the timed binaries (TIMED below) assert how long something took: each runs alone, last.
#
# Usage: scripts/run_test_binaries.sh [--group all|faults|rest] [--artifacts FILE] [ARGS...]
#   --group faults   only the fault binaries; rest: every other binary and the doc tests;
#                    all (default): the rest, then the fault binaries.
#   --artifacts FILE cargo's `--message-format=json-render-diagnostics` output of a build that
#                    already made the binaries (the runner then runs no cargo build of its own;
#                    the doc tests still run through cargo). Without it the runner builds them.
#   ARGS go to every test binary (a name filter, `--nocapture`, ...).
# FLOW_TEST_JOBS (default 3) sets how many binaries run at once; 1 runs every binary in turn.
# Exits non-zero if any binary failed, after running all of its group.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$FLOW_REPO_ROOT"

JOBS="${FLOW_TEST_JOBS:-3}"
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || flow_die "FLOW_TEST_JOBS must be a positive integer, not '$JOBS'"

# Test binaries (by target name) whose assertions are about timing.
TIMED=" nats_stop nats_stalled_pull "

group=all
artifacts=""
while [ "$#" -gt 0 ]; do
    case "$1" in
    --group)
        [ "$#" -ge 2 ] || flow_die "--group needs a value: all, faults or rest"
        group="$2"
        shift 2
        ;;
    --artifacts)
        [ "$#" -ge 2 ] || flow_die "--artifacts needs the file cargo's JSON output was written to"
        artifacts="$2"
        shift 2
        ;;
    *) break ;;
    esac
done
case "$group" in
all | faults | rest) ;;
*) flow_die "--group must be all, faults or rest, not '$group'" ;;
esac

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [ -z "$artifacts" ]; then
    artifacts="$work/artifacts.json"
    flow_build_tests "$artifacts" "$group"
fi
[ -r "$artifacts" ] || flow_die "cannot read the build's artifacts file '$artifacts'"

# One line per test binary: name, executable, package directory; in the queue of its kind. A
# test binary is the artifact whose profile says `"test":true` (a target's own `"test"` only says
# whether it has tests); the first `"name"` of its line is its target's.
: >"$work/parallel" && : >"$work/faults" && : >"$work/timed"
while IFS= read -r line; do
    exe="$(grep -o '"executable":"[^"]*"' <<<"$line" | cut -d'"' -f4 || true)"
    [ -n "$exe" ] || continue
    name="$(grep -o '"name":"[^"]*"' <<<"$line" | head -n1 | cut -d'"' -f4)"
    manifest="$(grep -o '"manifest_path":"[^"]*"' <<<"$line" | cut -d'"' -f4)"
    queue=parallel
    [[ " ${FLOW_FAULT_TESTS[*]} " == *" $name "* ]] && queue=faults
    [[ "$TIMED" == *" $name "* ]] && queue=timed
    printf '%s\t%s\t%s\n' "$name" "$exe" "$(dirname "$manifest")" >>"$work/$queue"
done < <(grep '"reason":"compiler-artifact"' "$artifacts" |
    grep -E '"profile":\{[^}]*"test":true\}')

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
    if cargo test "${FLOW_TEST_CARGO_ARGS[@]}" --doc >"$log" 2>&1; then status=ok; else status=FAILED; fi
    printf '%-6s %4ss %s %s\n' "$status" "$((SECONDS - start))" "doc-tests" "$log" |
        tee -a "$FLOW_TEST_WORK/results"
}
# Runs the binaries of queue $1 one at a time.
run_in_turn() {
    while IFS=$'\t' read -r name exe dir; do
        run_one "$name" "$exe" "$dir" </dev/null
    done <"$work/$1"
}
export -f run_one
export FLOW_TEST_WORK="$work"
: >"$work/results"
if [ "$#" -gt 0 ]; then printf '%s\n' "$@" >"$work/args"; else : >"$work/args"; fi

started=$SECONDS
if [ "$group" != faults ]; then
    [ -s "$work/parallel" ] || flow_die "the build listed no test binary besides the fault binaries"
    flow_log "running $(wc -l <"$work/parallel") test binaries, $JOBS at a time, and the doc tests"
    run_doc_tests &
    doc_tests=$!
    tr '\t' '\n' <"$work/parallel" | xargs -d '\n' -n 3 -P "$JOBS" bash -c 'run_one "$@"' run_one || true
    wait "$doc_tests" || true
    flow_log "running $(wc -l <"$work/timed") test binaries that time themselves, one at a time"
    run_in_turn timed
fi
if [ "$group" != rest ]; then
    [ -s "$work/faults" ] || flow_die "the build listed none of the fault binaries (${FLOW_FAULT_TESTS[*]})"
    flow_log "running $(wc -l <"$work/faults") test binaries that stop servers, one at a time"
    run_in_turn faults
fi

failed=0
while read -r status _ name log; do
    [ "$status" = FAILED ] || continue
    failed=$((failed + 1))
    printf '\n========== %s failed; its output: ==========\n' "$name"
    cat "$log"
done <"$work/results"

# The tests, summed over every job's `test result:` lines (libtest prints one per binary, and one
# per doc-test crate); a failed test is listed by its binary and name. With FLOW_TEST_TOTALS set
# (scripts/test.sh), the counts and names are appended to that file for the run's last line.
passed=0 failed_tests=0 ignored=0
: >"$work/failed-tests"
while read -r _ _ name log; do
    while read -r p f i; do
        passed=$((passed + p)) failed_tests=$((failed_tests + f)) ignored=$((ignored + i))
    done < <(sed -nE 's/^test result: [A-Za-z]+\. ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1 \2 \3/p' "$log")
    sed -nE "s/^test (.+) \.\.\. FAILED\$/  $name: \1/p" "$log" >>"$work/failed-tests"
done <"$work/results"
if [ -n "${FLOW_TEST_TOTALS:-}" ]; then
    printf 'counts %s %s %s\n' "$passed" "$failed_tests" "$ignored" >>"$FLOW_TEST_TOTALS"
    sed 's/^/failed /' "$work/failed-tests" >>"$FLOW_TEST_TOTALS"
fi
flow_log "$group: $(wc -l <"$work/results") test jobs in $((SECONDS - started)) s, $failed failed; tests: $passed passed, $failed_tests failed, $ignored ignored"
[ "$failed" -eq 0 ]

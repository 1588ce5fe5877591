#!/usr/bin/env bash
# Runs every test: installs what is missing, starts the local cluster, then `cargo fmt --check`
# and every test of `cargo test --workspace --exclude flow-examples --profile ci` (release with
# opt-level 1: see Cargo.toml), its binaries several at once (scripts/run_test_binaries.sh), the
# ones that stop servers while the rest builds.
# Lints: scripts/lint.sh (clippy builds every target a second time, which a 20-minute CI run
# cannot afford).
# Extra arguments go to every test binary (e.g. `scripts/test.sh --nocapture`, or a name filter).
# The local cluster is left running afterwards; stop it with `scripts/cluster.sh down`.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$FLOW_REPO_ROOT"

# What the crates need to build (C toolchain, pkg-config, what librdkafka builds against); the
# cluster's packages are installed while the tests build (below).
flow_ensure_build_packages

# Rust: the toolchain is pinned by rust-toolchain.toml; rustup installs it (with rustfmt and clippy)
# on first use.
if ! command -v cargo >/dev/null 2>&1 && [ -f "$HOME/.cargo/env" ]; then
    # shellcheck source=/dev/null
    source "$HOME/.cargo/env"
fi
command -v cargo >/dev/null 2>&1 ||
    flow_die "cargo not found: install rustup (https://rustup.rs); rust-toolchain.toml pins the toolchain"
if command -v rustup >/dev/null 2>&1 && ! rustc --version >/dev/null 2>&1; then
    rustup toolchain install # no argument: the toolchain of rust-toolchain.toml
fi
if ! cargo fmt --version >/dev/null 2>&1; then
    rustup component add rustfmt
fi

flow_log "cargo fmt --all -- --check"
cargo fmt --all -- --check

# The build takes most of a CI run and needs none of the servers; the fault binaries need the
# servers and little CPU. So: the fault binaries (and the libraries and bins they use, most of the
# build) are built while the cluster's packages install and its servers start; they then run
# while the rest of the workspace builds; the other binaries run last. Both builds use the same
# packages and profile, so the second reuses everything the first made (flow_build_tests).
faults_json="$(mktemp)" && faults_log="$(mktemp)" && rest_json="$(mktemp)" && rest_log="$(mktemp)"
# What every group of test binaries counted (scripts/run_test_binaries.sh appends to it).
FLOW_TEST_TOTALS="$(mktemp)" && export FLOW_TEST_TOTALS
build=""
trap '[ -z "$build" ] || kill "$build" 2>/dev/null || true; rm -f "$faults_json" "$faults_log" "$rest_json" "$rest_log" "$FLOW_TEST_TOTALS"' EXIT
# The run's last line: the tests of every binary it ran, summed, with the failed ones named above.
print_totals() {
    local passed=0 failed=0 ignored=0 kind a b c
    if grep -q '^failed ' "$FLOW_TEST_TOTALS"; then
        echo "failed tests:"
        sed -n 's/^failed //p' "$FLOW_TEST_TOTALS"
    fi
    while read -r kind a b c; do
        [ "$kind" = counts ] || continue
        passed=$((passed + a)) failed=$((failed + b)) ignored=$((ignored + c))
    done <"$FLOW_TEST_TOTALS"
    echo "$passed passed, $failed failed, $ignored ignored"
}
# Waits for the build of pid $1 and prints its log $2; dies naming what it built ($3) if it failed.
wait_for_build() {
    local status=0
    wait "$1" || status=$?
    build=""
    cat "$2"
    [ "$status" -eq 0 ] || flow_die "building $3 failed (cargo exited $status)"
}

flow_log "building the fault binaries (${FLOW_FAULT_TESTS[*]}) in the background"
flow_build_tests "$faults_json" faults 2>"$faults_log" &
build=$!
flow_ensure_cluster_packages
flow_log "starting the local cluster"
bash scripts/cluster.sh up
flow_log "waiting for the fault binaries' build"
wait_for_build "$build" "$faults_log" "the fault binaries"

flow_log "building every other test in the background while the fault binaries run"
flow_build_tests "$rest_json" 2>"$rest_log" &
build=$!
faults_ok=0
bash scripts/run_test_binaries.sh --group faults --artifacts "$faults_json" "$@" || faults_ok=$?
flow_log "waiting for the build of the other tests"
wait_for_build "$build" "$rest_log" "the tests"
rest_ok=0
bash scripts/run_test_binaries.sh --group rest --artifacts "$rest_json" "$@" || rest_ok=$?
if [ "$faults_ok" -ne 0 ] || [ "$rest_ok" -ne 0 ]; then
    flow_log "tests failed: fault binaries exit $faults_ok, the others exit $rest_ok (each binary's output is printed above)"
    print_totals
    exit 1
fi

flow_log "all checks passed; the local cluster is still running (scripts/cluster.sh down stops it)"
print_totals

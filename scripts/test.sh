#!/usr/bin/env bash
# Runs every test: installs what is missing, starts the local cluster, then `cargo fmt --check`
# and every test of `cargo test --workspace --exclude flow-examples --profile ci` (release with
# opt-level 1: see Cargo.toml), its binaries several at once (scripts/run_test_binaries.sh).
# Lints: scripts/lint.sh (clippy builds every target a second time, which a 20-minute CI run
# cannot afford).
# Extra arguments go to every test binary (e.g. `scripts/test.sh --nocapture`, or a name filter).
# The local cluster is left running afterwards; stop it with `scripts/cluster.sh down`.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$FLOW_REPO_ROOT"

# What the crates need to build (C toolchain, pkg-config, librdkafka); the cluster's packages
# are installed while the tests build (below).
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

# The build takes most of a CI run and needs none of the servers: it runs while the cluster's
# packages are installed and its servers start.
build_log="$(mktemp)"
flow_log "cargo test --workspace --exclude flow-examples --profile ci --no-run (in the background)"
cargo test --workspace --exclude flow-examples --profile ci --no-run >"$build_log" 2>&1 &
build=$!
trap 'kill "$build" 2>/dev/null || true' EXIT
flow_ensure_cluster_packages
flow_log "starting the local cluster"
bash scripts/cluster.sh up
flow_log "waiting for the build"
build_ok=0
wait "$build" || build_ok=$?
trap - EXIT
cat "$build_log"
rm -f "$build_log"
[ "$build_ok" -eq 0 ] || flow_die "building the tests failed (cargo exited $build_ok)"

# flow-examples is left out: its examples are built (and run) as flow-integration's `-it` bins
# from the same files, and building them twice cost a CI run ~40 s. The binaries run several at
# once (see run_test_binaries.sh).
bash scripts/run_test_binaries.sh "$@"

flow_log "all checks passed; the local cluster is still running (scripts/cluster.sh down stops it)"

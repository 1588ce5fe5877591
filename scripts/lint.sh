#!/usr/bin/env bash
# The lints every commit keeps clean: no import cycle between the modules of any crate
# (scripts/import_cycles.py), `cargo fmt --check`, clippy on every target and rustdoc, both with
# warnings as errors. Needs no cluster.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$FLOW_REPO_ROOT"

flow_log "import cycles (scripts/import_cycles.py)"
python3 scripts/import_cycles.py

flow_ensure_build_packages
if ! cargo clippy --version >/dev/null 2>&1; then
    rustup component add rustfmt clippy
fi
flow_log "cargo fmt --all -- --check"
cargo fmt --all -- --check
flow_log "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
flow_log "cargo doc --no-deps --workspace (RUSTDOCFLAGS=-D warnings)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace
flow_log "lints clean"

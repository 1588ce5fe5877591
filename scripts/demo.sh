#!/usr/bin/env bash
# The quickstart: installs what is missing, builds the worker, starts the local cluster, creates the
# demo tables, runs the quickstart pipeline and prints what landed. Safe to re-run: the pipeline's
# state lives in $FLOW_DEMO_DIR (default /tmp/flow-demo), so a second run finds everything delivered
# and adds nothing; `rm -rf /tmp/flow-demo` starts over.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$FLOW_REPO_ROOT"

DEMO_DIR="${FLOW_DEMO_DIR:-/tmp/flow-demo}"
mkdir -p "$DEMO_DIR"

flow_ensure_cluster_packages
flow_ensure_build_packages
command -v cargo >/dev/null 2>&1 || flow_die "cargo not found: install rustup; rust-toolchain.toml pins the toolchain"

flow_log "building flow-worker (release)"
cargo build --release -q -p flow-worker
WORKER="$FLOW_REPO_ROOT/target/release/flow-worker"

flow_log "starting the local cluster"
bash scripts/cluster.sh up >/dev/null

# The demo table on every node: each shard's two replicas share one ZooKeeper path.
for port in 18123 18124 18125 18126; do
    curl -sS --fail-with-body "http://127.0.0.1:$port/" --data-binary @- <<'SQL' >/dev/null
CREATE TABLE IF NOT EXISTS default.events (
    id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime, payload String
) ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/default.events', '{replica}')
ORDER BY id
SQL
done

SPEC="$FLOW_REPO_ROOT/examples/specs/quickstart.yaml"
flow_log "validating $SPEC"
"$WORKER" validate "$SPEC"
flow_log "running the quickstart pipeline (4 partitions x 25,000 generated messages, sharded exactly-once)"
RUST_LOG="${RUST_LOG:-warn}" "$WORKER" run "$SPEC" --state-dir "$DEMO_DIR/state"

echo
echo "Landed in default.events (count, distinct ids, distinct user_ids per replica):"
for node in a1:18123 a2:18124 b1:18125 b2:18126; do
    port="${node#*:}"
    curl -sS --fail-with-body "http://127.0.0.1:$port/" --data-binary "SYSTEM SYNC REPLICA default.events" >/dev/null
    printf '  shard %s replica %s: %s\n' "${node:0:1}" "${node%%:*}" \
        "$(curl -sS --fail-with-body "http://127.0.0.1:$port/" --data-binary "SELECT count(), uniqExact(id), uniqExact(user_id) FROM default.events" | tr '\t' ' ')"
done
echo
echo "Pipeline state:"
"$WORKER" status --state-dir "$DEMO_DIR/state"

# shellcheck shell=bash
# Shared helpers for the scripts in this directory. Source it; do not run it.

FLOW_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export FLOW_REPO_ROOT

flow_log() {
    printf '[flow] %s\n' "$*" >&2
}

flow_die() {
    printf '[flow] error: %s\n' "$*" >&2
    exit 1
}

# Is the Debian package $1 installed?
flow_pkg_installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" = "install ok installed" ]
}

# flow_ensure_packages PKG...: apt-get installs the packages that are not installed yet.
flow_ensure_packages() {
    local missing=() pkg
    for pkg in "$@"; do
        flow_pkg_installed "$pkg" || missing+=("$pkg")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    command -v apt-get >/dev/null 2>&1 ||
        flow_die "missing packages (${missing[*]}) and no apt-get to install them"
    local sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 ||
            flow_die "missing packages (${missing[*]}); run as root or install them yourself"
        sudo=(sudo)
    fi
    flow_log "installing missing packages: ${missing[*]}"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# The packages the local cluster needs (ClickHouse 18.16, ZooKeeper 3.8 + Java, NATS, curl, openssl)
# and its modern ClickHouse nodes.
flow_ensure_cluster_packages() {
    local need=()
    command -v clickhouse-server >/dev/null 2>&1 || need+=(clickhouse-server)
    command -v clickhouse-client >/dev/null 2>&1 || need+=(clickhouse-client)
    { [ -f /usr/share/java/zookeeper.jar ] && command -v java >/dev/null 2>&1; } || need+=(zookeeper)
    command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || need+=(nats-server)
    command -v curl >/dev/null 2>&1 || need+=(curl)
    command -v openssl >/dev/null 2>&1 || need+=(openssl)
    [ -d /etc/ssl/certs ] && [ -n "$(ls -A /etc/ssl/certs 2>/dev/null)" ] || need+=(ca-certificates)
    [ "${#need[@]}" -eq 0 ] || flow_ensure_packages "${need[@]}"
    flow_ensure_modern_clickhouse
}

# The modern ClickHouse nodes (m1, m2 in scripts/cluster.sh): ClickHouse 26.9 as PyPI's chdb-core,
# pinned, in a virtualenv outside the clone that outlives it (like CI's build output), so that a
# machine downloads the 181 MB wheel once. FLOW_MODERN_VENV moves it.
FLOW_MODERN_CHDB_CORE=26.9.0
FLOW_MODERN_CLICKHOUSE=26.9.2.1
FLOW_MODERN_VENV="${FLOW_MODERN_VENV:-/var/tmp/flow-chdb-core-$FLOW_MODERN_CHDB_CORE}"

# The Python of the modern nodes' virtualenv.
flow_modern_python() {
    echo "$FLOW_MODERN_VENV/bin/python"
}

# Is the pinned chdb-core importable from the virtualenv?
flow_modern_installed() {
    [ -x "$(flow_modern_python)" ] &&
        [ "$("$(flow_modern_python)" -c 'import importlib.metadata as m; print(m.version("chdb-core"))' 2>/dev/null)" = "$FLOW_MODERN_CHDB_CORE" ] &&
        "$(flow_modern_python)" -c 'from chdb import _chdb' 2>/dev/null
}

# Installs chdb-core into FLOW_MODERN_VENV unless it is there. A half-made virtualenv (an install
# that was killed) is made again.
flow_ensure_modern_clickhouse() {
    flow_modern_installed && return 0
    command -v python3 >/dev/null 2>&1 || flow_ensure_packages python3 python3-venv
    flow_log "installing ClickHouse $FLOW_MODERN_CLICKHOUSE (PyPI chdb-core==$FLOW_MODERN_CHDB_CORE) into $FLOW_MODERN_VENV"
    rm -rf "$FLOW_MODERN_VENV"
    if ! python3 -m venv "$FLOW_MODERN_VENV" >/dev/null 2>&1; then
        rm -rf "$FLOW_MODERN_VENV"
        flow_ensure_packages python3-venv
        python3 -m venv "$FLOW_MODERN_VENV" || flow_die "python3 -m venv $FLOW_MODERN_VENV failed"
    fi
    "$FLOW_MODERN_VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps \
        "chdb-core==$FLOW_MODERN_CHDB_CORE" ||
        flow_die "pip could not install chdb-core==$FLOW_MODERN_CHDB_CORE into $FLOW_MODERN_VENV"
    flow_modern_installed || flow_die "chdb-core==$FLOW_MODERN_CHDB_CORE installed into $FLOW_MODERN_VENV but does not import"
}

# What building the workspace needs besides Rust: a C toolchain and pkg-config for -sys crates,
# and the libraries librdkafka is built against (rdkafka-sys compiles its bundled sources with
# TLS, SASL and zlib from the system; zstd it compiles itself).
flow_ensure_build_packages() {
    local need=()
    command -v cc >/dev/null 2>&1 || need+=(build-essential)
    command -v make >/dev/null 2>&1 || need+=(make)
    command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
    local lib
    for lib in libssl-dev libsasl2-dev zlib1g-dev; do
        flow_pkg_installed "$lib" || need+=("$lib")
    done
    [ "${#need[@]}" -eq 0 ] || flow_ensure_packages "${need[@]}"
}

# The workspace's tests as scripts/test.sh builds and runs them: release settings with opt-level 1
# (Cargo.toml's `ci` profile); flow-examples is left out, its examples are built and run as
# flow-integration's `-it` bins from the same files.
FLOW_TEST_CARGO_ARGS=(--workspace --exclude flow-examples --profile ci)

# Test binaries that stop or restart servers of the shared cluster (scripts/run_test_binaries.sh
# runs them one at a time with no other test beside them).
FLOW_FAULT_TESTS=(fault_suite exactly_once_faults scale_out nats_source)

# flow_build_tests OUTPUT [faults]: builds the tests without running them and writes cargo's JSON
# list of what it built to OUTPUT (diagnostics go to stderr); with `faults`, only the fault
# binaries and what they need. Both take the same packages, profile and features, so a full
# build after the fault binaries' reuses everything they made.
flow_build_tests() {
    local output="$1" name args=("${FLOW_TEST_CARGO_ARGS[@]}" --no-run --message-format=json-render-diagnostics)
    if [ "${2:-}" = faults ]; then
        for name in "${FLOW_FAULT_TESTS[@]}"; do
            args+=(--test "$name")
        done
    fi
    flow_log "cargo test ${args[*]}"
    cargo test "${args[@]}" >"$output"
}

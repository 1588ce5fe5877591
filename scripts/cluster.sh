#!/usr/bin/env bash
# The local cluster: one ZooKeeper, four ClickHouse 18.16 servers (two shards of two replicas), two
# modern ClickHouse 26.9 nodes (two single-node shards) and one NATS server with JetStream.
#
#   scripts/cluster.sh up            start every node that is not running (keeps data), wait, print endpoints
#   scripts/cluster.sh down          stop every node (TERM, then KILL after a timeout); keeps data
#   scripts/cluster.sh status        one line per node: running/stopped, pid, ports
#   scripts/cluster.sh start NODE    start one node (zk, a1, a2, b1, b2, m1, m2, nats) and wait until it answers
#   scripts/cluster.sh stop NODE     stop one node gracefully (TERM, then KILL); keeps data
#   scripts/cluster.sh kill NODE     SIGKILL one node (crash simulation); keeps data
#   scripts/cluster.sh endpoints     print the endpoints
#
# Environment: FLOW_CLUSTER_DIR (default /tmp/flow-cluster), FLOW_CLUSTER_TIMEOUT (seconds to wait for a
# node to answer, default 90), FLOW_CLUSTER_STOP_TIMEOUT (seconds between TERM and KILL, default 30).
#
# Ports (all on 127.0.0.1):
#   zk  client 12181
#   a1  http 18123  native 19000  interserver 19009  https 18443   shard a
#   a2  http 18124  native 19001  interserver 19010  https 18444   shard a
#   b1  http 18125  native 19002  interserver 19011  https 18445   shard b
#   b2  http 18126  native 19003  interserver 19012  https 18446   shard b
#   m1  http 18127  native 19004   modern shard a (ClickHouse 26.9, MergeTree only)
#   m2  http 18128  native 19005   modern shard b (ClickHouse 26.9, MergeTree only)
#   nats  client 14222  monitoring 18222   JetStream store under $FLOW_CLUSTER_DIR/nats/jetstream
# Users: `default` (no password) and `flow_secret` (password `flow-pass`).
# remote_servers cluster `flow`: shard a = a1,a2; shard b = b1,b2 (internal_replication true).
# TLS: self-signed certificate for 127.0.0.1/localhost at $FLOW_CLUSTER_DIR/tls/ca.crt.
# The modern nodes are ClickHouse 26.9.2.1 from PyPI's chdb-core (clickhouse-local serving HTTP and
# native TCP; scripts/modern_node.py): user `default` only, no TLS, no ZooKeeper, so no
# ReplicatedMergeTree (a replicated table there stays read-only) and no async insert queue (an
# `async_insert` INSERT runs synchronously). Installed into FLOW_MODERN_VENV (lib.sh).
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

BASE="${FLOW_CLUSTER_DIR:-/tmp/flow-cluster}"
mkdir -p "$BASE"
BASE="$(cd "$BASE" && pwd)"
START_TIMEOUT="${FLOW_CLUSTER_TIMEOUT:-90}"
STOP_TIMEOUT="${FLOW_CLUSTER_STOP_TIMEOUT:-30}"
HOST=127.0.0.1
ZK_PORT=12181
NATS_PORT=14222
NATS_MONITOR_PORT=18222
CH_NODES=(a1 a2 b1 b2)
MODERN_NODES=(m1 m2)
ALL_NODES=(zk a1 a2 b1 b2 m1 m2 nats)

node_index() {
    case "$1" in
        a1) echo 0 ;;
        a2) echo 1 ;;
        b1) echo 2 ;;
        b2) echo 3 ;;
        m1) echo 4 ;;
        m2) echo 5 ;;
        *) return 1 ;;
    esac
}
is_modern() { case "$1" in m1 | m2) return 0 ;; *) return 1 ;; esac }
http_port() { echo $((18123 + $(node_index "$1"))); }
tcp_port() { echo $((19000 + $(node_index "$1"))); }
interserver_port() { echo $((19009 + $(node_index "$1"))); }
https_port() { echo $((18443 + $(node_index "$1"))); }
shard_of() { # a1, a2, m1 are in shard a; b1, b2, m2 in shard b
    case "$1" in
        m1) echo a ;;
        m2) echo b ;;
        *) echo "${1:0:1}" ;;
    esac
}

valid_node() {
    case "$1" in
        zk | a1 | a2 | b1 | b2 | m1 | m2 | nats) return 0 ;;
        *) return 1 ;;
    esac
}

node_dir() { echo "$BASE/$1"; }
node_log() {
    case "$1" in
        zk) echo "$BASE/zk/zookeeper.log" ;;
        nats) echo "$BASE/nats/nats-server.log" ;;
        *) echo "$BASE/$1/log/clickhouse-server.log" ;;
    esac
}

# The node's config file; its path on a command line identifies the node's server process.
node_config() {
    case "$1" in
        zk) echo "$(node_dir zk)/zoo.cfg" ;;
        nats) echo "$(node_dir nats)/nats.conf" ;;
        *) echo "$(node_dir "$1")/config.xml" ;;
    esac
}

# The pid of the node's server if it is running, else nothing (and status 1).
node_pid() {
    local pidfile pid
    pidfile="$(node_dir "$1")/pid"
    if [ -f "$pidfile" ]; then
        pid="$(tr -dc '0-9' <"$pidfile")"
        # Guard against a recycled pid: the process must be ours (its command line names the node
        # dir).
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null &&
            tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$(node_dir "$1")/"; then
            echo "$pid"
            return 0
        fi
    fi
    # The pid file can be stale (a launch that lost to a running server) and /proc/PID/cmdline
    # reads empty while the launcher execs the server: find the server by its config path, and
    # record what was found.
    pid="$(pgrep -f -- "$(node_config "$1")" 2>/dev/null | head -n 1 || true)"
    [ -n "$pid" ] || return 1
    echo "$pid" >"$pidfile"
    echo "$pid"
}

# Has the node's server exited? Asked twice, half a second apart, so that a launch caught in
# mid-exec is not taken for a crash.
node_exited() {
    node_pid "$1" >/dev/null && return 1
    sleep 0.5
    ! node_pid "$1" >/dev/null
}

# ---------------------------------------------------------------------------------------------------
# Configuration

ensure_tls() {
    local tls="$BASE/tls"
    [ -s "$tls/server.crt" ] && [ -s "$tls/server.key" ] && return 0
    mkdir -p "$tls"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 \
        -keyout "$tls/server.key.tmp" -out "$tls/server.crt.tmp" \
        -subj "/CN=localhost" \
        -addext "subjectAltName=IP:127.0.0.1,DNS:localhost" >/dev/null 2>&1 ||
        flow_die "openssl could not generate the self-signed certificate in $tls"
    chmod 600 "$tls/server.key.tmp"
    mv "$tls/server.key.tmp" "$tls/server.key"
    mv "$tls/server.crt.tmp" "$tls/server.crt"
    # Self-signed: the certificate is its own CA. Clients use --cacert $tls/ca.crt.
    cp "$tls/server.crt" "$tls/ca.crt"
}

write_zk_config() {
    local dir
    dir="$(node_dir zk)"
    mkdir -p "$dir/data"
    cat >"$dir/zoo.cfg" <<EOF
# Generated by scripts/cluster.sh; rewritten on every start.
tickTime=2000
initLimit=10
syncLimit=5
dataDir=$dir/data
clientPort=$ZK_PORT
clientPortAddress=$HOST
maxClientCnxns=0
admin.enableServer=false
4lw.commands.whitelist=ruok,stat,mntr,srvr
autopurge.snapRetainCount=3
autopurge.purgeInterval=1
EOF
    cat >"$dir/log4j.properties" <<'EOF'
log4j.rootLogger=INFO, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} - %-5p [%t:%C{1}@%L] - %m%n
EOF
}

remote_servers_xml() {
    local shard node
    echo "    <remote_servers>"
    echo "        <flow>"
    for shard in a b; do
        echo "            <shard>"
        echo "                <internal_replication>true</internal_replication>"
        for node in "${shard}1" "${shard}2"; do
            echo "                <replica><host>$HOST</host><port>$(tcp_port "$node")</port></replica>"
        done
        echo "            </shard>"
    done
    echo "        </flow>"
    echo "    </remote_servers>"
}

write_ch_config() {
    local node="$1" dir
    dir="$(node_dir "$node")"
    mkdir -p "$dir/data" "$dir/tmp" "$dir/user_files" "$dir/format_schemas" "$dir/log"
    cat >"$dir/users.xml" <<'EOF'
<?xml version="1.0"?>
<!-- Generated by scripts/cluster.sh; rewritten on every start. -->
<yandex>
    <profiles>
        <default>
            <max_memory_usage>4000000000</max_memory_usage>
            <use_uncompressed_cache>0</use_uncompressed_cache>
            <load_balancing>random</load_balancing>
        </default>
        <readonly>
            <readonly>1</readonly>
        </readonly>
    </profiles>
    <users>
        <default>
            <password></password>
            <networks><ip>::1</ip><ip>127.0.0.1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </default>
        <flow_secret>
            <password>flow-pass</password>
            <networks><ip>::1</ip><ip>127.0.0.1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </flow_secret>
    </users>
    <quotas>
        <default>
            <interval>
                <duration>3600</duration>
                <queries>0</queries>
                <errors>0</errors>
                <result_rows>0</result_rows>
                <read_rows>0</read_rows>
                <execution_time>0</execution_time>
            </interval>
        </default>
    </quotas>
</yandex>
EOF
    {
        cat <<EOF
<?xml version="1.0"?>
<!-- Generated by scripts/cluster.sh for node $node; rewritten on every start. -->
<yandex>
    <logger>
        <level>information</level>
        <log>$dir/log/clickhouse-server.log</log>
        <errorlog>$dir/log/clickhouse-server.err.log</errorlog>
        <size>100M</size>
        <count>3</count>
    </logger>
    <listen_host>$HOST</listen_host>
    <http_port>$(http_port "$node")</http_port>
    <tcp_port>$(tcp_port "$node")</tcp_port>
    <https_port>$(https_port "$node")</https_port>
    <interserver_http_port>$(interserver_port "$node")</interserver_http_port>
    <interserver_http_host>$HOST</interserver_http_host>
    <openSSL>
        <server>
            <certificateFile>$BASE/tls/server.crt</certificateFile>
            <privateKeyFile>$BASE/tls/server.key</privateKeyFile>
            <verificationMode>none</verificationMode>
            <loadDefaultCAFile>true</loadDefaultCAFile>
            <cacheSessions>true</cacheSessions>
            <disableProtocols>sslv2,sslv3</disableProtocols>
            <preferServerCiphers>true</preferServerCiphers>
        </server>
        <client>
            <loadDefaultCAFile>true</loadDefaultCAFile>
            <cacheSessions>true</cacheSessions>
            <disableProtocols>sslv2,sslv3</disableProtocols>
            <preferServerCiphers>true</preferServerCiphers>
            <invalidCertificateHandler><name>RejectCertificateHandler</name></invalidCertificateHandler>
        </client>
    </openSSL>
    <max_connections>1024</max_connections>
    <keep_alive_timeout>3</keep_alive_timeout>
    <max_concurrent_queries>100</max_concurrent_queries>
    <uncompressed_cache_size>67108864</uncompressed_cache_size>
    <mark_cache_size>268435456</mark_cache_size>
    <path>$dir/data/</path>
    <tmp_path>$dir/tmp/</tmp_path>
    <user_files_path>$dir/user_files/</user_files_path>
    <format_schema_path>$dir/format_schemas/</format_schema_path>
    <users_config>$dir/users.xml</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <timezone>UTC</timezone>
    <mlock_executable>false</mlock_executable>
    <builtin_dictionaries_reload_interval>3600</builtin_dictionaries_reload_interval>
    <max_session_timeout>3600</max_session_timeout>
    <default_session_timeout>60</default_session_timeout>
    <zookeeper>
        <node><host>$HOST</host><port>$ZK_PORT</port></node>
        <session_timeout_ms>10000</session_timeout_ms>
    </zookeeper>
    <macros>
        <shard>$(shard_of "$node")</shard>
        <replica>$node</replica>
    </macros>
    <distributed_ddl>
        <path>/clickhouse/task_queue/ddl</path>
    </distributed_ddl>
EOF
        remote_servers_xml
        echo "</yandex>"
    } >"$dir/config.xml"
}

# A modern node's config.xml, read by LocalServer from its working directory: listeners and a log
# of its own. The data path is given to the server's query (scripts/modern_node.py).
write_modern_config() {
    local node="$1" dir
    dir="$(node_dir "$node")"
    mkdir -p "$dir/data" "$dir/log"
    cat >"$dir/config.xml" <<EOF
<?xml version="1.0"?>
<!-- Generated by scripts/cluster.sh for modern node $node; rewritten on every start. -->
<clickhouse>
    <logger>
        <level>information</level>
        <log>$dir/log/clickhouse-server.log</log>
        <errorlog>$dir/log/clickhouse-server.err.log</errorlog>
        <size>100M</size>
        <count>3</count>
        <console>0</console>
    </logger>
    <listen_host>$HOST</listen_host>
    <http_port>$(http_port "$node")</http_port>
    <tcp_port>$(tcp_port "$node")</tcp_port>
    <timezone>UTC</timezone>
    <max_concurrent_queries>100</max_concurrent_queries>
    <mark_cache_size>268435456</mark_cache_size>
    <!-- What a test reads to see what the server received (the settings of each INSERT, its
         deduplication token among them). -->
    <query_log>
        <database>system</database>
        <table>query_log</table>
        <flush_interval_milliseconds>1000</flush_interval_milliseconds>
    </query_log>
</clickhouse>
EOF
}

# ---------------------------------------------------------------------------------------------------
# Health checks

# ZooKeeper serves requests. Not `ruok`: it answers `imok` while the server is still loading its
# snapshot and refusing sessions, and a ClickHouse server started then dies on its first handshake.
# `srvr` prints a `Mode:` line only once the server is running.
zk_ok() {
    local answer
    answer="$(timeout 3 bash -c "exec 3<>/dev/tcp/$HOST/$ZK_PORT && printf srvr >&3 && cat <&3" 2>/dev/null || true)"
    grep -q '^Mode: ' <<<"$answer"
}

# NATS answers its monitoring endpoint once it serves clients; `jetstream` must be enabled.
nats_ok() {
    curl -sS --max-time 3 "http://$HOST:$NATS_MONITOR_PORT/jsz" 2>/dev/null | grep -q '"config"'
}

write_nats_config() {
    local dir
    dir="$(node_dir nats)"
    mkdir -p "$dir/jetstream"
    cat >"$dir/nats.conf" <<CONF
listen: $HOST:$NATS_PORT
http: $HOST:$NATS_MONITOR_PORT
server_name: flow-nats
jetstream {
    store_dir: "$dir/jetstream"
    max_memory_store: 256MB
    max_file_store: 8GB
}
CONF
}

ch_query() { # ch_query NODE SQL
    curl -sS --max-time 5 --data-binary "$2" "http://$HOST:$(http_port "$1")/" 2>/dev/null
}

ch_ok() {
    local node="$1" ping one
    ping="$(curl -sS --max-time 3 "http://$HOST:$(http_port "$node")/ping" 2>/dev/null || true)"
    [ "$ping" = "Ok." ] || return 1
    one="$(ch_query "$node" "SELECT 1" || true)"
    [ "$one" = 1 ]
}

# ClickHouse node connected to ZooKeeper (replicated tables usable).
ch_zk_ok() {
    local n
    n="$(ch_query "$1" "SELECT count() FROM system.zookeeper WHERE path = '/'" || true)"
    [[ "$n" =~ ^[0-9]+$ ]]
}

node_ok() {
    case "$1" in
        zk) zk_ok ;;
        nats) nats_ok ;;
        *) ch_ok "$1" ;;
    esac
}

node_port() {
    case "$1" in
        zk) echo "$ZK_PORT" ;;
        nats) echo "$NATS_PORT" ;;
        *) http_port "$1" ;;
    esac
}

# ---------------------------------------------------------------------------------------------------
# Start / stop

launch() { # launch NODE: start the node's server detached, write its pid file
    local node="$1" dir pidfile cp
    dir="$(node_dir "$node")"
    pidfile="$dir/pid"
    rm -f "$pidfile"
    if [ "$node" = zk ]; then
        write_zk_config
        cp="$dir:/usr/share/java/zookeeper.jar"
        # Debian's zookeeper.jar lists its dependencies in its manifest but no SLF4J binding.
        [ -f /usr/share/java/slf4j-log4j12.jar ] && [ -f /usr/share/java/log4j-1.2.jar ] &&
            cp="$cp:/usr/share/java/slf4j-log4j12.jar:/usr/share/java/log4j-1.2.jar"
        # The inner shell records its own pid, then execs the server: the pid file holds the server's pid.
        # shellcheck disable=SC2016
        setsid nohup bash -c 'echo $$ >"$0"; exec "$@"' "$pidfile" \
            java -Xms32m -Xmx256m -XX:+UseSerialGC -Djava.net.preferIPv4Stack=true \
            -Dzookeeper.log.dir="$dir" -Dlog4j.configuration="file:$dir/log4j.properties" \
            -cp "$cp" org.apache.zookeeper.server.quorum.QuorumPeerMain "$dir/zoo.cfg" \
            </dev/null >>"$dir/zookeeper.log" 2>&1 &
    elif [ "$node" = nats ]; then
        write_nats_config
        # shellcheck disable=SC2016
        setsid nohup bash -c 'echo $$ >"$0"; exec "$@"' "$pidfile" \
            "$(command -v nats-server || echo /usr/sbin/nats-server)" --config "$dir/nats.conf" \
            </dev/null >>"$dir/nats-server.log" 2>&1 &
    elif is_modern "$node"; then
        write_modern_config "$node"
        # shellcheck disable=SC2016
        setsid nohup bash -c 'echo $$ >"$0"; exec "$@"' "$pidfile" \
            "$(flow_modern_python)" "$FLOW_REPO_ROOT/scripts/modern_node.py" "$dir/config.xml" "$dir/data" \
            </dev/null >>"$dir/log/stdout.log" 2>&1 &
    else
        ensure_tls
        write_ch_config "$node"
        # shellcheck disable=SC2016
        setsid nohup bash -c 'echo $$ >"$0"; exec "$@"' "$pidfile" \
            clickhouse-server --config-file="$dir/config.xml" \
            </dev/null >>"$dir/log/stdout.log" 2>&1 &
    fi
    local _
    for _ in $(seq 1 50); do
        [ -s "$pidfile" ] && break
        sleep 0.1
    done
    [ -s "$pidfile" ] || flow_die "node $node did not start (no pid file); see $(node_log "$node")"
}

# Is something not ours already listening on the node's port?
port_taken() {
    timeout 2 bash -c "exec 3<>/dev/tcp/$HOST/$1" 2>/dev/null
}

start_node() { # start_node NODE: start if not running; does not wait
    local node="$1" pid port
    if pid="$(node_pid "$node")"; then
        return 0
    fi
    port="$(node_port "$node")"
    if port_taken "$port"; then
        flow_die "node $node is not running from $BASE but 127.0.0.1:$port is in use by another process" \
            "(a cluster started with another FLOW_CLUSTER_DIR, or a stray server?)"
    fi
    flow_log "starting $node"
    launch "$node"
}

# A replica killed between writing a part and committing it to ZooKeeper finds that part unknown
# to ZooKeeper at its next start, and 18.16 refuses to start when such parts hold more than half
# of a table's rows (a new table's only part). The part was never committed (its INSERT was not
# acknowledged), so the server's own remedy is right: the force_restore_data flag, with which
# it detaches the part and fetches what ZooKeeper lists from the other replica.
restore_if_parts_unknown() { # restore_if_parts_unknown NODE
    local node="$1" flags
    if tail -n 60 "$(node_log "$node")" 2>/dev/null |
        grep -q "doesn't look like the set of parts in ZooKeeper"; then
        flags="$(node_dir "$node")/data/flags"
        mkdir -p "$flags" && touch "$flags/force_restore_data"
        flow_log "node $node holds parts ZooKeeper does not know (written, never committed, before it was killed); starting it with force_restore_data, which detaches them"
    fi
}

wait_node() { # wait_node NODE [with-zk]: wait until the node answers (and, for ClickHouse, sees ZooKeeper)
    local node="$1" with_zk="${2:-}" deadline launches=1
    deadline=$((SECONDS + START_TIMEOUT))
    while :; do
        if node_exited "$node"; then
            # ClickHouse 18.16 exits when ZooKeeper drops its first handshake while it loads replicated
            # tables (ZooKeeper restarting, or its sessions from a kill still expiring). A second and
            # third launch succeed once ZooKeeper serves; a real configuration error fails all three.
            if [ "$node" != zk ] && [ "$node" != nats ] && ! is_modern "$node" && [ "$launches" -lt 3 ] && zk_ok; then
                launches=$((launches + 1))
                restore_if_parts_unknown "$node"
                flow_log "node $node exited during start-up; launching it again (launch $launches of 3)"
                sleep 1
                launch "$node"
                continue
            fi
            flow_log "node $node exited during start-up; last lines of its logs:"
            tail -n 20 "$(node_log "$node")" >&2 2>/dev/null || true
            case "$node" in zk | nats) ;; *) tail -n 20 "$(node_dir "$node")/log/stdout.log" >&2 2>/dev/null || true ;; esac
            flow_die "node $node failed to start; see $(node_log "$node")"
        fi
        if node_ok "$node"; then
            if [ "$node" = zk ] || [ "$node" = nats ] || is_modern "$node" || [ -z "$with_zk" ] || ch_zk_ok "$node"; then
                return 0
            fi
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            flow_die "node $node did not answer within ${START_TIMEOUT}s (port $(node_port "$node")); see $(node_log "$node")"
        fi
        sleep 0.3
    done
}

stop_node() { # stop_node NODE [SIGNAL]
    local node="$1" sig="${2:-TERM}" pid deadline
    if ! pid="$(node_pid "$node")"; then
        rm -f "$(node_dir "$node")/pid"
        return 0
    fi
    flow_log "stopping $node (pid $pid, SIG$sig)"
    kill "-$sig" "$pid" 2>/dev/null || true
    deadline=$((SECONDS + STOP_TIMEOUT))
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            flow_log "$node (pid $pid) still running after ${STOP_TIMEOUT}s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            deadline=$((SECONDS + 10))
        fi
        sleep 0.2
    done
    rm -f "$(node_dir "$node")/pid"
}

print_endpoints() {
    local node
    echo "flow local cluster ($BASE):"
    echo "  zk  127.0.0.1:$ZK_PORT (ZooKeeper client port)"
    for node in "${CH_NODES[@]}"; do
        printf '  %s  shard %s  http://127.0.0.1:%s  native 127.0.0.1:%s  https://127.0.0.1:%s  interserver %s\n' \
            "$node" "$(shard_of "$node")" "$(http_port "$node")" "$(tcp_port "$node")" \
            "$(https_port "$node")" "$(interserver_port "$node")"
    done
    for node in "${MODERN_NODES[@]}"; do
        printf '  %s  modern shard %s  http://127.0.0.1:%s  native 127.0.0.1:%s  (ClickHouse %s, MergeTree only)\n' \
            "$node" "$(shard_of "$node")" "$(http_port "$node")" "$(tcp_port "$node")" "$FLOW_MODERN_CLICKHOUSE"
    done
    echo "  users: default (no password), flow_secret / flow-pass (18.16 nodes only)"
    echo "  cluster 'flow' (remote_servers): shard a = a1,a2; shard b = b1,b2"
    echo "  modern shards (no replication): a = m1, b = m2"
    echo "  nats  nats://127.0.0.1:$NATS_PORT (JetStream)  monitoring http://127.0.0.1:$NATS_MONITOR_PORT"
    echo "  TLS CA certificate: $BASE/tls/ca.crt"
    echo "  logs: $BASE/<node>/log/clickhouse-server.log, $BASE/zk/zookeeper.log, $BASE/nats/nats-server.log"
}

# ---------------------------------------------------------------------------------------------------
# Commands

# After ZooKeeper was down, replicated tables stay read-only until their own session is re-established
# (several seconds). Wait for that, but only warn: a table whose ZooKeeper metadata is gone stays
# read-only forever and must not make `up` fail.
wait_replicas_writable() { # wait_replicas_writable [NODE...] (default: all ClickHouse nodes)
    local deadline node ro nodes=("$@")
    [ "${#nodes[@]}" -gt 0 ] || nodes=("${CH_NODES[@]}")
    deadline=$((SECONDS + 45))
    for node in "${nodes[@]}"; do
        while :; do
            ro="$(ch_query "$node" "SELECT count() FROM system.replicas WHERE is_readonly" || true)"
            [ "$ro" = 0 ] && break
            if [ "$SECONDS" -ge "$deadline" ]; then
                flow_log "warning: $node still has read-only replicated tables:" \
                    "$(ch_query "$node" "SELECT groupArray(concat(database, '.', table)) FROM system.replicas WHERE is_readonly" || true)"
                break
            fi
            sleep 0.5
        done
    done
}

cmd_up() {
    flow_ensure_cluster_packages
    mkdir -p "$BASE"
    local node
    start_node zk
    wait_node zk
    for node in "${CH_NODES[@]}" "${MODERN_NODES[@]}"; do
        start_node "$node"
    done
    start_node nats
    for node in "${CH_NODES[@]}"; do
        wait_node "$node" with-zk
    done
    for node in "${MODERN_NODES[@]}"; do
        wait_node "$node"
    done
    wait_node nats
    wait_replicas_writable
    print_endpoints
}

cmd_down() {
    local node
    # ClickHouse first, ZooKeeper last: replicas shut down cleanly while their session is alive.
    for node in b2 b1 a2 a1 m2 m1; do
        stop_node "$node" &
    done
    stop_node nats &
    wait
    stop_node zk
    flow_log "cluster stopped (data kept in $BASE)"
}

cmd_status() {
    local node pid state ports
    for node in "${ALL_NODES[@]}"; do
        if pid="$(node_pid "$node")"; then
            if node_ok "$node"; then state=running; else state="running (not answering)"; fi
        else
            pid=-
            state=stopped
        fi
        if [ "$node" = zk ]; then
            ports="client $ZK_PORT"
        elif [ "$node" = nats ]; then
            ports="client $NATS_PORT monitoring $NATS_MONITOR_PORT"
        elif is_modern "$node"; then
            ports="http $(http_port "$node") native $(tcp_port "$node") (ClickHouse $FLOW_MODERN_CLICKHOUSE)"
        else
            ports="http $(http_port "$node") native $(tcp_port "$node") https $(https_port "$node")"
        fi
        printf '%-4s %-24s pid %-8s %s\n' "$node" "$state" "$pid" "$ports"
    done
}

cmd_start() {
    local node="$1"
    flow_ensure_cluster_packages
    mkdir -p "$BASE"
    start_node "$node"
    wait_node "$node"
    # After a kill -9, the old ZooKeeper session (and its replica `is_active` nodes) lives until it
    # times out; the replicas are read-only until then. Wait for that unless ZooKeeper is down.
    if [ "$node" != zk ] && [ "$node" != nats ] && ! is_modern "$node" && zk_ok; then
        wait_node "$node" with-zk
        wait_replicas_writable "$node"
    fi
    flow_log "$node running (pid $(node_pid "$node"), port $(node_port "$node"))"
}

usage() {
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

main() {
    [ $# -ge 1 ] || usage
    local cmd="$1"
    shift
    case "$cmd" in
        up) cmd_up ;;
        down) cmd_down ;;
        status) cmd_status ;;
        endpoints) print_endpoints ;;
        start | stop | kill)
            if [ $# -ne 1 ] || ! valid_node "$1"; then
                flow_die "usage: $0 $cmd zk|a1|a2|b1|b2|m1|m2|nats"
            fi
            case "$cmd" in
                start) cmd_start "$1" ;;
                stop) stop_node "$1" TERM ;;
                kill) stop_node "$1" KILL ;;
            esac
            ;;
        -h | --help | help) usage ;;
        *) usage ;;
    esac
}

main "$@"

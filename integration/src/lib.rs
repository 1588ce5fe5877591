//! Shared helpers for tests against the local cluster started by `scripts/cluster.sh up`.
//!
//! The cluster (pinned by the contract): ZooKeeper on 127.0.0.1:12181 and four ClickHouse 18.16
//! servers, shard `a` = `a1`, `a2` and shard `b` = `b1`, `b2`, HTTP ports 18123..18126, native ports
//! 19000..19003, HTTPS ports 18443..18446. Every node has the macros `{shard}` and `{replica}`, a
//! `remote_servers` cluster named `flow`, the user `default` (no password) and the user
//! `flow_secret` (password `flow-pass`). Beside them, two modern ClickHouse 26.9 nodes `m1`, `m2`
//! (HTTP 18127, 18128): the delivery tests run on both generations ([`generation`]:
//! [`generation::Generation`], [`each_generation!`]).
//!
//! The HTTP client here is deliberately tiny (blocking, `std::net` only) so that any test, sync or
//! async, can use it to set up tables and check results.

pub mod generation;
pub mod nats;
pub mod proxy;
mod test_dir;
pub mod worker;

pub use test_dir::TestDir;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};

/// Every node listens on this address only.
pub const HOST: &str = "127.0.0.1";
/// ZooKeeper client port.
pub const ZK_PORT: u16 = 12181;

pub const A1_HTTP: u16 = 18123;
pub const A2_HTTP: u16 = 18124;
pub const B1_HTTP: u16 = 18125;
pub const B2_HTTP: u16 = 18126;

/// Name of the `remote_servers` cluster (for `Distributed(...)` tables and `ON CLUSTER`).
pub const CLUSTER_NAME: &str = "flow";
/// A user with a password, for authentication tests.
pub const SECRET_USER: &str = "flow_secret";
pub const SECRET_PASSWORD: &str = "flow-pass";

/// One ClickHouse node of the local cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    pub name: &'static str,
    pub shard: &'static str,
    pub http_port: u16,
    pub tcp_port: u16,
    pub https_port: u16,
}

impl Node {
    /// `127.0.0.1:<http port>`, the form the sink parameters use.
    pub fn http_addr(&self) -> String {
        format!("{HOST}:{}", self.http_port)
    }
}

pub const A1: Node = Node {
    name: "a1",
    shard: "a",
    http_port: 18123,
    tcp_port: 19000,
    https_port: 18443,
};
pub const A2: Node = Node {
    name: "a2",
    shard: "a",
    http_port: 18124,
    tcp_port: 19001,
    https_port: 18444,
};
pub const B1: Node = Node {
    name: "b1",
    shard: "b",
    http_port: 18125,
    tcp_port: 19002,
    https_port: 18445,
};
pub const B2: Node = Node {
    name: "b2",
    shard: "b",
    http_port: 18126,
    tcp_port: 19003,
    https_port: 18446,
};

/// All ClickHouse nodes, shard `a` first.
pub const NODES: [Node; 4] = [A1, A2, B1, B2];
/// The nodes of shard `a`.
pub const SHARD_A: [Node; 2] = [A1, A2];
/// The nodes of shard `b`.
pub const SHARD_B: [Node; 2] = [B1, B2];

/// The cluster's base directory (`$FLOW_CLUSTER_DIR`, default `/tmp/flow-cluster`).
pub fn cluster_dir() -> PathBuf {
    std::env::var_os("FLOW_CLUSTER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/flow-cluster"))
}

/// The self-signed CA certificate for the HTTPS ports.
pub fn tls_ca_cert() -> PathBuf {
    cluster_dir().join("tls").join("ca.crt")
}

/// Path of `scripts/cluster.sh`.
pub fn cluster_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("scripts")
        .join("cluster.sh")
}

/// Runs `scripts/cluster.sh ARGS...` and returns its stdout; an error (with stderr) if it fails.
pub fn cluster_sh(args: &[&str]) -> Result<String> {
    let script = cluster_script();
    let out = Command::new("bash")
        .arg(&script)
        .args(args)
        .output()
        .with_context(|| format!("running {} {}", script.display(), args.join(" ")))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{} {} failed ({}):\n{}\n{}",
            script.display(),
            args.join(" "),
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(stdout)
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const IO_TIMEOUT: Duration = Duration::from_secs(120);

fn connect(port: u16, timeout: Duration) -> Result<TcpStream> {
    let addr: SocketAddr = format!("{HOST}:{port}").parse().context("bad address")?;
    let stream = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(stream)
}

/// The reply to an HTTP request.
#[derive(Debug, Clone)]
pub struct HttpReply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpReply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The ClickHouse error code in an error body (`Code: 60, e.displayText() = ...`).
    pub fn error_code(&self) -> Option<u32> {
        let text = self.text();
        let rest = text.split("Code: ").nth(1)?;
        rest.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .ok()
    }
}

/// Sends one HTTP/1.1 request (`Connection: close`) to `127.0.0.1:port` and reads the whole reply.
/// `path_and_query` starts with `/`.
pub fn http_request(
    port: u16,
    method: &str,
    path_and_query: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<HttpReply> {
    let mut stream = connect(port, CONNECT_TIMEOUT)?;
    let mut req = format!(
        "{method} {path_and_query} HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes())?;
    stream.write_all(body)?;
    stream.flush()?;
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .with_context(|| format!("reading the reply from {HOST}:{port}"))?;
    parse_reply(&raw).with_context(|| format!("parsing the reply from {HOST}:{port}"))
}

fn parse_reply(raw: &[u8]) -> Result<HttpReply> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("no end of headers in {} bytes", raw.len()))?;
    let head = std::str::from_utf8(&raw[..split]).context("headers are not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let rest = &raw[split + 4..];
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.to_ascii_lowercase().contains("chunked")
    });
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest.to_vec()
    };
    Ok(HttpReply {
        status,
        headers,
        body,
    })
}

fn dechunk(mut data: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| anyhow!("truncated chunk header"))?;
        let size_text = std::str::from_utf8(&data[..eol])?;
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .with_context(|| format!("bad chunk size {size_text:?}"))?;
        data = &data[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if data.len() < size {
            bail!("truncated chunk: want {size} bytes, have {}", data.len());
        }
        out.extend_from_slice(&data[..size]);
        data = data.get(size + 2..).unwrap_or_default();
    }
}

/// POSTs `sql` to a node's HTTP interface as user `default`; returns the raw reply whatever its status.
pub fn query_raw(port: u16, sql: &str) -> Result<HttpReply> {
    http_request(port, "POST", "/", &[], sql.as_bytes())
}

/// Like [`query_raw`] but as `user` with `password` (sent the way the `clickhouse` crate does),
/// for read-only queries: a connection the server resets before any reply is tried once more
/// (a loaded 18.16 server resets a fresh connection now and then; a clean-clone CI run met it
/// once), and anything else is returned as it came.
pub fn query_raw_as(port: u16, user: &str, password: &str, sql: &str) -> Result<HttpReply> {
    let send = || {
        http_request(
            port,
            "POST",
            "/",
            &[("X-ClickHouse-User", user), ("X-ClickHouse-Key", password)],
            sql.as_bytes(),
        )
    };
    match send() {
        Err(err) if is_connection_reset(&err) => send(),
        other => other,
    }
}

fn is_connection_reset(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionReset)
    })
}

fn ok_text(port: u16, sql: &str, reply: HttpReply) -> Result<String> {
    if reply.status != 200 {
        bail!(
            "HTTP {} from {HOST}:{port} for `{sql}`: {}",
            reply.status,
            reply.text().trim_end()
        );
    }
    Ok(reply.text())
}

/// Runs `sql` on the node with this HTTP port and returns the reply body (TabSeparated unless the
/// query says otherwise). An error carries the HTTP status and ClickHouse's message.
pub fn query_text(port: u16, sql: &str) -> Result<String> {
    ok_text(port, sql, query_raw(port, sql)?)
}

/// Runs a statement, discarding its output.
pub fn exec(port: u16, sql: &str) -> Result<()> {
    query_text(port, sql).map(|_| ())
}

/// Runs a query returning one number (e.g. `SELECT count() ...`).
pub fn query_u64(port: u16, sql: &str) -> Result<u64> {
    let text = query_text(port, sql)?;
    text.trim()
        .parse()
        .with_context(|| format!("`{sql}` returned {text:?}, not a number"))
}

/// Runs a query returning numbers separated by white space (columns of a row, or rows of one
/// column), e.g. `SELECT count(), uniqExact(id) ...` or `SELECT id ...`.
pub fn query_u64s(port: u16, sql: &str) -> Result<Vec<u64>> {
    let text = query_text(port, sql)?;
    text.split_whitespace()
        .map(|n| {
            n.parse()
                .with_context(|| format!("`{sql}` returned {n:?}, not a number"))
        })
        .collect()
}

/// POSTs `data` to `INSERT INTO ... FORMAT ...` given in `insert_sql` (sent in the URL).
pub fn insert_formatted(port: u16, insert_sql: &str, data: &[u8]) -> Result<()> {
    let path = format!("/?query={}", url_encode(insert_sql));
    let reply = http_request(port, "POST", &path, &[], data)?;
    ok_text(port, insert_sql, reply).map(|_| ())
}

/// Percent-encodes a URL query component.
pub fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `SYSTEM SYNC REPLICA db.table` on the node: waits until it has fetched everything in the queue.
pub fn sync_replica(port: u16, db_table: &str) -> Result<()> {
    exec(port, &format!("SYSTEM SYNC REPLICA {db_table}"))
}

/// Does the ClickHouse node at this HTTP port answer `/ping`?
pub fn ping(port: u16) -> bool {
    let Ok(mut stream) = connect(port, Duration::from_secs(2)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let req = format!("GET /ping HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: close\r\n\r\n");
    if stream.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut raw = Vec::new();
    if stream.read_to_end(&mut raw).is_err() {
        return false;
    }
    matches!(parse_reply(&raw), Ok(r) if r.status == 200 && r.text().trim() == "Ok.")
}

/// Is ZooKeeper serving requests? `srvr` prints a `Mode:` line only once the server runs; `ruok`
/// would answer `imok` while the snapshot is still loading and sessions are refused.
pub fn zk_ok() -> bool {
    let Ok(mut stream) = connect(ZK_PORT, Duration::from_secs(2)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    if stream.write_all(b"srvr").is_err() {
        return false;
    }
    let mut answer = String::new();
    stream.read_to_string(&mut answer).is_ok() && answer.lines().any(|l| l.starts_with("Mode: "))
}

/// Is every node of the local cluster (ZooKeeper and the four ClickHouse servers) answering?
pub fn cluster_available() -> bool {
    zk_ok() && NODES.iter().all(|n| ping(n.http_port))
}

/// Ok if the whole cluster answers; otherwise an error naming the nodes that do not and telling to run
/// `scripts/cluster.sh up`. Tests call this first so that they fail (not skip) without a cluster.
pub fn require_cluster() -> Result<()> {
    let mut down: Vec<String> = Vec::new();
    if !zk_ok() {
        down.push(format!("zk ({HOST}:{ZK_PORT})"));
    }
    for n in NODES {
        if !ping(n.http_port) {
            down.push(format!("{} ({})", n.name, n.http_addr()));
        }
    }
    if down.is_empty() {
        return Ok(());
    }
    bail!(
        "the local cluster is not running (not answering: {}); start it with `scripts/cluster.sh up` \
         (FLOW_CLUSTER_DIR={})",
        down.join(", "),
        cluster_dir().display()
    )
}

/// A name unique to this process and call, safe as a ClickHouse identifier: `prefix_<pid>_<n>_<t>`.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0);
    format!("{prefix}_{}_{n}_{t}", std::process::id())
}

/// Polls `f` every 100 ms until it returns `Ok(true)` or `timeout` passes; the last error (or a
/// timeout error) otherwise.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = f();
        if matches!(last, Ok(true)) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return match last {
                Err(e) => Err(e.context(format!("condition not met within {timeout:?}"))),
                _ => Err(anyhow!("condition not met within {timeout:?}")),
            };
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A ReplicatedMergeTree table created on some nodes, with the zk path
/// `/clickhouse/tables/{shard}/<db>.<table>` and replica `{replica}`; dropped on every node when the
/// guard is dropped (errors ignored).
#[derive(Debug)]
pub struct ReplicatedTable {
    pub database: String,
    pub table: String,
    pub nodes: Vec<Node>,
}

impl ReplicatedTable {
    /// Creates `database.table (columns) ENGINE = ReplicatedMergeTree(...) ORDER BY order_by` on
    /// each node.
    pub fn create(
        database: &str,
        table: &str,
        columns: &str,
        order_by: &str,
        nodes: &[Node],
    ) -> Result<Self> {
        let ddl = replicated_table_ddl(database, table, columns, order_by);
        ReplicatedTable::create_by(database, table, &ddl, nodes)
    }

    /// Runs `ddl` (which creates `database.table`) on each node; the guard drops the table from
    /// the nodes it was created on, also when a later node fails.
    pub fn create_by(database: &str, table: &str, ddl: &str, nodes: &[Node]) -> Result<Self> {
        let mut guard = ReplicatedTable {
            database: database.into(),
            table: table.into(),
            nodes: Vec::new(),
        };
        for node in nodes {
            exec(node.http_port, ddl)
                .with_context(|| format!("creating {database}.{table} on {}", node.name))?;
            guard.nodes.push(*node);
        }
        Ok(guard)
    }

    /// `database.table`.
    pub fn qualified(&self) -> String {
        format!("{}.{}", self.database, self.table)
    }
}

impl Drop for ReplicatedTable {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // Kept for looking into what the failed test left there.
            eprintln!("the failed test's table is kept: {}", self.qualified());
            return;
        }
        for node in &self.nodes {
            let _ = exec(
                node.http_port,
                &format!("DROP TABLE IF EXISTS {}", self.qualified()),
            );
        }
    }
}

/// `CREATE TABLE IF NOT EXISTS db.t (columns) ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/db.t', '{replica}') ORDER BY ...`.
pub fn replicated_table_ddl(database: &str, table: &str, columns: &str, order_by: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {database}.{table} ({columns}) ENGINE = \
         ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{database}.{table}', '{{replica}}') \
         ORDER BY {order_by}"
    )
}

// ---------------------------------------------------------------------------------------------
// Helpers added for tests/clickhouse_session.rs (session rejection rules against the cluster).

/// Waits up to `timeout` for every node of the cluster to answer (other test binaries stop and
/// restart replicas), then behaves like [`require_cluster`].
pub fn wait_for_cluster(timeout: Duration) -> Result<()> {
    let _ = wait_until(timeout, || Ok(cluster_available()));
    require_cluster()
}

/// Tables created with arbitrary DDL, dropped on their nodes when the guard is dropped (errors
/// ignored). `add` records `(http port, database.table)`.
#[derive(Debug, Default)]
pub struct DropGuard {
    pub tables: Vec<(u16, String)>,
}

impl DropGuard {
    /// Runs `ddl` on the node and records `qualified` for dropping.
    pub fn create(&mut self, port: u16, qualified: &str, ddl: &str) -> Result<()> {
        exec(port, ddl).with_context(|| format!("creating {qualified} on port {port}"))?;
        self.tables.push((port, qualified.to_owned()));
        Ok(())
    }

    /// Creates the plain (non-replicated) `CREATE TABLE database.table (columns) ENGINE = MergeTree
    /// ORDER BY order_by` on the node and records it for dropping.
    pub fn create_merge_tree(
        &mut self,
        node: Node,
        database: &str,
        table: &str,
        columns: &str,
        order_by: &str,
    ) -> Result<()> {
        self.create(
            node.http_port,
            &format!("{database}.{table}"),
            &format!(
                "CREATE TABLE {database}.{table} ({columns}) ENGINE = MergeTree ORDER BY {order_by}"
            ),
        )
    }
}

impl Drop for DropGuard {
    fn drop(&mut self) {
        // Reverse order: a Distributed table before its local table.
        for (port, qualified) in self.tables.iter().rev() {
            let _ = exec(*port, &format!("DROP TABLE IF EXISTS {qualified}"));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers added for tests/guarantee_cases.rs.

/// The server log of a node: `<cluster dir>/<name>/log/clickhouse-server.log`.
pub fn server_log(node: Node) -> PathBuf {
    cluster_dir()
        .join(node.name)
        .join("log")
        .join("clickhouse-server.log")
}

/// Lines of the node's server log that contain every one of `needles` (0 if the log cannot be
/// read). The log is appended to by the server and may be rotated when large.
pub fn server_log_lines(node: Node, needles: &[&str]) -> usize {
    let Ok(bytes) = std::fs::read(server_log(node)) else {
        return 0;
    };
    String::from_utf8_lossy(&bytes)
        .lines()
        .filter(|line| needles.iter().all(|n| line.contains(n)))
        .count()
}

/// How many INSERT blocks into `db_table` the node recognised as already inserted and ignored
/// (ReplicatedMergeTree block deduplication), read from its server log: the lines
/// `<db_table> (Replicated OutputStream): Block with ID ... already exists; ignoring it.`
pub fn deduplicated_blocks_logged(node: Node, db_table: &str) -> usize {
    server_log_lines(
        node,
        &[
            &format!(" {db_table} (Replicated OutputStream): "),
            "already exists; ignoring it",
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_replies() {
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n1\n";
        let r = parse_reply(plain).unwrap();
        assert_eq!((r.status, r.text().as_str()), (200, "1\n"));

        let chunked =
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nCode:\r\n4\r\n 60,\r\n0\r\n\r\n";
        let r = parse_reply(chunked).unwrap();
        assert_eq!(r.status, 404);
        assert_eq!(r.text(), "Code: 60,");
        assert_eq!(r.error_code(), Some(60));
    }

    #[test]
    fn url_encodes() {
        assert_eq!(
            url_encode("INSERT INTO t FORMAT TSV"),
            "INSERT%20INTO%20t%20FORMAT%20TSV"
        );
    }

    #[test]
    fn unique_names_differ() {
        assert_ne!(unique_name("t"), unique_name("t"));
    }
}

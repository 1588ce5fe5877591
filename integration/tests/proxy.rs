//! The fault-injection proxy (`flow_integration::proxy`) against the real local cluster (a1, a2).
//! These tests fail, not skip, when the cluster is not running.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use flow_integration::proxy::{Fault, FaultProxy, ProxyStats};
use flow_integration::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const COLUMNS: &str = "id UInt64, payload String";
const ROWS: u64 = 5000;
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

fn a1_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], A1_HTTP))
}

async fn a1_proxy() -> FaultProxy {
    // Other test binaries stop and restart nodes (b1, b2 too): wait for the ones used here.
    let _ = wait_until(Duration::from_secs(120), || {
        Ok(zk_ok() && ping(A1_HTTP) && ping(A2_HTTP))
    });
    if !(zk_ok() && ping(A1_HTTP) && ping(A2_HTTP)) {
        require_cluster().unwrap();
    }
    FaultProxy::start(a1_addr()).await.unwrap()
}

/// Syncs a2 with the table and checks its row count, retrying while other test binaries restart a2.
fn a2_count_is(table: &ReplicatedTable, expected: u64) {
    wait_until(Duration::from_secs(120), || {
        sync_replica(A2_HTTP, &table.qualified())?;
        Ok(count_result(A2_HTTP, table)? == expected)
    })
    .unwrap();
}

/// `ROWS` rows of TabSeparated data (about 90 KB).
fn rows() -> Vec<u8> {
    let mut out = String::new();
    for i in 0..ROWS {
        out.push_str(&format!("{i}\tpayload-{i:08}-abcdefghijklmnop\n"));
    }
    out.into_bytes()
}

fn insert_path(table: &ReplicatedTable) -> String {
    format!(
        "/?query={}",
        url_encode(&format!(
            "INSERT INTO {} FORMAT TabSeparated",
            table.qualified()
        ))
    )
}

fn fresh_table() -> ReplicatedTable {
    ReplicatedTable::create("default", &unique_name("proxy"), COLUMNS, "id", &[A1, A2]).unwrap()
}

fn count_result(port: u16, table: &ReplicatedTable) -> Result<u64> {
    query_u64(port, &format!("SELECT count() FROM {}", table.qualified()))
}

fn count(port: u16, table: &ReplicatedTable) -> u64 {
    count_result(port, table).unwrap()
}

/// Polls the proxy's counters until `f` holds (counters are bumped right after forwarding, so they
/// may trail what the client saw by a moment).
async fn stats_until(proxy: &FaultProxy, f: impl Fn(&ProxyStats) -> bool) -> ProxyStats {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = proxy.stats();
        if f(&s) || Instant::now() > deadline {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// A tiny async HTTP/1.1 client (keep-alive capable) so that the proxy and the client share the
// test's runtime without blocking it.

struct Reply {
    status: u16,
    body: Vec<u8>,
}

impl Reply {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn connect(addr: SocketAddr) -> Result<Conn> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Conn {
            stream,
            buf: Vec::new(),
        })
    }

    /// Reads more bytes into the buffer; an error at EOF.
    async fn fill(&mut self) -> Result<()> {
        let mut chunk = [0u8; 16 * 1024];
        let n = self.stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed before the end of the response");
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    async fn take_until(&mut self, delim: &[u8]) -> Result<Vec<u8>> {
        loop {
            if let Some(pos) = self.buf.windows(delim.len()).position(|w| w == delim) {
                let out = self.buf[..pos].to_vec();
                self.buf.drain(..pos + delim.len());
                return Ok(out);
            }
            self.fill().await?;
        }
    }

    async fn take_exact(&mut self, n: usize) -> Result<Vec<u8>> {
        while self.buf.len() < n {
            self.fill().await?;
        }
        Ok(self.buf.drain(..n).collect())
    }

    async fn request(&mut self, method: &str, path: &str, body: &[u8]) -> Result<Reply> {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\
             Content-Length: {}\r\n\r\n",
            body.len()
        );
        let mut req = head.into_bytes();
        req.extend_from_slice(body);
        self.stream.write_all(&req).await?;
        loop {
            let head = self.take_until(b"\r\n\r\n").await?;
            let head = String::from_utf8_lossy(&head).into_owned();
            let mut lines = head.split("\r\n");
            let status: u16 = lines
                .next()
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| anyhow!("bad status line in {head:?}"))?;
            if (100..200).contains(&status) {
                continue;
            }
            let headers: Vec<(String, String)> = lines
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
                .collect();
            let header = |name: &str| {
                headers
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            };
            let body = if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
                let mut body = Vec::new();
                loop {
                    let size_line = self.take_until(b"\r\n").await?;
                    let size_text = String::from_utf8_lossy(&size_line).into_owned();
                    let size = usize::from_str_radix(
                        size_text.split(';').next().unwrap_or_default().trim(),
                        16,
                    )
                    .with_context(|| format!("bad chunk size {size_text:?}"))?;
                    let data = self.take_exact(size + 2).await?;
                    if size == 0 {
                        break body;
                    }
                    body.extend_from_slice(&data[..size]);
                }
            } else if let Some(len) = header("content-length") {
                self.take_exact(len.parse()?).await?
            } else {
                let mut rest = std::mem::take(&mut self.buf);
                self.stream.read_to_end(&mut rest).await?;
                rest
            };
            return Ok(Reply { status, body });
        }
    }
}

/// One request on a new connection, within `CLIENT_TIMEOUT`.
async fn http(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Result<Reply> {
    http_timeout(addr, method, path, body, CLIENT_TIMEOUT).await
}

async fn http_timeout(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<Reply> {
    tokio::time::timeout(timeout, async {
        Conn::connect(addr).await?.request(method, path, body).await
    })
    .await
    .map_err(|_| anyhow!("timed out after {timeout:?}"))?
}

async fn select_one(addr: SocketAddr) -> Result<String> {
    let reply = http(addr, "POST", "/", b"SELECT 1").await?;
    if reply.status != 200 {
        bail!("HTTP {}: {}", reply.status, reply.text());
    }
    Ok(reply.text())
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pass_forwards_select_one() {
    let proxy = a1_proxy().await;
    assert_eq!(proxy.fault(), Fault::Pass);
    assert_eq!(select_one(proxy.addr()).await.unwrap(), "1\n");
    let s = stats_until(&proxy, |s| s.bytes_down > 0).await;
    assert_eq!((s.connections, s.requests, s.responses), (1, 1, 1), "{s:?}");
    assert_eq!((s.refused, s.cuts, s.stalled), (0, 0, 0), "{s:?}");
    assert!(s.bytes_up > 0 && s.bytes_down > 0, "{s:?}");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refuse_fails_fast_then_pass_recovers() {
    let proxy = a1_proxy().await;
    proxy.set(Fault::Refuse);
    let started = Instant::now();
    let err = select_one(proxy.addr()).await;
    assert!(err.is_err(), "a refused request succeeded: {err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let s = proxy.stats();
    assert_eq!((s.connections, s.refused, s.requests), (1, 1, 0), "{s:?}");

    proxy.set(Fault::Pass);
    assert_eq!(select_one(proxy.addr()).await.unwrap(), "1\n");

    // One-shot: exactly one connection is refused.
    proxy.set_once(Fault::Refuse);
    assert_eq!(proxy.fault(), Fault::Refuse);
    assert!(select_one(proxy.addr()).await.is_err());
    assert_eq!(proxy.fault(), Fault::Pass);
    assert_eq!(select_one(proxy.addr()).await.unwrap(), "1\n");
    assert_eq!(proxy.stats().refused, 2);
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cut_request_leaves_no_rows() {
    let proxy = a1_proxy().await;
    let table = fresh_table();
    let data = rows();
    let path = insert_path(&table);
    let limit = (data.len() / 3) as u64;
    proxy.set(Fault::CutRequestAfter(limit));

    let res = http(proxy.addr(), "POST", &path, &data).await;
    assert!(
        res.is_err(),
        "the cut INSERT answered: status {:?}",
        res.map(|r| (r.status, r.text()))
    );
    let s = proxy.stats();
    assert_eq!((s.requests, s.cuts), (1, 1), "{s:?}");
    assert_eq!(s.bytes_up, limit, "{s:?}");

    // Give the server time to (wrongly) finish the insert, then check nothing landed.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(count(A1_HTTP, &table), 0);
    a2_count_is(&table, 0);

    // The same INSERT in Pass mode lands whole.
    proxy.set(Fault::Pass);
    let reply = http(proxy.addr(), "POST", &path, &data).await.unwrap();
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(count(A1_HTTP, &table), ROWS);
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cut_response_commits_but_loses_the_ack_and_resend_dedups() {
    let proxy = a1_proxy().await;
    let table = fresh_table();
    let data = rows();
    let path = insert_path(&table);

    proxy.set_once(Fault::CutResponse);
    assert_eq!(proxy.fault(), Fault::CutResponse);
    let res = http(proxy.addr(), "POST", &path, &data).await;
    assert!(
        res.is_err(),
        "the ack got through: status {:?}",
        res.map(|r| (r.status, r.text()))
    );
    let s = proxy.stats();
    assert_eq!(
        (s.requests, s.responses, s.cuts, s.bytes_down),
        (1, 1, 1, 0),
        "{s:?}"
    );
    assert!(s.bytes_up as usize > data.len(), "{s:?}");
    // The one-shot is spent.
    assert_eq!(proxy.fault(), Fault::Pass);

    // The server committed.
    assert_eq!(count(A1_HTTP, &table), ROWS);

    // Re-sending the identical block is deduplicated by the replicated table.
    let reply = http(proxy.addr(), "POST", &path, &data).await.unwrap();
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(count(A1_HTTP, &table), ROWS);
    a2_count_is(&table, ROWS);
    let s = proxy.stats();
    assert_eq!((s.requests, s.cuts), (2, 1), "{s:?}");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn latency_adds_at_least_the_delay() {
    let proxy = a1_proxy().await;
    let delay = Duration::from_millis(300);
    proxy.set(Fault::Latency(delay));
    let started = Instant::now();
    assert_eq!(select_one(proxy.addr()).await.unwrap(), "1\n");
    let took = started.elapsed();
    // At least one chunk each way.
    assert!(took >= 2 * delay, "took {took:?}");
    proxy.set(Fault::Pass);
    let started = Instant::now();
    assert_eq!(select_one(proxy.addr()).await.unwrap(), "1\n");
    assert!(started.elapsed() < delay, "took {:?}", started.elapsed());
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stall_makes_the_client_time_out() {
    let proxy = a1_proxy().await;
    proxy.set(Fault::Stall);
    let started = Instant::now();
    let res = http_timeout(
        proxy.addr(),
        "POST",
        "/",
        b"SELECT 1",
        Duration::from_secs(1),
    )
    .await;
    let err = res.err().expect("a stalled request answered");
    assert!(err.to_string().contains("timed out"), "{err:#}");
    assert!(started.elapsed() >= Duration::from_secs(1));
    let s = proxy.stats();
    assert_eq!(
        (s.requests, s.stalled, s.bytes_up, s.responses),
        (1, 1, 0, 0),
        "{s:?}"
    );

    proxy.set(Fault::Pass);
    assert_eq!(select_one(proxy.addr()).await.unwrap(), "1\n");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hold_keeps_a_request_from_the_server_until_released_then_it_is_answered() {
    let proxy = a1_proxy().await;
    proxy.set(Fault::Hold);
    let addr = proxy.addr();
    let request = tokio::spawn(async move {
        http_timeout(addr, "POST", "/", b"SELECT 7", Duration::from_secs(20)).await
    });
    wait_until(Duration::from_secs(5), || Ok(proxy.stats().held == 1)).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s = proxy.stats();
    assert_eq!(
        (s.held, s.released, s.bytes_up, s.responses),
        (1, 0, 0, 0),
        "{s:?}"
    );
    assert!(!request.is_finished());

    proxy.set(Fault::Pass);
    let reply = request.await.unwrap().unwrap();
    assert_eq!((reply.status, reply.text()), (200, "7\n".to_owned()));
    let s = proxy.stats();
    assert_eq!(
        (s.requests, s.held, s.released, s.responses),
        (1, 1, 1, 1),
        "{s:?}"
    );
    proxy.stop().await;
}

/// Modes are evaluated per request, so they reach a reused keep-alive connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keep_alive_connection_picks_up_the_mode_per_request() {
    let proxy = a1_proxy().await;
    let mut conn = Conn::connect(proxy.addr()).await.unwrap();
    for i in 1..=3u32 {
        let reply = conn
            .request("POST", "/", format!("SELECT {i}").as_bytes())
            .await
            .unwrap();
        assert_eq!((reply.status, reply.text()), (200, format!("{i}\n")));
    }
    let s = proxy.stats();
    assert_eq!((s.connections, s.requests, s.responses), (1, 3, 3), "{s:?}");

    // Lose exactly one ack on the pooled connection.
    proxy.set_once(Fault::CutResponse);
    let res = tokio::time::timeout(CLIENT_TIMEOUT, conn.request("POST", "/", b"SELECT 4"))
        .await
        .unwrap();
    assert!(res.is_err(), "the response got through");
    let s = proxy.stats();
    assert_eq!((s.connections, s.requests, s.cuts), (1, 4, 1), "{s:?}");
    assert_eq!(proxy.fault(), Fault::Pass);

    // Refuse reaches a pooled connection at its next request.
    let mut conn = Conn::connect(proxy.addr()).await.unwrap();
    let reply = conn.request("POST", "/", b"SELECT 5").await.unwrap();
    assert_eq!(reply.text(), "5\n");
    proxy.set(Fault::Refuse);
    let res = tokio::time::timeout(CLIENT_TIMEOUT, conn.request("POST", "/", b"SELECT 6"))
        .await
        .unwrap();
    assert!(res.is_err(), "a refused request answered");
    let s = proxy.stats();
    assert_eq!((s.connections, s.refused), (2, 1), "{s:?}");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stop_closes_the_listener() {
    let proxy = a1_proxy().await;
    let addr = proxy.addr();
    assert_eq!(select_one(addr).await.unwrap(), "1\n");
    proxy.stop().await;
    assert!(select_one(addr).await.is_err());
}

/// `stop` resets connections: an INSERT in flight is lost, not committed truncated.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stop_mid_request_leaves_no_rows() {
    let proxy = a1_proxy().await;
    let table = fresh_table();
    let data = rows();
    let path = insert_path(&table);
    proxy.set(Fault::Latency(Duration::from_millis(400)));
    let addr = proxy.addr();
    let client = tokio::spawn(async move { http(addr, "POST", &path, &data).await });
    // Wait until part of the body went upstream.
    let s = stats_until(&proxy, |s| s.bytes_up > 0).await;
    assert!(s.bytes_up > 0, "{s:?}");
    let partial = s.bytes_up;
    proxy.stop().await;
    let res = client.await.unwrap();
    assert!(
        res.is_err(),
        "the INSERT answered: {:?}",
        res.map(|r| (r.status, r.text()))
    );
    assert!(partial < rows().len() as u64);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(count(A1_HTTP, &table), 0);
}

//! A commandable TCP proxy for fault injection between a client (e.g. a ClickHouse sink) and one
//! upstream endpoint (e.g. a ClickHouse node's HTTP port), run inside the test process on tokio.
//!
//! ```no_run
//! # use flow_integration::proxy::{Fault, FaultProxy};
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let proxy = FaultProxy::start("127.0.0.1:18123".parse()?).await?;
//! // point the client at proxy.addr() ...
//! proxy.set_once(Fault::CutResponse); // the next response is lost: the server committed, no ack
//! # Ok(())
//! # }
//! ```
//!
//! The proxy is HTTP/1.1-aware only as far as needed to apply faults per request on keep-alive
//! connections: in one connection, a *request starts* with the first client bytes of the connection,
//! and afterwards with a client chunk that begins with an HTTP method (`POST `, `GET `, ...) once the
//! server has started answering the previous request; a *response starts* with the first
//! server bytes after a request started that are not only a `1xx` interim response
//! (`100 Continue`). The fault for a request is chosen when it starts (so a mode set with
//! [`FaultProxy::set`] also reaches pooled connections at their next request); whether to cut a
//! response is decided when it starts. Cuts and refusals close both sockets with a TCP reset
//! (`SO_LINGER` 0, never a FIN first), so the server sees a read error rather than a clean end of
//! the request body: ClickHouse 18.16 commits the rows of a truncated body when it sees a clean EOF.
//! Pipelined requests (a new request in the same chunk as the previous one) are not told apart.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// Size of each copy buffer (one per direction and connection).
const BUF_SIZE: usize = 64 * 1024;
/// Timeout for connecting to the upstream.
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between forwarding the last allowed request bytes and cutting, so that they reach the server.
const CUT_SETTLE: Duration = Duration::from_millis(20);
/// How often a held request looks whether its hold ended.
const HOLD_POLL: Duration = Duration::from_millis(20);

/// What the proxy does to connections and requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Forward both ways.
    Pass,
    /// Accept and immediately close new connections (the client sees a reset/EOF before any
    /// response); a request starting on an already open connection gets the connection reset too.
    Refuse,
    /// Forward, but cut the connection (both sides) once N bytes of the client's request have passed
    /// upstream (counted from the start of the current request in this connection) — the server sees
    /// a truncated request and must not commit it. Choose N smaller than the request: a request of at
    /// most N bytes is forwarded whole before the cut.
    CutRequestAfter(u64),
    /// Forward the request completely, let the server answer, and cut the connection as soon as the
    /// first bytes of the server's response arrive, without passing them to the client: the server
    /// committed, the ack is lost. (ClickHouse sends an INSERT's response after the commit, unless
    /// `send_progress_in_http_headers` makes it start the headers earlier.)
    CutResponse,
    /// Forward with this extra delay before each chunk in both directions.
    Latency(Duration),
    /// Accept and read, but never forward nor answer (the client's timeout fires).
    Stall,
    /// Hold the request back: nothing of it is forwarded (and no more of it read) until the
    /// standing fault for it is no longer `Hold`; it then goes on under that fault. The request
    /// reaches the server late, e.g. after another worker sent the same batch.
    Hold,
}

/// Counters of a [`FaultProxy`] since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Client connections accepted (including refused ones).
    pub connections: u64,
    /// Connections closed because of [`Fault::Refuse`] (at accept, or at a request start on an open
    /// connection).
    pub refused: u64,
    /// HTTP request starts seen (client chunks at a request start that begin with an HTTP method).
    pub requests: u64,
    /// Response starts seen (including cut ones).
    pub responses: u64,
    /// Connections cut by [`Fault::CutRequestAfter`] or [`Fault::CutResponse`].
    pub cuts: u64,
    /// Requests swallowed by [`Fault::Stall`].
    pub stalled: u64,
    /// Requests held back by [`Fault::Hold`] (counted when the hold starts).
    pub held: u64,
    /// Held requests let go (counted when the hold ends).
    pub released: u64,
    /// Bytes forwarded client → upstream.
    pub bytes_up: u64,
    /// Bytes forwarded upstream → client.
    pub bytes_down: u64,
    /// Failed connects to the upstream (the client connection is then reset).
    pub upstream_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    refused: AtomicU64,
    requests: AtomicU64,
    responses: AtomicU64,
    cuts: AtomicU64,
    stalled: AtomicU64,
    held: AtomicU64,
    released: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    upstream_errors: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

#[derive(Debug)]
struct Mode {
    /// The standing mode.
    base: Fault,
    /// A one-shot fault, consumed by the next request (or response, for `CutResponse`; or
    /// connection, for `Refuse`) it applies to.
    once: Option<Fault>,
    /// A one-shot fault for the next INSERT request only ([`FaultProxy::set_once_on_insert`]).
    once_insert: Option<Fault>,
    /// The standing mode applies to INSERT requests only ([`FaultProxy::set_on_inserts`]).
    inserts_only: bool,
}

impl Mode {
    /// The standing fault for a request.
    fn base_for(&self, is_insert: bool) -> Fault {
        if self.inserts_only && !is_insert {
            Fault::Pass
        } else {
            self.base.clone()
        }
    }
}

#[derive(Debug)]
struct Shared {
    upstream: SocketAddr,
    mode: Mutex<Mode>,
    counters: Counters,
    /// Set to `true` to close the listener and reset every proxied connection.
    closing: watch::Sender<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    /// At accept: should this new connection be refused? Consumes a one-shot `Refuse`.
    fn refuse_at_accept(&self) -> bool {
        let mut mode = lock(&self.mode);
        if mode.once == Some(Fault::Refuse) {
            mode.once = None;
            return true;
        }
        mode.base == Fault::Refuse
    }

    /// At a request start: the fault for this request. Consumes a one-shot fault other than
    /// `CutResponse` (which is consumed by the next response start).
    fn request_fault(&self, is_insert: bool, cut_this_response: &mut bool) -> Fault {
        let mut mode = lock(&self.mode);
        if is_insert {
            match mode.once_insert.take() {
                Some(Fault::CutResponse) => {
                    *cut_this_response = true;
                    return mode.base_for(is_insert);
                }
                Some(fault) => return fault,
                None => {}
            }
        }
        match mode.once.take() {
            Some(Fault::CutResponse) => {
                mode.once = Some(Fault::CutResponse);
                mode.base_for(is_insert)
            }
            Some(fault) => fault,
            None => mode.base_for(is_insert),
        }
    }

    /// Once the standing fault for a held request is no longer `Hold`: that fault.
    async fn released(&self, is_insert: bool) -> Fault {
        loop {
            let fault = lock(&self.mode).base_for(is_insert);
            if fault != Fault::Hold {
                return fault;
            }
            tokio::time::sleep(HOLD_POLL).await;
        }
    }

    /// At a response start: cut it? Consumes a one-shot `CutResponse`.
    fn cut_response(&self, is_insert: bool) -> bool {
        let mut mode = lock(&self.mode);
        if mode.once == Some(Fault::CutResponse) {
            mode.once = None;
            return true;
        }
        mode.base_for(is_insert) == Fault::CutResponse
    }
}

/// A TCP proxy from [`FaultProxy::addr`] to one upstream address, with a switchable [`Fault`].
/// Dropping it (or [`FaultProxy::stop`]) closes the listener and every proxied connection.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on `127.0.0.1:0` (an ephemeral port) and forwards to `upstream`, in [`Fault::Pass`].
    pub async fn start(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        Self::start_at(SocketAddr::from(([127, 0, 0, 1], 0)), upstream).await
    }

    /// Like [`FaultProxy::start`] but listens on `listen` (e.g. a fixed port).
    pub async fn start_at(listen: SocketAddr, upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            mode: Mutex::new(Mode {
                base: Fault::Pass,
                once: None,
                once_insert: None,
                inserts_only: false,
            }),
            counters: Counters::default(),
            closing: watch::Sender::new(false),
        });
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(FaultProxy {
            addr,
            shared,
            task: Some(task),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The upstream address.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// Sets the standing mode (and disarms a pending [`FaultProxy::set_once`]). It applies to new
    /// connections and to the next request (or response) on already open ones.
    pub fn set(&self, fault: Fault) {
        let mut mode = lock(&self.shared.mode);
        mode.base = fault;
        mode.once = None;
        mode.once_insert = None;
        mode.inserts_only = false;
    }

    /// Like [`FaultProxy::set`], for INSERT requests only: the sink's other queries (its columns
    /// checks) pass.
    pub fn set_on_inserts(&self, fault: Fault) {
        self.set(fault);
        lock(&self.shared.mode).inserts_only = true;
    }

    /// The pending one-shot fault if one is armed, otherwise the standing mode.
    pub fn fault(&self) -> Fault {
        let mode = lock(&self.shared.mode);
        mode.once
            .clone()
            .or_else(|| mode.once_insert.clone())
            .unwrap_or_else(|| mode.base.clone())
    }

    /// Like [`FaultProxy::set_once`], but the fault waits for the next INSERT request (the
    /// statement in the URL's `query`, as ClickHouse clients send an INSERT), letting the sink's
    /// other queries (its columns checks) pass; a `CutResponse` cuts that INSERT's response.
    pub fn set_once_on_insert(&self, fault: Fault) {
        let mut mode = lock(&self.shared.mode);
        mode.base = Fault::Pass;
        mode.once = None;
        mode.inserts_only = false;
        mode.once_insert = (fault != Fault::Pass).then_some(fault);
    }

    /// Arms a one-shot fault and sets the standing mode to [`Fault::Pass`]: the next request gets
    /// `fault`, later ones `Pass`. `CutResponse` is consumed by the first response that starts after
    /// arming; `Refuse` by the next new connection or request start, whichever comes first.
    /// `set_once(Fault::Pass)` is the same as `set(Fault::Pass)`.
    pub fn set_once(&self, fault: Fault) {
        let mut mode = lock(&self.shared.mode);
        mode.base = Fault::Pass;
        mode.once = (fault != Fault::Pass).then_some(fault);
    }

    /// Counters since start.
    pub fn stats(&self) -> ProxyStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ProxyStats {
            connections: get(&c.connections),
            refused: get(&c.refused),
            requests: get(&c.requests),
            responses: get(&c.responses),
            cuts: get(&c.cuts),
            stalled: get(&c.stalled),
            held: get(&c.held),
            released: get(&c.released),
            bytes_up: get(&c.bytes_up),
            bytes_down: get(&c.bytes_down),
            upstream_errors: get(&c.upstream_errors),
        }
    }

    /// Closes the listener, resets every proxied connection (a request in flight is lost, not
    /// committed truncated) and waits until they are gone.
    pub async fn stop(mut self) {
        self.shared.closing.send_replace(true);
        if let Some(mut task) = self.task.take() {
            if tokio::time::timeout(Duration::from_secs(10), &mut task)
                .await
                .is_err()
            {
                task.abort();
            }
        }
    }
}

impl Drop for FaultProxy {
    /// Like [`FaultProxy::stop`] without waiting: the listener and connections close shortly after.
    fn drop(&mut self) {
        self.shared.closing.send_replace(true);
    }
}

/// Accepts connections until the proxy is closing, then waits for its connection tasks (which reset
/// their sockets on `closing`); aborting it aborts them all.
async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut closing = shared.closing.subscribe();
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            () = closed(&mut closing) => break,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => {
                    bump(&shared.counters.connections, 1);
                    tasks.spawn(handle_connection(Arc::clone(&shared), client));
                }
                // E.g. too many open files: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    drop(listener);
    // The connections see `closing` too and reset themselves.
    while tasks.join_next().await.is_some() {}
}

/// Resolves once the proxy is closing (the `watch::Ref` is not held, so the future stays `Send`).
async fn closed(closing: &mut watch::Receiver<bool>) {
    let _ = closing.wait_for(|c| *c).await;
}

/// Closes a socket with a TCP reset once the last handle to it is dropped.
fn reset_on_close(stream: &TcpStream) {
    let _ = stream.set_zero_linger();
}

/// Per-connection request/response tracking, shared by the two directions.
#[derive(Debug)]
struct ConnState {
    /// No client bytes seen yet.
    fresh: bool,
    /// The server started answering the current request, so a new one may start.
    at_boundary: bool,
    /// The fault chosen when the current request started.
    fault: Fault,
    /// Bytes of the current request forwarded upstream.
    request_bytes: u64,
    /// The server started answering the current request.
    response_started: bool,
    /// A one-shot `CutResponse` armed for the current INSERT.
    cut_this_response: bool,
    /// The current request is an INSERT.
    is_insert: bool,
}

enum Outcome {
    /// This direction reached EOF (and passed it on); the other may go on.
    Done,
    /// Reset the whole connection.
    Abort,
}

async fn handle_connection(shared: Arc<Shared>, client: TcpStream) {
    let mut closing = shared.closing.subscribe();
    if shared.refuse_at_accept() {
        bump(&shared.counters.refused, 1);
        reset_on_close(&client);
        return;
    }
    let upstream = match tokio::time::timeout(
        UPSTREAM_CONNECT_TIMEOUT,
        TcpStream::connect(shared.upstream),
    )
    .await
    {
        Ok(Ok(upstream)) => upstream,
        _ => {
            bump(&shared.counters.upstream_errors, 1);
            reset_on_close(&client);
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let state = Mutex::new(ConnState {
        fresh: true,
        at_boundary: false,
        fault: Fault::Pass,
        request_bytes: 0,
        response_started: false,
        cut_this_response: false,
        is_insert: false,
    });
    let (mut client_r, mut client_w) = client.into_split();
    let (mut upstream_r, mut upstream_w) = upstream.into_split();
    let aborted = {
        let up = pump_up(&shared, &state, &mut client_r, &mut upstream_w);
        let down = pump_down(&shared, &state, &mut upstream_r, &mut client_w);
        tokio::pin!(up, down);
        let (mut up_done, mut down_done) = (false, false);
        loop {
            let outcome = tokio::select! {
                () = closed(&mut closing) => Outcome::Abort,
                o = &mut up, if !up_done => { up_done = true; o }
                o = &mut down, if !down_done => { down_done = true; o }
            };
            if matches!(outcome, Outcome::Abort) {
                break true;
            }
            if up_done && down_done {
                break false;
            }
        }
    };
    if aborted {
        // Reset, never FIN: ClickHouse 18.16 takes a clean EOF in the middle of a request body
        // (Content-Length or chunked) as the end of the data and commits the rows read so far. A
        // dropped `OwnedWriteHalf` would send a FIN first, so it is forgotten; the socket closes
        // with the read half, with `SO_LINGER` 0, i.e. with a RST.
        reset_on_close(client_r.as_ref());
        reset_on_close(upstream_r.as_ref());
        client_w.forget();
        upstream_w.forget();
    }
}

/// HTTP methods that start a request.
const METHODS: [&[u8]; 9] = [
    b"GET ",
    b"POST ",
    b"PUT ",
    b"HEAD ",
    b"DELETE ",
    b"OPTIONS ",
    b"PATCH ",
    b"TRACE ",
    b"CONNECT ",
];

fn starts_with_method(chunk: &[u8]) -> bool {
    METHODS.iter().any(|m| chunk.starts_with(m))
}

/// Whether a request's first chunk carries an INSERT in its request line's `query` parameter.
fn is_insert_request(chunk: &[u8]) -> bool {
    let line_end = chunk
        .windows(2)
        .position(|w| w == b"\r\n")
        .unwrap_or(chunk.len());
    chunk[..line_end]
        .windows(b"query=INSERT".len())
        .any(|w| w.eq_ignore_ascii_case(b"query=INSERT"))
}

/// Does this server chunk hold more than `1xx` interim responses (i.e. the start of the real
/// response)? Chunks that do not look like an HTTP status line count as a response start.
fn has_final_response(mut chunk: &[u8]) -> bool {
    while chunk.len() >= 10
        && (chunk.starts_with(b"HTTP/1.1 1") || chunk.starts_with(b"HTTP/1.0 1"))
    {
        match chunk.windows(4).position(|w| w == b"\r\n\r\n") {
            Some(end) => chunk = &chunk[end + 4..],
            // An interim response split across reads: its tail will not look like a status line,
            // so this may start the response early; ClickHouse clients rarely send `Expect`.
            None => return false,
        }
    }
    !chunk.is_empty()
}

/// Client → upstream.
async fn pump_up(
    shared: &Shared,
    state: &Mutex<ConnState>,
    from: &mut OwnedReadHalf,
    to: &mut OwnedWriteHalf,
) -> Outcome {
    let counters = &shared.counters;
    let mut buf = vec![0u8; BUF_SIZE];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) => {
                let _ = to.shutdown().await;
                return Outcome::Done;
            }
            Ok(n) => n,
            Err(_) => return Outcome::Abort,
        };
        let chunk = &buf[..n];
        let (fault, sent, started) = {
            let mut st = lock(state);
            let is_request = starts_with_method(chunk);
            let started = st.fresh || (st.at_boundary && is_request);
            if started {
                if is_request {
                    bump(&counters.requests, 1);
                }
                st.fresh = false;
                st.at_boundary = false;
                st.response_started = false;
                st.request_bytes = 0;
                st.cut_this_response = false;
                let is_insert = is_request && is_insert_request(chunk);
                st.is_insert = is_insert;
                st.fault = shared.request_fault(is_insert, &mut st.cut_this_response);
            }
            (st.fault.clone(), st.request_bytes, started)
        };
        let (fault, sent) = match fault {
            Fault::Hold => {
                bump(&counters.held, 1);
                let is_insert = lock(state).is_insert;
                let fault = shared.released(is_insert).await;
                bump(&counters.released, 1);
                lock(state).fault = fault.clone();
                (fault, sent)
            }
            fault => (fault, sent),
        };
        let forward = match fault {
            Fault::Pass | Fault::CutResponse => n,
            // A standing `Hold` was released above; a one-shot one ends with its request.
            Fault::Hold => n,
            Fault::Refuse => {
                bump(&counters.refused, 1);
                return Outcome::Abort;
            }
            Fault::Stall => {
                if started {
                    bump(&counters.stalled, 1);
                }
                continue;
            }
            Fault::Latency(d) => {
                tokio::time::sleep(d).await;
                n
            }
            Fault::CutRequestAfter(limit) => {
                let allowed = usize::try_from(limit.saturating_sub(sent)).unwrap_or(usize::MAX);
                n.min(allowed)
            }
        };
        if forward > 0 {
            if to.write_all(&chunk[..forward]).await.is_err() {
                return Outcome::Abort;
            }
            bump(&counters.bytes_up, forward as u64);
            lock(state).request_bytes = sent + forward as u64;
        }
        if let Fault::CutRequestAfter(limit) = fault {
            if sent + forward as u64 >= limit {
                let _ = to.flush().await;
                tokio::time::sleep(CUT_SETTLE).await;
                bump(&counters.cuts, 1);
                return Outcome::Abort;
            }
        }
    }
}

/// Upstream → client.
async fn pump_down(
    shared: &Shared,
    state: &Mutex<ConnState>,
    from: &mut OwnedReadHalf,
    to: &mut OwnedWriteHalf,
) -> Outcome {
    let counters = &shared.counters;
    let mut buf = vec![0u8; BUF_SIZE];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) => {
                let _ = to.shutdown().await;
                return Outcome::Done;
            }
            Ok(n) => n,
            Err(_) => return Outcome::Abort,
        };
        let chunk = &buf[..n];
        let (fault, cut) = {
            let mut st = lock(state);
            let mut cut = false;
            if !st.response_started && has_final_response(chunk) {
                st.response_started = true;
                st.at_boundary = true;
                bump(&counters.responses, 1);
                cut =
                    std::mem::take(&mut st.cut_this_response) || shared.cut_response(st.is_insert);
            }
            (st.fault.clone(), cut)
        };
        if cut {
            bump(&counters.cuts, 1);
            return Outcome::Abort;
        }
        if let Fault::Latency(d) = fault {
            tokio::time::sleep(d).await;
        }
        if to.write_all(chunk).await.is_err() {
            return Outcome::Abort;
        }
        bump(&counters.bytes_down, n as u64);
    }
}

/// Fault proxies in front of shard `b` (b1, b2), each doing `fault` from the start: the spec
/// lists their addresses for shard `b`.
pub async fn shard_b_proxies(fault: Fault) -> anyhow::Result<[FaultProxy; 2]> {
    let mut proxies = Vec::new();
    for node in [crate::B1, crate::B2] {
        let upstream: SocketAddr = node.http_addr().parse()?;
        let proxy = FaultProxy::start(upstream).await?;
        proxy.set(fault.clone());
        proxies.push(proxy);
    }
    let [b1, b2]: [FaultProxy; 2] = proxies
        .try_into()
        .map_err(|_| anyhow::anyhow!("two proxies were started"))?;
    Ok([b1, b2])
}

//! Token sending of the exactly-once ClickHouse sinks, seen by a test double: a tiny HTTP/1.1
//! server (std threads, keep-alive, chunked request bodies) that imitates a modern ClickHouse — or
//! an 18.16 one — well enough for the writer session's metadata queries
//! (`flow-clickhouse/src/server/session.rs`), and records every INSERT (URL query parameters,
//! headers, body). INSERT answers can be scripted to exercise the retry
//! classification.
//!
//! What a real server shows is tested on one: tokens per part and shard, their namespaces and
//! replays (`tokens_live.rs`, `token_replay.rs`, on the modern nodes' query log), the capability
//! refusals (`tokens_live.rs` on 18.16). The double keeps only what the real servers here cannot
//! show:
//! * async inserts (`async_insert_adds_wait_and_deduplicate_settings`): the modern nodes are
//!   clickhouse-local, which has no async insert queue and inserts synchronously whatever the
//!   settings say, so only the request can show that the async settings are sent;
//! * the exact form of each request (`modern_server_gets_one_token_per_batch_named_by_its_last_message`,
//!   `server_without_the_token_setting_gets_no_token`: URL parameters, headers, the frame of the
//!   body) and the exact cut of batches across epoch slices
//!   (`batches_span_the_slices_of_an_epoch_and_match_those_of_a_whole_epoch`): a server stores
//!   rows, not requests, and merges the parts that would show the cut;
//! * scripted error answers and what is resent after them (`too_many_parts_...`,
//!   `unknown_table_...`, `unclassified_code_...`, `at_least_once_fails_...`,
//!   `lz4_retries_resend_identical_compressed_bytes`): a real server does not answer an error on
//!   demand, nor keep the bytes of a retried request.
//!
//! These tests need no cluster.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;

use flow_core::{Pipeline, PipelineSpec, RunReport, RuntimeError};
use flow_state::{OutboxId, StateStore};

// ---------------------------------------------------------------------------------------------
// The double.

/// Which server the double imitates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flavor {
    /// A modern ClickHouse: knows `insert_deduplication_token`, `async_insert`,
    /// `async_insert_deduplicate`, `insert_deduplicate` and `system.replicas.zookeeper_name`.
    Modern,
    /// ClickHouse 18.16: only `insert_deduplicate`, no `zookeeper_name` column.
    V18,
}

/// One recorded INSERT request.
#[derive(Clone, Debug)]
struct Insert {
    /// Decoded URL query parameters, in order.
    params: Vec<(String, String)>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Insert {
    fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn token(&self) -> &str {
        self.param("insert_deduplication_token")
            .expect("INSERT without insert_deduplication_token")
    }
}

#[derive(Default)]
struct DoubleState {
    inserts: Vec<Insert>,
    /// Every metadata query text received.
    queries: Vec<String>,
    /// Answers to the next INSERTs, consumed in order; then `default_insert_answer`.
    scripted: VecDeque<(u16, String)>,
    /// `None` answers 200 with an empty body.
    default_insert_answer: Option<(u16, String)>,
}

/// A fake ClickHouse listening on one or more ports of 127.0.0.1, sharing its state.
struct Double {
    flavor: Flavor,
    state: Arc<Mutex<DoubleState>>,
    ports: Vec<u16>,
}

impl Double {
    fn start(flavor: Flavor, listeners: usize) -> Double {
        let state = Arc::new(Mutex::new(DoubleState::default()));
        let mut ports = Vec::new();
        for _ in 0..listeners {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            ports.push(port);
            let state = Arc::clone(&state);
            // Detached: the accept loop lives as long as the test process.
            thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    let state = Arc::clone(&state);
                    thread::spawn(move || serve_connection(flavor, port, stream, &state));
                }
            });
        }
        Double {
            flavor,
            state,
            ports,
        }
    }

    fn port(&self, i: usize) -> u16 {
        self.ports[i]
    }

    fn script_inserts(&self, answers: &[(u16, &str)]) {
        let mut state = self.state.lock().unwrap();
        state
            .scripted
            .extend(answers.iter().map(|(s, b)| (*s, (*b).to_owned())));
    }

    fn answer_every_insert_with(&self, status: u16, body: &str) {
        self.state.lock().unwrap().default_insert_answer = Some((status, body.to_owned()));
    }

    fn inserts(&self) -> Vec<Insert> {
        self.state.lock().unwrap().inserts.clone()
    }

    fn queries(&self) -> Vec<String> {
        self.state.lock().unwrap().queries.clone()
    }
}

fn serve_connection(flavor: Flavor, port: u16, stream: TcpStream, state: &Mutex<DoubleState>) {
    let mut writer = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    // HTTP/1.1 keep-alive: serve requests until the client closes the connection.
    while let Some(request) = read_request(&mut reader) {
        let (status, body) = answer(flavor, port, request, state);
        let reason = match status {
            200 => "OK",
            404 => "Not Found",
            _ => "Internal Server Error",
        };
        let head = format!(
            "HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=UTF-8\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        if writer.write_all(head.as_bytes()).is_err()
            || writer.write_all(body.as_bytes()).is_err()
            || writer.flush().is_err()
        {
            return;
        }
    }
}

struct Request {
    target: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

fn read_request(reader: &mut BufReader<TcpStream>) -> Option<Request> {
    let mut line = String::new();
    if reader.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let target = line.split_whitespace().nth(1)?.to_owned();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':')?;
        headers.push((k.trim().to_owned(), v.trim().to_owned()));
    }
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if header("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size).ok()?;
            let size = usize::from_str_radix(size.trim().split(';').next()?.trim(), 16).ok()?;
            if size == 0 {
                // Trailers (none expected) up to the empty line.
                loop {
                    let mut t = String::new();
                    reader.read_line(&mut t).ok()?;
                    if t.trim_end().is_empty() {
                        break;
                    }
                }
                break;
            }
            let mut chunk = vec![0; size];
            reader.read_exact(&mut chunk).ok()?;
            body.extend_from_slice(&chunk);
            let mut crlf = [0; 2];
            reader.read_exact(&mut crlf).ok()?;
        }
    } else if let Some(len) = header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body = vec![0; len];
        reader.read_exact(&mut body).ok()?;
    }
    Some(Request {
        target,
        headers,
        body,
    })
}

/// Decodes `application/x-www-form-urlencoded` (what the `url` crate writes).
fn url_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).unwrap()
}

fn query_params(target: &str) -> Vec<(String, String)> {
    let Some((_, query)) = target.split_once('?') else {
        return Vec::new();
    };
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (url_decode(k), url_decode(v))
        })
        .collect()
}

/// The generator's six columns, with the ClickHouse types they map to.
const COLUMNS: [(&str, &str); 6] = [
    ("id", "UInt64"),
    ("partition", "UInt32"),
    ("offset", "UInt64"),
    ("user_id", "UInt64"),
    ("ts", "DateTime"),
    ("payload", "String"),
];

fn answer(
    flavor: Flavor,
    port: u16,
    request: Request,
    state: &Mutex<DoubleState>,
) -> (u16, String) {
    let params = query_params(&request.target);
    let insert_sql = params
        .iter()
        .find(|(k, _)| k == "query")
        .map(|(_, v)| v.clone());
    if insert_sql.is_some_and(|q| q.starts_with("INSERT")) {
        let mut state = state.lock().unwrap();
        state.inserts.push(Insert {
            params,
            headers: request.headers,
            body: request.body,
        });
        return state
            .scripted
            .pop_front()
            .or_else(|| state.default_insert_answer.clone())
            .unwrap_or((200, String::new()));
    }
    let sql = String::from_utf8_lossy(&request.body).into_owned();
    state.lock().unwrap().queries.push(sql.clone());
    let lines: Vec<String> = if sql.contains("FROM system.tables") {
        vec![r#"{"engine":"ReplicatedMergeTree"}"#.to_owned()]
    } else if sql.contains("FROM system.columns WHERE database = 'system'") {
        match flavor {
            Flavor::Modern => vec![r#"{"name":"zookeeper_name"}"#.to_owned()],
            Flavor::V18 => Vec::new(),
        }
    } else if sql.starts_with("DESCRIBE TABLE") || sql.contains("FROM system.columns") {
        // The session reads the table's columns from system.columns, the check around each
        // INSERT with DESCRIBE TABLE; both answer with these four fields.
        COLUMNS
            .iter()
            .map(|(name, ty)| {
                format!(
                    r#"{{"name":"{name}","type":"{ty}","default_type":"","default_expression":""}}"#
                )
            })
            .collect()
    } else if sql.contains("FROM system.settings") {
        let names: &[&str] = match flavor {
            Flavor::Modern => &[
                "insert_deduplication_token",
                "async_insert",
                "async_insert_deduplicate",
                "insert_deduplicate",
            ],
            Flavor::V18 => &["insert_deduplicate"],
        };
        names
            .iter()
            .map(|n| format!(r#"{{"name":"{n}"}}"#))
            .collect()
    } else if sql.contains("FROM system.replicas") {
        let zk_name = match flavor {
            Flavor::Modern => r#","zookeeper_name":"default""#,
            Flavor::V18 => "",
        };
        vec![format!(
            r#"{{"zookeeper_path":"/clickhouse/tables/double-{port}/default.t","replica_name":"r1"{zk_name}}}"#
        )]
    } else if sql.starts_with("SHOW CREATE TABLE") {
        vec![format!(
            r#"{{"statement":"CREATE TABLE default.t (id UInt64) ENGINE = ReplicatedMergeTree('/clickhouse/tables/double-{port}/default.t', 'r1') ORDER BY id SETTINGS index_granularity = 8192"}}"#
        )]
    } else if sql.contains("FROM system.merge_tree_settings") {
        vec![r#"{"name":"replicated_deduplication_window_seconds","value":"604800"}"#.to_owned()]
    } else {
        return (
            500,
            format!(
                "Code: 62, e.displayText() = DB::Exception: the double does not understand `{sql}`"
            ),
        );
    };
    let mut body = lines.join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    (200, body)
}

// ---------------------------------------------------------------------------------------------
// Pipelines against the double.

const PIPELINE: &str = "tokpipe";
const SINK: &str = "out";

/// One partition of `count` generator messages, all in one epoch, into sink `out` of `class`.
fn spec(class: &str, parameters: &str, dynamic: &str, count: u64) -> String {
    format!(
        r#"
pipeline: {PIPELINE}
partitions: 1
epoch: {{max_messages: 1000, max_duration_ms: 60000}}
source:
  class: generator
  parameters: {{count: {count}, payload_bytes: 4}}
sinks:
  - name: {SINK}
    sink_class_name: {class}
    input_stream_ids: [rows]
    parameters: {parameters}
    dynamic_parameters: {dynamic}
"#
    )
}

fn unsharded_params(double: &Double, extra: &str) -> String {
    format!(
        "{{host: '127.0.0.1:{}', table: t, codec: none{extra}}}",
        double.port(0)
    )
}

async fn run(yaml: &str) -> Result<RunReport, RuntimeError> {
    let dir = flow_integration::TestDir::new().unwrap();
    run_in(dir.path(), yaml).await.0
}

/// Runs `yaml` on the state directory `dir`; returns the result and the directory's outbox id.
async fn run_in(
    dir: &std::path::Path,
    yaml: &str,
) -> (Result<RunReport, RuntimeError>, Option<OutboxId>) {
    let registry = flow_worker::registry();
    let spec = PipelineSpec::from_yaml(yaml).expect("spec parses");
    let validated = registry.build(&spec).expect("spec validates");
    let store = StateStore::open(dir).unwrap();
    let outbox = store.outbox_id().unwrap();
    let result = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        Pipeline::new(validated, store.clone()).run(),
    )
    .await
    .expect("the pipeline did not finish in time");
    store.close().unwrap();
    (result, outbox)
}

/// `text` (a token, or a message quoting tokens) with the outbox id taken out of the default
/// namespace `tokpipe.out.<16 hex digits>/`, leaving `tokpipe.out/`: every `run` starts a new
/// state directory, hence a new id (`the_default_namespace_names_the_outbox` checks the ids).
fn without_outbox_id(text: &str) -> String {
    let marker = format!("{PIPELINE}.{SINK}.");
    let (mut out, mut rest) = (String::new(), text);
    while let Some(at) = rest.find(&marker) {
        out.push_str(&rest[..at]);
        out.push_str(&format!("{PIPELINE}.{SINK}"));
        let after = &rest[at + marker.len()..];
        let id = after
            .get(..17)
            .filter(|id| id.ends_with('/') && id[..16].bytes().all(|b| b.is_ascii_hexdigit()));
        match id {
            Some(_) => rest = &after[16..],
            None => {
                out.push('.');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The ids of the RowBinary rows of one insert body (the generator's six columns, in order).
/// With `codec: none` the body is one uncompressed ClickHouse frame: a 16-byte checksum, method
/// byte 0x02, frame and data sizes, then the rows verbatim.
fn decode_ids(body: &[u8]) -> Vec<u64> {
    assert_eq!(body[16], 0x02, "an uncompressed frame");
    let data_len = u32::from_le_bytes(body[21..25].try_into().unwrap()) as usize;
    let mut body = &body[25..];
    assert_eq!(body.len(), data_len);
    let mut ids = Vec::new();
    while !body.is_empty() {
        let id = u64::from_le_bytes(body[..8].try_into().unwrap());
        // id u64, partition u32, offset u64, user_id u64, ts u32 (DateTime).
        body = &body[8 + 4 + 8 + 8 + 4..];
        // payload: LEB128 length, bytes.
        let (mut len, mut shift, mut i) = (0usize, 0, 0);
        loop {
            let b = body[i];
            len |= usize::from(b & 0x7f) << shift;
            shift += 7;
            i += 1;
            if b & 0x80 == 0 {
                break;
            }
        }
        body = &body[i + len..];
        ids.push(id);
    }
    ids
}

const EXPECTED_INSERT_SQL: &str =
    "INSERT INTO `default`.`t` (`id`, `partition`, `offset`, `user_id`, `ts`, `payload`) FORMAT RowBinary";

/// Checks what every exactly-once INSERT must carry on a modern server.
fn assert_modern_insert(insert: &Insert) {
    assert_eq!(insert.param("query"), Some(EXPECTED_INSERT_SQL));
    assert_eq!(insert.param("insert_deduplicate"), Some("1"), "{insert:?}");
    // `codec: none`: the body is one uncompressed frame, so a cut body cannot be committed.
    assert_eq!(insert.param("decompress"), Some("1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modern_server_gets_one_token_per_batch_named_by_its_last_message() {
    let double = Double::start(Flavor::Modern, 1);
    run(&spec(
        "ClickHouseBatchingSink",
        &unsharded_params(&double, ""),
        "{max_rows_per_batch: 4}",
        10,
    ))
    .await
    .unwrap();
    let inserts = double.inserts();
    let tokens: Vec<String> = inserts
        .iter()
        .map(|i| without_outbox_id(i.token()))
        .collect();
    assert_eq!(
        tokens,
        ["tokpipe.out/0-3", "tokpipe.out/0-7", "tokpipe.out/0-9"]
    );
    let ids: Vec<Vec<u64>> = inserts.iter().map(|i| decode_ids(&i.body)).collect();
    assert_eq!(ids, [vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
    for insert in &inserts {
        assert_modern_insert(insert);
        assert_eq!(insert.param("async_insert"), None);
        assert_eq!(insert.param("wait_for_async_insert"), None);
        assert_eq!(insert.param("async_insert_deduplicate"), None);
        assert!(
            insert
                .headers
                .iter()
                .any(|(k, v)| k.eq_ignore_ascii_case("X-ClickHouse-User") && v == "default"),
            "{:?}",
            insert.headers
        );
    }
}

/// Two epochs of 50k messages into `ClickHouseBatchingSink` with batches of 7000 rows; with
/// `beside_debug_sink` a `DebugSink` reads the same stream, and since it takes whole epochs the
/// batching sink does too. Returns each insert's token and ids.
async fn tokens_of_two_epochs(double: &Double, beside_debug_sink: bool) -> Vec<(String, Vec<u64>)> {
    let dir = flow_integration::TestDir::new().unwrap();
    let debug = if beside_debug_sink {
        format!(
            "  - {{name: dbg, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: '{}'}}}}\n",
            dir.path().join("debug.jsonl").display()
        )
    } else {
        String::new()
    };
    let yaml = format!(
        "pipeline: {PIPELINE}\npartitions: 1\nepoch: {{max_messages: 50000, max_duration_ms: 60000}}\n\
         source: {{class: generator, parameters: {{count: 100000, payload_bytes: 4}}}}\nsinks:\n\
         \x20 - {{name: {SINK}, sink_class_name: ClickHouseBatchingSink, input_stream_ids: [rows], \
         parameters: {params}, dynamic_parameters: {{max_rows_per_batch: 7000}}}}\n{debug}",
        params = unsharded_params(double, ""),
    );
    let report = run(&yaml).await.unwrap();
    assert_eq!(report.messages(), 100_000);
    double
        .inserts()
        .iter()
        .map(|insert| (without_outbox_id(insert.token()), decode_ids(&insert.body)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_span_the_slices_of_an_epoch_and_match_those_of_a_whole_epoch() {
    // Independently of the cutter: 7000-row batches from each epoch's start, and the epoch's
    // remainder (50000 = 7 x 7000 + 1000) as its last batch.
    let mut expected = Vec::new();
    for epoch in 0..2u64 {
        let start = epoch * 50_000;
        let ends = (1..=7).map(|k| start + 7000 * k).chain([start + 50_000]);
        let mut first = start;
        for end in ends {
            let token = format!("{PIPELINE}.{SINK}/0-{}", end - 1);
            expected.push((token, (first..end).collect::<Vec<u64>>()));
            first = end;
        }
    }
    // The sink alone takes the epochs in slices of 16384 messages, which 7000-row batches
    // straddle; beside a DebugSink it takes them whole.
    let sliced = tokens_of_two_epochs(&Double::start(Flavor::Modern, 1), false).await;
    assert_eq!(sliced.len(), 16);
    assert!(sliced == expected, "sliced epochs cut other batches");
    let whole = tokens_of_two_epochs(&Double::start(Flavor::Modern, 1), true).await;
    assert!(whole == expected, "whole epochs cut other batches");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_insert_adds_wait_and_deduplicate_settings() {
    let double = Double::start(Flavor::Modern, 1);
    run(&spec(
        "ClickHouseBatchingSink",
        &unsharded_params(&double, ""),
        "{max_rows_per_batch: 4, async_insert: true}",
        10,
    ))
    .await
    .unwrap();
    let inserts = double.inserts();
    assert_eq!(inserts.len(), 3);
    for insert in &inserts {
        assert_modern_insert(insert);
        assert_eq!(insert.param("async_insert"), Some("1"));
        assert_eq!(insert.param("wait_for_async_insert"), Some("1"));
        assert_eq!(insert.param("async_insert_deduplicate"), Some("1"));
    }
    let tokens: Vec<String> = inserts
        .iter()
        .map(|i| without_outbox_id(i.token()))
        .collect();
    assert_eq!(
        tokens,
        ["tokpipe.out/0-3", "tokpipe.out/0-7", "tokpipe.out/0-9"]
    );
    // The async window is the one checked.
    assert!(double
        .queries()
        .iter()
        .any(|q| q.contains("replicated_deduplication_window_seconds_for_async_inserts")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_without_the_token_setting_gets_no_token() {
    let double = Double::start(Flavor::V18, 1);
    assert_eq!(double.flavor, Flavor::V18);
    run(&spec(
        "ClickHouseBatchingSink",
        &unsharded_params(&double, ""),
        "{max_rows_per_batch: 4}",
        10,
    ))
    .await
    .unwrap();
    let inserts = double.inserts();
    assert_eq!(inserts.len(), 3);
    for insert in &inserts {
        assert!(
            !insert.params.iter().any(
                |(k, v)| k.contains("deduplication_token") || v.contains("deduplication_token")
            ),
            "{insert:?}"
        );
        assert_eq!(insert.param("insert_deduplicate"), Some("1"));
        assert_eq!(insert.param("async_insert"), None);
        assert_eq!(insert.param("query"), Some(EXPECTED_INSERT_SQL));
    }
    // The 18.16 double has no system.replicas.zookeeper_name: the session must not ask for it.
    assert!(double
        .queries()
        .iter()
        .any(|q| q.starts_with("SELECT zookeeper_path, replica_name FROM system.replicas")));
}

const TOO_MANY_PARTS: &str = "Code: 252, e.displayText() = DB::Exception: Too many parts (300). \
                              Merges are processing significantly slower than inserts., e.what() = DB::Exception";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_parts_is_retried_with_the_same_token_and_bytes() {
    let double = Double::start(Flavor::Modern, 1);
    double.script_inserts(&[(500, TOO_MANY_PARTS), (500, TOO_MANY_PARTS)]);
    run(&spec(
        "ClickHouseBatchingSink",
        &unsharded_params(&double, ""),
        // max_insert_attempts does not bound retryable errors.
        "{max_rows_per_batch: 4, retry_backoff: 10ms, max_insert_attempts: 1}",
        4,
    ))
    .await
    .unwrap();
    let inserts = double.inserts();
    assert_eq!(
        inserts.len(),
        3,
        "two refused attempts, then the accepted one"
    );
    for insert in &inserts {
        assert_eq!(without_outbox_id(insert.token()), "tokpipe.out/0-3");
        assert_eq!(insert.body, inserts[0].body);
        assert_modern_insert(insert);
    }
    assert_eq!(decode_ids(&inserts[0].body), [0, 1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_table_is_permanent_and_given_up_after_one_attempt() {
    let double = Double::start(Flavor::Modern, 1);
    double.answer_every_insert_with(
        404,
        "Code: 60, e.displayText() = DB::Exception: Table default.t doesn't exist., e.what() = DB::Exception",
    );
    let err = run(&spec(
        "ClickHouseBatchingSink",
        &unsharded_params(&double, ""),
        "{max_rows_per_batch: 4, retry_backoff: 1ms}",
        4,
    ))
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("Giving up insert into ClickHouse"), "{err}");
    assert!(
        without_outbox_id(&err).contains("after 1 attempt(s), token tokpipe.out/0-3"),
        "{err}"
    );
    assert!(err.contains("code 60 UNKNOWN_TABLE"), "{err}");
    assert_eq!(double.inserts().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unclassified_code_is_tried_max_insert_attempts_times() {
    let double = Double::start(Flavor::Modern, 1);
    double.answer_every_insert_with(
        500,
        "Code: 62, e.displayText() = DB::Exception: Syntax error: failed at position 1, e.what() = DB::Exception",
    );
    let err = run(&spec(
        "ClickHouseBatchingSink",
        &unsharded_params(&double, ""),
        "{max_rows_per_batch: 4, retry_backoff: 1ms, max_insert_attempts: 3}",
        4,
    ))
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("Giving up insert into ClickHouse"), "{err}");
    assert!(err.contains("after 3 attempt(s)"), "{err}");
    assert!(
        err.contains("unclassified error (code 62 SYNTAX_ERROR)"),
        "{err}"
    );
    let inserts = double.inserts();
    assert_eq!(inserts.len(), 3);
    for insert in &inserts {
        assert_eq!(without_outbox_id(insert.token()), "tokpipe.out/0-3");
        assert_eq!(insert.body, inserts[0].body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_fails_the_write_after_max_insert_attempts_on_an_unknown_error() {
    let double = Double::start(Flavor::Modern, 1);
    double.answer_every_insert_with(
        500,
        "Code: 62, e.displayText() = DB::Exception: Syntax error: failed at position 1, e.what() = DB::Exception",
    );
    let err = run(&spec(
        "AtLeastOnceClickHouseSink",
        &unsharded_params(&double, ""),
        "{max_rows_per_batch: 4, retry_backoff: 1ms, max_insert_attempts: 3}",
        4,
    ))
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("after 3 attempt(s)"), "{err}");
    assert!(
        err.contains("unclassified error (code 62 SYNTAX_ERROR)"),
        "{err}"
    );
    // No veto and replay: exactly the three attempts of the first part were made.
    assert_eq!(double.inserts().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lz4_retries_resend_identical_compressed_bytes() {
    let double = Double::start(Flavor::Modern, 1);
    double.script_inserts(&[(500, TOO_MANY_PARTS)]);
    run(&spec(
        "ClickHouseBatchingSink",
        // codec defaults to lz4.
        &format!("{{host: '127.0.0.1:{}', table: t}}", double.port(0)),
        "{max_rows_per_batch: 4, retry_backoff: 10ms}",
        4,
    ))
    .await
    .unwrap();
    let inserts = double.inserts();
    assert_eq!(inserts.len(), 2);
    for insert in &inserts {
        assert_eq!(insert.param("decompress"), Some("1"));
        assert_eq!(without_outbox_id(insert.token()), "tokpipe.out/0-3");
        assert_eq!(insert.body, inserts[0].body);
    }
    // ClickHouse's compressed block framing: 16-byte checksum, then method byte 0x82 (LZ4).
    assert_eq!(inserts[0].body.get(16), Some(&0x82));
}

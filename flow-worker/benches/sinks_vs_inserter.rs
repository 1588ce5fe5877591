//! The four ClickHouse sink classes, each run by the real `flow-worker` binary, against a
//! hand-written `clickhouse::Inserter` loop on the same rows, on the local cluster
//! (`scripts/cluster.sh up`). `cargo bench -p flow-worker --bench sinks_vs_inserter`; see
//! docs/performance.md for the cases, the measurements and the targets.
//!
//! Environment: `FLOW_BENCH_ROWS` (comma list, default `2000000,8000000`),
//! `FLOW_BENCH_REPETITIONS` (3; cases alternate within each repetition, medians are reported),
//! `FLOW_BENCH_ONLY` (comma list of `inserter,inserter_sharded,batching,sharded,at_least_once,
//! at_most_once`, and, run only when named, `jetstream` (the batching sink reading the
//! generator's rows as JSON from a JetStream stream the orchestrator publishes beforehand) and
//! `batching_scraped` (the batching sink serving `/metrics`, scraped every second)),
//! `FLOW_BENCH_KEEP=1` (keep state directories and worker logs), `FLOW_BENCH_ENDLESS_SECS` (run the
//! endless flat-footprint check instead, at `FLOW_BENCH_ENDLESS_RATE` rows/s in all).
//!
//! One binary, three roles (`FLOW_BENCH_ROLE`): the orchestrator (unset), a `runner` that spawns
//! one measured child and reports its rusage, and the `inserter` loop itself. Every case runs as a
//! grandchild of the orchestrator so that the loop and flow-worker are measured the same way.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// No global allocator here: the loop is what a user writes by hand, on the default allocator
// with no tuning (issue 25). flow-worker, a process of its own, keeps its tuned jemalloc; the
// embedded `push` case runs on the default allocator, as a program that embeds flow without
// choosing one does.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use flow_core::sources::generator::{fill_payload, row_values};

const ROLE: &str = "FLOW_BENCH_ROLE";
/// The role the runner gives its child; unset means "not this binary" (flow-worker).
const CHILD_ROLE: &str = "FLOW_BENCH_CHILD_ROLE";
const WORKER: &str = env!("CARGO_BIN_EXE_flow-worker");

const PARTITIONS: u32 = 4;
const BATCH_ROWS: u64 = 100_000;
const PAYLOAD_BYTES: usize = 64;
/// Per shard: an epoch of a partition holds `EPOCH_MAX_MESSAGES` rows for each shard it is cut
/// for, and a batch `BATCH_ROWS` ([`Case::per_shard`]), so that each shard's part of a batch is
/// a 100k-row insert, as each of the loop's, and not a share of one (docs/clickhouse.md,
/// "Sizing batches for several shards").
const EPOCH_MAX_MESSAGES: u64 = 100_000;
/// Long enough that an unthrottled epoch ends on `max_messages` (100k rows per partition), so
/// flow's batches are the loop's 100k-row inserts; short enough to bound an epoch's memory.
const EPOCH_MAX_DURATION_MS: u64 = 2_000;
/// The sink's ceiling: 100k rows of ~100 bytes exceed the 5 MiB default, which would cut batches
/// smaller than the loop's inserts.
const MAX_BYTES_PER_BATCH: u64 = 256 << 20;

const A1: &str = "127.0.0.1:18123";
const A2: &str = "127.0.0.1:18124";
const B1: &str = "127.0.0.1:18125";
const B2: &str = "127.0.0.1:18126";
const NODES: [&str; 4] = [A1, A2, B1, B2];
const NATS_URL: &str = "nats://127.0.0.1:14222";
/// Where the `batching_scraped` case serves its metrics.
const METRICS_ADDR: &str = "127.0.0.1:19464";

/// Scrapes `/metrics` of the case under measurement every second, as Prometheus would.
struct Scraper {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Scraper {
    fn start() -> Scraper {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let mut answered = 0;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(mut stream) = std::net::TcpStream::connect(METRICS_ADDR) {
                    let request = format!("GET /metrics HTTP/1.1\r\nHost: {METRICS_ADDR}\r\nConnection: close\r\n\r\n");
                    let mut body = Vec::new();
                    if stream.write_all(request.as_bytes()).is_ok()
                        && stream.read_to_end(&mut body).is_ok()
                        && body.starts_with(b"HTTP/1.1 200")
                    {
                        answered += 1;
                    }
                }
                std::thread::sleep(Duration::from_secs(1));
            }
            answered
        });
        Scraper { stop, thread }
    }

    fn stop(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Case {
    Inserter,
    /// The loop over both shards: the sharded class's baseline (four servers take the rows).
    InserterSharded,
    Batching,
    Sharded,
    AtLeastOnce,
    AtMostOnce,
    /// `ClickHouseBatchingSink` fed by `nats_jetstream` instead of the generator.
    JetStream,
    /// `ClickHouseBatchingSink` serving `/metrics`, scraped every second.
    BatchingScraped,
}

impl Case {
    const ALL: [Case; 6] = [
        Case::Inserter,
        Case::InserterSharded,
        Case::Batching,
        Case::Sharded,
        Case::AtLeastOnce,
        Case::AtMostOnce,
    ];
    /// Run only when `FLOW_BENCH_ONLY` names them.
    const ON_REQUEST: [Case; 2] = [Case::JetStream, Case::BatchingScraped];

    fn name(self) -> &'static str {
        match self {
            Case::Inserter => "inserter",
            Case::InserterSharded => "inserter_sharded",
            Case::Batching => "batching",
            Case::Sharded => "sharded",
            Case::AtLeastOnce => "at_least_once",
            Case::AtMostOnce => "at_most_once",
            Case::JetStream => "jetstream",
            Case::BatchingScraped => "batching_scraped",
        }
    }

    /// The sink class the spec names.
    fn sink_class(self) -> &'static str {
        match self {
            Case::JetStream | Case::BatchingScraped => Case::Batching.class(),
            _ => self.class(),
        }
    }

    fn class(self) -> &'static str {
        match self {
            Case::Inserter => "clickhouse::Inserter loop",
            Case::InserterSharded => "clickhouse::Inserter loop, 2 shards",
            Case::Batching => "ClickHouseBatchingSink",
            Case::Sharded => "ShardedClickHouseBatchingSink",
            Case::AtLeastOnce => "AtLeastOnceClickHouseSink",
            Case::AtMostOnce => "AtMostOnceClickHouseSink",
            Case::JetStream => "ClickHouseBatchingSink from JetStream",
            Case::BatchingScraped => "ClickHouseBatchingSink, /metrics scraped every 1 s",
        }
    }

    fn table(self) -> String {
        format!("bench_{}", self.name())
    }

    /// Replicas per shard; the first of each shard is where the rows are counted.
    fn shards(self) -> Vec<[&'static str; 2]> {
        match self {
            Case::Sharded | Case::InserterSharded => vec![[A1, A2], [B1, B2]],
            _ => vec![[A1, A2]],
        }
    }

    /// `rows` for each shard the case writes: what its epochs and batches hold.
    fn per_shard(self, rows: u64) -> u64 {
        rows * self.shards().len() as u64
    }

    fn is_loop(self) -> bool {
        matches!(self, Case::Inserter | Case::InserterSharded)
    }

    /// The loop this case is compared with: the one writing to the same servers.
    fn baseline(self) -> Case {
        match self {
            Case::Sharded | Case::InserterSharded => Case::InserterSharded,
            _ => Case::Inserter,
        }
    }

    /// The throughput each case must reach against the plain loop: every class at least the
    /// loop's (docs/performance.md, "Targets").
    fn target_ratio(self) -> f64 {
        1.0
    }

    fn sink_parameters(self, table: &str) -> String {
        match self {
            Case::Sharded => format!(
                "{{shard_hosts: {{a: ['{A1}', '{A2}'], b: ['{B1}', '{B2}']}}, sharding_key_columns: [user_id], table: {table}}}"
            ),
            _ => format!("{{hosts: ['{A1}', '{A2}'], table: {table}}}"),
        }
    }
}

fn main() -> ExitCode {
    let result = match std::env::var(ROLE).as_deref() {
        Ok("runner") => runner(),
        Ok("inserter") => inserter_loop(),
        Ok("push") => push_pipeline(),
        _ => orchestrate(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Runner: one child, measured

#[derive(serde::Serialize, serde::Deserialize, Debug)]
struct Measured {
    wall_s: f64,
    cpu_s: f64,
    max_rss_kib: i64,
    success: bool,
}

/// Spawns its arguments as the only child, waits, and prints one JSON line. With exactly one
/// child, RUSAGE_CHILDREN is that child's CPU time and its peak RSS.
fn runner() -> Result<()> {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let (program, rest) = args.split_first().context("runner: no child command")?;
    let mut command = Command::new(program);
    command.args(rest).env_remove(ROLE).stdout(Stdio::null());
    if let Some(role) = std::env::var_os(CHILD_ROLE) {
        command.env(ROLE, role).env_remove(CHILD_ROLE);
    }
    let started = Instant::now();
    let status = command
        .status()
        .with_context(|| format!("spawning {}", program.to_string_lossy()))?;
    let wall_s = started.elapsed().as_secs_f64();
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)?;
    let seconds = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    let measured = Measured {
        wall_s,
        cpu_s: seconds(usage.user_time()) + seconds(usage.system_time()),
        max_rss_kib: usage.max_rss(),
        success: status.success(),
    };
    println!("{}", serde_json::to_string(&measured)?);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The baseline: the loop a user would write

#[derive(clickhouse::Row, serde::Serialize)]
struct GeneratorRow<'a> {
    id: u64,
    partition: u32,
    offset: u64,
    user_id: u64,
    ts: u32,
    payload: &'a [u8],
}

fn inserter_loop() -> Result<()> {
    let rows: u64 = env_parse("FLOW_BENCH_INSERTER_ROWS")?.context("FLOW_BENCH_INSERTER_ROWS")?;
    let table = std::env::var("FLOW_BENCH_INSERTER_TABLE").context("FLOW_BENCH_INSERTER_TABLE")?;
    let sharded = env_parse::<bool>("FLOW_BENCH_INSERTER_SHARDED")?.unwrap_or(false);
    // Sharded: one inserter per shard in every task, rows routed as the sharded sink routes them
    // (rendezvous hashing of `user_id` over shards `a`, `b`).
    let nodes: &[&str] = if sharded { &[A1, B1] } else { &[A1] };
    let router = flow_clickhouse::testing::RendezvousRouter::new(&["a".to_owned(), "b".to_owned()]);
    let per_partition = rows / u64::from(PARTITIONS);
    tokio::runtime::Runtime::new()?.block_on(async move {
        let tasks: Vec<_> = (0..PARTITIONS)
            .map(|partition| {
                let mut inserters: Vec<_> = nodes
                    .iter()
                    .map(|node| {
                        clickhouse::Client::default()
                            .with_url(format!("http://{node}"))
                            .with_validation(false)
                            .with_compression(clickhouse::Compression::Lz4)
                            .inserter::<GeneratorRow<'static>>(&table)
                            .with_max_rows(BATCH_ROWS)
                    })
                    .collect();
                let router = router.clone();
                tokio::spawn(async move {
                    let mut payload = Vec::with_capacity(PAYLOAD_BYTES);
                    let mut key = Vec::with_capacity(9);
                    for offset in 0..per_partition {
                        let (id, user_id, ts) = row_values(partition, offset, PARTITIONS);
                        fill_payload(id, PAYLOAD_BYTES, &mut payload);
                        let row = GeneratorRow {
                            id,
                            partition,
                            offset,
                            user_id,
                            ts: u32::try_from(ts)?,
                            payload: &payload,
                        };
                        let shard = if inserters.len() > 1 {
                            key.clear();
                            key.push(2u8);
                            key.extend_from_slice(&user_id.to_le_bytes());
                            router.route(&key)
                        } else {
                            0
                        };
                        inserters[shard].write(&row).await?;
                        inserters[shard].commit().await?;
                    }
                    for inserter in inserters {
                        inserter.end().await?;
                    }
                    anyhow::Ok(())
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// ClickHouse housekeeping

struct ClickHouse {
    runtime: tokio::runtime::Runtime,
}

impl ClickHouse {
    fn client(node: &str) -> clickhouse::Client {
        clickhouse::Client::default()
            .with_url(format!("http://{node}"))
            .with_validation(false)
    }

    fn exec(&self, node: &str, sql: &str) -> Result<()> {
        self.runtime
            .block_on(Self::client(node).query(sql).execute())
            .with_context(|| {
                format!("`{sql}` on {node} (is the cluster up? scripts/cluster.sh up)")
            })
    }

    fn fetch_u64(&self, node: &str, sql: &str) -> Result<u64> {
        self.runtime
            .block_on(Self::client(node).query(sql).fetch_one::<u64>())
            .with_context(|| format!("`{sql}` on {node}"))
    }

    /// Drops every bench table and waits until no node merges or fetches anything, so that each
    /// timed run starts on a quiet server rather than sharing the cores with the previous run's
    /// merges and replication.
    fn settle(&self) -> Result<()> {
        for case in Case::ALL.into_iter().chain(Case::ON_REQUEST) {
            for node in NODES {
                self.exec(
                    node,
                    &format!("DROP TABLE IF EXISTS default.{}", case.table()),
                )?;
            }
        }
        for node in NODES {
            self.exec(node, "DROP TABLE IF EXISTS default.bench_endless")?;
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let mut busy = 0;
            for node in NODES {
                busy += self.fetch_u64(node, "SELECT count() FROM system.merges")?;
                busy += self.fetch_u64(node, "SELECT count() FROM system.replication_queue")?;
            }
            if busy == 0 {
                wait_for_idle_servers();
                return Ok(());
            }
            if Instant::now() > deadline {
                eprintln!(
                    "warning: still {busy} merges/replication entries after 120 s; running anyway"
                );
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `old_parts_lifetime = 30`: an endless run at 200k rows/s merges so much that parts merged
    /// away (kept 8 minutes by default) once filled this machine's disk; it changes nothing the
    /// client measures.
    fn create_table(&self, table: &str, shards: &[[&str; 2]]) -> Result<()> {
        for node in shards.iter().flatten() {
            self.exec(node, &format!("CREATE TABLE default.{table} (id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime, payload String) ENGINE = ReplicatedMergeTree('/clickhouse/tables/{{shard}}/default.{table}', '{{replica}}') ORDER BY id SETTINGS old_parts_lifetime = 30"))?;
        }
        Ok(())
    }

    /// `(count(), uniqExact(id))` summed over shards (a row goes to exactly one shard, so the
    /// per-shard distinct counts add up), read after the counting replica has caught up.
    fn counts(&self, table: &str, shards: &[[&str; 2]]) -> Result<(u64, u64)> {
        let (mut rows, mut ids) = (0, 0);
        for [node, _] in shards {
            self.exec(node, &format!("SYSTEM SYNC REPLICA default.{table}"))?;
            rows += self.fetch_u64(node, &format!("SELECT count() FROM default.{table}"))?;
            ids += self.fetch_u64(node, &format!("SELECT uniqExact(id) FROM default.{table}"))?;
        }
        Ok((rows, ids))
    }
}

// ---------------------------------------------------------------------------------------------
// Orchestrator

fn env_parse<T: std::str::FromStr>(name: &str) -> Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(value) if !value.trim().is_empty() => value
            .trim()
            .parse()
            .map(Some)
            .map_err(|err| anyhow::anyhow!("{name}={value}: {err}")),
        _ => Ok(None),
    }
}

fn spec(case: Case, table: &str, count: u64, rate_per_second: u64) -> String {
    let source = if case == Case::JetStream {
        format!(
            "  class: nats_jetstream\n  parameters:\n    servers: ['{NATS_URL}']\n    stream: {stream}\n    subject_template: '{stream}.{{partition}}'\n    format: json\n    max_messages_per_pull: {EPOCH_MAX_MESSAGES}\n    schema: [{{name: id, type: uint64}}, {{name: partition, type: uint32}}, {{name: offset, type: uint64}}, {{name: user_id, type: uint64}}, {{name: ts, type: datetime}}, {{name: payload, type: string}}]\n",
            stream = jetstream::stream_name(count * u64::from(PARTITIONS)),
        )
    } else {
        format!("  class: generator\n  parameters: {{count: {count}, rate_per_second: {rate_per_second}, payload_bytes: {PAYLOAD_BYTES}}}\n")
    };
    format!(
        "pipeline: bench_{name}\npartitions: {PARTITIONS}\nepoch: {{max_messages: {epoch}, max_duration_ms: {EPOCH_MAX_DURATION_MS}}}\nsource:\n{source}sinks:\n  - name: ch\n    sink_class_name: {class}\n    input_stream_ids: [rows]\n    parameters: {parameters}\n    dynamic_parameters: {{max_rows_per_batch: {batch_rows}, max_bytes_per_batch: {MAX_BYTES_PER_BATCH}}}\n",
        name = case.name(),
        epoch = case.per_shard(EPOCH_MAX_MESSAGES),
        batch_rows = case.per_shard(BATCH_ROWS),
        class = case.sink_class(),
        parameters = case.sink_parameters(table),
    )
}

/// Bytes of the files under `path` (apparent sizes, as `du --apparent-size` counts them).
fn dir_bytes(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => dir_bytes(&entry.path()),
            Ok(meta) => meta.len(),
            Err(_) => 0,
        })
        .sum()
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    rows_per_s: f64,
    cpu_s: f64,
    /// CPU the ClickHouse servers and ZooKeeper used while the child ran.
    server_cpu_s: f64,
    rss_mib: f64,
    state_bytes: Option<u64>,
    table_rows: u64,
}

fn run_case(ch: &ClickHouse, case: Case, rows: u64, work: &Path, tag: &str) -> Result<Sample> {
    let table = case.table();
    ch.settle()?;
    ch.create_table(&table, &case.shards())?;
    let state_dir = work.join(format!("{tag}-state"));
    let log = work.join(format!("{tag}.log"));
    let mut command = Command::new(std::env::current_exe()?);
    command.env(ROLE, "runner");
    if case.is_loop() {
        command
            .arg(std::env::current_exe()?)
            .env(CHILD_ROLE, "inserter")
            .env("FLOW_BENCH_INSERTER_ROWS", rows.to_string())
            .env("FLOW_BENCH_INSERTER_TABLE", &table)
            .env(
                "FLOW_BENCH_INSERTER_SHARDED",
                (case == Case::InserterSharded).to_string(),
            );
    } else {
        let spec_path = work.join(format!("{tag}.yaml"));
        std::fs::write(
            &spec_path,
            spec(case, &table, rows / u64::from(PARTITIONS), 0),
        )?;
        command
            .arg(WORKER)
            .arg("run")
            .arg(&spec_path)
            .arg("--state-dir")
            .arg(&state_dir);
        if case == Case::BatchingScraped {
            command.arg("--metrics-addr").arg(METRICS_ADDR);
        }
    }
    let scraper = (case == Case::BatchingScraped).then(Scraper::start);
    // A stream has no end: the JetStream run is stopped (SIGTERM, a graceful stop) once every row
    // is in the table, and timed to that stop.
    let stopper = (case == Case::JetStream).then(|| {
        let spec_path = work.join(format!("{tag}.yaml"));
        jetstream::StopWhenLanded::start(table.clone(), rows, spec_path)
    });
    let servers_before = server_cpu_s();
    let output = command
        .stderr(std::fs::File::create(&log)?)
        .output()
        .context("running the runner")?;
    let server_cpu_s = server_cpu_s() - servers_before;
    if let Some(stopper) = stopper {
        stopper.join();
    }
    if let Some(scraper) = scraper {
        let scrapes = scraper.stop();
        println!("  {tag}: /metrics answered {scrapes} scrapes");
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let measured: Measured = stdout
        .lines()
        .last()
        .and_then(|line| serde_json::from_str(line).ok())
        .with_context(|| {
            format!(
                "{tag}: the runner printed no measurement; log in {}",
                log.display()
            )
        })?;
    if !measured.success {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(20).collect();
        bail!(
            "{tag}: the child failed; last lines of {}:\n{}",
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    let state_bytes = (!case.is_loop()).then(|| dir_bytes(&state_dir));
    let (table_rows, ids) = ch.counts(&table, &case.shards())?;
    match case {
        Case::Inserter
        | Case::InserterSharded
        | Case::Batching
        | Case::Sharded
        | Case::JetStream
        | Case::BatchingScraped => ensure!(
            table_rows == rows && ids == rows,
            "{tag}: {} wrote {rows} rows but the table holds {table_rows} rows with {ids} distinct ids: rows were lost or duplicated",
            case.class()
        ),
        Case::AtLeastOnce => ensure!(
            ids == rows,
            "{tag}: at-least-once wrote {rows} rows but only {ids} distinct ids arrived"
        ),
        Case::AtMostOnce => {}
    }
    let sample = Sample {
        rows_per_s: rows as f64 / measured.wall_s,
        cpu_s: measured.cpu_s,
        server_cpu_s,
        rss_mib: measured.max_rss_kib as f64 / 1024.0,
        state_bytes,
        table_rows,
    };
    println!(
        "  {tag:<28} {:>6.2} s {:>10.0} rows/s  cpu {:>6.2} s  servers {:>6.2} s  rss {:>6.1} MiB  state {:>12}  table rows {table_rows}",
        measured.wall_s,
        sample.rows_per_s,
        sample.cpu_s,
        sample.server_cpu_s,
        sample.rss_mib,
        state_bytes.map_or("-".to_owned(), |b| b.to_string()),
    );
    if std::env::var_os("FLOW_BENCH_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&state_dir);
        let _ = std::fs::remove_file(&log);
    }
    Ok(sample)
}

/// Waits (at most 30 s) until the servers used under a tenth of a core for a whole second:
/// with merges and replication queues empty they still clean up after the run before (old parts,
/// ZooKeeper nodes of dropped tables), and a run that starts meanwhile shares the two cores with
/// that work, which always followed the same case when the order was fixed.
fn wait_for_idle_servers() {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let before = server_cpu_s();
        std::thread::sleep(Duration::from_secs(1));
        if server_cpu_s() - before < 0.1 {
            return;
        }
    }
    eprintln!("warning: the servers were still busy after 30 s; running anyway");
}

/// User + system CPU seconds so far of the local cluster's servers (`clickhouse-server`s and
/// ZooKeeper's JVM): on a machine that runs client and servers on the same cores, what the
/// client makes the servers do costs the client throughput too.
fn server_cpu_s() -> f64 {
    let ticks_per_s = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let ticks: u64 = entries
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|entry| std::fs::read_to_string(entry.path().join("stat")).ok())
        .filter_map(|stat| {
            // `pid (comm) state ppid ...`: utime and stime are fields 14 and 15.
            let (head, tail) = stat.rsplit_once(") ")?;
            let comm = head.split_once(" (")?.1;
            if comm != "clickhouse-serv" && comm != "java" {
                return None;
            }
            let fields: Vec<&str> = tail.split_whitespace().collect();
            let utime: u64 = fields.get(11)?.parse().ok()?;
            let stime: u64 = fields.get(12)?.parse().ok()?;
            Some(utime + stime)
        })
        .sum();
    ticks as f64 / ticks_per_s
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    if values.len().is_multiple_of(2) {
        (values[middle - 1] + values[middle]) / 2.0
    } else {
        values[middle]
    }
}

fn orchestrate() -> Result<()> {
    if let Some(secs) = env_parse::<u64>("FLOW_BENCH_ENDLESS_SECS")? {
        return endless(secs);
    }
    let rows_list: Vec<u64> = std::env::var("FLOW_BENCH_ROWS")
        .unwrap_or_else(|_| "2000000,8000000".to_owned())
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<u64>()
                .with_context(|| format!("FLOW_BENCH_ROWS: `{s}`"))
        })
        .collect::<Result<_>>()?;
    let repetitions = env_parse::<usize>("FLOW_BENCH_REPETITIONS")?
        .unwrap_or(3)
        .max(1);
    let cases: Vec<Case> = match std::env::var("FLOW_BENCH_ONLY") {
        Ok(only) if !only.trim().is_empty() => only
            .split(',')
            .map(|name| {
                Case::ALL
                    .into_iter()
                    .chain(Case::ON_REQUEST)
                    .find(|case| case.name() == name.trim())
                    .with_context(|| format!("FLOW_BENCH_ONLY: unknown case `{name}`"))
            })
            .collect::<Result<_>>()?,
        _ => Case::ALL.to_vec(),
    };
    let work = std::env::temp_dir().join(format!("flow-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let ch = ClickHouse {
        runtime: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
    };
    println!("# sinks_vs_inserter");
    println!(
        "rows {rows_list:?}, repetitions {repetitions} (medians), partitions {PARTITIONS}, payload {PAYLOAD_BYTES} B, \
         batches/inserts of {BATCH_ROWS} rows per shard (max_bytes_per_batch {MAX_BYTES_PER_BATCH}), \
         epoch {{max_messages: {EPOCH_MAX_MESSAGES} per shard, max_duration_ms: {EPOCH_MAX_DURATION_MS}}}, flow-worker {WORKER}"
    );
    let mut samples: BTreeMap<(u64, Case), Vec<Sample>> = BTreeMap::new();
    for &rows in &rows_list {
        if cases.contains(&Case::JetStream) {
            jetstream::publish_generator_rows(&ch.runtime, rows)?;
        }
        for repetition in 1..=repetitions {
            println!("rows {rows}, repetition {repetition}/{repetitions}");
            // Alternate the cases within a repetition, so that drift on a shared machine hits
            // every case alike, and rotate their order from one repetition to the next, so that
            // no case always follows the same one.
            let mut order = cases.clone();
            order.rotate_left((repetition - 1) % cases.len());
            for &case in &order {
                let tag = format!("{}-{rows}-{repetition}", case.name());
                let sample = run_case(&ch, case, rows, &work, &tag)?;
                samples.entry((rows, case)).or_default().push(sample);
            }
        }
    }
    ch.settle()?;
    print_table(&samples);
    if std::env::var_os("FLOW_BENCH_KEEP").is_some() {
        println!(
            "\nstate directories and worker logs kept in {}",
            work.display()
        );
    } else {
        let _ = std::fs::remove_dir_all(&work);
    }
    Ok(())
}

fn print_table(samples: &BTreeMap<(u64, Case), Vec<Sample>>) {
    println!();
    println!("| case | rows | rows/s | ratio to loop (target) | CPU s (user+sys) | CPU vs loop (target <= 1.25) | server CPU s | peak RSS MiB (target <= 256) | state dir bytes at end | rows in table |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (&(rows, case), runs) in samples {
        let pick = |f: fn(&Sample) -> f64| median(runs.iter().map(f).collect());
        let rate = pick(|s| s.rows_per_s);
        let cpu = pick(|s| s.cpu_s);
        let loop_median = samples.get(&(rows, case.baseline())).map(|runs| {
            (
                median(runs.iter().map(|s| s.rows_per_s).collect()),
                median(runs.iter().map(|s| s.cpu_s).collect()),
            )
        });
        let (ratio, cpu_ratio) = match (case, loop_median) {
            (Case::Inserter | Case::InserterSharded, _) => {
                ("1.00 (baseline)".to_owned(), "1.00".to_owned())
            }
            (_, Some((loop_rate, loop_cpu))) => (
                format!("{:.2} (>= {:.2})", rate / loop_rate, case.target_ratio()),
                format!("{:.2}", cpu / loop_cpu),
            ),
            (_, None) => (format!("- (>= {:.2})", case.target_ratio()), "-".to_owned()),
        };
        let state = if case.is_loop() {
            "-".to_owned()
        } else {
            format!("{:.0}", pick(|s| s.state_bytes.unwrap_or_default() as f64))
        };
        println!(
            "| {} | {rows} | {rate:.0} | {ratio} | {cpu:.2} | {cpu_ratio} | {:.2} | {:.1} | {state} | {:.0} |",
            case.class(),
            pick(|s| s.server_cpu_s),
            pick(|s| s.rss_mib),
            pick(|s| s.table_rows as f64),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Endless: the flat-footprint check

fn vm_rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|line| line.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn endless(secs: u64) -> Result<()> {
    let rate = env_parse::<u64>("FLOW_BENCH_ENDLESS_RATE")?.unwrap_or(20_000);
    // `push`: the payload mode, through an embedded pipeline fed by the application.
    let push = std::env::var("FLOW_BENCH_ENDLESS_MODE").as_deref() == Ok("push");
    let (case, table) = (
        Case::Batching,
        if push {
            "bench_endless_push"
        } else {
            "bench_endless"
        },
    );
    let ch = ClickHouse {
        runtime: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
    };
    for [a, b] in case.shards() {
        ch.exec(a, &format!("DROP TABLE IF EXISTS default.{table}"))?;
        ch.exec(b, &format!("DROP TABLE IF EXISTS default.{table}"))?;
    }
    ch.create_table(table, &case.shards())?;
    let work = std::env::temp_dir().join(format!("flow-bench-endless-{}", std::process::id()));
    let state_dir = work.join("state");
    std::fs::create_dir_all(&work)?;
    let spec_path = work.join("endless.yaml");
    let per_partition = rate.div_ceil(u64::from(PARTITIONS));
    std::fs::write(&spec_path, spec(case, table, 0, per_partition))?;
    println!("# endless {}: {secs} s at {rate} rows/s ({per_partition} per partition), samples every 5 s", case.class());
    let mut command = if push {
        let mut command = Command::new(std::env::current_exe()?);
        command
            .env(ROLE, "push")
            .env("FLOW_BENCH_PUSH_RATE", rate.to_string())
            .env("FLOW_BENCH_PUSH_TABLE", table)
            .env("FLOW_BENCH_PUSH_STATE", &state_dir);
        command
    } else {
        let mut command = Command::new(WORKER);
        command
            .args(["--log-format", "json", "run"])
            .arg(&spec_path)
            .arg("--state-dir")
            .arg(&state_dir);
        command
    };
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let stderr = child.stderr.take().context("worker stderr")?;
    let latency: Arc<Mutex<(u64, Option<serde_json::Value>)>> = Arc::default();
    let p99s: Arc<Mutex<Vec<u64>>> = Arc::default();
    let collector = {
        let latency = Arc::clone(&latency);
        let p99s = Arc::clone(&p99s);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let Ok(event) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                // tracing-subscriber's json layout nests the message under `fields` unless the
                // event is flattened; accept either.
                let message = event
                    .pointer("/fields/message")
                    .or_else(|| event.get("message"))
                    .and_then(|m| m.as_str());
                if message == Some("memory") {
                    let field = |name: &str| {
                        event
                            .pointer(&format!("/fields/{name}"))
                            .and_then(|v| v.as_f64())
                            .unwrap_or(f64::NAN)
                    };
                    println!(
                        "   allocator: allocated {:.1} MiB, active {:.1} MiB, resident {:.1} MiB",
                        field("allocated_mib"),
                        field("active_mib"),
                        field("resident_mib")
                    );
                } else if message == Some("delivery latency") {
                    if let Some(p99) = event.pointer("/fields/p99_ms").and_then(|v| v.as_u64()) {
                        p99s.lock().unwrap().push(p99);
                    }
                    let mut latency = latency.lock().unwrap();
                    latency.0 += 1;
                    latency.1 = Some(event.get("fields").cloned().unwrap_or(event));
                } else if matches!(
                    event.get("level").and_then(|l| l.as_str()),
                    Some("ERROR" | "WARN")
                ) {
                    eprintln!("worker: {line}");
                }
            }
        })
    };
    let started = Instant::now();
    let mut samples: Vec<(f64, u64, u64)> = Vec::new();
    while started.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_secs(5));
        if let Some(status) = child.try_wait()? {
            bail!("the worker exited early ({status})");
        }
        let t = started.elapsed().as_secs_f64();
        let rss = vm_rss_kib(child.id()).unwrap_or_default();
        let state = dir_bytes(&state_dir);
        println!(
            "{t:>7.1} s  RSS {:>7.1} MiB  state dir {state:>12} bytes",
            rss as f64 / 1024.0
        );
        samples.push((t, rss, state));
    }
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    let status = child.wait()?;
    let _ = collector.join();
    println!("worker stopped by SIGTERM: {status}");
    ensure!(
        !samples.is_empty(),
        "no samples: FLOW_BENCH_ENDLESS_SECS must be at least 5"
    );
    let mean = |pick: &dyn Fn(&(f64, u64, u64)) -> bool, field: fn(&(f64, u64, u64)) -> u64| {
        let chosen: Vec<u64> = samples.iter().filter(|s| pick(s)).map(field).collect();
        chosen.iter().sum::<u64>() as f64 / chosen.len().max(1) as f64
    };
    let last_from = samples.last().map_or(0.0, |s| s.0) - 60.0;
    if secs < 120 {
        println!("(under 120 s the first and last minute overlap; the ratios below say little)");
    }
    let first = |s: &(f64, u64, u64)| s.0 <= 60.0;
    let last = |s: &(f64, u64, u64)| s.0 > last_from;
    // RSS samples are KiB, state-dir samples bytes; both are shown in MiB.
    for (what, field, per_mib) in [
        ("RSS", (|s: &(f64, u64, u64)| s.1) as fn(&_) -> u64, 1024.0),
        ("state dir", |s| s.2, 1048576.0),
    ] {
        let (a, b) = (mean(&first, field), mean(&last, field));
        println!(
            "{what}: first minute mean {:.1} MiB, last minute mean {:.1} MiB, ratio {:.3} (flat: within 0.90..1.10)",
            a / per_mib,
            b / per_mib,
            b / a.max(1.0)
        );
    }
    let max_state = samples.iter().map(|s| s.2).max().unwrap_or_default();
    println!(
        "state dir peak {max_state} bytes = {:.1} MiB (target <= 64 MiB)",
        max_state as f64 / 1048576.0
    );
    let (events, last_event) = latency.lock().unwrap().clone();
    match last_event {
        Some(event) => println!("delivery latency: {events} events, last {event}"),
        None => println!("delivery latency: none logged"),
    }
    let p99s = p99s.lock().unwrap().clone();
    println!(
        "delivery latency p99 per 60 s window: {p99s:?} ms (max {} ms; target <= 2 x max_duration_ms + 1 s = {} ms)",
        p99s.iter().max().copied().unwrap_or_default(),
        2 * EPOCH_MAX_DURATION_MS + 1000
    );
    for (t, rss, state) in &samples {
        if (*t as u64) % 60 < 5 {
            println!(
                "sample {t:>6.0} s  RSS {:>6.1} MiB  state {:>6.1} MiB",
                *rss as f64 / 1024.0,
                *state as f64 / 1048576.0
            );
        }
    }
    let (rows, ids) = ch.counts(table, &case.shards())?;
    println!("table rows {rows}, distinct ids {ids}");
    ensure!(
        rows == ids,
        "the exactly-once sink duplicated rows in the endless run"
    );
    if std::env::var_os("FLOW_BENCH_KEEP").is_some() {
        println!("state directory kept in {}", state_dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&work);
        for [a, b] in case.shards() {
            ch.exec(a, &format!("DROP TABLE IF EXISTS default.{table}"))?;
            ch.exec(b, &format!("DROP TABLE IF EXISTS default.{table}"))?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Push: the outbox's payload mode, through an embedded pipeline that an application feeds

/// Pushes `rate` messages per second into one partition through the application's handle, in
/// 10 ms ticks: the generator's values for each offset, built by the producer as an application
/// hands over its own records. Receipts are dropped: the bench measures the outbox, not the
/// producer's bookkeeping.
async fn produce(partition: u32, rate: u64, events: flow_core::PushHandle) {
    use flow_core::{Route, Value};
    let per_tick = rate.div_ceil(100).max(1);
    let mut ticks = tokio::time::interval(Duration::from_millis(10));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut offset = 0u64;
    let mut payload = Vec::with_capacity(PAYLOAD_BYTES);
    loop {
        ticks.tick().await;
        for _ in 0..per_tick {
            let (id, user_id, ts) = row_values(partition, offset, PARTITIONS);
            payload.clear();
            fill_payload(id, PAYLOAD_BYTES, &mut payload);
            let values = [
                Value::Uint(id),
                Value::Uint(u64::from(partition)),
                Value::Uint(offset),
                Value::Uint(user_id),
                Value::Uint(ts),
                Value::Bytes(&payload),
            ];
            if events
                .send(Route::Partition(partition), &values)
                .await
                .is_err()
            {
                return;
            }
            offset += 1;
        }
    }
}

/// The `push` role: an embedded pipeline with flow-core's `PushSource` into `ClickHouseBatchingSink`,
/// fed at `FLOW_BENCH_PUSH_RATE` rows/s until SIGTERM. JSON logs on stderr, like the worker's.
fn push_pipeline() -> Result<()> {
    let rate: u64 = env_parse("FLOW_BENCH_PUSH_RATE")?.context("FLOW_BENCH_PUSH_RATE")?;
    let table = std::env::var("FLOW_BENCH_PUSH_TABLE").context("FLOW_BENCH_PUSH_TABLE")?;
    let state = std::env::var_os("FLOW_BENCH_PUSH_STATE").context("FLOW_BENCH_PUSH_STATE")?;
    tracing_subscriber::fmt()
        .json()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let (source, events) = flow_core::PushSource::new(
            "rows",
            flow_core::sources::generator::schema(),
            flow_core::PushOptions::default(),
        );
        let mut registry = flow::registry();
        source.register(&mut registry, "push");
        // The generator's spec with its source swapped for the push class, which takes no
        // parameters.
        let generator = format!(
            "  class: generator\n  parameters: {{count: 0, rate_per_second: 0, payload_bytes: {PAYLOAD_BYTES}}}\n"
        );
        let text = spec(Case::Batching, &table, 0, 0).replace(&generator, "  class: push\n");
        anyhow::ensure!(text.contains("class: push"), "the bench spec's source moved: {text}");
        let validated = registry
            .build_yaml(&text)
            .map_err(|err| anyhow::anyhow!("{err}"))?;
        let store = flow_state::StateStore::open(Path::new(&state))?;
        let pipeline = flow_core::Pipeline::new(validated, store.clone());
        let control = pipeline.control();
        tokio::spawn(flow_worker::report_memory());
        for partition in 0..PARTITIONS {
            let rate = rate.div_ceil(u64::from(PARTITIONS));
            tokio::spawn(produce(partition, rate, events.clone()));
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::spawn(async move {
            term.recv().await;
            control.shutdown();
        });
        pipeline.run().await?;
        tokio::task::spawn_blocking(move || store.close()).await??;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// The JetStream case's input: the generator's rows, published once per row count

mod jetstream {
    use std::fmt::Write as _;

    use anyhow::{Context, Result};
    use async_nats::jetstream::{self, stream};
    use flow_core::sources::generator::{fill_payload, row_values};

    use super::{NATS_URL, PARTITIONS, PAYLOAD_BYTES};

    /// Watches the table from a thread and sends SIGTERM to the worker running `spec` once it
    /// holds `rows` rows.
    pub struct StopWhenLanded {
        thread: std::thread::JoinHandle<()>,
    }

    impl StopWhenLanded {
        pub fn start(table: String, rows: u64, spec: std::path::PathBuf) -> StopWhenLanded {
            let thread = std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
                while std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    if count(&table).is_some_and(|n| n >= rows) {
                        break;
                    }
                }
                if let Some(pid) = worker_pid(&spec) {
                    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
                }
            });
            StopWhenLanded { thread }
        }

        pub fn join(self) {
            let _ = self.thread.join();
        }
    }

    fn count(table: &str) -> Option<u64> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(super::A1).ok()?;
        let query = format!("SELECT%20count()%20FROM%20default.{table}");
        let request = format!(
            "GET /?query={query} HTTP/1.0\r\nHost: {}\r\n\r\n",
            super::A1
        );
        stream.write_all(request.as_bytes()).ok()?;
        let mut reply = String::new();
        stream.read_to_string(&mut reply).ok()?;
        reply.split("\r\n\r\n").nth(1)?.trim().parse().ok()
    }

    /// The pid of the `flow-worker run` whose command line names `spec`.
    fn worker_pid(spec: &std::path::Path) -> Option<nix::unistd::Pid> {
        let spec = spec.to_string_lossy();
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let args: Vec<String> = cmdline
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            if args.first().is_some_and(|a| a == super::WORKER) && args.iter().any(|a| *a == spec) {
                return Some(nix::unistd::Pid::from_raw(pid));
            }
        }
        None
    }

    /// The stream holding `rows` rows; its subjects are `<name>.<partition>`.
    pub fn stream_name(rows: u64) -> String {
        format!("bench_{rows}")
    }

    /// Publishes the rows the generator would produce for `rows` (partition `p`'s offsets to
    /// subject `<stream>.<p>`, as JSON), unless the stream already holds exactly them.
    pub fn publish_generator_rows(runtime: &tokio::runtime::Runtime, rows: u64) -> Result<()> {
        let name = stream_name(rows);
        runtime.block_on(async {
            let client = async_nats::connect(NATS_URL)
                .await
                .with_context(|| format!("connecting to {NATS_URL} (scripts/cluster.sh up)"))?;
            let js = jetstream::new(client);
            if let Ok(mut existing) = js.get_stream(&name).await {
                if existing.info().await?.state.messages == rows {
                    println!("jetstream: stream {name} already holds {rows} rows");
                    return Ok(());
                }
                js.delete_stream(&name).await?;
            }
            js.create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.*")],
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await?;
            let started = std::time::Instant::now();
            let per_partition = rows / u64::from(PARTITIONS);
            let (mut payload, mut json) = (Vec::new(), String::new());
            let mut acks = Vec::new();
            for offset in 0..per_partition {
                for partition in 0..PARTITIONS {
                    let (id, user_id, ts) = row_values(partition, offset, PARTITIONS);
                    fill_payload(id, PAYLOAD_BYTES, &mut payload);
                    json.clear();
                    // The payload alphabet is [a-z0-9]: no escaping needed.
                    let _ = write!(
                        json,
                        r#"{{"id":{id},"partition":{partition},"offset":{offset},"user_id":{user_id},"ts":{ts},"payload":"{}"}}"#,
                        String::from_utf8_lossy(&payload)
                    );
                    acks.push(js.publish(format!("{name}.{partition}"), json.clone().into()).await?);
                    if acks.len() >= 4096 {
                        for ack in acks.drain(..) {
                            ack.await?;
                        }
                    }
                }
            }
            for ack in acks {
                ack.await?;
            }
            println!(
                "jetstream: published {rows} rows to stream {name} in {:.1} s",
                started.elapsed().as_secs_f64()
            );
            anyhow::Ok(())
        })
    }
}

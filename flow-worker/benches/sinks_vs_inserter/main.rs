//! The four ClickHouse sink classes, each run by the real `flow-worker` binary, against a
//! hand-written `clickhouse::Inserter` loop on the same rows, and flow's broker sources against
//! the consumers a user writes by hand, on the local cluster (`scripts/cluster.sh up`).
//! `cargo bench -p flow-worker --bench sinks_vs_inserter`; see docs/performance.md for the cases,
//! the measurements and the targets.
//!
//! Environment: `FLOW_BENCH_ROWS` (comma list, default `2000000,8000000`),
//! `FLOW_BENCH_REPETITIONS` (3; cases alternate within each repetition, medians are reported),
//! `FLOW_BENCH_ONLY` (comma list of `inserter,inserter_sharded,batching,sharded,at_least_once,
//! at_most_once`, and, run only when named: `jetstream` (the batching sink reading the
//! generator's rows as JSON from a JetStream stream the orchestrator publishes beforehand),
//! `jetstream_consumer_none` and `jetstream_consumer_all` (the hand-written pull consumers of the
//! same stream, `AckPolicy::None` / `All`), `kafka` (the batching sink reading the same JSON from
//! a Kafka topic), `kafka_consumer` (the hand-written rdkafka consumer of it), `brokers` (those
//! five), `batching_scraped` (the batching sink serving `/metrics`, scraped every second) and
//! `scale_out` (8 JetStream partitions into the sharded sink on 1, 2 and 3 `--cluster` workers,
//! each capped by a cgroup CPU quota; `FLOW_BENCH_SCALE_ROWS`, `FLOW_BENCH_SCALE_CPU`)),
//! `FLOW_BENCH_KAFKA=host:port` (a real Kafka-protocol broker instead of librdkafka's mock
//! cluster, which keeps only 5 MiB per partition), `FLOW_BENCH_KEEP=1` (keep state directories
//! and worker logs), `FLOW_BENCH_ENDLESS_SECS` (run the endless flat-footprint check instead, at
//! `FLOW_BENCH_ENDLESS_RATE` rows/s in all; `FLOW_BENCH_ENDLESS_MODE` `push` or `jetstream`),
//! `FLOW_BENCH_SERVER` (`18.16`, the default, or `26.9`: the local cluster's modern nodes,
//! `server.rs`).
//!
//! One binary, several roles (`FLOW_BENCH_ROLE`): the orchestrator (unset), a `runner` that
//! spawns one measured child and reports its rusage, the hand-written baselines (`inserter`,
//! `jetstream_consumer`, `kafka_consumer`) and the endless check's embedded pipeline (`push`).
//! Every case runs as a grandchild of the orchestrator so that the baselines and flow-worker are
//! measured the same way.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// No global allocator here: the loop is what a user writes by hand, on the default allocator
// with no tuning (issue 25). flow-worker, a process of its own, keeps its tuned jemalloc; the
// embedded `push` case runs on the default allocator, as a program that embeds flow without
// choosing one does.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

mod broker_rows;
mod endless;
mod hand_written;
mod jetstream;
mod kafka;
mod landed;
mod scale_out;
mod server;

use server::Server;

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
/// The same for a broker case reading a published stream: on a 2-core machine a partition
/// reads ~35k JSON messages per second while NATS and ClickHouse share the cores, so a 2 s
/// epoch ended on its deadline at ~70k messages (24-28 batches of 2 M rows, not the
/// consumer's 20 inserts: docs/performance.md, fifteenth run). The endless run keeps 2 s.
const BROKER_EPOCH_MAX_DURATION_MS: u64 = 5_000;
/// The sink's ceiling: 100k rows of ~100 bytes exceed the 5 MiB default, which would cut batches
/// smaller than the loop's inserts.
const MAX_BYTES_PER_BATCH: u64 = 256 << 20;

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
    /// The hand-written JetStream consumer, `AckPolicy::None`: the baseline of `JetStream`.
    JetStreamConsumerNone,
    /// The same consumer with `AckPolicy::All`, acking the last message of each pull.
    JetStreamConsumerAll,
    /// `ClickHouseBatchingSink` fed by the `kafka` source.
    Kafka,
    /// The hand-written rdkafka consumer: the baseline of `Kafka`.
    KafkaConsumer,
    /// `ClickHouseBatchingSink` serving `/metrics`, scraped every second.
    BatchingScraped,
    /// `ShardedClickHouseBatchingSink` fed by 8 JetStream partitions, on 1, 2 and 3 capped
    /// workers in cluster mode: measured by `scale_out.rs`, not by [`run_case`].
    ScaleOut,
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
    const ON_REQUEST: [Case; 7] = [
        Case::JetStream,
        Case::JetStreamConsumerNone,
        Case::JetStreamConsumerAll,
        Case::Kafka,
        Case::KafkaConsumer,
        Case::BatchingScraped,
        Case::ScaleOut,
    ];
    /// What `FLOW_BENCH_ONLY=brokers` names.
    const BROKERS: [Case; 5] = [
        Case::JetStream,
        Case::JetStreamConsumerNone,
        Case::JetStreamConsumerAll,
        Case::Kafka,
        Case::KafkaConsumer,
    ];

    fn name(self) -> &'static str {
        match self {
            Case::Inserter => "inserter",
            Case::InserterSharded => "inserter_sharded",
            Case::Batching => "batching",
            Case::Sharded => "sharded",
            Case::AtLeastOnce => "at_least_once",
            Case::AtMostOnce => "at_most_once",
            Case::JetStream => "jetstream",
            Case::JetStreamConsumerNone => "jetstream_consumer_none",
            Case::JetStreamConsumerAll => "jetstream_consumer_all",
            Case::Kafka => "kafka",
            Case::KafkaConsumer => "kafka_consumer",
            Case::BatchingScraped => "batching_scraped",
            Case::ScaleOut => "scale_out",
        }
    }

    /// The sink class the spec names.
    fn sink_class(self) -> &'static str {
        match self {
            Case::JetStream | Case::Kafka | Case::BatchingScraped => Case::Batching.class(),
            Case::ScaleOut => Case::Sharded.class(),
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
            Case::JetStreamConsumerNone => "JetStream pull consumer, AckPolicy::None",
            Case::JetStreamConsumerAll => "JetStream pull consumer, AckPolicy::All",
            Case::Kafka => "ClickHouseBatchingSink from Kafka",
            Case::KafkaConsumer => "rdkafka StreamConsumer",
            Case::BatchingScraped => "ClickHouseBatchingSink, /metrics scraped every 1 s",
            Case::ScaleOut => "ShardedClickHouseBatchingSink from JetStream, 1-3 capped workers",
        }
    }

    fn table(self) -> String {
        format!("bench_{}", self.name())
    }

    /// Whether the case writes to both shards.
    fn is_sharded(self) -> bool {
        matches!(self, Case::Sharded | Case::InserterSharded | Case::ScaleOut)
    }

    /// The hosts of each shard the case writes (`FLOW_BENCH_SERVER`'s generation); the first of
    /// each shard is where the rows are counted.
    fn shards(self) -> Vec<&'static [&'static str]> {
        Server::get()
            .map(|server| server.shards(self.is_sharded()))
            .unwrap_or_default()
    }

    /// `rows` for each shard the case writes: what its epochs and batches hold.
    fn per_shard(self, rows: u64) -> u64 {
        rows * self.shards().len() as u64
    }

    /// The role of the bench binary that runs this case as the runner's child, for the cases a
    /// user writes by hand; `None` for flow-worker.
    fn hand_written_role(self) -> Option<&'static str> {
        match self {
            Case::Inserter | Case::InserterSharded => Some("inserter"),
            Case::JetStreamConsumerNone | Case::JetStreamConsumerAll => Some("jetstream_consumer"),
            Case::KafkaConsumer => Some("kafka_consumer"),
            _ => None,
        }
    }

    fn is_hand_written(self) -> bool {
        self.hand_written_role().is_some()
    }

    /// Reads a broker: its input is published before the repetitions, and a flow case is stopped
    /// once its rows landed.
    fn reads_jetstream(self) -> bool {
        matches!(
            self,
            Case::JetStream | Case::JetStreamConsumerNone | Case::JetStreamConsumerAll
        )
    }

    fn reads_kafka(self) -> bool {
        matches!(self, Case::Kafka | Case::KafkaConsumer)
    }

    /// What this case is compared with: the loop writing to the same servers, or for a broker
    /// case the hand-written consumer of the same broker (`AckPolicy::None` for JetStream, as
    /// flow's source reads).
    fn baseline(self) -> Case {
        match self {
            Case::Sharded | Case::InserterSharded => Case::InserterSharded,
            Case::JetStream | Case::JetStreamConsumerNone | Case::JetStreamConsumerAll => {
                Case::JetStreamConsumerNone
            }
            Case::Kafka | Case::KafkaConsumer => Case::KafkaConsumer,
            _ => Case::Inserter,
        }
    }

    /// The throughput each case must reach against its baseline (docs/performance.md,
    /// "Targets"): every generator class at least the loop's, a broker source 0.9 of the
    /// hand-written consumer's.
    fn target_ratio(self) -> f64 {
        match self {
            Case::JetStream | Case::Kafka => 0.9,
            _ => 1.0,
        }
    }

    fn sink_parameters(self, server: Server, table: &str) -> String {
        let hosts = server.host_parameters(self.is_sharded());
        if self.is_sharded() {
            format!("{{{hosts}, sharding_key_columns: [user_id], table: {table}}}")
        } else {
            format!("{{{hosts}, table: {table}}}")
        }
    }
}

fn main() -> ExitCode {
    let result = match std::env::var(ROLE).as_deref() {
        Ok("runner") => runner(),
        Ok("inserter") => hand_written::inserter_loop(),
        Ok("jetstream_consumer") => hand_written::jetstream_consumer(),
        Ok("kafka_consumer") => hand_written::kafka_consumer(),
        Ok("push") => endless::push_pipeline(),
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
        let nodes = Server::get()?.nodes();
        for case in Case::ALL.into_iter().chain(Case::ON_REQUEST) {
            for &node in &nodes {
                self.exec(
                    node,
                    &format!("DROP TABLE IF EXISTS default.{}", case.table()),
                )?;
            }
        }
        for &node in &nodes {
            self.exec(node, "DROP TABLE IF EXISTS default.bench_endless")?;
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let mut busy = 0;
            for &node in &nodes {
                busy += self.fetch_u64(node, "SELECT count() FROM system.merges")?;
                busy += self.fetch_u64(node, "SELECT count() FROM system.replication_queue")?;
            }
            if busy == 0 {
                wait_for_idle_machine();
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

    /// The table on every host of `shards`, with the generation's engine ([`Server::engine`]).
    fn create_table(&self, table: &str, shards: &[&[&str]]) -> Result<()> {
        let engine = Server::get()?.engine(table);
        for node in shards.iter().copied().flatten() {
            self.exec(node, &format!("CREATE TABLE default.{table} (id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime, payload String) ENGINE = {engine}"))?;
        }
        Ok(())
    }

    /// Drops the table on every host of `shards`.
    fn drop_table(&self, table: &str, shards: &[&[&str]]) -> Result<()> {
        for node in shards.iter().copied().flatten() {
            self.exec(node, &format!("DROP TABLE IF EXISTS default.{table}"))?;
        }
        Ok(())
    }

    /// `(count(), uniqExact(id))` summed over shards (a row goes to exactly one shard, so the
    /// per-shard distinct counts add up), read after the counting replica has caught up.
    fn counts(&self, table: &str, shards: &[&[&str]]) -> Result<(u64, u64)> {
        let (mut rows, mut ids) = (0, 0);
        let replicates = Server::get()?.replicates();
        for shard in shards {
            let node = shard[0];
            if replicates {
                self.exec(node, &format!("SYSTEM SYNC REPLICA default.{table}"))?;
            }
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

/// The columns of the JSON the broker cases read, as a broker source's `schema`.
const BROKER_SCHEMA: &str = "[{name: id, type: uint64}, {name: partition, type: uint32}, {name: offset, type: uint64}, {name: user_id, type: uint64}, {name: ts, type: datetime}, {name: payload, type: string}]";

/// The spec of a flow case; `kafka` is the bootstrap address the `kafka` case reads from.
fn spec(case: Case, table: &str, count: u64, rate_per_second: u64, kafka: Option<&str>) -> String {
    let input = broker_rows::name(count * u64::from(PARTITIONS));
    let source = match case {
        Case::JetStream => format!(
            "  class: nats_jetstream\n  parameters:\n    servers: ['{NATS_URL}']\n    stream: {input}\n    subject_template: '{input}.{{partition}}'\n    format: json\n    max_messages_per_pull: {EPOCH_MAX_MESSAGES}\n    schema: {BROKER_SCHEMA}\n",
        ),
        Case::Kafka => format!(
            "  class: kafka\n  parameters:\n    brokers: ['{}']\n    topic: {input}\n    format: json\n    schema: {BROKER_SCHEMA}\n",
            kafka.unwrap_or_default(),
        ),
        _ => format!("  class: generator\n  parameters: {{count: {count}, rate_per_second: {rate_per_second}, payload_bytes: {PAYLOAD_BYTES}}}\n"),
    };
    format!(
        "pipeline: bench_{name}\npartitions: {PARTITIONS}\nepoch: {{max_messages: {epoch}, max_duration_ms: {epoch_ms}}}\nsource:\n{source}sinks:\n  - name: ch\n    sink_class_name: {class}\n    input_stream_ids: [rows]\n    parameters: {parameters}\n    dynamic_parameters: {{max_rows_per_batch: {batch_rows}, max_bytes_per_batch: {MAX_BYTES_PER_BATCH}}}\n",
        name = case.name(),
        epoch = case.per_shard(EPOCH_MAX_MESSAGES).min(broker_epoch(case, count)),
        epoch_ms = epoch_max_duration_ms(case, count),
        batch_rows = case.per_shard(BATCH_ROWS).min(broker_epoch(case, count)),
        class = case.sink_class(),
        parameters = case.sink_parameters(Server::current(), table),
    )
}

/// The most messages an epoch of a broker case may hold: a stream has no end, so an epoch that
/// waits for more messages than its partition holds ends only on its deadline (seconds of nothing to
/// read), where the hand-written consumer ends on its count. So a partition of fewer than
/// [`EPOCH_MAX_MESSAGES`] rows (a smoke run, or the Kafka mock cluster's most) is one epoch and
/// one batch, as the consumer's one INSERT of them. Unlimited for the other cases.
fn broker_epoch(case: Case, per_partition: u64) -> u64 {
    match case {
        Case::JetStream | Case::Kafka if per_partition > 0 => per_partition,
        _ => u64::MAX,
    }
}

/// The epoch's deadline: [`BROKER_EPOCH_MAX_DURATION_MS`] for a broker case reading a
/// published stream of `per_partition` rows, [`EPOCH_MAX_DURATION_MS`] otherwise.
fn epoch_max_duration_ms(case: Case, per_partition: u64) -> u64 {
    match case {
        Case::JetStream | Case::Kafka if per_partition > 0 => BROKER_EPOCH_MAX_DURATION_MS,
        _ => EPOCH_MAX_DURATION_MS,
    }
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

fn run_case(
    ch: &ClickHouse,
    case: Case,
    rows: u64,
    kafka: Option<&str>,
    work: &Path,
    tag: &str,
) -> Result<Sample> {
    let table = case.table();
    ch.settle()?;
    ch.create_table(&table, &case.shards())?;
    let state_dir = work.join(format!("{tag}-state"));
    let log = work.join(format!("{tag}.log"));
    let mut command = Command::new(std::env::current_exe()?);
    command.env(ROLE, "runner");
    let input = broker_rows::name(rows);
    if let Some(role) = case.hand_written_role() {
        command
            .arg(std::env::current_exe()?)
            .env(CHILD_ROLE, role)
            .env("FLOW_BENCH_INSERTER_ROWS", rows.to_string())
            .env("FLOW_BENCH_INSERTER_TABLE", &table)
            .env(
                "FLOW_BENCH_INSERTER_SHARDED",
                (case == Case::InserterSharded).to_string(),
            )
            .env("FLOW_BENCH_STREAM", &input)
            .env(
                "FLOW_BENCH_ACK",
                if case == Case::JetStreamConsumerAll {
                    "all"
                } else {
                    "none"
                },
            )
            .env("FLOW_BENCH_KAFKA_BROKERS", kafka.unwrap_or_default())
            .env("FLOW_BENCH_KAFKA_TOPIC", &input);
    } else {
        let spec_path = work.join(format!("{tag}.yaml"));
        std::fs::write(
            &spec_path,
            spec(case, &table, rows / u64::from(PARTITIONS), 0, kafka),
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
    // A stream has no end: flow reading a broker is stopped (SIGTERM, a graceful stop) once every
    // row is in the table, and timed to that stop. The hand-written consumers end on their count.
    let stopper = matches!(case, Case::JetStream | Case::Kafka).then(|| {
        let spec_path = work.join(format!("{tag}.yaml"));
        landed::StopWhenLanded::start(table.clone(), rows, spec_path)
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
    let state_bytes = (!case.is_hand_written()).then(|| dir_bytes(&state_dir));
    let (table_rows, ids) = ch.counts(&table, &case.shards())?;
    match case {
        Case::Inserter
        | Case::InserterSharded
        | Case::Batching
        | Case::Sharded
        | Case::JetStream
        | Case::JetStreamConsumerNone
        | Case::JetStreamConsumerAll
        | Case::Kafka
        | Case::KafkaConsumer
        | Case::BatchingScraped
        | Case::ScaleOut => ensure!(
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

/// Waits (at most 30 s) until the whole machine used under a tenth of a core for a whole second:
/// with merges and replication queues empty the servers still clean up after the run before (old
/// parts, ZooKeeper nodes of dropped tables), NATS still writes what a broker case published, and
/// a run that starts meanwhile shares the two cores with that work, which always followed the
/// same case when the order was fixed.
fn wait_for_idle_machine() {
    // Publishing a broker case's rows leaves NATS writing its file store back for seconds after
    // the publisher returned: the dirty pages go to disk now, not under the next timed run.
    nix::unistd::sync();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let before = machine_cpu_s();
        std::thread::sleep(Duration::from_secs(1));
        if machine_cpu_s() - before < 0.1 {
            return;
        }
    }
    eprintln!("warning: the machine was still busy after 30 s; running anyway");
}

/// CPU seconds the whole machine was busy so far (every field of `/proc/stat`'s `cpu` line but
/// idle and iowait).
pub(crate) fn machine_cpu_s() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0.0;
    };
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return 0.0;
    };
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let ticks: u64 = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .filter_map(|(_, t)| t.parse::<u64>().ok())
        .sum();
    ticks as f64 / ticks_per_s()
}

/// User + system CPU seconds so far of the local cluster's servers (`clickhouse-server`s and
/// ZooKeeper's JVM): on a machine that runs client and servers on the same cores, what the
/// client makes the servers do costs the client throughput too.
fn server_cpu_s() -> f64 {
    let server = Server::get().unwrap_or(Server::V18);
    processes_cpu_s(|comm| server.is_server_process(comm))
}

/// User + system CPU seconds so far of the processes whose `comm` (as `/proc/PID/stat` has it,
/// cut to 15 bytes) `wanted` accepts.
fn processes_cpu_s(wanted: impl Fn(&str) -> bool) -> f64 {
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
            if !wanted(head.split_once(" (")?.1) {
                return None;
            }
            let fields: Vec<&str> = tail.split_whitespace().collect();
            let utime: u64 = fields.get(11)?.parse().ok()?;
            let stime: u64 = fields.get(12)?.parse().ok()?;
            Some(utime + stime)
        })
        .sum();
    ticks as f64 / ticks_per_s()
}

/// The kernel's clock ticks per second, the unit of `/proc`'s CPU times.
fn ticks_per_s() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64
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
    let server = Server::get()?;
    println!(
        "servers: ClickHouse {} (FLOW_BENCH_SERVER), nodes {}",
        server.version(),
        server.nodes().join(", ")
    );
    if let Some(secs) = env_parse::<u64>("FLOW_BENCH_ENDLESS_SECS")? {
        return endless::endless(secs);
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
    let mut cases: Vec<Case> = match std::env::var("FLOW_BENCH_ONLY") {
        Ok(only) if !only.trim().is_empty() => {
            let mut cases = Vec::new();
            for name in only.split(',').map(str::trim) {
                if name == "brokers" {
                    cases.extend(Case::BROKERS);
                    continue;
                }
                cases.push(
                    Case::ALL
                        .into_iter()
                        .chain(Case::ON_REQUEST)
                        .find(|case| case.name() == name)
                        .with_context(|| {
                            format!("FLOW_BENCH_ONLY: unknown case `{name}`; the cases are {}, and `brokers` for all five broker cases",
                                Case::ALL.into_iter().chain(Case::ON_REQUEST).map(Case::name).collect::<Vec<_>>().join(", "))
                        })?,
                );
            }
            cases.dedup();
            cases
        }
        _ => Case::ALL.to_vec(),
    };
    // Measured apart (its own row count, workers and table): see scale_out.rs.
    let scale_out = cases.contains(&Case::ScaleOut);
    cases.retain(|&case| case != Case::ScaleOut);
    // Lives until the end: librdkafka's mock cluster serves only while its creator runs.
    let kafka = if cases.iter().any(|case| case.reads_kafka()) {
        let broker = kafka::Broker::start()?;
        println!("kafka: {}", broker.describe());
        Some(broker)
    } else {
        None
    };
    let kafka_bootstrap = kafka.as_ref().map(kafka::Broker::bootstrap);
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
         epoch {{max_messages: {EPOCH_MAX_MESSAGES} per shard, max_duration_ms: {EPOCH_MAX_DURATION_MS}, {BROKER_EPOCH_MAX_DURATION_MS} reading a broker}}, flow-worker {WORKER}"
    );
    let mut samples: BTreeMap<(u64, Case), Vec<Sample>> = BTreeMap::new();
    let mut not_run = Vec::new();
    for &rows in &rows_list {
        if cases.iter().any(|case| case.reads_jetstream()) {
            jetstream::publish_generator_rows(&ch.runtime, rows)?;
        }
        let mut cases = cases.clone();
        if let Some(kafka) = &kafka {
            match kafka.too_small_for(rows) {
                Some(why) => {
                    println!("kafka cases not run at {rows} rows: {why}");
                    not_run.push(format!("{rows} rows, kafka cases: {why}"));
                    cases.retain(|case| !case.reads_kafka());
                }
                None => kafka.produce_generator_rows(rows)?,
            }
        }
        if cases.is_empty() {
            continue;
        }
        let per_partition = rows / u64::from(PARTITIONS);
        if cases
            .iter()
            .any(|case| matches!(case, Case::JetStream | Case::Kafka))
            && per_partition > EPOCH_MAX_MESSAGES
            && per_partition % EPOCH_MAX_MESSAGES != 0
        {
            println!(
                "note: {per_partition} rows per partition is no multiple of the epoch's {EPOCH_MAX_MESSAGES} messages: \
                 each partition's last epoch of a broker case waits for its {BROKER_EPOCH_MAX_DURATION_MS} ms deadline, \
                 which the hand-written consumers do not (choose rows as a multiple of {})",
                EPOCH_MAX_MESSAGES * u64::from(PARTITIONS)
            );
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
                let sample = run_case(&ch, case, rows, kafka_bootstrap.as_deref(), &work, &tag)?;
                samples.entry((rows, case)).or_default().push(sample);
            }
        }
    }
    if scale_out {
        if let Some(why) = scale_out::run(&ch, &work, repetitions)? {
            not_run.push(format!("scale_out: {why}"));
        }
    }
    ch.settle()?;
    if !samples.is_empty() {
        print_table(&samples);
    }
    for line in &not_run {
        println!("not run: {line}");
    }
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
    println!("| case | rows | rows/s | baseline | ratio to baseline (target) | CPU s (user+sys) | CPU vs baseline (target <= 1.25) | server CPU s | peak RSS MiB (target <= 256) | state dir bytes at end | rows in table |");
    println!("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (&(rows, case), runs) in samples {
        let pick = |f: fn(&Sample) -> f64| median(runs.iter().map(f).collect());
        let rate = pick(|s| s.rows_per_s);
        let cpu = pick(|s| s.cpu_s);
        let medians = |of: Case| {
            samples.get(&(rows, of)).map(|runs| {
                (
                    median(runs.iter().map(|s| s.rows_per_s).collect()),
                    median(runs.iter().map(|s| s.cpu_s).collect()),
                )
            })
        };
        let (mut ratio, mut cpu_ratio) = match (case.is_hand_written(), medians(case.baseline())) {
            (true, _) => ("1.00 (baseline)".to_owned(), "1.00".to_owned()),
            (false, Some((base_rate, base_cpu))) => (
                format!("{:.2} (>= {:.2})", rate / base_rate, case.target_ratio()),
                format!("{:.2}", cpu / base_cpu),
            ),
            (false, None) => (format!("- (>= {:.2})", case.target_ratio()), "-".to_owned()),
        };
        // Flow's JetStream source acknowledges nothing, like the `AckPolicy::None` consumer; the
        // consumer acking every pull is shown beside it, as what a user acking would get.
        if let (Case::JetStream, Some((all_rate, all_cpu))) =
            (case, medians(Case::JetStreamConsumerAll))
        {
            ratio.push_str(&format!("; {:.2} vs AckPolicy::All", rate / all_rate));
            cpu_ratio.push_str(&format!("; {:.2} vs AckPolicy::All", cpu / all_cpu));
        }
        let state = if case.is_hand_written() {
            "-".to_owned()
        } else {
            format!("{:.0}", pick(|s| s.state_bytes.unwrap_or_default() as f64))
        };
        println!(
            "| {} | {rows} | {rate:.0} | {} | {ratio} | {cpu:.2} | {cpu_ratio} | {:.2} | {:.1} | {state} | {:.0} |",
            case.class(),
            if case.is_hand_written() {
                "-"
            } else {
                case.baseline().name()
            },
            pick(|s| s.server_cpu_s),
            pick(|s| s.rss_mib),
            pick(|s| s.table_rows as f64),
        );
    }
}

//! Operating a running pipeline, against the local cluster (`scripts/cluster.sh up`).
//!
//! **Topology switch** (`flow-worker drain`). A sharded pipeline writes to shard `a` only, through
//! a [`FaultProxy`] in front of a1. Once rows land, the proxy refuses every connection, so
//! committed batches pile up in the outbox, and the worker is killed with `kill -9`. The spec is
//! then edited to shards `{a, b}`: a `drain` under the edited spec is refused (the topology guard
//! names `drain`), a `drain` under the unchanged spec delivers every pending batch and says the
//! topology can now be changed, and a `run` of the edited spec finishes the source across both
//! shards with every id exactly once.
//!
//! **SIGHUP reload** of a running worker's ClickHouse sink:
//! 1. `ClickHouseBatchingSink`: merges are stopped on the table, so every INSERT stays one part in
//!    `system.parts` with its own row count. Epochs close on exactly 200 messages; with
//!    `max_rows_per_batch: 200` each epoch is one part of 200 rows. A broken spec on SIGHUP is
//!    rejected with a log line naming the violation, and parts keep 200 rows; a valid spec with
//!    `max_rows_per_batch: 50` makes each later epoch four parts of 50 rows.
//! 2. `ClickHouseBatchingSink` whose target refuses every connection, so that its partition's
//!    epochs wait on the full delivery queue: a shorter `retry_backoff` / `max_retry_backoff` on
//!    SIGHUP shortens the next pauses at once (the sink's factory applies it, not the waiting
//!    epoch loop), and every id lands once when the target returns.
//! 3. `AtMostOnceClickHouseSink` with the lossy queue: shrinking `total_queue_bytes_limit` to one
//!    byte on SIGHUP drops every later message (it cannot fit), which the sink's counters and its
//!    warning show: delivered (= the rows in the table) plus dropped is every message.
//!
//! One binary for both (CI links each test file once). The tests fail, not skip, without a
//! cluster. They stop no node.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;

// --- topology switch ---------------------------------------------------------------------

const PARTITIONS: u64 = 2;
const PER_PARTITION: u64 = 4_000;
const TOTAL: u64 = PARTITIONS * PER_PARTITION;
/// Messages per epoch and rows per batch.
const BATCH: u64 = 200;
/// Per partition: about 4 s undisturbed.
const RATE: u64 = 1_000;
/// Pending batches to wait for before the kill.
const MIN_PENDING: u64 = 4;
const PIPELINE: &str = "topo_switch";

fn spec_yaml(table: &str, shard_a: SocketAddr, with_b: bool) -> String {
    let b = if with_b {
        format!(", b: ['{}']", B1.http_addr())
    } else {
        String::new()
    };
    GeneratorSpec::new(
        PIPELINE,
        "ShardedClickHouseBatchingSink",
        format!(
            "{{shard_hosts: {{a: ['{shard_a}']{b}}}, database: default, table: {table}, sharding_key_columns: [user_id]}}"
        ),
    )
    .partitions(PARTITIONS)
    .epoch(BATCH, 600_000)
    .count(PER_PARTITION)
    .rate(RATE)
    .sink_name("events")
    .dynamic(format!(
        "{{max_rows_per_batch: {BATCH}, retry_backoff: 200ms, max_retry_backoff: 1s, max_insert_attempts: 1000}}"
    ))
    .yaml()
}

fn drain(spec: &Path, state: &Path) -> WorkerOutput {
    let (spec, state) = (spec.display().to_string(), state.display().to_string());
    run_worker(
        worker_bin!(),
        &["drain", &spec, "--state-dir", &state],
        &[],
        Duration::from_secs(60),
    )
    .unwrap()
}

/// (count, uniqExact(id)) over both shards, read from a1 and b1 (the only hosts written to).
fn across_shards(table: &str) -> (u64, u64) {
    let sql = format!(
        "SELECT count(), uniqExact(id) FROM remote('127.0.0.1:{},127.0.0.1:{}', default.{table})",
        A1.tcp_port, B1.tcp_port
    );
    let both = query_u64s(A1.http_port, &sql).unwrap();
    (both[0], both[1])
}

#[test]
fn drain_then_a_new_shard_set_delivers_every_id_exactly_once_across_shards() {
    let started = Instant::now();
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let t = unique_name("it_topo_switch");
    let nodes = [A1, A2, B1, B2];
    let _table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &nodes).unwrap();
    let a1 = SocketAddr::from(([127, 0, 0, 1], A1.http_port));
    let proxy = rt.block_on(FaultProxy::start(a1)).unwrap();
    let dir = TestDir::new().unwrap();
    let (spec, state) = (dir.path().join("spec.yaml"), dir.path().join("state"));
    let old_spec = spec_yaml(&t, proxy.addr(), false);
    let new_spec = spec_yaml(&t, proxy.addr(), true);

    // 1. Shard `a` takes rows, then refuses every connection: batches pile up; kill -9.
    std::fs::write(&spec, &old_spec).unwrap();
    let mut worker =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run1.log")).unwrap();
    let landed = || query_u64(A1.http_port, &format!("SELECT count() FROM default.{t}"));
    wait_until(Duration::from_secs(30), || Ok(landed()? >= BATCH)).unwrap();
    proxy.set(Fault::Refuse);
    wait_until(Duration::from_secs(30), || {
        let status = pipeline_status(worker_bin!(), &state, PIPELINE)?;
        Ok(status.is_some_and(|s| s.batches() >= MIN_PENDING))
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", worker.log_tail()));
    assert_eq!(worker.kill_9().unwrap(), None, "{}", worker.log_tail());
    let pending = pipeline_status(worker_bin!(), &state, PIPELINE)
        .unwrap()
        .unwrap();
    assert!(pending.batches() >= MIN_PENDING, "{pending:?}");
    proxy.set(Fault::Pass);

    // 2. A drain under the edited shard set is refused, names `drain`, and sends nothing.
    std::fs::write(&spec, &new_spec).unwrap();
    let before = landed().unwrap();
    let refused = drain(&spec, &state);
    assert_ne!(refused.code, Some(0), "{refused:?}");
    assert!(
        refused.stderr.contains("the shard topology changed while")
            && refused.stderr.contains("`flow-worker drain SPEC`"),
        "{}",
        refused.stderr
    );
    assert_eq!(landed().unwrap(), before);

    // 3. A drain under the unchanged spec empties the outbox, and says the topology may change.
    std::fs::write(&spec, &old_spec).unwrap();
    let drained = drain(&spec, &state);
    assert_eq!(drained.code, Some(0), "{drained:?}");
    assert!(
        drained.stdout.contains(&format!(
            "drained pipeline `{PIPELINE}`: {} batch(es), {} row(s) delivered, nothing pending: the topology can now be changed",
            pending.batches(),
            pending.rows()
        )),
        "{drained:?}"
    );
    let after_drain = pipeline_status(worker_bin!(), &state, PIPELINE)
        .unwrap()
        .unwrap();
    assert_eq!((after_drain.batches(), after_drain.rows()), (0, 0));
    // The source was not read: the committed positions are those of the killed run.
    assert_eq!(after_drain.positions, pending.positions);
    let again = drain(&spec, &state);
    assert_eq!(
        (again.code, again.stdout.trim()),
        (
            Some(0),
            format!(
                "nothing pending in the outbox of pipeline `{PIPELINE}`: the topology can be changed now"
            )
            .as_str()
        )
    );

    // 4. The edited spec runs the rest of the source across both shards: every id once.
    std::fs::write(&spec, &new_spec).unwrap();
    let run = run_spec(worker_bin!(), &spec, &state, Duration::from_secs(60)).unwrap();
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(across_shards(&t), (TOTAL, TOTAL));
    let on_b = query_u64(B1.http_port, &format!("SELECT count() FROM default.{t}")).unwrap();
    assert!(on_b > 0, "shard b took no row of the new topology");
    rt.block_on(proxy.stop());
    eprintln!("topology switch test took {:?}", started.elapsed());
}

// --- SIGHUP reload ---------------------------------------------------------------------------

const TABLE_ROWS: &str = "SELECT count() FROM default.";

fn log_text(worker: &Worker) -> String {
    std::fs::read_to_string(worker.log()).unwrap_or_default()
}

fn wait_for_log(worker: &Worker, needle: &str) {
    wait_until(Duration::from_secs(20), || {
        Ok(log_text(worker).contains(needle))
    })
    .unwrap_or_else(|e| panic!("no `{needle}` in the log: {e:#}\n{}", worker.log_tail()));
}

/// The active parts of `default.table` on a1: (rows of a part, how many parts have that many).
fn parts_by_rows(table: &str) -> Vec<(u64, u64)> {
    let sql = format!(
        "SELECT rows, count() FROM system.parts WHERE database = 'default' AND table = '{table}' \
         AND active GROUP BY rows ORDER BY rows FORMAT TSV"
    );
    query_text(A1.http_port, &sql)
        .unwrap()
        .lines()
        .map(|line| {
            let (rows, parts) = line.split_once('\t').unwrap();
            (rows.parse().unwrap(), parts.parse().unwrap())
        })
        .collect()
}

fn parts(table: &str) -> u64 {
    parts_by_rows(table).iter().map(|(_, parts)| parts).sum()
}

fn write_spec(path: &Path, spec: &GeneratorSpec) {
    std::fs::write(path, spec.yaml()).unwrap();
}

#[test]
fn sighup_changes_the_batch_size_of_a_running_sink_and_a_broken_spec_keeps_it() {
    const COUNT: u64 = 4_000;
    let started = Instant::now();
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let t = unique_name("it_reload_batch");
    let _table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &SHARD_A).unwrap();
    for node in SHARD_A {
        exec(node.http_port, &format!("SYSTEM STOP MERGES default.{t}")).unwrap();
    }
    let spec = |dynamic: &str| {
        GeneratorSpec::new(
            "reload_batch",
            "ClickHouseBatchingSink",
            format!(
                "{{host: '{}', database: default, table: {t}}}",
                A1.http_addr()
            ),
        )
        .epoch(200, 600_000)
        .count(COUNT)
        .rate(500)
        .sink_name("events")
        .dynamic(dynamic.to_owned())
    };
    let dir = TestDir::new().unwrap();
    let (path, state) = (dir.path().join("spec.yaml"), dir.path().join("state"));
    write_spec(&path, &spec("{max_rows_per_batch: 200}"));
    let mut worker = Worker::spawn(worker_bin!(), &path, &state, dir.path().join("log")).unwrap();
    wait_until(Duration::from_secs(30), || Ok(parts(&t) >= 2)).unwrap();

    write_spec(&path, &spec("{max_rows_per_batch: 0}"));
    worker.signal("HUP").unwrap();
    wait_for_log(
        &worker,
        "spec reload rejected; the running parameters stay in force",
    );
    let rejected = log_text(&worker);
    assert!(
        rejected.contains("sinks[0].dynamic_parameters.max_rows_per_batch"),
        "{rejected}"
    );
    let seen = parts(&t);
    wait_until(Duration::from_secs(10), || Ok(parts(&t) >= seen + 2)).unwrap();
    let kept = parts_by_rows(&t);
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].0, 200, "{kept:?}");

    write_spec(&path, &spec("{max_rows_per_batch: 50}"));
    worker.signal("HUP").unwrap();
    wait_for_log(&worker, "dynamic parameters applied");
    assert_eq!(
        worker.wait_exit(Duration::from_secs(30)).unwrap(),
        Some(0),
        "{}",
        worker.log_tail()
    );
    let end = parts_by_rows(&t);
    let (small, large) = match end.as_slice() {
        [(50, small), (200, large)] => (*small, *large),
        other => panic!("parts by rows: {other:?}"),
    };
    assert!(large >= kept[0].1 && small % 4 == 0, "{end:?}");
    assert_eq!(50 * small + 200 * large, COUNT, "{end:?}");
    eprintln!("batch size reload test took {:?}", started.elapsed());
}

/// `field=N` of the log's `at-most-once sink counters` line.
fn counter(log: &str, field: &str) -> u64 {
    let line = log
        .lines()
        .find(|line| line.contains("at-most-once sink counters"))
        .unwrap_or_else(|| panic!("no counters line in\n{log}"));
    let start = line
        .find(&format!("{field}="))
        .unwrap_or_else(|| panic!("no {field} in {line}"))
        + field.len()
        + 1;
    let digits: String = line[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap()
}

#[test]
fn sighup_shrinking_the_at_most_once_queue_limit_drops_every_later_message() {
    const COUNT: u64 = 3_000;
    let started = Instant::now();
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let t = unique_name("it_reload_queue");
    let _table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &SHARD_A).unwrap();
    let spec = |limit: u64| {
        GeneratorSpec::new(
            "reload_queue",
            "AtMostOnceClickHouseSink",
            format!(
                "{{host: '{}', database: default, table: {t}, at_most_once_strategy: {{enabled: true}}}}",
                A1.http_addr()
            ),
        )
        .epoch(100, 600_000)
        .count(COUNT)
        .rate(500)
        .sink_name("events")
        .dynamic(format!(
            "{{at_most_once_strategy: {{total_queue_bytes_limit: {limit}}}}}"
        ))
    };
    let dir = TestDir::new().unwrap();
    let (path, state) = (dir.path().join("spec.yaml"), dir.path().join("state"));
    write_spec(&path, &spec(1 << 20));
    let mut worker = Worker::spawn(worker_bin!(), &path, &state, dir.path().join("log")).unwrap();
    let rows = || query_u64(A1.http_port, &format!("{TABLE_ROWS}{t}"));
    wait_until(Duration::from_secs(30), || Ok(rows()? >= 300)).unwrap();
    assert!(!log_text(&worker).contains("at-most-once queue full"));

    write_spec(&path, &spec(1));
    worker.signal("HUP").unwrap();
    wait_for_log(&worker, "dynamic parameters applied");
    let at_reload = rows().unwrap();
    assert_eq!(
        worker.wait_exit(Duration::from_secs(30)).unwrap(),
        Some(0),
        "{}",
        worker.log_tail()
    );
    let log = log_text(&worker);
    assert!(
        log.contains("at-most-once queue full: messages dropped"),
        "{log}"
    );
    let (delivered, dropped) = (
        counter(&log, "delivered_rows"),
        counter(&log, "dropped_rows"),
    );
    assert_eq!(rows().unwrap(), delivered);
    assert_eq!(delivered + dropped, COUNT, "{log}");
    assert!(delivered >= at_reload && dropped > 0, "{log}");
    eprintln!("queue limit reload test took {:?}", started.elapsed());
}

/// The pauses of the logged insert retries, in order (`pause_ms=N`).
fn retry_pauses_ms(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|line| line.contains("insert failed; retrying"))
        .filter_map(|line| {
            let start = line.find("pause_ms=")? + "pause_ms=".len();
            let digits: String = line[start..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
        .collect()
}

#[test]
fn sighup_shortens_the_retry_backoff_of_a_sink_whose_target_is_down() {
    const COUNT: u64 = 10_000;
    let started = Instant::now();
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let t = unique_name("it_reload_backoff");
    let _table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &SHARD_A).unwrap();
    let a1 = SocketAddr::from(([127, 0, 0, 1], A1.http_port));
    let proxy = rt.block_on(FaultProxy::start(a1)).unwrap();
    let spec = |backoff: &str| {
        GeneratorSpec::new(
            "reload_backoff",
            "ClickHouseBatchingSink",
            format!(
                "{{host: '{}', database: default, table: {t}}}",
                proxy.addr()
            ),
        )
        .epoch(200, 600_000)
        // The delivery queue (8 batches) is full 0.4 s after the target goes down.
        .count(COUNT)
        .rate(5_000)
        .sink_name("events")
        .dynamic(format!(
            "{{max_rows_per_batch: 200, {backoff}, max_insert_attempts: 1000}}"
        ))
    };
    let dir = TestDir::new().unwrap();
    let (path, state) = (dir.path().join("spec.yaml"), dir.path().join("state"));
    write_spec(&path, &spec("retry_backoff: 3s, max_retry_backoff: 3s"));
    let mut worker = Worker::spawn(worker_bin!(), &path, &state, dir.path().join("log")).unwrap();
    let rows = || query_u64(A1.http_port, &format!("{TABLE_ROWS}{t}"));
    wait_until(Duration::from_secs(30), || Ok(rows()? >= 200)).unwrap();

    // The target refuses every connection: the sink retries every 3 s, and its delivery queue
    // fills, so the partition waits on delivery (in an epoch's commit, or in the final drain
    // once the source is exhausted) and does not reach its next epoch.
    proxy.set(Fault::Refuse);
    wait_until(Duration::from_secs(10), || {
        Ok(retry_pauses_ms(&log_text(&worker)).len() >= 2)
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", worker.log_tail()));
    // 3 s less up to 20 % jitter.
    let slow = retry_pauses_ms(&log_text(&worker));
    assert!(
        slow.iter().all(|&p| (2_400..=3_000).contains(&p)),
        "{slow:?}"
    );

    // The reload reaches the waiting sink at once: after the pause in progress, 200 ms at most.
    write_spec(
        &path,
        &spec("retry_backoff: 100ms, max_retry_backoff: 200ms"),
    );
    let before = retry_pauses_ms(&log_text(&worker)).len();
    worker.signal("HUP").unwrap();
    wait_until(Duration::from_secs(10), || {
        let pauses = retry_pauses_ms(&log_text(&worker));
        Ok(pauses.iter().filter(|&&p| p <= 200).count() >= 5)
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", worker.log_tail()));
    let pauses = retry_pauses_ms(&log_text(&worker));
    // At most the retry whose 3 s pause had begun before the reload.
    assert!(
        pauses[before..].iter().filter(|&&p| p > 200).count() <= 1,
        "{pauses:?}"
    );

    proxy.set(Fault::Pass);
    assert_eq!(
        worker.wait_exit(Duration::from_secs(30)).unwrap(),
        Some(0),
        "{}",
        worker.log_tail()
    );
    let counted = query_u64s(
        A1.http_port,
        &format!("SELECT count(), uniqExact(id) FROM default.{t}"),
    )
    .unwrap();
    assert_eq!(counted, vec![COUNT, COUNT]);
    rt.block_on(proxy.stop());
    eprintln!("backoff reload test took {:?}", started.elapsed());
}

//! The delivery guarantee of each ClickHouse sink class (docs/guarantees.md), each shown by one
//! fault with exact numbers, against the local cluster (`scripts/cluster.sh up`):
//!
//! * a lost ack (`Fault::CutResponse`: ClickHouse commits the INSERT, the response never reaches
//!   the sink) through the exactly-once classes: the retry, on the other replica, is deduplicated
//!   by ClickHouse's block dedup and every id lands once;
//! * the same lost ack through `AtLeastOnceClickHouseSink`: on a plain `MergeTree` (no block dedup)
//!   the retried batch is a duplicate of exactly that batch's rows; on a `ReplicatedMergeTree` the
//!   identical retry is deduplicated and no duplicate is visible;
//! * `AtMostOnceClickHouseSink` with the bounded queue under a tiny limit: drops, and the logged
//!   counters account for every missing row;
//! * `AtMostOnceClickHouseSink` (ordered): a lost ack is counted as lost and not retried (the rows
//!   are in the table anyway), a cut request lands nothing and its rows are counted as lost.
//!
//! Faults come from an in-process [`FaultProxy`] in front of the node(s). The proxy is armed only
//! once the first rows are in the table, i.e. after the writer session's start queries, so the
//! one-shot fault hits an INSERT. Generators are rate-limited so that plenty of INSERTs follow.
//! Epochs close on `max_messages: 1000` only and `max_rows_per_batch` is 1000 with one partition,
//! so every INSERT carries exactly the 1000 ids `[k*1000, k*1000+999]`.
//!
//! The at-least-once and at-most-once cases run on both server generations (on 26.9 a plain
//! `MergeTree` on m1); the lost acks of the exactly-once classes retried on the other replica, the
//! window-expiry case and the at-most-once failover need two replicas of a shard and run on 18.16
//! (`token_replay.rs` shows the exactly-once lost ack on both).
//!
//! Other test binaries stop and restart replicas: every test waits for the cluster first and
//! bounds its runs. The tests fail, not skip, without a cluster.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use flow_core::{RunReport, RuntimeError};
use flow_integration::generation::*;
use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;

/// Messages of the lost-ack runs (one partition).
const N: u64 = 20_000;
/// Rows per INSERT in the lost-ack runs.
const BATCH: u64 = 1_000;
/// Messages per second of the lost-ack runs: ~4 s, ~20 INSERTs, so that the proxy is armed early.
const RATE: u64 = 5_000;

const RUN_TIMEOUT: Duration = Duration::from_secs(180);

fn cluster() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
}

fn node_addr(node: Node) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], node.http_port))
}

async fn proxy_for(node: Node) -> FaultProxy {
    FaultProxy::start(node_addr(node)).await.unwrap()
}

/// One rate-limited generator partition of `N` messages into sink `out`, epochs of exactly
/// `BATCH` messages, batches of `BATCH` rows.
fn lost_ack_spec(pipeline: &str, class: &str, parameters: &str) -> String {
    GeneratorSpec::new(pipeline, class, parameters)
        .partitions(1)
        .epoch(BATCH, 600_000)
        .count(N)
        .rate(RATE)
        .payload_bytes(8)
        .sink_name("out")
        .dynamic(format!(
            "{{retry_backoff: 100ms, max_retry_backoff: 2s, max_rows_per_batch: {BATCH}}}"
        ))
        .yaml()
}

/// Runs `yaml` in this process (so that the proxies share its runtime), bounded by `RUN_TIMEOUT`.
async fn run_in_process(yaml: &str) -> Result<RunReport, RuntimeError> {
    let dir = TestDir::new().unwrap();
    run_pipeline(&flow_worker::registry(), yaml, dir.path(), RUN_TIMEOUT)
        .await
        .unwrap()
}

/// Blocking SQL off the runtime's worker threads (the proxies and the pipeline run there).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// `(count(), uniqExact(id))` of `default.table` on the node (after syncing it, if replicated).
/// Retried for up to 2 minutes while the node does not answer (other test binaries restart
/// replicas).
async fn count_uniq(node: Node, table: &str, replicated: bool) -> (u64, u64) {
    let table = table.to_owned();
    blocking(move || {
        let q = format!("default.{table}");
        let read = || -> anyhow::Result<(u64, u64)> {
            if replicated {
                sync_replica(node.http_port, &q)?;
            }
            flow_integration::worker::count_uniq(node, &q)
        };
        let mut last = None;
        wait_until(Duration::from_secs(120), || {
            last = Some(read()?);
            Ok(true)
        })
        .unwrap_or_else(|err| panic!("reading {q} on {}: {err:#}", node.name));
        last.unwrap()
    })
    .await
}

/// Waits until `default.table` on the node has a row: the writer session has started and INSERTs
/// are flowing, so a one-shot fault armed now hits an INSERT, not a session query.
async fn wait_for_first_rows(node: Node, table: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let t = table.to_owned();
        let rows = blocking(move || {
            query_u64(node.http_port, &format!("SELECT count() FROM default.{t}")).unwrap_or(0)
        })
        .await;
        if rows > 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no row reached default.{table} on {} within 2 minutes",
            node.name
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Arms `fault` once on `proxy` after the first rows reached `table` on `node`, in the background.
async fn arm_after_first_rows(proxy: &FaultProxy, node: Node, table: &str, fault: Fault) {
    wait_for_first_rows(node, table).await;
    proxy.set_once_on_insert(fault);
}

/// `(duplicated ids, min, max)` of the ids present more than once.
async fn duplicated_ids(node: Node, table: &str) -> (u64, u64, u64) {
    let table = table.to_owned();
    blocking(move || {
        let f = query_u64s(
            node.http_port,
            &format!(
                "SELECT count(), min(id), max(id) FROM \
                 (SELECT id FROM default.{table} GROUP BY id HAVING count() > 1)"
            ),
        )
        .unwrap();
        (f[0], f[1], f[2])
    })
    .await
}

/// Blocks of `default.table` the node deduplicated, from its server log; waits up to 10 s for
/// `expected` (the log may trail the INSERT's response), then returns what it found.
async fn dedup_logged(node: Node, table: &str, expected: usize) -> usize {
    let q = format!("default.{table}");
    blocking(move || {
        let _ = wait_until(Duration::from_secs(10), || {
            Ok(deduplicated_blocks_logged(node, &q) >= expected)
        });
        deduplicated_blocks_logged(node, &q)
    })
    .await
}

/// A plain (non-replicated) `MergeTree` table of generator rows on one node, dropped with the guard.
fn plain_table(node: Node, prefix: &str) -> (String, DropGuard) {
    let t = unique_name(prefix);
    let mut guard = DropGuard::default();
    guard
        .create_merge_tree(node, "default", &t, GENERATOR_COLUMNS, "id")
        .unwrap();
    (t, guard)
}

// ---------------------------------------------------------------------------------------------
// The worker binary (at-most-once counters are read from its JSON log).

/// The `at-most-once sink counters` of a worker's JSON log: the maximum of each field over all
/// such lines (the counters are sink-wide and only grow, so that is the final value), and how many
/// lines there were.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct AtMostOnceCounters {
    delivered_rows: u64,
    dropped_rows: u64,
    lost_rows: u64,
    lines: usize,
}

fn at_most_once_counters(log: &str) -> AtMostOnceCounters {
    let mut c = AtMostOnceCounters::default();
    for line in log.lines() {
        let Ok(json) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let fields = &json["fields"];
        if fields["message"] != "at-most-once sink counters" {
            continue;
        }
        let get = |name: &str| {
            fields[name]
                .as_u64()
                .unwrap_or_else(|| panic!("no numeric `{name}` in {line}"))
        };
        c.delivered_rows = c.delivered_rows.max(get("delivered_rows"));
        c.dropped_rows = c.dropped_rows.max(get("dropped_rows"));
        c.lost_rows = c.lost_rows.max(get("lost_rows"));
        c.lines += 1;
    }
    c
}

/// Runs `flow-worker-it --log-format json run SPEC` to its end while `during` runs alongside (it
/// may arm proxies of this process); returns (exit code, stderr).
async fn worker_run_json(
    yaml: &str,
    during: impl std::future::Future<Output = ()>,
) -> (Option<i32>, String) {
    let dir = TestDir::new().unwrap();
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, yaml).unwrap();
    let args: Vec<String> = vec![
        "--log-format".into(),
        "json".into(),
        "run".into(),
        spec_path.to_str().unwrap().into(),
        "--state-dir".into(),
        dir.path().join("state").to_str().unwrap().into(),
    ];
    let run = blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_worker(worker_bin!(), &args, &[], RUN_TIMEOUT)
    });
    let (out, ()) = tokio::join!(run, during);
    let out = out.unwrap_or_else(|err| panic!("{err:#}"));
    (out.code, out.stderr)
}

fn log_tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

// ---------------------------------------------------------------------------------------------
// 1. Exactly-once: a lost ack is retried on the other replica and deduplicated.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batching_sink_lost_ack_retried_on_the_other_replica_lands_every_id_exactly_once() {
    cluster();
    let t = unique_name("it_gc_eo");
    let table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &SHARD_A).unwrap();
    let (pa1, pa2) = (proxy_for(A1).await, proxy_for(A2).await);
    let yaml = lost_ack_spec(
        "gc_eo",
        "ClickHouseBatchingSink",
        &format!(
            "{{hosts: ['{}', '{}'], table: {t}}}",
            pa1.addr(),
            pa2.addr()
        ),
    );

    let (result, ()) = tokio::join!(
        run_in_process(&yaml),
        arm_after_first_rows(&pa1, A1, &t, Fault::CutResponse)
    );
    let report = result.unwrap();
    assert_eq!(report.messages(), N);

    let (s1, s2) = (pa1.stats(), pa2.stats());
    println!("a1 proxy: {s1:?}\na2 proxy: {s2:?}");
    assert_eq!(s1.cuts, 1, "exactly one lost ack on a1");
    assert_eq!(s2.cuts, 0);
    for node in SHARD_A {
        assert_eq!(count_uniq(node, &t, true).await, (N, N), "on {}", node.name);
    }
    // The retry carried the bytes a1 had committed: one replica recognised that one block (a2,
    // after the failover, unless another test binary had a2 down at that moment).
    let dedup_a2 = dedup_logged(A2, &t, 1).await;
    let dedup_a1 = dedup_logged(A1, &t, 1 - dedup_a2.min(1)).await;
    println!(
        "REPORT exactly-once (unsharded): 1 lost ack, count = uniqExact = {N} on a1 and a2, \
         blocks deduplicated (server logs): a1 {dedup_a1}, a2 {dedup_a2}"
    );
    assert_eq!(dedup_a1 + dedup_a2, 1, "one block recognised as a replay");
    drop(table);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batching_sink_lost_acks_past_the_dedup_window_set_the_batches_aside_instead_of_resending()
{
    cluster();
    let t = unique_name("it_gc_expired");
    let mut tables = DropGuard::default();
    // One replica, and a deduplication window of 2 s.
    tables
        .create(
            A1.http_port,
            &format!("default.{t}"),
            &format!(
                "CREATE TABLE default.{t} ({GENERATOR_COLUMNS}) ENGINE = ReplicatedMergeTree('/clickhouse/tables/{{shard}}/default.{t}', '{{replica}}') \
                 ORDER BY id SETTINGS replicated_deduplication_window_seconds = 2"
            ),
        )
        .unwrap();
    let proxy = proxy_for(A1).await;
    let yaml = lost_ack_spec(
        "gc_expired",
        "ClickHouseBatchingSink",
        &format!("{{host: '{}', table: {t}}}", proxy.addr()),
    );
    let dir = TestDir::new().unwrap();
    // Every INSERT lands and loses its answer for 4 s: each batch then in delivery is retried
    // (each retry recognised by the server) until it is 2 s old, then set aside.
    let faults = async {
        wait_for_first_rows(A1, &t).await;
        proxy.set_on_inserts(Fault::CutResponse);
        tokio::time::sleep(Duration::from_secs(4)).await;
        proxy.set_on_inserts(Fault::Pass);
    };
    let registry = flow_worker::registry();
    let (result, ()) = tokio::join!(
        run_pipeline(&registry, &yaml, dir.path(), RUN_TIMEOUT),
        faults
    );
    let report = result.unwrap().unwrap();
    assert_eq!(report.messages(), N);
    assert!(proxy.stats().cuts >= 2, "{:?}", proxy.stats());

    // Every id landed (each unanswered attempt did), none twice.
    assert_eq!(count_uniq(A1, &t, true).await, (N, N));
    let store = flow_state::StateStore::open(dir.path()).unwrap();
    let dead = store.all_dead_letters(Some("out")).unwrap();
    store.close().unwrap();
    let rows = dead.len() as u64;
    println!("REPORT expired backlog: {rows} rows set aside, count = uniqExact = {N}");
    assert!(
        rows >= BATCH && rows.is_multiple_of(BATCH),
        "whole batches are set aside: {rows} rows"
    );
    for letter in &dead {
        assert!(
            letter
                .letter
                .reason
                .contains("past the shard's deduplication window of 2 s"),
            "{}",
            letter.letter.reason
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sharded_batching_sink_lost_ack_retried_on_the_other_replica_lands_every_id_exactly_once() {
    cluster();
    let t = unique_name("it_gc_eo_sharded");
    let table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &NODES).unwrap();
    let mut proxies = Vec::new();
    for node in NODES {
        proxies.push(proxy_for(node).await);
    }
    let yaml = lost_ack_spec(
        "gc_eo_sharded",
        "ShardedClickHouseBatchingSink",
        &format!(
            "{{shard_hosts: {{a: ['{}', '{}'], b: ['{}', '{}']}}, table: {t}, \
             sharding_key_columns: [id]}}",
            proxies[0].addr(),
            proxies[1].addr(),
            proxies[2].addr(),
            proxies[3].addr()
        ),
    );

    let (result, ()) = tokio::join!(
        run_in_process(&yaml),
        arm_after_first_rows(&proxies[0], A1, &t, Fault::CutResponse)
    );
    let report = result.unwrap();
    assert_eq!(report.messages(), N);

    let cuts: Vec<u64> = proxies.iter().map(|p| p.stats().cuts).collect();
    println!("proxy cuts a1, a2, b1, b2: {cuts:?}");
    assert_eq!(cuts, [1, 0, 0, 0], "exactly one lost ack, on a1");
    let (a1, a2) = (
        count_uniq(A1, &t, true).await,
        count_uniq(A2, &t, true).await,
    );
    let (b1, b2) = (
        count_uniq(B1, &t, true).await,
        count_uniq(B2, &t, true).await,
    );
    println!("shard a: {a1:?} / {a2:?}, shard b: {b1:?} / {b2:?}");
    assert_eq!(a1, a2, "replicas of shard a differ");
    assert_eq!(b1, b2, "replicas of shard b differ");
    assert_eq!(a1.0, a1.1, "duplicates on shard a");
    assert_eq!(b1.0, b1.1, "duplicates on shard b");
    assert!(a1.0 > 0 && b1.0 > 0, "both shards get rows");
    // Disjoint shards: the sum of distinct ids per shard is the distinct ids overall.
    assert_eq!(a1.0 + b1.0, N);
    let overlap = blocking({
        let t = t.clone();
        move || {
            let a = query_text(A1.http_port, &format!("SELECT id FROM default.{t}")).unwrap();
            let b = query_text(B1.http_port, &format!("SELECT id FROM default.{t}")).unwrap();
            let a: std::collections::BTreeSet<&str> = a.lines().collect();
            b.lines().filter(|id| a.contains(id)).count()
        }
    })
    .await;
    assert_eq!(overlap, 0, "ids on both shards");
    let mut dedup = Vec::new();
    for node in NODES {
        dedup.push(dedup_logged(node, &t, 0).await);
    }
    if dedup.iter().sum::<usize>() == 0 {
        // The log may trail: wait for the replica the retry went to (a2 after the failover).
        dedup[1] = dedup_logged(A2, &t, 1).await;
        dedup[0] = dedup_logged(A1, &t, 0).await;
    }
    println!(
        "REPORT exactly-once (sharded): 1 lost ack on a1, shard a {} + shard b {} = {N} rows, all \
         distinct; blocks deduplicated (server logs) a1, a2, b1, b2: {dedup:?}",
        a1.0, b1.0
    );
    assert_eq!(
        dedup[0] + dedup[1],
        1,
        "one block of shard a recognised as a replay"
    );
    assert_eq!(dedup[2] + dedup[3], 0, "shard b had no lost ack");
    drop(table);
}

// ---------------------------------------------------------------------------------------------
// 2. At-least-once: the lost ack's batch is inserted again.

async fn at_least_once_lost_ack_duplicates_exactly_the_unacknowledged_batch_on_plain_merge_tree(
    generation: Generation,
) {
    generation.require().unwrap();
    let host = generation.first();
    let (t, guard) = plain_table(host, "it_gc_alo_plain");
    let pa1 = proxy_for(host).await;
    let yaml = lost_ack_spec(
        "gc_alo_plain",
        "AtLeastOnceClickHouseSink",
        &format!("{{host: '{}', table: {t}}}", pa1.addr()),
    );
    let (result, ()) = tokio::join!(
        run_in_process(&yaml),
        arm_after_first_rows(&pa1, host, &t, Fault::CutResponse)
    );
    let report = result.unwrap();
    assert_eq!(report.messages(), N);
    let stats = pa1.stats();
    println!("{} proxy: {stats:?}", host.name);
    assert_eq!(stats.cuts, 1, "exactly one lost ack");

    let (count, uniq) = count_uniq(host, &t, false).await;
    assert_eq!(uniq, N, "no id is missing");
    let duplicates = count - uniq;
    let (dup_ids, min, max) = duplicated_ids(host, &t).await;
    println!(
        "REPORT at-least-once, plain MergeTree: count {count}, uniqExact {uniq}, duplicates \
         {duplicates} (ids {min}..={max}, each twice)"
    );
    assert_eq!(duplicates, BATCH, "the lost ack's batch, inserted twice");
    // Exactly one INSERT's ids, each present twice.
    assert_eq!(dup_ids, BATCH);
    assert_eq!((min % BATCH, max - min + 1), (0, BATCH));
    drop(guard);
}
each_generation!(
    at_least_once_lost_ack_duplicates_exactly_the_unacknowledged_batch_on_plain_merge_tree
);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_least_once_lost_ack_is_hidden_by_block_dedup_on_replicated_merge_tree() {
    cluster();
    let t = unique_name("it_gc_alo_repl");
    let table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &[A1]).unwrap();
    let pa1 = proxy_for(A1).await;
    let yaml = lost_ack_spec(
        "gc_alo_repl",
        "AtLeastOnceClickHouseSink",
        &format!("{{host: '{}', table: {t}}}", pa1.addr()),
    );
    let (result, ()) = tokio::join!(
        run_in_process(&yaml),
        arm_after_first_rows(&pa1, A1, &t, Fault::CutResponse)
    );
    let report = result.unwrap();
    assert_eq!(report.messages(), N);
    assert_eq!(pa1.stats().cuts, 1, "exactly one lost ack");
    let dedup = dedup_logged(A1, &t, 1).await;
    let (count, uniq) = count_uniq(A1, &t, true).await;
    println!(
        "REPORT at-least-once, ReplicatedMergeTree: count {count}, uniqExact {uniq}, duplicates \
         {} (blocks deduplicated by a1, server log: {dedup})",
        count - uniq
    );
    assert_eq!(
        (count, uniq),
        (N, N),
        "the identical retry was deduplicated"
    );
    assert_eq!(dedup, 1, "a1 recognised the retried block once");
    drop(table);
}

// ---------------------------------------------------------------------------------------------
// 3. At-most-once, bounded queue: drops under a tiny limit, counted.

async fn at_most_once_queue_drops_under_a_tiny_limit_and_the_counters_account_for_every_missing_row(
    generation: Generation,
) {
    const PARTITIONS: u64 = 4;
    const PER_PARTITION: u64 = 25_000;
    const TOTAL: u64 = PARTITIONS * PER_PARTITION;
    generation.require().unwrap();
    let host = generation.first();
    let t = unique_name("it_gc_amo_queue");
    let table = generation
        .create_table_on("default", &t, GENERATOR_COLUMNS, "id", generation.shard_a())
        .unwrap();
    let yaml = format!(
        r#"
pipeline: gc_amo_queue
partitions: {PARTITIONS}
epoch: {{max_messages: 5000, max_duration_ms: 500}}
source:
  class: generator
  parameters: {{count: {PER_PARTITION}, payload_bytes: 8}}
sinks:
  - name: out
    sink_class_name: AtMostOnceClickHouseSink
    input_stream_ids: [rows]
    parameters: {{host: '{}', table: {t}, at_most_once_strategy: {{enabled: true}}}}
    dynamic_parameters: {{retry_backoff: 100ms, max_retry_backoff: 2s, at_most_once_strategy: {{total_queue_bytes_limit: 50000}}}}
"#,
        host.http_addr()
    );
    let (code, log) = worker_run_json(&yaml, async {}).await;
    assert_eq!(code, Some(0), "{}", log_tail(&log));
    let c = at_most_once_counters(&log);
    let (count, uniq) = count_uniq(host, &t, generation.replicates()).await;
    println!(
        "REPORT at-most-once queue (limit 50000 bytes): {TOTAL} generated, count {count}, \
         uniqExact {uniq}, counters {c:?}"
    );
    assert!(
        c.lines >= 1,
        "no counters line in the log:\n{}",
        log_tail(&log)
    );
    assert!(c.dropped_rows > 0, "nothing was dropped: {c:?}");
    assert_eq!(count, uniq, "duplicates");
    assert_eq!(
        c.delivered_rows, count,
        "delivered_rows = rows in the table"
    );
    assert_eq!(
        c.dropped_rows + c.lost_rows,
        TOTAL - count,
        "dropped_rows + lost_rows = missing rows"
    );
    drop(table);
}
each_generation!(
    at_most_once_queue_drops_under_a_tiny_limit_and_the_counters_account_for_every_missing_row
);

// ---------------------------------------------------------------------------------------------
// 4. At-most-once, ordered: one INSERT attempt each.

/// Runs the ordered at-most-once sink through a proxy in front of the generation's first host
/// into a fresh plain MergeTree, arming `fault` once after the first rows; returns the table, its
/// guard, the proxy's cuts, the counters and `(count, uniqExact)`.
async fn at_most_once_ordered_with(
    generation: Generation,
    prefix: &str,
    fault: Fault,
) -> (String, DropGuard, u64, AtMostOnceCounters, (u64, u64)) {
    generation.require().unwrap();
    let host = generation.first();
    let (t, guard) = plain_table(host, prefix);
    let pa1 = proxy_for(host).await;
    let yaml = lost_ack_spec(
        prefix,
        "AtMostOnceClickHouseSink",
        &format!("{{host: '{}', table: {t}}}", pa1.addr()),
    );
    let (code, log) = worker_run_json(&yaml, arm_after_first_rows(&pa1, host, &t, fault)).await;
    assert_eq!(code, Some(0), "{}", log_tail(&log));
    let stats = pa1.stats();
    println!("{} proxy: {stats:?}", host.name);
    let c = at_most_once_counters(&log);
    assert!(
        c.lines >= 1,
        "no counters line in the log:\n{}",
        log_tail(&log)
    );
    let counts = count_uniq(host, &t, false).await;
    (t, guard, stats.cuts, c, counts)
}

async fn at_most_once_lost_ack_is_counted_lost_and_not_retried_though_the_rows_landed(
    generation: Generation,
) {
    let (_t, guard, cuts, c, (count, uniq)) =
        at_most_once_ordered_with(generation, "gc_amo_lost_ack", Fault::CutResponse).await;
    println!(
        "REPORT at-most-once ordered, lost ack: count {count}, uniqExact {uniq}, counters {c:?}"
    );
    assert_eq!(cuts, 1, "exactly one lost ack");
    // ClickHouse committed the batch; the sink could not know and did not send it again.
    assert_eq!((count, uniq), (N, N));
    assert_eq!(
        c.lost_rows, BATCH,
        "the unacknowledged batch is counted as lost"
    );
    assert_eq!(c.delivered_rows, N - BATCH);
    assert_eq!(c.dropped_rows, 0);
    drop(guard);
}
each_generation!(at_most_once_lost_ack_is_counted_lost_and_not_retried_though_the_rows_landed);

async fn at_most_once_cut_request_lands_nothing_and_its_rows_are_counted_lost(
    generation: Generation,
) {
    // Well past the request headers, well before the end of a ~1000-row body.
    let (t, guard, cuts, c, (count, uniq)) =
        at_most_once_ordered_with(generation, "gc_amo_cut_req", Fault::CutRequestAfter(2048)).await;
    let host = generation.first();
    let missing = blocking({
        let t = t.clone();
        move || {
            // With one partition, id = offset: the missing ids are `BATCH` consecutive ones.
            query_u64s(
                host.http_port,
                &format!(
                    "SELECT count(), min(n), max(n) FROM \
                     (SELECT number AS n FROM system.numbers LIMIT {N}) \
                     WHERE n NOT IN (SELECT id FROM default.{t})"
                ),
            )
            .unwrap()
        }
    })
    .await;
    println!(
        "REPORT at-most-once ordered, cut request: count {count}, uniqExact {uniq}, missing ids \
         {} ({}..={}), counters {c:?}",
        missing[0], missing[1], missing[2]
    );
    assert_eq!(cuts, 1, "exactly one cut request");
    assert_eq!(
        (count, uniq),
        (N - BATCH, N - BATCH),
        "the cut batch is missing"
    );
    assert_eq!(missing[0], BATCH);
    assert_eq!(
        (missing[1] % BATCH, missing[2] - missing[1] + 1),
        (0, BATCH)
    );
    assert_eq!(c.lost_rows, BATCH, "lost_rows = the missing rows");
    assert_eq!(c.delivered_rows, N - BATCH);
    assert_eq!(c.dropped_rows, 0);
    drop(guard);
}
each_generation!(at_most_once_cut_request_lands_nothing_and_its_rows_are_counted_lost);

/// `hosts: [<proxy a1>, a1]`: once the proxy refuses every connection, the part being sent is lost
/// (one attempt), and the next parts fail over to the second endpoint instead of being lost on the
/// first one too. (The second endpoint is a1 itself, reached directly, so that the test does not
/// depend on a2, which other test binaries restart; the failover logic only sees two endpoints.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_most_once_fails_over_after_a_failed_insert_losing_only_that_batch() {
    cluster();
    let t = unique_name("it_gc_amo_failover");
    let table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &[A1]).unwrap();
    let pa1 = proxy_for(A1).await;
    let yaml = lost_ack_spec(
        "gc_amo_failover",
        "AtMostOnceClickHouseSink",
        &format!(
            "{{hosts: ['{}', '{}'], table: {t}}}",
            pa1.addr(),
            A1.http_addr()
        ),
    );
    let refuse = async {
        wait_for_first_rows(A1, &t).await;
        pa1.set(Fault::Refuse);
    };
    let (code, log) = worker_run_json(&yaml, refuse).await;
    assert_eq!(code, Some(0), "{}", log_tail(&log));
    let stats = pa1.stats();
    println!("a1 proxy: {stats:?}");
    assert!(stats.refused >= 1, "a1 refused nothing");
    let c = at_most_once_counters(&log);
    let (count, uniq) = count_uniq(A1, &t, true).await;
    println!(
        "REPORT at-most-once ordered, proxy of a1 refusing: count {count}, uniqExact {uniq}, counters {c:?}"
    );
    assert_eq!(
        c.lost_rows, BATCH,
        "only the batch of the refused attempt is lost"
    );
    assert_eq!(c.delivered_rows, N - BATCH);
    assert_eq!((count, uniq), (N - BATCH, N - BATCH));
    drop(table);
}

//! The outbox of bounds, against the local cluster (`scripts/cluster.sh up`).
//!
//! With a replayable source (`generator`, `jsonl_file`) and the default `outbox: {payloads: auto}`
//! the exactly-once sinks keep per pending batch only its bounds, token, row count, size and
//! content hash; after a restart they re-read the source, re-cut at the stored bounds and send a
//! batch only if it hashes as committed. These tests run the worker binary through a
//! [`FaultProxy`] in front of a1 (the table is a `ReplicatedMergeTree` on a1 and a2):
//!
//! 1. bounds mode: once the writer session is up the proxy loses every acknowledgement
//!    (standing `CutResponse`), so each partition's head batch is committed by ClickHouse but
//!    stays in the outbox, and the batches behind it pile up unsent. After a `kill -9` the state
//!    directory holds no payload at all; the restarted worker rebuilds every pending batch from
//!    the generator, and the heads, which the server already holds, are re-sent. ClickHouse 18.16
//!    deduplicates a block only if its data is identical, so `count() == uniqExact(id) == total`
//!    (and exactly one deduplicated block per partition in a1's log) proves the rebuilt batches
//!    are identical to the originals. On ClickHouse 26.9 (m1, a plain MergeTree with a
//!    deduplication window) the heads are recognised by their tokens: one more finished INSERT
//!    under an earlier token per partition in m1's query log, and every id once.
//! 2. the same with `outbox: {payloads: always}`: payload segments on disk while batches are
//!    pending, no rebuild, and the segments reclaimed afterwards. Tests 1 and 2 run on both server
//!    generations.
//! 3. `jsonl_file`: every INSERT is cut (`CutRequestAfter`) so all batches stay pending; a line
//!    of the oldest pending batch is edited in place: the restarted worker must refuse (exit
//!    non-zero, the batch named), send nothing and keep every batch; with the file restored it
//!    delivers every id once.
//!
//! The tests fail, not skip, without a cluster. They stop no node.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use flow_integration::generation::*;
use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;
use serde_json::Value as Json;

const PARTITIONS: u64 = 2;
const PER_PARTITION: u64 = 40_000;
const TOTAL: u64 = PARTITIONS * PER_PARTITION;
/// Rows per batch; epochs close on exactly this many messages, so every batch of partition `p`
/// holds the offsets `[k * BATCH, k * BATCH + BATCH - 1]`.
const BATCH: u64 = 1_000;
/// Per partition: ~8 s undisturbed.
const RATE: u64 = 5_000;
/// Pending batches per partition to wait for before the kill.
const MIN_PENDING: u64 = 5;
/// `flow_state::segments::SEGMENT_ROLL_BYTES` (not exported): a segment takes no more payloads
/// once it holds this many bytes.
const SEGMENT_ROLL_BYTES: u64 = 4 << 20;
const REBUILD_LOG: &str = "rebuilding pending batches from the source";

fn node_addr(node: Node) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], node.http_port))
}

/// A runtime for the proxies; the test itself runs on the main thread with blocking calls.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Every file under `<state>/payloads/<queue>/`: (queue dir, file name, size).
fn payload_files(state: &Path) -> Vec<(String, String, u64)> {
    let mut out = Vec::new();
    let Ok(queues) = std::fs::read_dir(state.join("payloads")) else {
        return out;
    };
    for queue in queues {
        let queue = queue.unwrap();
        let qname = queue.file_name().to_string_lossy().into_owned();
        if !queue.file_type().unwrap().is_dir() {
            out.push((String::new(), qname, queue.metadata().unwrap().len()));
            continue;
        }
        for file in std::fs::read_dir(queue.path()).unwrap() {
            let file = file.unwrap();
            out.push((
                qname.clone(),
                file.file_name().to_string_lossy().into_owned(),
                file.metadata().unwrap().len(),
            ));
        }
    }
    out.sort();
    out
}

/// Total size of the files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .map(|e| {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                dir_bytes(&e.path())
            } else {
                e.metadata().map(|m| m.len()).unwrap_or(0)
            }
        })
        .sum()
}

/// `status --json` of `pipeline`'s sinks (from the running worker's snapshot if it runs).
fn sinks(state: &Path, pipeline: &str) -> anyhow::Result<Vec<Json>> {
    let summary = status_json(worker_bin!(), state)?
        .ok_or_else(|| anyhow::anyhow!("nothing committed yet"))?;
    Ok(summary["pipelines"][pipeline]["sinks"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

fn num(v: &Json, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("no numeric `{field}` in {v}"))
}

/// The sink partition `partition` of a `sinks` list.
fn partition(sinks: &[Json], partition: u64) -> Json {
    sinks
        .iter()
        .find(|s| num(s, "partition") == partition)
        .cloned()
        .unwrap_or_else(|| panic!("no sink partition {partition} in {sinks:?}"))
}

fn log_text(worker: &Worker) -> String {
    std::fs::read_to_string(worker.log()).unwrap_or_default()
}

fn rows_where(node: Node, table: &str, cond: &str) -> u64 {
    query_u64(
        node.http_port,
        &format!("SELECT count() FROM default.{table} WHERE {cond}"),
    )
    .unwrap()
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// `outbox` left at its default (`auto`): bounds for the generator.
    Bounds,
    /// `outbox: {payloads: always}`.
    Payloads,
}

impl Mode {
    fn stored(self) -> &'static str {
        match self {
            Mode::Bounds => "bounds",
            Mode::Payloads => "payload",
        }
    }
}

/// Test 1 and 2: lost acks pile batches up in the outbox, `kill -9`, restart, every id once.
fn lost_acks_kill_9_and_restart(generation: Generation, mode: Mode) {
    let started = Instant::now();
    generation.require().unwrap();
    let host = generation.first();
    let rt = runtime();
    let tag = match mode {
        Mode::Bounds => "ob_bounds",
        Mode::Payloads => "ob_payloads",
    };
    let t = unique_name(&format!("it_{tag}"));
    let table = generation
        .create_table_on("default", &t, GENERATOR_COLUMNS, "id", generation.shard_a())
        .unwrap();
    let proxy = rt.block_on(FaultProxy::start(node_addr(host))).unwrap();

    let mut spec = GeneratorSpec::new(
        tag,
        "ClickHouseBatchingSink",
        format!(
            "{{host: '{}', database: default, table: {t}}}",
            proxy.addr()
        ),
    )
    .partitions(PARTITIONS)
    .epoch(BATCH, 600_000)
    .count(PER_PARTITION)
    .rate(RATE)
    .payload_bytes(16)
    .sink_name("events")
    .dynamic(format!(
        "{{max_rows_per_batch: {BATCH}, retry_backoff: 300ms, max_retry_backoff: 2s, max_insert_attempts: 1000}}"
    ));
    // Each mode is this test's subject: `FLOW_TEST_OUTBOX_PAYLOADS` does not apply.
    spec.store_payloads = mode == Mode::Payloads;
    let yaml = spec.yaml();
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    std::fs::write(&spec, &yaml).unwrap();
    let state = dir.path().join("state");

    // --- run 1: the session comes up, then every acknowledgement is lost -----------------------
    let mut worker =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run1.log")).unwrap();
    wait_until(Duration::from_secs(60), || {
        Ok(query_u64(host.http_port, &format!("SELECT count() FROM default.{t}"))? > 0)
    })
    .unwrap_or_else(|e| panic!("no row landed within 60 s ({e:#})\n{}", worker.log_tail()));
    proxy.set_on_inserts(Fault::CutResponse);
    let cut_at = Instant::now();
    // Batches pile up behind each partition's head, whose acks are lost. A head whose attempt
    // met a connection the proxy had just reset (hyper's `SendRequest`) is retried after a
    // pause, so its cut may come after the pile-up: both are waited for.
    wait_until(Duration::from_secs(60), || {
        let s = sinks(&state, tag)?;
        Ok(s.len() == PARTITIONS as usize
            && s.iter().all(|s| num(s, "undelivered") >= MIN_PENDING)
            && proxy.stats().cuts >= PARTITIONS)
    })
    .unwrap_or_else(|e| {
        panic!(
            "fewer than {MIN_PENDING} undelivered batches per partition, or fewer than {PARTITIONS} lost acks, within 60 s ({e:#}): {:?}; proxy {:?}\n{}",
            sinks(&state, tag).ok(),
            proxy.stats(),
            worker.log_tail()
        )
    });
    let running_view = sinks(&state, tag).unwrap();
    for s in &running_view {
        for end in ["oldest", "newest"] {
            assert_eq!(
                s[end]["stored"],
                mode.stored(),
                "while running, {end} batch of partition {}: {s}",
                s["partition"]
            );
        }
    }
    let stats = proxy.stats();
    assert!(
        stats.cuts >= PARTITIONS,
        "every partition's head should have lost its ack: {stats:?}"
    );
    assert!(
        worker.kill_9().unwrap().is_none(),
        "the worker had exited before the kill\n{}",
        worker.log_tail()
    );
    let pending_for = cut_at.elapsed();

    // --- what the outbox holds after kill -9 ---------------------------------------------------
    // Read before `status` opens the store (which deletes unreferenced segments).
    let files = payload_files(&state);
    let state_bytes = dir_bytes(&state);
    let view = sinks(&state, tag).unwrap();
    let mut pending_batches = 0;
    let mut pending_bytes = 0;
    let mut heads = Vec::new();
    for p in 0..PARTITIONS {
        let s = partition(&view, p);
        let (undelivered, rows, bytes) =
            (num(&s, "undelivered"), num(&s, "rows"), num(&s, "bytes"));
        let (oldest, newest) = (&s["oldest"], &s["newest"]);
        println!(
            "partition {p}: {undelivered} undelivered, {rows} rows, {bytes} bytes; oldest {oldest}; newest {newest}"
        );
        assert!(undelivered >= MIN_PENDING, "partition {p}: {s}");
        for (end, b) in [("oldest", oldest), ("newest", newest)] {
            assert_eq!(b["stored"], mode.stored(), "partition {p}, {end}: {s}");
            assert_eq!(num(b, "rows"), BATCH, "partition {p}, {end}: {s}");
            assert_eq!(
                num(b, "last_offset") - num(b, "first_offset"),
                BATCH - 1,
                "partition {p}, {end}: {s}"
            );
            assert_eq!(
                num(b, "first_offset") % BATCH,
                0,
                "partition {p}, {end}: {s}"
            );
            assert!(num(b, "bytes") > 0, "partition {p}, {end}: {s}");
            assert!(!b["token"].as_str().unwrap_or("").is_empty(), "{s}");
            assert!(num(b, "sealed_at_ms") > 0, "{s}");
        }
        // The pending batches are consecutive, BATCH rows each.
        assert_eq!(rows, undelivered * BATCH, "partition {p}: {s}");
        assert_eq!(
            num(newest, "last_offset") + 1 - num(oldest, "first_offset"),
            undelivered * BATCH,
            "partition {p}: {s}"
        );
        assert_ne!(oldest["token"], newest["token"], "{s}");
        // Everything before the head was delivered and acknowledged; the head is on the server
        // (its ack was lost); nothing behind it was sent.
        let (first, last) = (num(oldest, "first_offset"), num(oldest, "last_offset"));
        assert_eq!(
            rows_where(host, &t, &format!("partition = {p} AND offset < {first}")),
            first,
            "partition {p}: the acknowledged batches before the head"
        );
        assert_eq!(
            rows_where(
                host,
                &t,
                &format!("partition = {p} AND offset BETWEEN {first} AND {last}")
            ),
            BATCH,
            "partition {p}: the head batch {oldest} should be on the server (ack lost)"
        );
        assert_eq!(
            rows_where(host, &t, &format!("partition = {p} AND offset > {last}")),
            0,
            "partition {p}: nothing behind the head may have been sent"
        );
        heads.push(oldest.clone());
        pending_batches += undelivered;
        pending_bytes += bytes;
    }
    println!(
        "after kill -9 ({:.1} s of lost acks): {pending_batches} batches / {pending_bytes} bytes pending, \
         state dir {state_bytes} bytes, payload files {files:?}",
        pending_for.as_secs_f64()
    );
    match mode {
        Mode::Bounds => {
            assert!(
                files.is_empty(),
                "bounds mode must write no payload segment, found {files:?}"
            );
        }
        Mode::Payloads => {
            let queues: std::collections::BTreeSet<&String> = files.iter().map(|f| &f.0).collect();
            assert_eq!(
                queues.len(),
                PARTITIONS as usize,
                "one segment series per sink partition: {files:?}"
            );
            let on_disk: u64 = files.iter().map(|f| f.2).sum();
            assert!(
                on_disk >= pending_bytes,
                "segments hold {on_disk} bytes, less than the {pending_bytes} pending payload bytes: {files:?}"
            );
        }
    }
    // The heads' earlier resends were already deduplicated; count from here (the log may trail).
    std::thread::sleep(Duration::from_secs(1));
    let qualified = format!("default.{t}");
    let dedup_before = replays_recognised(generation, host, &qualified).unwrap();

    // --- run 2: acks pass again; to completion ---------------------------------------------------
    proxy.set(Fault::Pass);
    let rerun = Instant::now();
    let mut worker =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run2.log")).unwrap();
    let code = worker
        .wait_exit(Duration::from_secs(180))
        .unwrap_or_else(|e| panic!("the last run: {e:#}"));
    assert_eq!(code, Some(0), "the last run failed\n{}", worker.log_tail());
    let rerun_took = rerun.elapsed();
    let log = log_text(&worker);
    let rebuild_lines: Vec<&str> = log.lines().filter(|l| l.contains(REBUILD_LOG)).collect();
    println!("rebuild log lines: {rebuild_lines:#?}");
    match mode {
        Mode::Bounds => {
            assert_eq!(
                rebuild_lines.len(),
                PARTITIONS as usize,
                "one `{REBUILD_LOG}` per sink partition\n{}",
                worker.log_tail()
            );
            for p in 0..PARTITIONS {
                let n = num(&partition(&view, p), "undelivered");
                assert!(
                    rebuild_lines
                        .iter()
                        .any(|l| l.contains(&format!("partition={p}"))
                            && l.contains(&format!("batches={n}"))),
                    "no `{REBUILD_LOG}` for partition {p} with batches={n}: {rebuild_lines:?}"
                );
            }
        }
        Mode::Payloads => assert!(
            rebuild_lines.is_empty(),
            "stored payloads must be replayed as stored, not rebuilt: {rebuild_lines:?}"
        ),
    }

    // Read the segment directory before `status` opens the store again.
    let files_after = payload_files(&state);
    println!("payload files after the last run: {files_after:?}");
    let end = sinks(&state, tag).unwrap();
    for s in &end {
        assert_eq!(num(s, "undelivered"), 0, "{s}");
        assert_eq!(num(s, "rows"), 0, "{s}");
    }
    let end_status = pipeline_status(worker_bin!(), &state, tag)
        .unwrap()
        .unwrap();
    assert_eq!(
        end_status.positions,
        vec![PER_PARTITION; PARTITIONS as usize]
    );
    match mode {
        Mode::Bounds => assert!(files_after.is_empty(), "{files_after:?}"),
        Mode::Payloads => {
            // Acknowledged segments are deleted; at most the active one per queue stays, below
            // the roll size plus one batch.
            let mut per_queue = std::collections::BTreeMap::<&str, usize>::new();
            for (q, _, size) in &files_after {
                *per_queue.entry(q.as_str()).or_default() += 1;
                assert!(
                    *size < SEGMENT_ROLL_BYTES + (1 << 20),
                    "a segment of {size} bytes stayed: {files_after:?}"
                );
            }
            assert!(
                per_queue.values().all(|&n| n <= 1),
                "more than one segment per queue after every batch was acknowledged: {files_after:?}"
            );
            // `status` opened the store: a segment nothing references is deleted at open.
            let reopened = payload_files(&state);
            assert!(
                reopened.is_empty(),
                "unreferenced segments survived a reopen of the store: {reopened:?}"
            );
        }
    }

    // --- the end state ------------------------------------------------------------------------------
    generation
        .sync("default", &t, generation.shard_a())
        .unwrap();
    for &node in generation.shard_a() {
        assert_eq!(
            count_uniq(node, &table.qualified()).unwrap(),
            (TOTAL, TOTAL),
            "count(), uniqExact(id) on {}",
            node.name
        );
    }
    for (p, head) in heads.iter().enumerate() {
        let (first, last) = (num(head, "first_offset"), num(head, "last_offset"));
        assert_eq!(
            rows_where(
                host,
                &t,
                &format!("partition = {p} AND offset BETWEEN {first} AND {last}")
            ),
            BATCH,
            "partition {p}: the head batch re-sent after the restart must have been deduplicated"
        );
    }
    // The re-sent heads were recognised as already inserted: one block per partition.
    let _ = wait_until(Duration::from_secs(10), || {
        Ok(replays_recognised(generation, host, &qualified)? >= dedup_before + PARTITIONS as usize)
    });
    std::thread::sleep(Duration::from_millis(500));
    let dedup_after = replays_recognised(generation, host, &qualified).unwrap();
    println!(
        "REPORT {mode:?}: {pending_batches} pending batches over {PARTITIONS} partitions after kill -9, \
         count = uniqExact = {TOTAL} on {generation}, replays recognised by {} after the restart: {}, \
         last run {:.1} s, test {:.1} s",
        host.name,
        dedup_after - dedup_before,
        rerun_took.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        dedup_after - dedup_before,
        PARTITIONS as usize,
        "each partition's head (already on the server) must be re-sent once and deduplicated"
    );
    drop(proxy);
    drop(table);
}

fn kill_9_during_delivery_of_a_replayable_pipeline_rebuilds_identical_batches_and_lands_every_id_once(
    generation: Generation,
) {
    lost_acks_kill_9_and_restart(generation, Mode::Bounds);
}
each_generation!(
    sync kill_9_during_delivery_of_a_replayable_pipeline_rebuilds_identical_batches_and_lands_every_id_once
);

fn payload_mode_survives_kill_9_and_lands_every_id_once(generation: Generation) {
    lost_acks_kill_9_and_restart(generation, Mode::Payloads);
}
each_generation!(sync payload_mode_survives_kill_9_and_lands_every_id_once);

// ---------------------------------------------------------------------------------------------
// 3. An edited input under a pending batch.

const LINES: u64 = 4_000;
const JSONL_BATCH: u64 = 500;
/// Larger than every session query, smaller than every INSERT of JSONL_BATCH rows.
const CUT_AFTER: u64 = 4_096;
const S_LEN: usize = 64;

fn s_value(i: u64) -> String {
    let mut out = Vec::new();
    flow_core::sources::generator::fill_payload(i, S_LEN, &mut out);
    String::from_utf8(out).unwrap()
}

fn jsonl_line(i: u64, s: &str) -> String {
    format!("{{\"id\": {i}, \"v\": {}, \"s\": \"{s}\"}}\n", i * 7 + 3)
}

fn jsonl_text(edit: Option<(u64, &str)>) -> String {
    (0..LINES)
        .map(|i| match edit {
            Some((line, s)) if line == i => jsonl_line(i, s),
            _ => jsonl_line(i, &s_value(i)),
        })
        .collect()
}

#[test]
fn editing_a_replayable_input_under_a_pending_batch_refuses_to_resend_and_keeps_the_batch() {
    let started = Instant::now();
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let rt = runtime();
    let t = unique_name("it_ob_jsonl");
    let table = ReplicatedTable::create(
        "default",
        &t,
        "id UInt64, v UInt64, s String",
        "id",
        &SHARD_A,
    )
    .unwrap();
    let proxy = rt.block_on(FaultProxy::start(node_addr(A1))).unwrap();
    // The session's queries pass; every INSERT is cut before its end (nothing lands).
    proxy.set_on_inserts(Fault::CutRequestAfter(CUT_AFTER));

    let dir = TestDir::new().unwrap();
    let input: PathBuf = dir.path().join("input.jsonl");
    let original = jsonl_text(None);
    std::fs::write(&input, &original).unwrap();
    let pipeline = "ob_jsonl";
    let yaml = format!(
        "pipeline: {pipeline}\n\
         partitions: 1\n\
         epoch: {{max_messages: 1000, max_duration_ms: 600000}}\n\
         source:\n  class: jsonl_file\n  parameters: {{files: ['{}'], schema: [{{name: id, type: uint64}}, {{name: v, type: uint64}}, {{name: s, type: string}}]}}\n\
         sinks:\n  - name: out\n    sink_class_name: ClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{host: '{}', database: default, table: {t}}}\n    dynamic_parameters: {{max_rows_per_batch: {JSONL_BATCH}, retry_backoff: 200ms, max_retry_backoff: 2s, max_insert_attempts: 1000}}\n",
        input.display(),
        proxy.addr()
    );
    let spec = dir.path().join("spec.yaml");
    std::fs::write(&spec, &yaml).unwrap();
    let state = dir.path().join("state");
    let batches = LINES / JSONL_BATCH;

    // --- run 1: every batch sealed, none delivered ---------------------------------------------
    let mut worker =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run1.log")).unwrap();
    wait_until(Duration::from_secs(60), || {
        let s = sinks(&state, pipeline)?;
        Ok(s.len() == 1 && num(&s[0], "undelivered") == batches && proxy.stats().cuts > 0)
    })
    .unwrap_or_else(|e| {
        panic!(
            "not all {batches} batches pending with INSERTs being cut within 60 s ({e:#}): {:?}, proxy {:?}\n{}",
            sinks(&state, pipeline).ok(),
            proxy.stats(),
            worker.log_tail()
        )
    });
    assert!(
        worker.kill_9().unwrap().is_none(),
        "the worker exited before the kill\n{}",
        worker.log_tail()
    );
    assert_eq!(
        query_u64(A1.http_port, &format!("SELECT count() FROM default.{t}")).unwrap(),
        0,
        "a cut INSERT must land nothing"
    );
    let before = partition(&sinks(&state, pipeline).unwrap(), 0);
    println!("pending after kill -9: {before}");
    let (oldest, newest) = (before["oldest"].clone(), before["newest"].clone());
    assert_eq!(num(&before, "undelivered"), batches, "{before}");
    assert_eq!(num(&before, "rows"), LINES, "{before}");
    assert_eq!(oldest["stored"], "bounds", "{before}");
    assert_eq!(newest["stored"], "bounds", "{before}");
    assert_eq!(
        (num(&oldest, "first_offset"), num(&oldest, "last_offset")),
        (0, JSONL_BATCH - 1),
        "{before}"
    );
    assert_eq!(num(&newest, "last_offset"), LINES - 1, "{before}");
    assert!(
        payload_files(&state).is_empty(),
        "bounds mode wrote payloads: {:?}",
        payload_files(&state)
    );

    // --- edit one line of the oldest pending batch (same length, same line count) -------------
    let edited_line = JSONL_BATCH / 2;
    let marker = format!("{:x<S_LEN$}", "edited");
    let edited = jsonl_text(Some((edited_line, &marker)));
    assert_eq!(edited.len(), original.len());
    assert_eq!(edited.lines().count(), original.lines().count());
    assert_ne!(edited, original);
    std::fs::write(&input, &edited).unwrap();

    // --- run 2: the proxy passes; the worker must refuse the batch ----------------------------
    proxy.set(Fault::Pass);
    let mut worker =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run2.log")).unwrap();
    let refused_code = worker
        .wait_exit(Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("the run on the edited input: {e:#}"));
    let code = refused_code;
    let log = log_text(&worker);
    println!(
        "run on the edited input exited {code:?}\n{}",
        worker.log_tail()
    );
    assert!(
        code.is_some_and(|c| c != 0),
        "the worker must exit non-zero on an edited input, exited {code:?}\n{}",
        worker.log_tail()
    );
    assert!(
        log.contains("cannot be rebuilt identically"),
        "{}",
        worker.log_tail()
    );
    let named = format!(
        "pending batch {} (messages 0-0..0-{}, token {}) cannot be rebuilt identically",
        num(&oldest, "seq"),
        JSONL_BATCH - 1,
        oldest["token"].as_str().unwrap()
    );
    assert!(
        log.contains(&named),
        "the refusal must name `{named}`\n{}",
        worker.log_tail()
    );
    assert!(
        log.contains("Nothing was sent for it and it stays in the outbox"),
        "{}",
        worker.log_tail()
    );
    assert_eq!(
        query_u64(A1.http_port, &format!("SELECT count() FROM default.{t}")).unwrap(),
        0,
        "nothing may be sent after the refusal"
    );
    assert_eq!(
        rows_where(A1, &t, "s LIKE 'edited%'"),
        0,
        "the edited value reached the table"
    );
    let after = partition(&sinks(&state, pipeline).unwrap(), 0);
    for field in ["undelivered", "rows", "bytes", "next_seq"] {
        assert_eq!(
            after[field], before[field],
            "{field}: before {before}, after {after}"
        );
    }
    assert_eq!(
        after["oldest"], oldest,
        "the refused batch must stay as it was"
    );
    assert_eq!(
        after["newest"], newest,
        "the newest pending batch must stay as it was"
    );

    // --- run 3: the original input restored ---------------------------------------------------
    std::fs::write(&input, &original).unwrap();
    let mut worker =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run3.log")).unwrap();
    let code = worker
        .wait_exit(Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("the run on the restored input: {e:#}"));
    assert_eq!(code, Some(0), "{}", worker.log_tail());
    assert!(
        log_text(&worker).contains(REBUILD_LOG),
        "{}",
        worker.log_tail()
    );
    let end = partition(&sinks(&state, pipeline).unwrap(), 0);
    assert_eq!(num(&end, "undelivered"), 0, "{end}");
    for node in SHARD_A {
        sync_when_writable(node, "default", &t, Duration::from_secs(90)).unwrap();
        assert_eq!(
            count_uniq(node, &table.qualified()).unwrap(),
            (LINES, LINES),
            "count(), uniqExact(id) on {}",
            node.name
        );
    }
    let sum_v = query_u64(A1.http_port, &format!("SELECT sum(v) FROM default.{t}")).unwrap();
    assert_eq!(sum_v, (0..LINES).map(|i| i * 7 + 3).sum::<u64>());
    assert_eq!(rows_where(A1, &t, "s LIKE 'edited%'"), 0);
    println!(
        "REPORT jsonl: {batches} batches pending, edited line {edited_line} refused (exit {refused_code:?} \
         on the edited run), restored: count = uniqExact = {LINES}; proxy {:?}; test {:.1} s",
        proxy.stats(),
        started.elapsed().as_secs_f64()
    );
    drop(proxy);
    drop(table);
}

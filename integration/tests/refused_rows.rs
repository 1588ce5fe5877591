//! Rows the server refuses, against the real server: a table whose `guard` column makes every
//! block holding an id ending in 777 fail (`throwIf`, code 395), and an exactly-once sink with
//! `on_bad_rows: dead_letter`. The refused batches are delivered in halves until the refused rows
//! are isolated; a `kill -9` while that goes on, and the restart, lose and double nothing; the
//! isolated rows are exactly the x777 ones, in `dead-letters export` with code 395; after the
//! guard is dropped, `dead-letters requeue` and a run land them exactly once. On both server
//! generations: on 26.9 the pieces of a split are deduplicated by their tokens.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::path::Path;
use std::time::Duration;

use flow_integration::generation::*;
use flow_integration::worker::*;
use flow_integration::*;
use serde_json::Value as Json;

const PARTITIONS: u64 = 2;
const PER_PARTITION: u64 = 50_000;
const ROWS: u64 = PARTITIONS * PER_PARTITION;

fn refused(id: u64) -> bool {
    id % 1000 == 777
}

/// The generator's columns plus the guard, on the generation's first host alone (on 18.16
/// replicated, but the splits send about a thousand of small inserts; a second replica fetching
/// each would only slow the test down). The dedup window holds every piece a split sends, so
/// pieces sent again after the kill are recognised.
fn create_table(generation: Generation, table: &str) -> DropGuard {
    let engine = match generation {
        Generation::V18 => format!(
            "ReplicatedMergeTree('/clickhouse/tables/{{shard}}/default.{table}', '{{replica}}') \
             ORDER BY id SETTINGS replicated_deduplication_window = 100000"
        ),
        Generation::V26 => {
            "MergeTree ORDER BY id SETTINGS non_replicated_deduplication_window = 100000".to_owned()
        }
    };
    let mut guard = DropGuard::default();
    guard
        .create(
            generation.first().http_port,
            &format!("default.{table}"),
            &format!(
                "CREATE TABLE default.{table} ({GENERATOR_COLUMNS}, guard UInt8 MATERIALIZED throwIf(id % 1000 = 777)) \
                 ENGINE = {engine}, parts_to_delay_insert = 100000, parts_to_throw_insert = 100000"
            ),
        )
        .unwrap();
    guard
}

fn dead_letters(action: &str, state: &Path) -> WorkerOutput {
    dead_letters_command(worker_bin!(), action, state).unwrap()
}

fn run_to_end(spec: &Path, state: &Path) {
    let out = run_spec(worker_bin!(), spec, state, Duration::from_secs(300)).unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
}

/// `(count(), uniqExact(id), countIf(id % 1000 = 777))` on the generation's first host.
fn landed(generation: Generation, table: &str) -> Vec<u64> {
    query_u64s(
        generation.first().http_port,
        &format!(
            "SELECT arrayJoin([count(), uniqExact(id), countIf(id % 1000 = 777)]) FROM default.{table}"
        ),
    )
    .unwrap()
}

fn refused_rows_are_isolated_into_dead_letters_across_a_kill_and_requeued_exactly_once(
    generation: Generation,
) {
    generation.require().unwrap();
    let table = unique_name("it_refused");
    let _tables = create_table(generation, &table);
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    let state = dir.path().join("state");
    let parameters = format!(
        "{{host: '{}', table: {table}, on_bad_rows: dead_letter}}",
        generation.first().http_addr(),
    );
    let yaml = GeneratorSpec::new("refused", "ClickHouseBatchingSink", parameters)
        .partitions(PARTITIONS)
        .count(PER_PARTITION)
        .epoch(10_000, 500)
        .dynamic("{max_rows_per_batch: 5000, retry_backoff: 50ms, max_retry_backoff: 1s}")
        .yaml();
    std::fs::write(&spec, yaml).unwrap();

    // Kill the worker once a split is under way and some of its pieces have landed.
    let mut worker =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run1.log")).unwrap();
    wait_until(Duration::from_secs(120), || {
        let log = std::fs::read_to_string(worker.log())?;
        Ok(log.matches("sending it in halves").count() >= 2)
    })
    .unwrap_or_else(|err| panic!("{err}: {}", worker.log_tail()));
    std::thread::sleep(Duration::from_millis(700));
    assert!(worker.running(), "{}", worker.log_tail());
    worker.kill_9().unwrap();

    run_to_end(&spec, &state);
    let bad: Vec<u64> = (0..ROWS).filter(|id| refused(*id)).collect();
    let good = ROWS - bad.len() as u64;
    assert_eq!(
        landed(generation, &table),
        vec![good, good, 0],
        "every other row once"
    );

    let dead: Vec<Json> = export_dead_letters(worker_bin!(), &state).unwrap();
    let mut ids: Vec<u64> = dead
        .iter()
        .map(|d| d["row"]["id"].as_u64().unwrap())
        .collect();
    ids.sort_unstable();
    assert_eq!(
        ids, bad,
        "exactly the x777 rows are dead letters, once each"
    );
    for d in &dead {
        let id = d["row"]["id"].as_u64().unwrap();
        assert_eq!(d["code"], 395, "{d}");
        assert_eq!(d["sink"], "out");
        // Unsharded batches hold every message of their bounds: the exact id is known.
        let (partition, offset) = (id % PARTITIONS, id / PARTITIONS);
        assert_eq!(d["message_id"], format!("{partition}-{offset}"), "{d}");
        assert!(
            d["reason"].as_str().unwrap().contains("throwIf"),
            "the server's text is kept: {d}"
        );
    }

    // The operator fixes the cause; the requeued rows land once.
    exec(
        generation.first().http_port,
        &format!("ALTER TABLE default.{table} DROP COLUMN guard"),
    )
    .unwrap();
    let requeue = dead_letters("requeue", &state);
    assert_eq!(requeue.code, Some(0), "{}", requeue.stderr);
    assert!(
        requeue
            .stdout
            .contains(&format!("requeued {} dead letter(s)", bad.len())),
        "{}",
        requeue.stdout
    );
    assert_eq!(
        export_dead_letters(worker_bin!(), &state).unwrap(),
        Vec::<Json>::new(),
        "requeued rows leave the dead letters"
    );
    run_to_end(&spec, &state);
    assert_eq!(
        landed(generation, &table),
        vec![ROWS, ROWS, bad.len() as u64]
    );
}
each_generation!(sync refused_rows_are_isolated_into_dead_letters_across_a_kill_and_requeued_exactly_once);

//! A table's columns changed under a running exactly-once sink (issue "Hardening", case 1).
//!
//! RowBinary carries no types, so before the columns guard an `ALTER TABLE ... MODIFY COLUMN
//! user_id Float64` made the server read the old UInt64 layout as Float64 and store values like
//! 7.3e-322 without an error. Now the sink reads the columns before every INSERT and stops with
//! the difference, its batches kept. The generator's `user_id` is `id % 1000`, so the oracle is
//! the server itself: every stored row must still satisfy `user_id = id % 1000`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 2;
const PER_PARTITION: u64 = 30_000;

fn alter_under_a_running_sink_stops_it_and_stores_no_wrong_value(
    tag: &str,
    alter: &str,
    expected: &str,
) {
    require_cluster().unwrap();
    let t = unique_name(tag);
    let table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &SHARD_A).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let spec = GeneratorSpec::new(
        tag,
        "ClickHouseBatchingSink",
        format!(
            "{{hosts: ['{}', '{}'], database: default, table: {t}}}",
            A1.http_addr(),
            A2.http_addr()
        ),
    )
    .partitions(PARTITIONS)
    .epoch(500, 200)
    .count(PER_PARTITION)
    .rate(2_000)
    .dynamic("{max_rows_per_batch: 500}");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec.yaml()).unwrap();
    let state = dir.path().join("state");
    let log = dir.path().join("worker.log");
    let mut worker = Worker::spawn(worker_bin!(), &spec_path, &state, log.clone()).unwrap();
    let qualified = table.qualified();
    wait_until(Duration::from_secs(60), || {
        Ok(count_uniq(A1, &qualified)?.0 >= 2_000)
    })
    .unwrap();
    exec(A1.http_port, &alter.replace("{table}", &qualified)).unwrap();
    wait_until(Duration::from_secs(60), || {
        Ok(std::fs::read_to_string(&log)?.contains(expected))
    })
    .unwrap_or_else(|err| panic!("{err:#}: no `{expected}` in the log\n{}", worker.log_tail()));
    if worker.running() {
        worker.kill_9().unwrap();
    }
    sync_when_writable(A1, "default", &t, Duration::from_secs(60)).unwrap();
    let (rows, distinct) = count_uniq(A1, &qualified).unwrap();
    let wrong = query_u64(
        A1.http_port,
        &format!(
            "SELECT count() FROM {qualified} WHERE toFloat64(user_id) != toFloat64(id % 1000)"
        ),
    )
    .unwrap();
    assert_eq!(wrong, 0, "rows stored with a garbled user_id");
    assert_eq!(rows, distinct, "no row twice");
    assert!(
        rows < PARTITIONS * PER_PARTITION,
        "the sink stopped before the end"
    );
    // What was not delivered stays in the outbox for the next start.
    let status = pipeline_status(worker_bin!(), &state, tag)
        .unwrap()
        .unwrap();
    assert!(status.batches() > 0, "pending batches kept: {status:?}");
}

#[test]
fn a_column_type_modified_under_a_running_sink_stops_it_before_a_value_is_stored_wrong() {
    alter_under_a_running_sink_stops_it_and_stores_no_wrong_value(
        "schema_modify",
        "ALTER TABLE {table} MODIFY COLUMN user_id Float64",
        "column 4 was `user_id` UInt64, is now `user_id` Float64",
    );
}

#[test]
fn a_column_added_with_a_non_deterministic_default_under_a_running_sink_stops_it() {
    alter_under_a_running_sink_stops_it_and_stores_no_wrong_value(
        "schema_add",
        "ALTER TABLE {table} ADD COLUMN ts2 DateTime DEFAULT now()",
        "column 7 was added: `ts2` DateTime DEFAULT now()",
    );
}

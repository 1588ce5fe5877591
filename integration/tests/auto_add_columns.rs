//! `auto_add_columns: true` (issue 26, item 1): a stream column missing from the table is added
//! to it when the session starts, on every replica, with the stream type's natural column type,
//! and the rows land with it. Without the parameter the start is refused as before, and the
//! exactly-once classes refuse the parameter at validation.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use flow_integration::worker::*;
use flow_integration::*;

/// The generator's columns without `payload`.
const WITHOUT_PAYLOAD: &str =
    "id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime";

fn run(class: &str, t: &str, extra: &str) -> WorkerOutput {
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    std::fs::write(
        &spec,
        GeneratorSpec::new(
            "auto_add",
            class,
            format!(
                "{{hosts: ['{}', '{}'], table: {t}{extra}}}",
                A1.http_addr(),
                A2.http_addr()
            ),
        )
        .partitions(2)
        .count(1_000)
        .yaml(),
    )
    .unwrap();
    run_spec(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        Duration::from_secs(120),
    )
    .unwrap()
}

#[test]
fn a_stream_column_missing_from_the_table_is_added_on_every_replica() {
    require_cluster().unwrap();
    let t = unique_name("auto_add");
    let table = ReplicatedTable::create("default", &t, WITHOUT_PAYLOAD, "id", &SHARD_A).unwrap();
    let qualified = table.qualified();

    // Without the parameter: refused as before, nothing altered.
    let out = run("AtLeastOnceClickHouseSink", &t, "");
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    let refused = format!(
        "the stream column `payload` is not a column of default.{t}; add it to the table or drop it from the stream"
    );
    assert!(out.stderr.contains(&refused), "{}", out.stderr);

    // An exactly-once class refuses the parameter before anything starts.
    let out = run("ClickHouseBatchingSink", &t, ", auto_add_columns: true");
    assert_ne!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stderr.contains(
            "parameters.auto_add_columns: ClickHouseBatchingSink cannot add columns to its table"
        ),
        "{}",
        out.stderr
    );

    let out = run("AtLeastOnceClickHouseSink", &t, ", auto_add_columns: true");
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("auto_add_columns: added a stream column missing from the table"),
        "{}",
        out.stderr
    );
    for node in SHARD_A {
        assert_eq!(
            query_text(
                node.http_port,
                &format!("SELECT type FROM system.columns WHERE database = 'default' AND table = '{t}' AND name = 'payload' FORMAT TSV"),
            )
            .unwrap()
            .trim(),
            "String",
            "on {}",
            node.name
        );
    }
    sync_when_writable(A1, "default", &t, Duration::from_secs(60)).unwrap();
    assert_eq!(count_uniq(A1, &qualified).unwrap(), (2_000, 2_000));
    assert_eq!(
        query_u64(
            A1.http_port,
            &format!("SELECT count() FROM {qualified} WHERE payload != ''")
        )
        .unwrap(),
        2_000,
        "the added column is filled from the stream"
    );
}

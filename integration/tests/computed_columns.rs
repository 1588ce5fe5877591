//! Columns the server computes (`ALIAS`, `MATERIALIZED`) against the real cluster
//! (`scripts/cluster.sh up`), through every ClickHouse sink class.
//!
//! The session reads each column's default kind with its name and type and plans the INSERT
//! from the stream's columns only: a table column the stream does not send is left to the server,
//! so an ALIAS column is computed when read and a MATERIALIZED one when inserted; a stream column
//! that is an ALIAS or MATERIALIZED column of the table cannot be written (ClickHouse refuses an
//! INSERT that names it), so the start is refused naming it.
//!
//! Pipelines run in-process (`flow::registry()`, a temp state store): a refused start surfaces as
//! `RuntimeError::PartitionsFailed` carrying the refusal. Every test uses its own tables
//! (`unique_name`) on a1 and drops them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use flow_core::{RunReport, RuntimeError};
use flow_integration::worker::*;
use flow_integration::*;

/// Messages of one partition: ids 0..ROWS.
const ROWS: u64 = 100;
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// Every ClickHouse sink class, with the host form it takes for a1 alone.
fn classes() -> [(&'static str, String); 4] {
    let host = format!("host: '{}'", A1.http_addr());
    let shard = format!("shard_hosts: {{a: ['{}']}}", A1.http_addr());
    [
        ("ClickHouseBatchingSink", host.clone()),
        ("ShardedClickHouseBatchingSink", shard),
        ("AtLeastOnceClickHouseSink", host.clone()),
        ("AtMostOnceClickHouseSink", host),
    ]
}

/// One partition of ROWS generator messages into `table` through `class`.
fn spec(class: &str, hosts: &str, table: &str) -> String {
    GeneratorSpec::new("computed", class, format!("{{{hosts}, table: {table}}}"))
        .partitions(1)
        .epoch(1000, 500)
        .count(ROWS)
        .payload_bytes(8)
        .sink_name("out")
        .dynamic("{retry_backoff: 100ms, max_retry_backoff: 2s}")
        .yaml()
}

async fn run(yaml: &str) -> Result<RunReport, RuntimeError> {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let dir = TestDir::new().unwrap();
    run_pipeline(&flow::registry(), yaml, dir.path(), RUN_TIMEOUT)
        .await
        .unwrap()
}

fn query(sql: &str) -> Vec<u64> {
    query_u64s(A1.http_port, sql).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alias_and_materialized_columns_the_stream_does_not_send_are_computed_by_the_server() {
    for (class, hosts) in classes() {
        let t = unique_name("it_computed_ok");
        // The generator's columns, then two the server computes from them.
        let table = ReplicatedTable::create(
            "default",
            &t,
            &format!(
                "{GENERATOR_COLUMNS}, id_twice UInt64 ALIAS id * 2, \
                 id_mod UInt64 MATERIALIZED id % 7"
            ),
            "id",
            &[A1],
        )
        .unwrap();
        let report = run(&spec(class, &hosts, &t))
            .await
            .unwrap_or_else(|err| panic!("{class}: {err}"));
        assert_eq!(report.messages(), ROWS, "{class}");
        // An ALIAS column is not stored: it is computed at every read.
        let rows = query(&format!(
            "SELECT count(), uniqExact(id), countIf(id_twice = id * 2), sum(id_twice), \
             countIf(id_mod = id % 7), sum(id_mod) FROM default.{t} FORMAT TSV"
        ));
        let sum_ids: u64 = (0..ROWS).sum();
        let sum_mod: u64 = (0..ROWS).map(|id| id % 7).sum();
        assert_eq!(
            rows,
            vec![ROWS, ROWS, ROWS, 2 * sum_ids, ROWS, sum_mod],
            "{class}: count, distinct ids, id_twice = id * 2, sum(id_twice), id_mod = id % 7, \
             sum(id_mod)"
        );
        drop(table);
    }
}

/// Runs `class` into a table whose `payload` (a column the generator sends) is `payload_column`;
/// returns the refusal's text after checking that nothing landed.
async fn refused(class: &str, hosts: &str, payload_column: &str) -> String {
    let t = unique_name("it_computed_refused");
    let columns = GENERATOR_COLUMNS.replace("payload String", payload_column);
    assert_ne!(
        columns, GENERATOR_COLUMNS,
        "the generator's columns changed"
    );
    let table = ReplicatedTable::create("default", &t, &columns, "id", &[A1]).unwrap();
    let err = match run(&spec(class, hosts, &t)).await {
        Ok(report) => panic!("{class}: the start was expected to be refused: {report:?}"),
        Err(err) => err,
    };
    assert!(
        matches!(err, RuntimeError::PartitionsFailed(_)),
        "{class}: unexpected error kind: {err:?}"
    );
    let rows = query(&format!("SELECT count() FROM default.{t} FORMAT TSV"));
    assert_eq!(rows, vec![0], "{class}: rows landed in a refused table");
    drop(table);
    err.to_string().replace(&t, "<table>")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_column_that_is_materialized_or_alias_in_the_table_refuses_the_start() {
    for (class, hosts) in classes() {
        for kind in ["MATERIALIZED", "ALIAS"] {
            let text = refused(
                class,
                &hosts,
                &format!("payload String {kind} toString(id)"),
            )
            .await;
            let reason = format!(
                "Refusing to start the ClickHouse sink for default.<table>: the stream column \
                 `payload` is a {kind} column of the table, which ClickHouse computes itself; \
                 drop it from the stream"
            );
            // The refusal is the partition's whole failure, word for word.
            assert_eq!(
                text,
                format!("1 partition(s) failed:\n  partition 0: sink `out`: {reason}"),
                "{class}, {kind}"
            );
        }
    }
}

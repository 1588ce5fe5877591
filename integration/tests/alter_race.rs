//! An ALTER racing INSERTs, then reverted (issue 24, item 2).
//!
//! `ADD COLUMN extra UInt8 DEFAULT 0` while parts are in flight stores them with `extra`; the sink
//! sees the change after those INSERTs and stops. Dropping the column again and restarting used to
//! send those parts again: under the original columns they are other blocks than the stored ones,
//! so 18.16 (no `insert_deduplication_token`) did not drop them and their rows landed twice. Now a
//! part sent while the columns changed is looked up on the shard's replicas by its ids in
//! `message_id_column` first (landed: acknowledged without a resend), or, without that parameter,
//! the sink stops with the check to run.
//!
//! The race is made certain by a fault proxy in front of each replica that holds every INSERT for
//! 2 s before passing it on (the sink's columns checks pass at once): at the moment of the ALTER
//! each partition's INSERT is waiting in a proxy, so it reaches the server after the change.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 6;
const PER_PARTITION: u64 = 3_000;

/// What the first run (stopped by the change) and the second one (after the revert) left.
struct Reverted {
    table: ReplicatedTable,
    first_log: String,
    second: WorkerOutput,
}

/// Runs the batching sink over proxies to a1 and a2 (`extra_parameters` added to its parameters),
/// adds a column while INSERTs are held in the proxies, waits for the sink to stop, drops the
/// column, and runs the worker again on the same state directory.
fn alter_racing_inserts_then_reverted(tag: &str, extra_parameters: &str) -> Reverted {
    require_cluster().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let proxies: Vec<FaultProxy> = SHARD_A
        .iter()
        .map(|node| {
            let upstream: SocketAddr = node.http_addr().parse().unwrap();
            runtime.block_on(FaultProxy::start(upstream)).unwrap()
        })
        .collect();
    let name = unique_name(tag);
    let table =
        ReplicatedTable::create("default", &name, GENERATOR_COLUMNS, "id", &SHARD_A).unwrap();
    let qualified = table.qualified();
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.yaml");
    let state = dir.path().join("state");
    let parameters = format!(
        "{{hosts: ['{}', '{}'], table: {name}{extra_parameters}}}",
        proxies[0].addr(),
        proxies[1].addr()
    );
    std::fs::write(
        &spec,
        GeneratorSpec::new(tag, "ClickHouseBatchingSink", parameters)
            .partitions(PARTITIONS)
            .epoch(250, 200)
            .count(PER_PARTITION)
            .rate(500)
            .dynamic("{max_rows_per_batch: 250, retry_backoff: 100ms, write_timeout: 20s}")
            .yaml(),
    )
    .unwrap();
    let mut worker =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w1.log")).unwrap();
    wait_until(Duration::from_secs(60), || {
        Ok(count_uniq(A1, &qualified)?.0 >= 1_500)
    })
    .unwrap_or_else(|err| panic!("{err:#}: nothing landed\n{}", worker.log_tail()));
    for proxy in &proxies {
        proxy.set_on_inserts(Fault::Latency(Duration::from_secs(2)));
    }
    // Every partition's next INSERT is now held in a proxy.
    std::thread::sleep(Duration::from_millis(1_500));
    exec(
        A1.http_port,
        &format!("ALTER TABLE {qualified} ADD COLUMN extra UInt8 DEFAULT 0"),
    )
    .unwrap();
    let stopped = "was being inserted (column 7 was added: `extra` UInt8 DEFAULT 0)";
    wait_until(Duration::from_secs(60), || {
        Ok(std::fs::read_to_string(worker.log())?.contains(stopped))
    })
    .unwrap_or_else(|err| panic!("{err:#}: no `{stopped}`\n{}", worker.log_tail()));
    for proxy in &proxies {
        proxy.set(Fault::Pass);
    }
    if worker.wait_exit(Duration::from_secs(30)).is_err() || worker.running() {
        worker.kill_9().unwrap();
    }
    let first_log = std::fs::read_to_string(worker.log()).unwrap();
    // Reverted as the message of 7b2b35f advised; the replicated ALTER reaches a2 too.
    exec(
        A1.http_port,
        &format!("ALTER TABLE {qualified} DROP COLUMN extra"),
    )
    .unwrap();
    for node in SHARD_A {
        wait_until(Duration::from_secs(60), || {
            Ok(query_u64(
                node.http_port,
                &format!(
                    "SELECT count() FROM system.columns WHERE database = 'default' AND table = '{name}' AND name = 'extra'"
                ),
            )? == 0)
        })
        .unwrap();
    }
    let second = run_spec(worker_bin!(), &spec, &state, Duration::from_secs(120)).unwrap();
    for node in SHARD_A {
        sync_when_writable(node, "default", &name, Duration::from_secs(60)).unwrap();
    }
    Reverted {
        table,
        first_log,
        second,
    }
}

#[test]
fn parts_that_landed_under_a_reverted_column_are_found_by_id_and_not_sent_again() {
    let Reverted {
        table,
        first_log,
        second,
    } = alter_racing_inserts_then_reverted("alter_race_ids", ", message_id_column: id");
    assert!(
        first_log.contains("the INSERT succeeded, so its rows are in the table"),
        "{first_log}"
    );
    assert_eq!(second.code, Some(0), "{}", second.stderr);
    let total = PARTITIONS * PER_PARTITION;
    for node in SHARD_A {
        assert_eq!(
            count_uniq(node, &table.qualified()).unwrap(),
            (total, total),
            "every id once on {}",
            node.name
        );
    }
    let acknowledged = second
        .stderr
        .matches("is in the table already (every one of its `id` ids, once): acknowledged without sending it again")
        .count();
    println!("parts found in the table and not sent again: {acknowledged}");
    assert!(acknowledged > 0, "{}", second.stderr);
}

#[test]
fn without_an_id_column_such_a_part_stops_the_sink_with_the_check_to_run() {
    let Reverted { table, second, .. } = alter_racing_inserts_then_reverted("alter_race_noid", "");
    assert_ne!(second.code, Some(0), "{}", second.stderr);
    for expected in [
        "Not sending a part again into ClickHouse: default.",
        "was sent while the table's columns changed, so it may be in the table under other columns",
        "The sink cannot check this: `message_id_column` is not set. Check on every replica: `SELECT count(), uniqExact(ID), min(ID), max(ID) FROM default.",
        "Then set `message_id_column: ID` in the sink's parameters and restart",
    ] {
        assert!(second.stderr.contains(expected), "no `{expected}` in\n{}", second.stderr);
    }
    // Nothing was sent twice meanwhile.
    let (rows, distinct) = count_uniq(A1, &table.qualified()).unwrap();
    assert_eq!(rows, distinct);
    assert!(rows < PARTITIONS * PER_PARTITION);
}

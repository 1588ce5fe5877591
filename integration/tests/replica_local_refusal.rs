//! A permanent refusal by one replica only (issue 24, item 18): `DETACH TABLE` on a1 makes a1
//! answer code 60 `UNKNOWN_TABLE` while a2, the other replica of shard `a`, is healthy. Before the
//! fix the refusal was permanent for the whole sink and the pipeline stopped; now the insert fails
//! over to a2 (the same bytes and token) with a WARN naming a1 and what to do, and the pipeline
//! completes. The table is attached again at the end of the test, even after a failure.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 2;
const PER_PARTITION: u64 = 6_000;

/// Attaches the table on the node again when dropped (a failed assertion included), before the
/// table's own guard drops it.
struct AttachAgain {
    node: Node,
    qualified: String,
}

impl Drop for AttachAgain {
    fn drop(&mut self) {
        // Already attached (the detach never ran, or the test attached it): the error is moot.
        let _ = exec(
            self.node.http_port,
            &format!("ATTACH TABLE {}", self.qualified),
        );
    }
}

/// Runs `class` over hosts a1, a2, detaches the table on a1 once rows landed there, and checks
/// that the pipeline completes with the WARN naming a1. Returns the table (attached again and
/// synced on both replicas) for the class's own count.
fn detach_one_replica_mid_run(tag: &str, class: &str) -> ReplicatedTable {
    require_cluster().unwrap();
    let name = unique_name(tag);
    let table =
        ReplicatedTable::create("default", &name, GENERATOR_COLUMNS, "id", &SHARD_A).unwrap();
    let qualified = table.qualified();
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    let parameters = format!(
        "{{hosts: ['{}', '{}'], table: {name}}}",
        A1.http_addr(),
        A2.http_addr()
    );
    std::fs::write(
        &spec,
        GeneratorSpec::new(tag, class, parameters)
            .partitions(PARTITIONS)
            .epoch(500, 200)
            .count(PER_PARTITION)
            .rate(1_500)
            .dynamic("{max_rows_per_batch: 500, retry_backoff: 100ms, write_timeout: 5s}")
            .yaml(),
    )
    .unwrap();
    let mut worker = Worker::spawn(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        dir.path().join("w.log"),
    )
    .unwrap();
    // The sink writes to a1, the first host, while nothing fails.
    wait_until(Duration::from_secs(60), || {
        Ok(count_uniq(A1, &qualified)?.0 >= 1_000)
    })
    .unwrap_or_else(|err| panic!("{err:#}: nothing landed on a1\n{}", worker.log_tail()));
    let _attach = AttachAgain {
        node: A1,
        qualified: qualified.clone(),
    };
    exec(A1.http_port, &format!("DETACH TABLE {qualified}")).unwrap();
    let code = worker.wait_exit(Duration::from_secs(90)).unwrap();
    let log = std::fs::read_to_string(worker.log()).unwrap();
    assert_eq!(code, Some(0), "the worker failed\n{}", worker.log_tail());
    let warning = format!(
        "replica {} refused the insert with an error about that host only (its table or database is missing or detached there, it is read-only, or its users differ); the part goes to the next replica of the shard. Fix that host (e.g. `ATTACH TABLE {qualified}` on it, or its users and grants): later parts try it again",
        A1.http_addr()
    );
    assert!(log.contains(&warning), "no `{warning}` in\n{log}");
    assert!(log.contains("UNKNOWN_TABLE"), "{log}");
    exec(A1.http_port, &format!("ATTACH TABLE {qualified}")).unwrap();
    for node in SHARD_A {
        sync_when_writable(node, "default", &name, Duration::from_secs(60)).unwrap();
    }
    table
}

#[test]
fn exactly_once_fails_over_from_a_replica_whose_table_is_detached_and_lands_every_id_once() {
    let table = detach_one_replica_mid_run("detach_batching", "ClickHouseBatchingSink");
    let total = PARTITIONS * PER_PARTITION;
    for node in SHARD_A {
        assert_eq!(
            count_uniq(node, &table.qualified()).unwrap(),
            (total, total),
            "on {}",
            node.name
        );
    }
}

#[test]
fn at_most_once_fails_over_from_a_replica_whose_table_is_detached_and_sends_no_row_twice() {
    let table = detach_one_replica_mid_run("detach_at_most_once", "AtMostOnceClickHouseSink");
    let total = PARTITIONS * PER_PARTITION;
    // A refused attempt stored nothing: failing over loses no part and doubles none.
    for node in SHARD_A {
        assert_eq!(
            count_uniq(node, &table.qualified()).unwrap(),
            (total, total),
            "on {}",
            node.name
        );
    }
}

#[test]
fn a_replica_whose_table_is_detached_at_the_start_is_left_out_and_the_pipeline_completes() {
    require_cluster().unwrap();
    let name = unique_name("detach_at_start");
    let table =
        ReplicatedTable::create("default", &name, GENERATOR_COLUMNS, "id", &SHARD_A).unwrap();
    let qualified = table.qualified();
    let _attach = AttachAgain {
        node: A1,
        qualified: qualified.clone(),
    };
    exec(A1.http_port, &format!("DETACH TABLE {qualified}")).unwrap();
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    let parameters = format!(
        "{{hosts: ['{}', '{}'], table: {name}}}",
        A1.http_addr(),
        A2.http_addr()
    );
    std::fs::write(
        &spec,
        GeneratorSpec::new("detach_at_start", "ClickHouseBatchingSink", parameters)
            .partitions(PARTITIONS)
            .epoch(500, 200)
            .count(PER_PARTITION)
            .rate(1_500)
            .dynamic("{max_rows_per_batch: 500, retry_backoff: 100ms}")
            .yaml(),
    )
    .unwrap();
    let output = run_spec(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        Duration::from_secs(90),
    )
    .unwrap();
    assert_eq!(output.code, Some(0), "{}", output.stderr);
    let warning = format!(
        "a host refuses the table that its shard's other hosts answer with: the sink writes to those and admits this one once it answers with the same table. Fix that host (e.g. ATTACH or create the table there) database=default table={name} shard= host={}",
        A1.http_addr()
    );
    assert!(
        output.stderr.contains(&warning),
        "no `{warning}` in\n{}",
        output.stderr
    );
    assert!(
        output
            .stderr
            .contains("the table does not exist on 127.0.0.1:18123"),
        "{}",
        output.stderr
    );
    exec(A1.http_port, &format!("ATTACH TABLE {qualified}")).unwrap();
    let total = PARTITIONS * PER_PARTITION;
    for node in SHARD_A {
        sync_when_writable(node, "default", &name, Duration::from_secs(60)).unwrap();
        assert_eq!(
            count_uniq(node, &qualified).unwrap(),
            (total, total),
            "on {}",
            node.name
        );
    }
}

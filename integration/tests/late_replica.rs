//! A host that does not answer when the worker starts (issue 8): the session starts on the
//! shard's other host, the rows go there, and the late host is admitted once it answers with the
//! same table, or kept out, with the reason, when it answers with another one. The late host sits
//! behind a fault proxy that refuses connections at the start, so no server is stopped.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 2;
const PER_PARTITION: u64 = 4_000;

/// Runs a batching sink over `a1` and a proxy to `late` (refusing until rows landed on a1),
/// waits for `expected` in the log after the proxy passes again, and returns the table and the
/// log once the worker finished.
fn run_with_a_late_host(late: Node, expected: &str) -> Result<(ReplicatedTable, String)> {
    wait_for_cluster(Duration::from_secs(120))?;
    let runtime = tokio::runtime::Runtime::new()?;
    let upstream: SocketAddr = late.http_addr().parse()?;
    let proxy = runtime.block_on(FaultProxy::start(upstream))?;
    proxy.set(Fault::Refuse);
    let name = unique_name("late_replica");
    let table = ReplicatedTable::create("default", &name, GENERATOR_COLUMNS, "id", &NODES)?;
    let dir = TestDir::new()?;
    let spec = dir.path().join("spec.yaml");
    let parameters = format!(
        "{{hosts: ['{}', '{}'], table: {name}}}",
        A1.http_addr(),
        proxy.addr()
    );
    std::fs::write(
        &spec,
        GeneratorSpec::new("late_replica", "ClickHouseBatchingSink", parameters)
            .partitions(PARTITIONS)
            .epoch(500, 200)
            .count(PER_PARTITION)
            .rate(800)
            .dynamic("{max_rows_per_batch: 500, retry_backoff: 100ms, write_timeout: 2s}")
            .yaml(),
    )?;
    let mut worker = Worker::spawn(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        dir.path().join("w.log"),
    )?;
    let qualified = table.qualified();
    wait_until(Duration::from_secs(30), || {
        Ok(count_uniq(A1, &qualified)?.0 > 0)
    })
    .with_context(|| {
        format!(
            "nothing landed on a1 while the late host refused\n{}",
            worker.log_tail()
        )
    })?;
    proxy.set(Fault::Pass);
    wait_until(Duration::from_secs(30), || {
        Ok(std::fs::read_to_string(worker.log())?.contains(expected))
    })
    .with_context(|| format!("no `{expected}` in the log\n{}", worker.log_tail()))?;
    let code = worker.wait_exit(Duration::from_secs(60))?;
    ensure!(code == Some(0), "the worker failed\n{}", worker.log_tail());
    let log = std::fs::read_to_string(worker.log())?;
    Ok((table, log))
}

#[test]
fn a_replica_down_at_the_start_is_admitted_once_it_answers_and_every_row_lands_once() -> Result<()>
{
    let (table, log) = run_with_a_late_host(A2, "it takes inserts again")?;
    assert!(
        log.contains("a host did not answer at the session start"),
        "{log}"
    );
    let qualified = table.qualified();
    for node in SHARD_A {
        sync_when_writable(node, "default", &table.table, Duration::from_secs(60))?;
    }
    let total = PARTITIONS * PER_PARTITION;
    assert_eq!(count_uniq(A1, &qualified)?, (total, total));
    assert_eq!(count_uniq(A2, &qualified)?, (total, total));
    Ok(())
}

#[test]
fn a_late_host_answering_with_another_table_stays_out_with_the_reason() -> Result<()> {
    // b1's table of the same name replicates through shard b's ZooKeeper path.
    let (table, log) = run_with_a_late_host(B1, "answers with another table")?;
    assert!(log.contains("replicates through ZooKeeper path"), "{log}");
    let qualified = table.qualified();
    let total = PARTITIONS * PER_PARTITION;
    assert_eq!(count_uniq(A1, &qualified)?, (total, total));
    assert_eq!(
        count_uniq(B1, &qualified)?,
        (0, 0),
        "nothing may go to the other table"
    );
    Ok(())
}

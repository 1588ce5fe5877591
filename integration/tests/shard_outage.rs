//! A shard that does not answer, while a sharded exactly-once pipeline runs or from its very
//! start (issue 8): the other shard's deliveries go on, the silent shard's batches wait in the
//! outbox (set aside from the delivery queue) and are read back, rebuilt from the source, once it
//! answers; at the end every id is once in ClickHouse on the shard it routes to. Shard b sits
//! behind fault proxies (b1, b2 refuse connections), so no server is stopped.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use flow_integration::proxy::{shard_b_proxies, Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 4;
const PER_PARTITION: u64 = 8_000;

/// How many of the run's ids route to shard a.
fn routed_to_a() -> u64 {
    let router = flow_clickhouse::testing::RendezvousRouter::new(&["a".to_owned(), "b".to_owned()]);
    (0..PARTITIONS * PER_PARTITION)
        .filter(|id| router.shards()[router.route(&user_routing_key(id % 1000))] == "a")
        .count() as u64
}

/// Lets b answer again, waits for the worker to finish and checks that every id is once on the
/// shard it routes to, with nothing left in the outbox.
fn release_and_check(
    proxies: &[FaultProxy],
    worker: &mut Worker,
    table: &ReplicatedTable,
    state: &std::path::Path,
    pipeline: &str,
) -> Result<()> {
    for proxy in proxies {
        proxy.set(Fault::Pass);
    }
    let code = worker.wait_exit(Duration::from_secs(120))?;
    ensure!(code == Some(0), "the worker failed\n{}", worker.log_tail());
    for node in NODES {
        sync_when_writable(node, "default", &table.table, Duration::from_secs(60))?;
    }
    let total = PARTITIONS * PER_PARTITION;
    let qualified = table.qualified();
    assert_eq!(landed_on_both_shards(&qualified)?, (total, total));
    check_routing(
        &[("a", SHARD_A.to_vec()), ("b", SHARD_B.to_vec())],
        &qualified,
        1000,
    )?;
    let status = pipeline_status(worker_bin!(), state, pipeline)?.context("no status")?;
    assert_eq!(status.batches(), 0, "undelivered batches after the run");
    Ok(())
}

/// The spec of a sharded sink over a1/a2 and the proxies of b1/b2.
fn spec_over_proxies(pipeline: &str, table: &str, proxies: &[FaultProxy]) -> String {
    let parameters = format!(
        "{{shard_hosts: {{a: ['{}', '{}'], b: ['{}', '{}']}}, sharding_key_columns: [user_id], table: {table}}}",
        A1.http_addr(),
        A2.http_addr(),
        proxies[0].addr(),
        proxies[1].addr()
    );
    GeneratorSpec::new(pipeline, "ShardedClickHouseBatchingSink", parameters)
        .partitions(PARTITIONS)
        .epoch(500, 200)
        .count(PER_PARTITION)
        .rate(1_000)
        .dynamic("{max_rows_per_batch: 500, retry_backoff: 100ms, max_retry_backoff: 1s, write_timeout: 2s}")
        .yaml()
}

#[test]
fn a_shard_down_from_the_start_and_through_a_kill_holds_up_only_its_own_batches() -> Result<()> {
    wait_for_cluster(Duration::from_secs(120))?;
    let runtime = tokio::runtime::Runtime::new()?;
    let proxies = runtime.block_on(shard_b_proxies(Fault::Refuse))?;
    let name = unique_name("shard_down_start");
    let table = ReplicatedTable::create("default", &name, GENERATOR_COLUMNS, "id", &NODES)?;
    let qualified = table.qualified();
    let dir = TestDir::new()?;
    let spec = dir.path().join("spec.yaml");
    std::fs::write(
        &spec,
        spec_over_proxies("shard_down_start", &name, &proxies),
    )?;
    let state = dir.path().join("state");
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w0.log"))?;
    let on_a = || -> Result<u64> { Ok(count_uniq(A1, &qualified)?.1) };
    wait_until(Duration::from_secs(30), || Ok(on_a()? > 0)).with_context(|| {
        format!(
            "nothing landed on a while b was down\n{}",
            worker.log_tail()
        )
    })?;
    // A restart while b is still down: its pending batches stay, a goes on.
    worker.kill_9()?;
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w1.log"))?;
    let routed = routed_to_a();
    wait_until(Duration::from_secs(90), || Ok(on_a()? == routed)).with_context(|| {
        format!(
            "shard a holds {:?} of its {routed} rows while b is down\n{}",
            on_a(),
            worker.log_tail()
        )
    })?;
    assert_eq!(
        count_uniq(B1, &qualified)?,
        (0, 0),
        "b answered nothing, so holds nothing"
    );
    release_and_check(&proxies, &mut worker, &table, &state, "shard_down_start")
}

#[test]
fn a_refusing_shard_holds_up_only_its_own_batches_which_land_once_when_it_answers_again(
) -> Result<()> {
    wait_for_cluster(Duration::from_secs(120))?;
    let runtime = tokio::runtime::Runtime::new()?;
    let proxies = runtime.block_on(shard_b_proxies(Fault::Pass))?;
    let name = unique_name("shard_outage");
    let table = ReplicatedTable::create("default", &name, GENERATOR_COLUMNS, "id", &NODES)?;
    let qualified = table.qualified();
    let dir = TestDir::new()?;
    let spec = dir.path().join("spec.yaml");
    std::fs::write(&spec, spec_over_proxies("shard_outage", &name, &proxies))?;
    let state = dir.path().join("state");
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w.log"))?;
    let on_a = || -> Result<u64> { Ok(count_uniq(A1, &qualified)?.1) };
    wait_until(Duration::from_secs(30), || Ok(on_a()? > 0))
        .with_context(|| format!("nothing landed\n{}", worker.log_tail()))?;
    for proxy in &proxies {
        proxy.set(Fault::Refuse);
    }
    let refused_at = Instant::now();
    // An INSERT already under way when the proxies turned may still finish.
    std::thread::sleep(Duration::from_millis(2_500));
    let b_before = count_uniq(B1, &qualified)?.1;

    // Shard a receives every row routed to it although b takes nothing: far more batches than
    // the delivery queue holds.
    let routed_to_a = routed_to_a();
    wait_until(Duration::from_secs(90), || Ok(on_a()? == routed_to_a)).with_context(|| {
        format!(
            "shard a holds {:?} of its {routed_to_a} rows while b refuses\n{}",
            on_a(),
            worker.log_tail()
        )
    })?;
    let b_during = count_uniq(B1, &qualified)?.1;
    ensure!(
        b_during == b_before,
        "b took rows while refusing: {b_before} -> {b_during}"
    );
    let log = std::fs::read_to_string(worker.log())?;
    ensure!(
        log.contains("its later batches wait in the outbox"),
        "no set-aside warning\n{}",
        worker.log_tail()
    );
    println!(
        "shard a complete ({routed_to_a} rows) {:.1} s after b started refusing; b held {b_during}",
        refused_at.elapsed().as_secs_f64()
    );

    release_and_check(&proxies, &mut worker, &table, &state, "shard_outage")
}

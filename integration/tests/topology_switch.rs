//! The safe topology switch (`flow-worker drain`), against the local cluster
//! (`scripts/cluster.sh up`).
//!
//! A sharded pipeline writes to shard `a` only, through a [`FaultProxy`] in front of a1. Once rows
//! land, the proxy refuses every connection, so committed batches pile up in the outbox, and the
//! worker is killed with `kill -9`. The spec is then edited to shards `{a, b}`: a `drain` under
//! the edited spec is refused (the topology guard names `drain`), a `drain` under the unchanged
//! spec delivers every pending batch and says the topology can now be changed, and a `run` of
//! the edited spec finishes the source across both shards with every id exactly once.
//!
//! The test fails, not skips, without a cluster. It stops no node.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 2;
const PER_PARTITION: u64 = 4_000;
const TOTAL: u64 = PARTITIONS * PER_PARTITION;
/// Messages per epoch and rows per batch.
const BATCH: u64 = 200;
/// Per partition: about 4 s undisturbed.
const RATE: u64 = 1_000;
/// Pending batches to wait for before the kill.
const MIN_PENDING: u64 = 4;
const PIPELINE: &str = "topo_switch";

fn spec_yaml(table: &str, shard_a: SocketAddr, with_b: bool) -> String {
    let b = if with_b {
        format!(", b: ['{}']", B1.http_addr())
    } else {
        String::new()
    };
    GeneratorSpec::new(
        PIPELINE,
        "ShardedClickHouseBatchingSink",
        format!(
            "{{shard_hosts: {{a: ['{shard_a}']{b}}}, database: default, table: {table}, sharding_key_columns: [user_id]}}"
        ),
    )
    .partitions(PARTITIONS)
    .epoch(BATCH, 600_000)
    .count(PER_PARTITION)
    .rate(RATE)
    .sink_name("events")
    .dynamic(format!(
        "{{max_rows_per_batch: {BATCH}, retry_backoff: 200ms, max_retry_backoff: 1s, max_insert_attempts: 1000}}"
    ))
    .yaml()
}

fn drain(spec: &Path, state: &Path) -> WorkerOutput {
    let (spec, state) = (spec.display().to_string(), state.display().to_string());
    run_worker(
        worker_bin!(),
        &["drain", &spec, "--state-dir", &state],
        &[],
        Duration::from_secs(60),
    )
    .unwrap()
}

/// (count, uniqExact(id)) over both shards, read from a1 and b1 (the only hosts written to).
fn across_shards(table: &str) -> (u64, u64) {
    let sql = format!(
        "SELECT count(), uniqExact(id) FROM remote('127.0.0.1:{},127.0.0.1:{}', default.{table})",
        A1.tcp_port, B1.tcp_port
    );
    let both = query_u64s(A1.http_port, &sql).unwrap();
    (both[0], both[1])
}

#[test]
fn drain_then_a_new_shard_set_delivers_every_id_exactly_once_across_shards() {
    let started = Instant::now();
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let t = unique_name("it_topo_switch");
    let nodes = [A1, A2, B1, B2];
    let _table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &nodes).unwrap();
    let a1 = SocketAddr::from(([127, 0, 0, 1], A1.http_port));
    let proxy = rt.block_on(FaultProxy::start(a1)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (spec, state) = (dir.path().join("spec.yaml"), dir.path().join("state"));
    let old_spec = spec_yaml(&t, proxy.addr(), false);
    let new_spec = spec_yaml(&t, proxy.addr(), true);

    // 1. Shard `a` takes rows, then refuses every connection: batches pile up; kill -9.
    std::fs::write(&spec, &old_spec).unwrap();
    let mut worker =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run1.log")).unwrap();
    let landed = || query_u64(A1.http_port, &format!("SELECT count() FROM default.{t}"));
    wait_until(Duration::from_secs(30), || Ok(landed()? >= BATCH)).unwrap();
    proxy.set(Fault::Refuse);
    wait_until(Duration::from_secs(30), || {
        let status = pipeline_status(worker_bin!(), &state, PIPELINE)?;
        Ok(status.is_some_and(|s| s.batches() >= MIN_PENDING))
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", worker.log_tail()));
    assert_eq!(worker.kill_9().unwrap(), None, "{}", worker.log_tail());
    let pending = pipeline_status(worker_bin!(), &state, PIPELINE)
        .unwrap()
        .unwrap();
    assert!(pending.batches() >= MIN_PENDING, "{pending:?}");
    proxy.set(Fault::Pass);

    // 2. A drain under the edited shard set is refused, names `drain`, and sends nothing.
    std::fs::write(&spec, &new_spec).unwrap();
    let before = landed().unwrap();
    let refused = drain(&spec, &state);
    assert_ne!(refused.code, Some(0), "{refused:?}");
    assert!(
        refused.stderr.contains("the shard topology changed while")
            && refused.stderr.contains("`flow-worker drain SPEC`"),
        "{}",
        refused.stderr
    );
    assert_eq!(landed().unwrap(), before);

    // 3. A drain under the unchanged spec empties the outbox, and says the topology may change.
    std::fs::write(&spec, &old_spec).unwrap();
    let drained = drain(&spec, &state);
    assert_eq!(drained.code, Some(0), "{drained:?}");
    assert!(
        drained.stdout.contains(&format!(
            "drained pipeline `{PIPELINE}`: {} batch(es), {} row(s) delivered, nothing pending: the topology can now be changed",
            pending.batches(),
            pending.rows()
        )),
        "{drained:?}"
    );
    let after_drain = pipeline_status(worker_bin!(), &state, PIPELINE)
        .unwrap()
        .unwrap();
    assert_eq!((after_drain.batches(), after_drain.rows()), (0, 0));
    // The source was not read: the committed positions are those of the killed run.
    assert_eq!(after_drain.positions, pending.positions);
    let again = drain(&spec, &state);
    assert_eq!(
        (again.code, again.stdout.trim()),
        (
            Some(0),
            format!(
                "nothing pending in the outbox of pipeline `{PIPELINE}`: the topology can be changed now"
            )
            .as_str()
        )
    );

    // 4. The edited spec runs the rest of the source across both shards: every id once.
    std::fs::write(&spec, &new_spec).unwrap();
    let run = run_spec(worker_bin!(), &spec, &state, Duration::from_secs(60)).unwrap();
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(across_shards(&t), (TOTAL, TOTAL));
    let on_b = query_u64(B1.http_port, &format!("SELECT count() FROM default.{t}")).unwrap();
    assert!(on_b > 0, "shard b took no row of the new topology");
    rt.block_on(proxy.stop());
    eprintln!("topology switch test took {:?}", started.elapsed());
}

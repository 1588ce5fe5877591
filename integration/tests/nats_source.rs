//! `nats_jetstream` into the sharded exactly-once sink, against the local cluster's NATS node
//! (`scripts/cluster.sh up` starts it on 127.0.0.1:14222) and ClickHouse shards a and b.
//!
//! A JetStream stream with one subject per partition receives JSON messages before and while the
//! worker runs; the worker is killed with `kill -9` several times and nats-server is restarted
//! once under it. Every message must end in ClickHouse exactly once, on the shard its `user_id`
//! routes to. Publishing uses `Nats-Msg-Id`, so the publisher's own retries across the server
//! restart never put a message twice into the stream: the stream is the oracle.
//!
//! The default is the issue's full shape (400,000 messages, 6 kills, 2 NATS restarts and a replica
//! stop/start), which CI runs; `FLOW_NATS_SHORT=1` runs a shorter one of the same steps (60,000
//! messages, 3 kills, 1 NATS restart) for a quick local check.
//! The tests fail, not skip, without the cluster.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use async_nats::jetstream::{self, stream};
use async_nats::HeaderMap;
use flow_integration::worker::*;
use flow_integration::*;

const NATS_URL: &str = "nats://127.0.0.1:14222";
const PARTITIONS: u64 = 4;
const USERS: u64 = 1_000;
/// The table every test writes, matching the spec's schema.
const COLUMNS: &str = "id UInt64, user_id UInt64, payload String";

struct Shape {
    messages: u64,
    kills: u32,
    nats_restarts: u32,
    replica_restart: bool,
}

fn shape() -> Shape {
    if std::env::var_os("FLOW_NATS_SHORT").is_some() {
        Shape {
            messages: 60_000,
            kills: 3,
            nats_restarts: 1,
            replica_restart: false,
        }
    } else {
        Shape {
            messages: 400_000,
            kills: 6,
            nats_restarts: 2,
            replica_restart: true,
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn jetstream_context() -> Result<jetstream::Context> {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(NATS_URL)
        .await
        .with_context(|| format!("connecting to {NATS_URL} (scripts/cluster.sh up starts it)"))?;
    Ok(jetstream::new(client))
}

fn message_json(id: u64) -> String {
    format!(
        r#"{{"id": {id}, "user_id": {}, "payload": "message {id}"}}"#,
        id % USERS
    )
}

/// Publishes ids `range` (id `k` to subject `<prefix>.<k % PARTITIONS>`), each with
/// `Nats-Msg-Id: k`; a chunk whose acknowledgements fail is published again until acknowledged.
async fn publish(js: &jetstream::Context, prefix: &str, range: std::ops::Range<u64>) -> Result<()> {
    let ids: Vec<u64> = range.collect();
    let deadline = Instant::now() + Duration::from_secs(180);
    for chunk in ids.chunks(2_000) {
        loop {
            match publish_chunk(js, prefix, chunk).await {
                Ok(()) => break,
                Err(err) if Instant::now() < deadline => {
                    eprintln!("publish retry: {err:#}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(err) => return Err(err),
            }
        }
    }
    Ok(())
}

async fn publish_chunk(js: &jetstream::Context, prefix: &str, ids: &[u64]) -> Result<()> {
    let mut acks = Vec::with_capacity(ids.len());
    for &id in ids {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.to_string().as_str());
        let subject = format!("{prefix}.{}", id % PARTITIONS);
        acks.push(
            js.publish_with_headers(subject, headers, message_json(id).into())
                .await?,
        );
    }
    for ack in acks {
        ack.await?;
    }
    Ok(())
}

fn write_spec(dir: &Path, stream: &str, prefix: &str, table: &str) -> PathBuf {
    let hosts =
        |nodes: [Node; 2]| format!("['{}', '{}']", nodes[0].http_addr(), nodes[1].http_addr());
    let yaml = format!(
        "pipeline: nats_it\npartitions: {PARTITIONS}\nepoch: {{max_messages: 5000, max_duration_ms: 300}}\n\
         source:\n  class: nats_jetstream\n  parameters:\n    servers: ['{NATS_URL}']\n    stream: {stream}\n    subject_template: '{prefix}.{{partition}}'\n    format: json\n    schema: [{{name: id, type: uint64}}, {{name: user_id, type: uint64}}, {{name: payload, type: string}}]\n\
         sinks:\n  - name: out\n    sink_class_name: ShardedClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{shard_hosts: {{a: {}, b: {}}}, database: default, table: {table}, sharding_key_columns: [user_id]}}\n    dynamic_parameters: {{max_rows_per_batch: 5000, retry_backoff: 100ms, max_retry_backoff: 2s}}\n",
        hosts(SHARD_A),
        hosts(SHARD_B),
    );
    let spec = dir.join("spec.yaml");
    std::fs::write(&spec, yaml).unwrap();
    spec
}

#[test]
fn jetstream_messages_land_exactly_once_across_worker_kills_and_nats_restarts() -> Result<()> {
    require_cluster()?;
    let _cluster = ClusterGuard;
    let shape = shape();
    let rt = runtime();
    let name = unique_name("nats_it");
    let prefix = format!("{name}.p");
    let js = rt.block_on(jetstream_context())?;
    rt.block_on(js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{prefix}.*")],
        storage: stream::StorageType::File,
        ..Default::default()
    }))
    .context("creating the JetStream stream")?;
    let table = ReplicatedTable::create("default", &name, COLUMNS, "id", &NODES)?;
    let dir = TestDir::new()?;
    let spec = write_spec(dir.path(), &name, &prefix, &name);
    let state = dir.path().join("state");

    let half = shape.messages / 2;
    rt.block_on(publish(&js, &prefix, 0..half))?;
    let publisher = {
        let js = js.clone();
        let prefix = prefix.clone();
        let total = shape.messages;
        rt.spawn(async move { publish(&js, &prefix, half..total).await })
    };

    let started = Instant::now();
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w0.log"))?;
    let events = shape.kills + shape.nats_restarts + u32::from(shape.replica_restart);
    let mut runs = 1;
    for event in 0..events {
        std::thread::sleep(Duration::from_millis(2_500));
        if worker.exited()?.is_some() {
            bail!("the worker exited on its own\n{}", worker.log_tail());
        }
        if event < shape.kills {
            worker.kill_9()?;
            worker = Worker::spawn(
                worker_bin!(),
                &spec,
                &state,
                dir.path().join(format!("w{runs}.log")),
            )?;
            runs += 1;
        } else if event < shape.kills + shape.nats_restarts {
            cluster_sh(&["kill", "nats"])?;
            std::thread::sleep(Duration::from_secs(2));
            cluster_sh(&["start", "nats"])?;
        } else {
            cluster_sh(&["stop", "a2"])?;
            std::thread::sleep(Duration::from_secs(3));
            cluster_sh(&["start", "a2"])?;
        }
    }
    rt.block_on(publisher)??;
    let qualified = table.qualified();
    wait_until(Duration::from_secs(240), || {
        Ok(landed_on_both_shards(&qualified)?.1 >= shape.messages)
    })
    .with_context(|| format!("not every message landed\n{}", worker.log_tail()))?;
    let elapsed = started.elapsed();
    // The running worker's status (its snapshot, refreshed every 2 s) shows every partition
    // caught up with the stream.
    let mut lags = Vec::new();
    wait_until(Duration::from_secs(20), || {
        lags = partition_lags(worker_bin!(), &state, "nats_it")?;
        Ok(lags.len() == PARTITIONS as usize && lags.iter().all(|&lag| lag == Some(0)))
    })
    .with_context(|| format!("status shows lags {lags:?}, not 0 for each partition"))?;
    worker.kill_9()?;

    for node in NODES {
        sync_when_writable(node, "default", &name, Duration::from_secs(60))?;
    }
    let (total, distinct) = landed_on_both_shards(&qualified)?;
    assert_eq!(
        (total, distinct),
        (shape.messages, shape.messages),
        "every message once over both shards"
    );
    for [first, second] in [SHARD_A, SHARD_B] {
        assert_eq!(
            count_uniq(first, &qualified)?,
            count_uniq(second, &qualified)?,
            "replicas of one shard agree"
        );
    }
    let held = check_routing(
        &[("a", SHARD_A.to_vec()), ("b", SHARD_B.to_vec())],
        &qualified,
        USERS,
    )?;
    println!(
        "{} messages, {runs} worker runs, {} NATS restarts: all once in {elapsed:?}; user_ids per shard {held:?}",
        shape.messages, shape.nats_restarts
    );
    let _ = rt.block_on(js.delete_stream(&name));
    Ok(())
}

/// A stream whose partition 0 holds a good message (sequence 1), one whose `id` is a string
/// (sequence 2) and another good one (sequence 3).
fn stream_with_a_bad_message(
    rt: &tokio::runtime::Runtime,
    name: &str,
) -> Result<(jetstream::Context, String)> {
    let prefix = format!("{name}.p");
    let js = rt.block_on(jetstream_context())?;
    rt.block_on(js.create_stream(stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{prefix}.*")],
        ..Default::default()
    }))?;
    rt.block_on(async {
        for payload in [
            message_json(1),
            r#"{"id": "x"}"#.to_owned(),
            message_json(3),
        ] {
            js.publish(format!("{prefix}.0"), payload.into())
                .await?
                .await?;
        }
        anyhow::Ok(())
    })?;
    Ok((js, prefix))
}

#[test]
fn a_message_that_breaks_the_schema_stops_its_partition_naming_partition_position_and_column(
) -> Result<()> {
    require_cluster()?;
    let rt = runtime();
    let name = unique_name("nats_bad");
    let (js, prefix) = stream_with_a_bad_message(&rt, &name)?;
    let table = ReplicatedTable::create("default", &name, COLUMNS, "id", &NODES)?;
    let dir = TestDir::new()?;
    let spec = write_spec(dir.path(), &name, &prefix, &name);
    let log = dir.path().join("worker.log");
    // The other partitions read on (an endless source): the failed one is reported in the log.
    let mut worker = Worker::spawn(worker_bin!(), &spec, &dir.path().join("state"), log.clone())?;
    let expected = "partition 0: source: 0/2: column `id` (uint64): expected uint64, got a string";
    wait_until(Duration::from_secs(30), || {
        Ok(std::fs::read_to_string(&log)?.contains(expected))
    })
    .with_context(|| format!("no `{expected}` in the log\n{}", worker.log_tail()))?;
    worker.kill_9()?;
    // The epoch that met the bad message was not committed: nothing of partition 0 landed.
    assert_eq!(landed_on_both_shards(&table.qualified())?, (0, 0));
    let _ = rt.block_on(js.delete_stream(&name));
    Ok(())
}

#[test]
fn a_message_that_breaks_the_schema_is_a_dead_letter_with_on_bad_record_dead_letter_and_the_rest_lands(
) -> Result<()> {
    require_cluster()?;
    let rt = runtime();
    let name = unique_name("nats_dead");
    let (js, prefix) = stream_with_a_bad_message(&rt, &name)?;
    let table = ReplicatedTable::create("default", &name, COLUMNS, "id", &NODES)?;
    let dir = TestDir::new()?;
    let spec = write_spec(dir.path(), &name, &prefix, &name);
    let yaml = std::fs::read_to_string(&spec)?.replace(
        "    format: json\n",
        "    format: json\n    on_bad_record: dead_letter\n",
    );
    std::fs::write(&spec, yaml)?;
    let state = dir.path().join("state");
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w.log"))?;
    let qualified = table.qualified();
    wait_until(Duration::from_secs(60), || {
        Ok(landed_on_both_shards(&qualified)?.1 >= 2)
    })
    .with_context(|| format!("ids 1 and 3 did not land\n{}", worker.log_tail()))?;
    // A stop lets `status` read the store itself.
    worker.kill_9()?;
    assert_eq!(landed_on_both_shards(&qualified)?, (2, 2));
    let summary = status_json(worker_bin!(), &state)?.context("status --json")?;
    let text = summary.to_string();
    assert!(
        text.contains("0/2") && text.contains("expected uint64, got a string"),
        "the dead letter names its position and reason: {text}"
    );
    let _ = rt.block_on(js.delete_stream(&name));
    Ok(())
}

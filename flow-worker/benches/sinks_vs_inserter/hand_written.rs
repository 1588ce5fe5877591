//! The baselines: what a user writes by hand, each run as a child of the runner like
//! flow-worker. The generator loop (`inserter`) writes the generator's rows; the broker consumers
//! (`jetstream_consumer`, `kafka_consumer`) read the rows the orchestrator published and decode
//! them with serde_json into a struct with a borrowed payload. All insert with
//! `clickhouse::Inserter`, lz4, 100k rows per INSERT, one task per partition, on the default
//! allocator with no tuning.

use std::time::Duration;

use anyhow::{Context, Result};
use flow_core::sources::generator::{fill_payload, row_values};
use futures_util::StreamExt;

use super::broker_rows::BrokerRow;
use super::{env_parse, Server, BATCH_ROWS, PARTITIONS, PAYLOAD_BYTES};

#[derive(clickhouse::Row, serde::Serialize)]
struct GeneratorRow<'a> {
    id: u64,
    partition: u32,
    offset: u64,
    user_id: u64,
    ts: u32,
    payload: &'a [u8],
}

/// The `inserter` role: 4 tasks, each writing the generator's rows of its partition (with
/// `FLOW_BENCH_INSERTER_SHARDED=true` to both shards, one `Inserter` per shard).
pub fn inserter_loop() -> Result<()> {
    let (rows, table) = rows_and_table()?;
    let sharded = env_parse::<bool>("FLOW_BENCH_INSERTER_SHARDED")?.unwrap_or(false);
    // Sharded: one inserter per shard in every task, rows routed as the sharded sink routes them
    // (rendezvous hashing of `user_id` over shards `a`, `b`).
    let nodes: Vec<&str> = Server::get()?
        .shards(sharded)
        .iter()
        .map(|shard| shard[0])
        .collect();
    let router = flow_clickhouse::testing::RendezvousRouter::new(&["a".to_owned(), "b".to_owned()]);
    let per_partition = rows / u64::from(PARTITIONS);
    run_partitions(&tokio::runtime::Runtime::new()?, |partition| {
        let mut inserters: Vec<_> = nodes
            .iter()
            .map(|node| inserter::<GeneratorRow<'static>>(node, &table))
            .collect();
        let router = router.clone();
        async move {
            let mut payload = Vec::with_capacity(PAYLOAD_BYTES);
            let mut key = Vec::with_capacity(9);
            for offset in 0..per_partition {
                let (id, user_id, ts) = row_values(partition, offset, PARTITIONS);
                fill_payload(id, PAYLOAD_BYTES, &mut payload);
                let row = GeneratorRow {
                    id,
                    partition,
                    offset,
                    user_id,
                    ts: u32::try_from(ts)?,
                    payload: &payload,
                };
                let shard = if inserters.len() > 1 {
                    key.clear();
                    key.push(2u8);
                    key.extend_from_slice(&user_id.to_le_bytes());
                    router.route(&key)
                } else {
                    0
                };
                inserters[shard].write(&row).await?;
                inserters[shard].commit().await?;
            }
            for inserter in inserters {
                inserter.end().await?;
            }
            anyhow::Ok(())
        }
    })
}

/// Runs `task` for each partition on its own tokio task of `runtime` (multi-threaded, as a
/// user's `#[tokio::main]`) and waits for all of them; the first error wins.
fn run_partitions<F>(runtime: &tokio::runtime::Runtime, task: impl Fn(u32) -> F) -> Result<()>
where
    F: std::future::Future<Output = Result<()>> + Send + 'static,
{
    runtime.block_on(async {
        let tasks: Vec<_> = (0..PARTITIONS)
            .map(|partition| tokio::spawn(task(partition)))
            .collect();
        for task in tasks {
            task.await??;
        }
        Ok(())
    })
}

/// What every child is told: how many rows to write (a quarter per partition) and where.
fn rows_and_table() -> Result<(u64, String)> {
    let rows: u64 = env_parse("FLOW_BENCH_INSERTER_ROWS")?.context("FLOW_BENCH_INSERTER_ROWS")?;
    let table = std::env::var("FLOW_BENCH_INSERTER_TABLE").context("FLOW_BENCH_INSERTER_TABLE")?;
    Ok((rows, table))
}

/// The `Inserter` every baseline uses: lz4, 100k rows per INSERT (`with_validation(false)`:
/// needed for the cluster's 18.16).
fn inserter<T: clickhouse::Row>(node: &str, table: &str) -> clickhouse::inserter::Inserter<T> {
    clickhouse::Client::default()
        .with_url(format!("http://{node}"))
        .with_validation(false)
        .with_compression(clickhouse::Compression::Lz4)
        .inserter::<T>(table)
        .with_max_rows(BATCH_ROWS)
}

/// Messages one JetStream pull asks for: flow's default `max_messages_per_pull`.
pub const JETSTREAM_PULL: usize = 10_000;

/// The `jetstream_consumer` role: 4 tasks, one pull consumer per subject of the stream
/// `FLOW_BENCH_STREAM`, with `AckPolicy::None` (as flow's source) or, with `FLOW_BENCH_ACK=all`,
/// `AckPolicy::All` acknowledging the last message of each pull. Each task reads its quarter of
/// the rows and ends.
pub fn jetstream_consumer() -> Result<()> {
    use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};

    let (rows, table) = rows_and_table()?;
    let first = Server::get()?.first();
    let stream = std::env::var("FLOW_BENCH_STREAM").context("FLOW_BENCH_STREAM")?;
    let ack_all = std::env::var("FLOW_BENCH_ACK").as_deref() == Ok("all");
    let per_partition = rows / u64::from(PARTITIONS);
    // One connection for the four tasks, as flow's source shares one.
    let runtime = tokio::runtime::Runtime::new()?;
    // The JetStream context spawns onto the runtime it is made in.
    let js = runtime.block_on(super::jetstream::connect())?;
    run_partitions(&runtime, |partition| {
        let (js, stream, table) = (js.clone(), stream.clone(), table.clone());
        async move {
            let subject = format!("{stream}.{partition}");
            let consumer = js
                .create_consumer_on_stream(
                    pull::Config {
                        filter_subject: subject.clone(),
                        deliver_policy: DeliverPolicy::All,
                        ack_policy: if ack_all {
                            AckPolicy::All
                        } else {
                            AckPolicy::None
                        },
                        // The default (1,000) would hold a pull of 10,000 unacknowledged
                        // messages back until it expires.
                        max_ack_pending: JETSTREAM_PULL as i64,
                        ..Default::default()
                    },
                    stream.as_str(),
                )
                .await
                .with_context(|| format!("a pull consumer of {subject}"))?;
            let mut inserter = inserter::<BrokerRow<'static>>(first, &table);
            let mut read = 0u64;
            while read < per_partition {
                let want = (per_partition - read).min(JETSTREAM_PULL as u64);
                let mut batch = consumer
                    .batch()
                    .max_messages(want as usize)
                    .expires(Duration::from_secs(5))
                    .messages()
                    .await
                    .with_context(|| format!("a pull of {subject}"))?;
                let mut last = None;
                while let Some(message) = batch.next().await {
                    let message =
                        message.map_err(|err| anyhow::anyhow!("a pull of {subject}: {err}"))?;
                    let row: BrokerRow<'_> = serde_json::from_slice(&message.payload)
                        .with_context(|| format!("a message of {subject}"))?;
                    inserter.write(&row).await?;
                    inserter.commit().await?;
                    read += 1;
                    last = Some(message);
                }
                if let (true, Some(message)) = (ack_all, last) {
                    message.ack().await.map_err(|err| {
                        anyhow::anyhow!("acknowledging a pull of {subject}: {err}")
                    })?;
                }
            }
            inserter.end().await?;
            anyhow::Ok(())
        }
    })
}

/// The `kafka_consumer` role: 4 tasks, each an rdkafka `StreamConsumer` with one partition of
/// `FLOW_BENCH_KAFKA_TOPIC` assigned from its beginning (as flow's source assigns it), reading its
/// quarter of the rows and ending.
pub fn kafka_consumer() -> Result<()> {
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

    let (rows, table) = rows_and_table()?;
    let first = Server::get()?.first();
    let brokers = std::env::var("FLOW_BENCH_KAFKA_BROKERS").context("FLOW_BENCH_KAFKA_BROKERS")?;
    let topic = std::env::var("FLOW_BENCH_KAFKA_TOPIC").context("FLOW_BENCH_KAFKA_TOPIC")?;
    let per_partition = rows / u64::from(PARTITIONS);
    run_partitions(&tokio::runtime::Runtime::new()?, |partition| {
        let (brokers, topic, table) = (brokers.clone(), topic.clone(), table.clone());
        async move {
            let consumer: StreamConsumer = ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                // librdkafka wants a group id even for partitions assigned by hand.
                .set("group.id", "flow_bench_consumer")
                .set("enable.auto.commit", "false")
                .create()
                .with_context(|| format!("a consumer of {brokers}"))?;
            let mut assignment = TopicPartitionList::new();
            assignment.add_partition_offset(&topic, partition as i32, Offset::Beginning)?;
            consumer.assign(&assignment)?;
            let mut inserter = inserter::<BrokerRow<'static>>(first, &table);
            for _ in 0..per_partition {
                let message = consumer
                    .recv()
                    .await
                    .with_context(|| format!("reading {topic}/{partition}"))?;
                let payload = message
                    .payload()
                    .with_context(|| format!("{topic}/{partition}: a message without a payload"))?;
                let row: BrokerRow<'_> = serde_json::from_slice(payload)
                    .with_context(|| format!("a message of {topic}/{partition}"))?;
                inserter.write(&row).await?;
                inserter.commit().await?;
            }
            inserter.end().await?;
            anyhow::Ok(())
        }
    })
}

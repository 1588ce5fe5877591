//! The Kafka cases' broker and input. By default librdkafka's mock cluster, which lives in the
//! process that creates it: the orchestrator starts it, keeps it for the whole invocation and
//! hands its bootstrap address to every child. `FLOW_BENCH_KAFKA=host:port` names a real
//! Kafka-protocol broker instead. The generator's rows are produced once per row count.

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, BaseRecord, DefaultProducerContext, Producer};

use super::broker_rows::{json_row, name as topic_name};
use super::PARTITIONS;

/// The variable naming a real broker (`host:port`).
pub const EXTERNAL: &str = "FLOW_BENCH_KAFKA";

/// What a partition of the mock cluster keeps: it drops its oldest message sets beyond 5 MiB
/// (librdkafka's rdkafka_mock.c, `mpart->max_size`, not configurable).
const MOCK_PARTITION_BYTES: u64 = 5 << 20;

/// A record's bytes in a partition's log beyond its value (record and batch headers), for the
/// estimate of what fits in the mock cluster.
const RECORD_OVERHEAD: u64 = 16;

const TIMEOUT: Duration = Duration::from_secs(30);

pub enum Broker {
    Mock(MockCluster<'static, DefaultProducerContext>),
    External(String),
}

impl Broker {
    pub fn start() -> Result<Broker> {
        match std::env::var(EXTERNAL) {
            Ok(address) if !address.trim().is_empty() => {
                Ok(Broker::External(address.trim().to_owned()))
            }
            _ => Ok(Broker::Mock(
                MockCluster::new(1).context("starting librdkafka's mock cluster")?,
            )),
        }
    }

    pub fn bootstrap(&self) -> String {
        match self {
            Broker::Mock(cluster) => cluster.bootstrap_servers(),
            Broker::External(address) => address.clone(),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Broker::Mock(cluster) => format!(
                "librdkafka's mock cluster at {} (set {EXTERNAL}=host:port for a real broker)",
                cluster.bootstrap_servers()
            ),
            Broker::External(address) => format!("the broker at {address} ({EXTERNAL})"),
        }
    }

    /// Why `rows` cannot be read whole from this broker, if they cannot: the mock cluster keeps
    /// only the last 5 MiB of each partition.
    pub fn too_small_for(&self, rows: u64) -> Option<String> {
        let Broker::Mock(_) = self else {
            return None;
        };
        let (mut payload, mut json) = (Vec::new(), String::new());
        json_row(
            PARTITIONS - 1,
            rows / u64::from(PARTITIONS),
            &mut payload,
            &mut json,
        );
        let per_row = json.len() as u64 + RECORD_OVERHEAD;
        let fits = MOCK_PARTITION_BYTES / per_row * u64::from(PARTITIONS);
        (rows > fits).then(|| {
            format!(
                "librdkafka's mock cluster keeps the last 5 MiB of a partition, about {fits} of these rows in all, not {rows}: \
                 run the Kafka cases with FLOW_BENCH_ROWS <= {fits}, or against a real broker with {EXTERNAL}=host:port"
            )
        })
    }

    /// Produces the generator's rows for `rows` to the topic [`topic_name`] (partition `p`'s
    /// offsets to Kafka partition `p`, as JSON), unless it already holds exactly them, and
    /// checks that every partition holds its rows from offset 0.
    pub fn produce_generator_rows(&self, rows: u64) -> Result<()> {
        let topic = topic_name(rows);
        let bootstrap = self.bootstrap();
        let per_partition = rows / u64::from(PARTITIONS);
        let held = self.create_topic(&topic)?;
        if held == Some(per_partition) {
            println!("kafka: topic {topic} already holds {rows} rows");
            return Ok(());
        }
        if let Some(held) = held.filter(|&held| held != 0) {
            bail!(
                "kafka: topic {topic} on {bootstrap} exists with {held} messages in a partition, not 0 or {per_partition}: \
                 delete it (kafka-topics.sh --delete --topic {topic}) and run again"
            );
        }
        let started = std::time::Instant::now();
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("linger.ms", "5")
            .create()
            .with_context(|| format!("a producer to {bootstrap}"))?;
        let (mut payload, mut json) = (Vec::new(), String::new());
        for offset in 0..per_partition {
            for partition in 0..PARTITIONS {
                json_row(partition, offset, &mut payload, &mut json);
                let mut record = BaseRecord::<(), _>::to(&topic)
                    .partition(partition as i32)
                    .payload(json.as_str());
                loop {
                    match producer.send(record) {
                        Ok(()) => break,
                        Err((
                            rdkafka::error::KafkaError::MessageProduction(
                                rdkafka::types::RDKafkaErrorCode::QueueFull,
                            ),
                            back,
                        )) => {
                            // A full local queue: let deliveries drain it, then send again.
                            producer.poll(Duration::from_millis(10));
                            record = back;
                        }
                        Err((err, _)) => {
                            bail!("kafka: producing to {topic}/{partition} on {bootstrap}: {err}")
                        }
                    }
                }
            }
            producer.poll(Duration::ZERO);
        }
        producer
            .flush(TIMEOUT)
            .with_context(|| format!("kafka: flushing the producer to {bootstrap}"))?;
        let held = self.held(&topic)?;
        ensure!(
            held.iter().all(|&(low, high)| low == 0 && high == per_partition as i64),
            "kafka: topic {topic} on {bootstrap} holds offsets {held:?} per partition after producing, not 0..{per_partition}: \
             the broker dropped or lost messages"
        );
        println!(
            "kafka: produced {rows} rows to topic {topic} in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Creates `topic` with [`PARTITIONS`] partitions unless it exists; `Some(messages in
    /// partition 0)` if it existed.
    fn create_topic(&self, topic: &str) -> Result<Option<u64>> {
        let held = match self.held(topic) {
            Ok(held) => held,
            Err(unread) => return self.create_missing_topic(topic, &unread).map(|()| None),
        };
        ensure!(
            held.len() == PARTITIONS as usize,
            "kafka: topic {topic} on {} has {} partitions, not {PARTITIONS}: delete it and run again",
            self.bootstrap(),
            held.len()
        );
        Ok(held.first().map(|&(low, high)| (high - low) as u64))
    }

    /// Creates `topic`, which could not be read (`unread`).
    fn create_missing_topic(&self, topic: &str, unread: &anyhow::Error) -> Result<()> {
        match self {
            Broker::Mock(cluster) => cluster
                .create_topic(topic, PARTITIONS as i32, 1)
                .with_context(|| format!("kafka: creating {topic} in the mock cluster")),
            Broker::External(address) => {
                let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
                    .set("bootstrap.servers", address)
                    .create()
                    .with_context(|| format!("an admin client of {address}"))?;
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                let created = runtime.block_on(admin.create_topics(
                    &[NewTopic::new(
                        topic,
                        PARTITIONS as i32,
                        TopicReplication::Fixed(1),
                    )],
                    &AdminOptions::new().operation_timeout(Some(TIMEOUT)),
                ));
                // Some Kafka-protocol brokers do not answer librdkafka's CreateTopics (tansu 0.6
                // lets it time out): then the topic is the user's to create.
                let why = match created.map(|results| results.into_iter().next()) {
                    Ok(Some(Ok(_))) => return Ok(()),
                    Ok(Some(Err((_, code)))) => code.to_string(),
                    Ok(None) => "no answer".to_owned(),
                    Err(err) => err.to_string(),
                };
                bail!(
                    "kafka: topic {topic} could not be read ({unread:#}), and creating it with {PARTITIONS} partitions on {address} failed ({why}): \
                     create it yourself (kafka-topics.sh --create --topic {topic} --partitions {PARTITIONS}, \
                     or tansu topic create {topic} --partitions {PARTITIONS} --broker tcp://{address}) and run again"
                )
            }
        }
    }

    /// `(low, high)` watermarks of each partition of `topic`, in partition order.
    fn held(&self, topic: &str) -> Result<Vec<(i64, i64)>> {
        let bootstrap = self.bootstrap();
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .create()
            .with_context(|| format!("a client of {bootstrap}"))?;
        let metadata = consumer
            .fetch_metadata(Some(topic), TIMEOUT)
            .with_context(|| format!("kafka: the metadata of {topic} on {bootstrap}"))?;
        let partitions = metadata
            .topics()
            .first()
            .filter(|t| t.error().is_none())
            .map_or(0, |t| t.partitions().len());
        ensure!(partitions > 0, "kafka: no topic {topic} on {bootstrap}");
        (0..partitions as i32)
            .map(|partition| {
                consumer
                    .fetch_watermarks(topic, partition, TIMEOUT)
                    .with_context(|| format!("kafka: the watermarks of {topic}/{partition}"))
            })
            .collect()
    }
}

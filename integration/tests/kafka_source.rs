//! The `kafka` source into the sharded exactly-once sink, against librdkafka's own mock cluster
//! (no Kafka broker package is available here): this test process starts the mock cluster and
//! produces to it, and the worker processes reach it over TCP like any broker. With
//! `FLOW_IT_KAFKA_BROKERS=host:port` the same tests run against that broker instead (a real
//! Kafka-protocol broker such as tansu; docs/performance.md says how it was run). The topic has one
//! Kafka partition per flow partition; messages are produced before and while the worker runs,
//! and the worker is killed with `kill -9` twice. Every message must end in ClickHouse exactly
//! once, on the shard its `user_id` routes to, with `status` showing lag 0. The tests fail, not
//! skip, without the ClickHouse cluster.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use flow_integration::worker::*;
use flow_integration::*;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, BaseRecord, DefaultProducerContext, Producer};

const PARTITIONS: u64 = 4;
const USERS: u64 = 1_000;
const COLUMNS: &str = "id UInt64, user_id UInt64, payload String";

fn message_json(id: u64) -> String {
    format!(
        r#"{{"id": {id}, "user_id": {}, "payload": "message {id}"}}"#,
        id % USERS
    )
}

/// Where the test's topics live: librdkafka's mock cluster (started by this process), or the
/// Kafka-protocol broker named by `FLOW_IT_KAFKA_BROKERS` (`host:port`, e.g. a local tansu), to
/// run the same test against a real broker.
enum Brokers {
    Mock(MockCluster<'static, DefaultProducerContext>),
    External(String),
}

impl Brokers {
    fn bootstrap_servers(&self) -> String {
        match self {
            Brokers::Mock(cluster) => cluster.bootstrap_servers(),
            Brokers::External(servers) => servers.clone(),
        }
    }
}

/// Brokers with `topic` of [`PARTITIONS`] partitions, and a producer to them.
fn brokers_with_topic(topic: &str) -> Result<(Brokers, BaseProducer)> {
    let brokers = match std::env::var("FLOW_IT_KAFKA_BROKERS") {
        Ok(servers) => {
            create_topic(&servers, topic)?;
            Brokers::External(servers)
        }
        Err(_) => {
            let cluster = MockCluster::new(1).context("starting librdkafka's mock cluster")?;
            cluster.create_topic(topic, PARTITIONS as i32, 1)?;
            Brokers::Mock(cluster)
        }
    };
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers.bootstrap_servers())
        .create()
        .context("creating the producer")?;
    Ok((brokers, producer))
}

/// Creates `topic` with [`PARTITIONS`] partitions on the broker at `servers`.
fn create_topic(servers: &str, topic: &str) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", servers)
        .create()
        .context("creating the admin client")?;
    let new = NewTopic::new(topic, PARTITIONS as i32, TopicReplication::Fixed(1));
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(admin.create_topics([&new], &options))
        .with_context(|| format!("creating topic {topic} on {servers}"))?;
    for result in results {
        result.map_err(|(name, code)| anyhow::anyhow!("creating topic {name}: {code}"))?;
    }
    Ok(())
}

/// Produces `payload(id)` for every id of `ids`, id `k` to partition `k % PARTITIONS` with key
/// `k`, and waits until every one is acknowledged.
fn produce(
    producer: &BaseProducer,
    topic: &str,
    ids: impl Iterator<Item = u64>,
    payload: impl Fn(u64) -> String,
) -> Result<()> {
    for id in ids {
        let (key, value) = (id.to_string(), payload(id));
        let mut record = BaseRecord::to(topic)
            .partition((id % PARTITIONS) as i32)
            .key(&key)
            .payload(&value);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((err, back)) => {
                    // A full local queue: let deliveries drain it, then send again.
                    if !matches!(
                        err,
                        rdkafka::error::KafkaError::MessageProduction(
                            rdkafka::types::RDKafkaErrorCode::QueueFull
                        )
                    ) {
                        bail!("producing id {id}: {err}");
                    }
                    producer.poll(Duration::from_millis(50));
                    record = back;
                }
            }
        }
        producer.poll(Duration::ZERO);
    }
    producer
        .flush(Duration::from_secs(30))
        .context("flushing the producer")
}

fn write_spec(dir: &Path, brokers: &str, topic: &str, table: &str, extra: &str) -> PathBuf {
    let hosts =
        |nodes: [Node; 2]| format!("['{}', '{}']", nodes[0].http_addr(), nodes[1].http_addr());
    let yaml = format!(
        "pipeline: kafka_it\npartitions: {PARTITIONS}\nepoch: {{max_messages: 5000, max_duration_ms: 300}}\n\
         source:\n  class: kafka\n  parameters:\n    brokers: ['{brokers}']\n    topic: {topic}\n    format: json\n{extra}    schema: [{{name: id, type: uint64}}, {{name: user_id, type: uint64}}, {{name: payload, type: string}}]\n\
         sinks:\n  - name: out\n    sink_class_name: ShardedClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{shard_hosts: {{a: {}, b: {}}}, database: default, table: {table}, sharding_key_columns: [user_id]}}\n    dynamic_parameters: {{max_rows_per_batch: 5000, retry_backoff: 100ms, max_retry_backoff: 2s}}\n",
        hosts(SHARD_A),
        hosts(SHARD_B),
    );
    let spec = dir.join("spec.yaml");
    std::fs::write(&spec, yaml).unwrap_or_else(|e| panic!("{e}"));
    spec
}

#[test]
fn kafka_messages_land_exactly_once_across_worker_kills() -> Result<()> {
    const MESSAGES: u64 = 40_000;
    wait_for_cluster(Duration::from_secs(120))?;
    let name = unique_name("kafka_it");
    let (cluster, producer) = brokers_with_topic(&name)?;
    let table = ReplicatedTable::create("default", &name, COLUMNS, "id", &NODES)?;
    let qualified = table.qualified();
    let dir = TestDir::new()?;
    let spec = write_spec(dir.path(), &cluster.bootstrap_servers(), &name, &name, "");
    let state = dir.path().join("state");

    produce(&producer, &name, 0..MESSAGES / 2, message_json)?;
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w0.log"))?;
    let mut runs = 1;
    for (round, ids) in [
        (MESSAGES / 2)..(3 * MESSAGES / 4),
        (3 * MESSAGES / 4)..MESSAGES,
    ]
    .into_iter()
    .enumerate()
    {
        produce(&producer, &name, ids, message_json)?;
        std::thread::sleep(Duration::from_millis(1_500));
        if worker.exited()?.is_some() {
            bail!("the worker exited on its own\n{}", worker.log_tail());
        }
        worker.kill_9()?;
        worker = Worker::spawn(
            worker_bin!(),
            &spec,
            &state,
            dir.path().join(format!("w{}.log", round + 1)),
        )?;
        runs += 1;
    }
    wait_until(Duration::from_secs(120), || {
        Ok(landed_on_both_shards(&qualified)?.1 >= MESSAGES)
    })
    .with_context(|| format!("not every message landed\n{}", worker.log_tail()))?;
    let mut lags = Vec::new();
    wait_until(Duration::from_secs(20), || {
        lags = partition_lags(worker_bin!(), &state, "kafka_it")?;
        Ok(lags.len() == PARTITIONS as usize && lags.iter().all(|&lag| lag == Some(0)))
    })
    .with_context(|| {
        format!(
            "status shows lags {lags:?}, not 0 for each partition\n{}",
            worker.log_tail()
        )
    })?;
    worker.kill_9()?;

    for node in NODES {
        sync_when_writable(node, "default", &name, Duration::from_secs(60))?;
    }
    assert_eq!(
        landed_on_both_shards(&qualified)?,
        (MESSAGES, MESSAGES),
        "every message once over both shards"
    );
    check_routing(
        &[("a", SHARD_A.to_vec()), ("b", SHARD_B.to_vec())],
        &qualified,
        USERS,
    )?;
    println!("{MESSAGES} messages, {runs} worker runs: all once");
    Ok(())
}

#[test]
fn a_kafka_message_that_breaks_the_schema_stops_naming_its_position_or_is_a_dead_letter(
) -> Result<()> {
    wait_for_cluster(Duration::from_secs(120))?;
    let name = unique_name("kafka_bad");
    let (cluster, producer) = brokers_with_topic(&name)?;
    // Partition 0: offsets 0, 1 (id is a string), 2.
    let payload = |id: u64| {
        if id == 4 {
            r#"{"id": "x"}"#.to_owned()
        } else {
            message_json(id)
        }
    };
    produce(&producer, &name, [0, 4, 8].into_iter(), payload)?;
    let table = ReplicatedTable::create("default", &name, COLUMNS, "id", &NODES)?;
    let brokers = cluster.bootstrap_servers();

    let dir = TestDir::new()?;
    let spec = write_spec(dir.path(), &brokers, &name, &name, "");
    let log = dir.path().join("stop.log");
    let mut worker = Worker::spawn(worker_bin!(), &spec, &dir.path().join("stop"), log.clone())?;
    let expected = "partition 0: source: 0/1: column `id` (uint64): expected uint64, got a string";
    wait_until(Duration::from_secs(30), || {
        Ok(std::fs::read_to_string(&log)?.contains(expected))
    })
    .with_context(|| format!("no `{expected}` in the log\n{}", worker.log_tail()))?;
    worker.kill_9()?;
    assert_eq!(
        landed_on_both_shards(&table.qualified())?,
        (0, 0),
        "the failed epoch committed nothing"
    );

    let spec = write_spec(
        dir.path(),
        &brokers,
        &name,
        &name,
        "    on_bad_record: dead_letter\n",
    );
    let state = dir.path().join("dead");
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("dead.log"))?;
    wait_until(Duration::from_secs(60), || {
        Ok(landed_on_both_shards(&table.qualified())?.1 >= 2)
    })
    .with_context(|| format!("ids 0 and 8 did not land\n{}", worker.log_tail()))?;
    worker.kill_9()?;
    let dead = export_dead_letters(worker_bin!(), &state)?;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["message_id"], "0-1", "{dead:?}");
    assert_eq!(landed_on_both_shards(&table.qualified())?, (2, 2));
    Ok(())
}

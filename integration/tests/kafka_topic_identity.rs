//! The `kafka` source and a topic deleted and created again (issue 24 item 1), against
//! librdkafka's mock cluster, into a `DebugSink` file (no ClickHouse needed). The mock cluster
//! cannot delete a topic, so the re-created topic is the same topic name on a second mock
//! cluster the worker is then pointed at: to the worker that is exactly a topic created again
//! (offsets from 0, other messages under them).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result};
use flow_integration::worker::*;
use flow_integration::*;
use rdkafka::config::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, BaseRecord, DefaultProducerContext, Producer};

type Mock = MockCluster<'static, DefaultProducerContext>;

/// A mock cluster with `topic` of one partition, `ids` produced to it.
fn cluster_with(topic: &str, ids: std::ops::Range<u64>) -> Result<Mock> {
    let cluster = MockCluster::new(1).context("starting librdkafka's mock cluster")?;
    cluster.create_topic(topic, 1, 1)?;
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", cluster.bootstrap_servers())
        .create()
        .context("creating the producer")?;
    for id in ids {
        let payload = format!(r#"{{"id": {id}, "payload": "message {id}"}}"#);
        producer
            .send(
                BaseRecord::<(), String>::to(topic)
                    .partition(0)
                    .payload(&payload),
            )
            .map_err(|(err, _)| err)
            .with_context(|| format!("producing id {id}"))?;
        producer.poll(Duration::ZERO);
    }
    producer
        .flush(Duration::from_secs(30))
        .context("flushing the producer")?;
    Ok(cluster)
}

fn write_spec(dir: &Path, file: &str, brokers: &str, topic: &str, out: &Path) -> PathBuf {
    let yaml = format!(
        "pipeline: kafka_identity\npartitions: 1\nepoch: {{max_messages: 1000, max_duration_ms: 200}}\n\
         source:\n  class: kafka\n  parameters:\n    brokers: ['{brokers}']\n    topic: {topic}\n    format: json\n    schema: [{{name: id, type: uint64}}, {{name: payload, type: string}}]\n\
         sinks:\n  - name: out\n    sink_class_name: DebugSink\n    input_stream_ids: [rows]\n    parameters: {{path: '{}'}}\n",
        out.display()
    );
    let spec = dir.join(file);
    std::fs::write(&spec, yaml).unwrap_or_else(|e| panic!("{e}"));
    spec
}

/// The ids in a `DebugSink` file, and how many lines it has.
fn ids_in(out: &Path) -> Result<(BTreeSet<u64>, usize)> {
    let text = match std::fs::read_to_string(out) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(err) => return Err(err.into()),
    };
    let mut ids = BTreeSet::new();
    for line in text.lines() {
        let value: serde_json::Value = serde_json::from_str(line)?;
        ids.insert(
            value
                .pointer("/row/id")
                .and_then(serde_json::Value::as_u64)
                .with_context(|| format!("no row.id in {line}"))?,
        );
    }
    Ok((ids, text.lines().count()))
}

#[test]
fn a_topic_created_again_stops_the_partition_and_skips_nothing() -> Result<()> {
    let topic = unique_name("kafka_again");
    let dir = TestDir::new()?;
    let out = dir.path().join("out.jsonl");
    let state = dir.path().join("state");

    let old = cluster_with(&topic, 0..100)?;
    let spec = write_spec(
        dir.path(),
        "spec.yaml",
        &old.bootstrap_servers(),
        &topic,
        &out,
    );
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w0.log"))?;
    let old_ids: BTreeSet<u64> = (0..100).collect();
    wait_until(Duration::from_secs(60), || Ok(ids_in(&out)?.0 == old_ids))
        .with_context(|| format!("ids 0..100 never landed\n{}", worker.log_tail()))?;
    worker.signal("TERM")?;
    assert_eq!(worker.wait_exit(Duration::from_secs(30))?, Some(0));
    drop(old);

    // The topic again, with more messages (150) than the committed position (offset 100).
    std::thread::sleep(Duration::from_millis(50));
    let new = cluster_with(&topic, 1000..1150)?;
    let spec = write_spec(
        dir.path(),
        "spec.yaml",
        &new.bootstrap_servers(),
        &topic,
        &out,
    );
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w1.log"))?;
    let code = worker.wait_exit(Duration::from_secs(60))?;
    let log = std::fs::read_to_string(worker.log())?;
    assert_eq!(code, Some(1), "the worker fails\n{log}");
    for expected in [
        format!("partition 0: source: topic `{topic}` was deleted and created again: flow partition 0 committed offset 100 of partition 0, but its message at offset 99 was stored at "),
        " when flow read it, and the one there now at ".to_owned(),
        "; its offsets name other messages, and reading on at 100 would skip the new topic's first 100 message(s). To read the new topic from its beginning, start the pipeline with a new state directory".to_owned(),
    ] {
        assert!(log.contains(&expected), "no `{expected}` in the log\n{log}");
    }
    assert_eq!(
        ids_in(&out)?,
        (old_ids, 100),
        "nothing of the new topic was read under the old position"
    );

    // The remedy: a new state directory reads every message of the new topic once.
    let fresh_out = dir.path().join("fresh.jsonl");
    let spec = write_spec(
        dir.path(),
        "fresh.yaml",
        &new.bootstrap_servers(),
        &topic,
        &fresh_out,
    );
    let mut fresh = Worker::spawn(
        worker_bin!(),
        &spec,
        &dir.path().join("fresh-state"),
        dir.path().join("fresh.log"),
    )?;
    let new_ids: BTreeSet<u64> = (1000..1150).collect();
    wait_until(Duration::from_secs(60), || {
        Ok(ids_in(&fresh_out)?.0 == new_ids)
    })
    .with_context(|| format!("ids 1000..1150 never landed\n{}", fresh.log_tail()))?;
    fresh.signal("TERM")?;
    assert_eq!(fresh.wait_exit(Duration::from_secs(30))?, Some(0));
    assert_eq!(ids_in(&fresh_out)?, (new_ids, 150));
    Ok(())
}

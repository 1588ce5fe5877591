//! The local cluster's NATS node (127.0.0.1:14222, JetStream on): streams for the tests.

use anyhow::{Context as _, Result};
use async_nats::jetstream::{self, stream};

/// The NATS node `scripts/cluster.sh up` starts.
pub const NATS_ADDR: &str = "127.0.0.1:14222";

/// A new stream `name` taking subjects `<name>.p.*`, and the JetStream context that made it.
pub async fn new_stream(name: &str) -> Result<jetstream::Context> {
    let client = async_nats::ConnectOptions::new()
        .connect(format!("nats://{NATS_ADDR}"))
        .await
        .with_context(|| format!("connecting to {NATS_ADDR} (scripts/cluster.sh up starts it)"))?;
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.p.*")],
        ..Default::default()
    })
    .await
    .with_context(|| format!("creating JetStream stream {name}"))?;
    Ok(js)
}

/// Publishes messages `ids` as `{"id", "user_id", "payload"}` JSON to subjects
/// `<prefix>.<id % partitions>` (`user_id` = `id % users`), and waits for every acknowledgement.
pub async fn publish_id_rows(
    js: &jetstream::Context,
    prefix: &str,
    ids: std::ops::Range<u64>,
    partitions: u64,
    users: u64,
) -> Result<()> {
    let mut acks = Vec::with_capacity(ids.end.saturating_sub(ids.start) as usize);
    for id in ids {
        let body = format!(
            r#"{{"id": {id}, "user_id": {}, "payload": "message {id}"}}"#,
            id % users
        );
        let subject = format!("{prefix}.{}", id % partitions);
        acks.push(js.publish(subject, body.into()).await?);
    }
    for ack in acks {
        ack.await?;
    }
    Ok(())
}

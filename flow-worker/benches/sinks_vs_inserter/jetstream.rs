//! The JetStream cases' input: the generator's rows, published once per row count.

use anyhow::{Context, Result};
use async_nats::jetstream::{self, stream};

use super::broker_rows::{json_row, name as stream_name};
use super::{NATS_URL, PARTITIONS};

/// Publishes the rows the generator would produce for `rows` (partition `p`'s offsets to
/// subject `<stream>.<p>`, as JSON), unless the stream already holds exactly them.
pub fn publish_generator_rows(runtime: &tokio::runtime::Runtime, rows: u64) -> Result<()> {
    let name = stream_name(rows);
    runtime.block_on(async {
        let client = async_nats::connect(NATS_URL)
            .await
            .with_context(|| format!("connecting to {NATS_URL} (scripts/cluster.sh up)"))?;
        let js = jetstream::new(client);
        if let Ok(mut existing) = js.get_stream(&name).await {
            if existing.info().await?.state.messages == rows {
                println!("jetstream: stream {name} already holds {rows} rows");
                return Ok(());
            }
            js.delete_stream(&name).await?;
        }
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.*")],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await?;
        let started = std::time::Instant::now();
        let per_partition = rows / u64::from(PARTITIONS);
        let (mut payload, mut json) = (Vec::new(), String::new());
        let mut acks = Vec::new();
        for offset in 0..per_partition {
            for partition in 0..PARTITIONS {
                json_row(partition, offset, &mut payload, &mut json);
                acks.push(
                    js.publish(format!("{name}.{partition}"), json.clone().into())
                        .await?,
                );
                if acks.len() >= 4096 {
                    for ack in acks.drain(..) {
                        ack.await?;
                    }
                }
            }
        }
        for ack in acks {
            ack.await?;
        }
        println!(
            "jetstream: published {rows} rows to stream {name} in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        anyhow::Ok(())
    })
}

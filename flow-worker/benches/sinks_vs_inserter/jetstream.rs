//! The JetStream cases' input: the generator's rows, published once per row count.

use anyhow::{Context, Result};
use async_nats::jetstream::{self, stream};

use super::broker_rows::{json_row, json_row_of, name as stream_name};
use super::{NATS_URL, PARTITIONS};

/// A JetStream context on the local cluster's NATS node.
pub async fn connect() -> Result<jetstream::Context> {
    let client = async_nats::connect(NATS_URL)
        .await
        .with_context(|| format!("connecting to {NATS_URL} (scripts/cluster.sh up)"))?;
    Ok(jetstream::new(client))
}

/// How long a stream of gigabytes may take to go: its delete can outlast a request's timeout.
const STREAM_DELETE_BOUND: std::time::Duration = std::time::Duration::from_secs(120);

/// Deletes stream `name` if it exists, and returns once the server no longer knows it: a delete
/// answered late (a timeout) is asked again, so a fresh run never reads an earlier run's rows.
async fn delete_stream(js: &jetstream::Context, name: &str) -> Result<()> {
    let started = std::time::Instant::now();
    loop {
        match js.get_stream(name).await {
            Err(err)
                if matches!(err.kind(), jetstream::context::GetStreamErrorKind::JetStream(e)
                    if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                return Ok(());
            }
            Err(err) if started.elapsed() > STREAM_DELETE_BOUND => {
                return Err(err).with_context(|| format!("looking for stream {name}"));
            }
            _ if started.elapsed() > STREAM_DELETE_BOUND => {
                anyhow::bail!("stream {name} is still there {STREAM_DELETE_BOUND:?} after deleting it; delete it by hand (nats stream rm {name})")
            }
            _ => {}
        }
        if let Err(err) = js.delete_stream(name).await {
            println!("jetstream: deleting stream {name}: {err}; asking again");
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// Publishes the rows the generator would produce for `rows` (partition `p`'s offsets to
/// subject `<stream>.<p>`, as JSON), unless the stream already holds exactly them.
pub fn publish_generator_rows(runtime: &tokio::runtime::Runtime, rows: u64) -> Result<()> {
    publish_rows(runtime, &stream_name(rows), rows, PARTITIONS)
}

/// Publishes the rows a generator of `partitions` partitions would produce for `rows` to stream
/// `name` (partition `p` to subject `<name>.<p>`), unless the stream already holds exactly them.
pub fn publish_rows(
    runtime: &tokio::runtime::Runtime,
    name: &str,
    rows: u64,
    partitions: u32,
) -> Result<()> {
    runtime.block_on(async {
        let js = connect().await?;
        if let Ok(mut existing) = js.get_stream(name).await {
            if existing.info().await?.state.messages == rows {
                println!("jetstream: stream {name} already holds {rows} rows");
                return Ok(());
            }
            delete_stream(&js, name).await?;
        }
        js.create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{name}.*")],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .with_context(|| format!("creating stream {name}"))?;
        let started = std::time::Instant::now();
        let (mut payload, mut json) = (Vec::new(), String::new());
        let mut acks = Vec::new();
        for offset in 0..rows / u64::from(partitions) {
            for partition in 0..partitions {
                json_row_of(partitions, partition, offset, &mut payload, &mut json);
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

/// The endless check's input: `rate` rows per second published for as long as it runs, partition
/// `n % 4` getting offset `n / 4`, to the stream of [`stream_name`]`(0)`, created anew and bounded
/// (oldest messages dropped) so that an endless run keeps the server's memory or disk flat too.
pub struct EndlessPublisher {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Result<u64>>,
}

/// Where the endless stream keeps its messages, and how they are published
/// (`FLOW_BENCH_ENDLESS_STORAGE`, `FLOW_BENCH_ENDLESS_PUBLISH`).
#[derive(Clone, Copy, Debug)]
pub struct EndlessInput {
    pub storage: stream::StorageType,
    pub publish: Publish,
}

/// How the endless publisher hands each message to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Publish {
    /// A JetStream publish whose acknowledgement is awaited.
    Acked,
    /// A core NATS publish the stream captures, counted from the stream's last sequence at the
    /// end (the server then sends no acknowledgement per message: half the messages it handles).
    Core,
}

impl EndlessInput {
    pub fn from_env() -> Result<EndlessInput> {
        let storage = match std::env::var("FLOW_BENCH_ENDLESS_STORAGE").as_deref() {
            Err(_) | Ok("file") => stream::StorageType::File,
            Ok("memory") => stream::StorageType::Memory,
            Ok(other) => {
                anyhow::bail!("FLOW_BENCH_ENDLESS_STORAGE={other}: expected file or memory")
            }
        };
        let publish = match std::env::var("FLOW_BENCH_ENDLESS_PUBLISH").as_deref() {
            Err(_) | Ok("acked") => Publish::Acked,
            Ok("core") => Publish::Core,
            Ok(other) => {
                anyhow::bail!("FLOW_BENCH_ENDLESS_PUBLISH={other}: expected acked or core")
            }
        };
        Ok(EndlessInput { storage, publish })
    }

    /// The most bytes the stream keeps: minutes of backlog at 100k rows/s of ~150 bytes on file;
    /// in memory, what the local cluster's NATS allows (256 MB) less a margin (~10 s of backlog).
    fn max_bytes(self) -> i64 {
        match self.storage {
            stream::StorageType::Memory => 200 << 20,
            stream::StorageType::File => 2 << 30,
        }
    }
}

impl EndlessPublisher {
    /// Creates the stream, then publishes from a thread of its own until [`Self::stop`].
    pub fn start(rate: u64, input: EndlessInput) -> Result<EndlessPublisher> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let name = stream_name(0);
        let js = runtime.block_on(async {
            let js = connect().await?;
            delete_stream(&js, &name).await?;
            js.create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.*")],
                storage: input.storage,
                max_bytes: input.max_bytes(),
                discard: stream::DiscardPolicy::Old,
                ..Default::default()
            })
            .await?;
            anyhow::Ok(js)
        })?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            runtime.block_on(publish_at_rate(js, name, rate, input.publish, stopped))
        });
        Ok(EndlessPublisher { stop, thread })
    }

    /// Stops publishing; the number of rows the stream took.
    pub fn stop(self) -> Result<u64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the publisher thread panicked"))?
    }
}

/// Publishes `rate` rows a second in 10 ms ticks until `stop`. Acked: waits for the acks every
/// 4096 and returns how many came; core: returns the stream's last sequence once the server has
/// taken everything sent (the stream is new, so that is how many messages it stored).
async fn publish_at_rate(
    js: jetstream::Context,
    name: String,
    rate: u64,
    publish: Publish,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Result<u64> {
    let client = js.client();
    let per_tick = rate.div_ceil(100).max(1);
    let mut ticks = tokio::time::interval(std::time::Duration::from_millis(10));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let (mut payload, mut json) = (Vec::new(), String::new());
    let (mut next, mut taken) = (0u64, 0u64);
    let mut acks = Vec::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        ticks.tick().await;
        for _ in 0..per_tick {
            let partition = (next % u64::from(PARTITIONS)) as u32;
            json_row(
                partition,
                next / u64::from(PARTITIONS),
                &mut payload,
                &mut json,
            );
            let subject = format!("{name}.{partition}");
            next += 1;
            if publish == Publish::Core {
                client.publish(subject, json.clone().into()).await?;
                continue;
            }
            acks.push(js.publish(subject, json.clone().into()).await?);
            if acks.len() >= 4096 {
                for ack in acks.drain(..) {
                    ack.await?;
                    taken += 1;
                }
            }
        }
    }
    for ack in acks {
        ack.await?;
        taken += 1;
    }
    if publish == Publish::Acked {
        return Ok(taken);
    }
    client.flush().await?;
    // A flushed publish is at the server, not necessarily in the stream yet: wait until the last
    // sequence stops moving.
    let mut stream = js.get_stream(&name).await?;
    let mut last = u64::MAX;
    loop {
        let seen = stream.info().await?.state.last_sequence;
        if seen == last {
            if seen < next {
                println!("jetstream: {next} rows sent, the stream took {seen}");
            }
            return Ok(seen);
        }
        last = seen;
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

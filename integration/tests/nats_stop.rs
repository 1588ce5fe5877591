//! A stop does not wait for a JetStream pull (issue 25 item 3), against the local cluster's NATS
//! node (127.0.0.1:14222), into a `DebugSink` file (no ClickHouse needed).
//!
//! The epoch's deadline is 10 s, so once the stream is read to its end the partition waits in a
//! pull that expires only then. SIGTERM must end the run at once: the pull is cut, what was read
//! before it is committed and delivered, and the worker exits 0 within 2 s (it used to wait for
//! the pull's expiry). The tests fail, not skip, without the cluster.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use async_nats::jetstream;
use flow_integration::worker::*;
use flow_integration::*;

const NATS_URL: &str = "nats://127.0.0.1:14222";
const MESSAGES: u64 = 3_000;

/// Publishes `MESSAGES` JSON messages to `<name>.p.0` of a new stream `name`.
async fn fill_stream(name: &str) -> Result<jetstream::Context> {
    let js = flow_integration::nats::new_stream(name).await?;
    let mut acks = Vec::new();
    for id in 0..MESSAGES {
        let payload = format!(r#"{{"id": {id}}}"#);
        acks.push(js.publish(format!("{name}.p.0"), payload.into()).await?);
    }
    for ack in acks {
        ack.await?;
    }
    Ok(js)
}

/// The lines of a `DebugSink` file and how many distinct `row.id`s they hold.
fn lines_and_ids(out: &Path) -> Result<(usize, usize)> {
    let text = match std::fs::read_to_string(out) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok((0, 0)),
        Err(err) => return Err(err.into()),
    };
    let mut ids = std::collections::BTreeSet::new();
    for line in text.lines() {
        let value: serde_json::Value = serde_json::from_str(line)?;
        ids.insert(value.pointer("/row/id").and_then(serde_json::Value::as_u64));
    }
    Ok((text.lines().count(), ids.len()))
}

#[test]
fn sigterm_cuts_a_waiting_pull_and_the_worker_exits_within_2_s_with_every_message_once(
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let name = unique_name("nats_stop");
    let js = rt.block_on(fill_stream(&name))?;
    let dir = TestDir::new()?;
    let out = dir.path().join("out.jsonl");
    let spec = dir.path().join("spec.yaml");
    std::fs::write(
        &spec,
        format!(
            "pipeline: nats_stop\npartitions: 1\nepoch: {{max_messages: 1000, max_duration_ms: 10000}}\n\
             source:\n  class: nats_jetstream\n  parameters:\n    servers: ['{NATS_URL}']\n    stream: {name}\n    subjects: ['{name}.p.0']\n    format: json\n    schema: [{{name: id, type: uint64}}]\n\
             sinks:\n  - name: out\n    sink_class_name: DebugSink\n    input_stream_ids: [rows]\n    parameters: {{path: '{}'}}\n",
            out.display()
        ),
    )?;
    let mut worker = Worker::spawn(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        dir.path().join("worker.log"),
    )?;
    let everything = (MESSAGES as usize, MESSAGES as usize);
    wait_until(Duration::from_secs(60), || {
        Ok(lines_and_ids(&out)? == everything)
    })
    .with_context(|| format!("not every message was delivered\n{}", worker.log_tail()))?;
    // Now the partition waits in a pull that expires at the 10 s deadline.
    std::thread::sleep(Duration::from_millis(500));
    let stopped_at = Instant::now();
    worker.signal("TERM")?;
    let code = worker.wait_exit(Duration::from_secs(30))?;
    let took = stopped_at.elapsed();
    let _ = rt.block_on(js.delete_stream(&name));
    assert_eq!(code, Some(0), "{}", worker.log_tail());
    assert!(
        took < Duration::from_secs(2),
        "SIGTERM took {took:?} to end the run\n{}",
        worker.log_tail()
    );
    assert_eq!(lines_and_ids(&out)?, everything);
    println!("SIGTERM to exit: {took:?}");
    Ok(())
}

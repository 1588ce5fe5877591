//! `nats_jetstream` and the stream behind it (issue 24 items 1 and 11), against the local
//! cluster's NATS node (127.0.0.1:14222), into a `DebugSink` file (no ClickHouse needed).
//!
//! - A stream deleted and created again with more messages than the committed position, while
//!   the worker is stopped and while it runs: the partition stops naming the stream, both creation
//!   times and the committed sequence, with the remedy; no message of the new stream is read under
//!   the old position, and a new state directory then reads every one of them.
//! - A missing stream and a subject outside the stream's subjects are refused at start: exit 1,
//!   nothing read, the message names the stream and its subjects (or the command to create it).
//! - A stream that disappears under a running worker: one WARN saying what to do, `status` and
//!   `/metrics` (`flow_source_unavailable`) show the partition's source unavailable while the
//!   worker waits for the stream.
//!
//! The tests fail, not skip, without the cluster.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result};
use async_nats::jetstream::{self, stream};
use flow_integration::worker::*;
use flow_integration::*;

const NATS_URL: &str = "nats://127.0.0.1:14222";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn jetstream_context() -> Result<jetstream::Context> {
    let client = async_nats::ConnectOptions::new()
        .connect(NATS_URL)
        .await
        .with_context(|| format!("connecting to {NATS_URL} (scripts/cluster.sh up starts it)"))?;
    Ok(jetstream::new(client))
}

/// Creates stream `name` taking `<name>.p.*`.
async fn create_stream(js: &jetstream::Context, name: &str) -> Result<()> {
    js.create_stream(stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.p.*")],
        ..Default::default()
    })
    .await
    .with_context(|| format!("creating stream {name}"))?;
    Ok(())
}

/// Publishes ids `range` to `subject`, each acknowledged.
async fn publish(
    js: &jetstream::Context,
    subject: &str,
    range: std::ops::Range<u64>,
) -> Result<()> {
    for id in range {
        let payload = format!(r#"{{"id": {id}, "payload": "message {id}"}}"#);
        js.publish(subject.to_owned(), payload.into())
            .await?
            .await?;
    }
    Ok(())
}

/// A one-partition spec reading `subject` of `stream` into the `DebugSink` file `out`.
fn write_spec(dir: &Path, file: &str, stream: &str, subject: &str, out: &Path) -> PathBuf {
    let yaml = format!(
        "pipeline: nats_identity\npartitions: 1\nepoch: {{max_messages: 1000, max_duration_ms: 200}}\n\
         source:\n  class: nats_jetstream\n  parameters:\n    servers: ['{NATS_URL}']\n    stream: {stream}\n    subjects: ['{subject}']\n    format: json\n    schema: [{{name: id, type: uint64}}, {{name: payload, type: string}}]\n\
         sinks:\n  - name: out\n    sink_class_name: DebugSink\n    input_stream_ids: [rows]\n    parameters: {{path: '{}'}}\n",
        out.display()
    );
    let spec = dir.join(file);
    std::fs::write(&spec, yaml).unwrap();
    spec
}

/// A free local TCP port for the metrics endpoint.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}

/// `GET /metrics` on `port`: the exposition's body.
fn scrape(port: u16) -> Result<String> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: flow\r\nConnection: close\r\n\r\n")?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default())
}

/// The ids in a `DebugSink` file, and how many lines it has.
fn ids_in(out: &Path) -> Result<(BTreeSet<u64>, usize)> {
    let text = match std::fs::read_to_string(out) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(err) => return Err(err.into()),
    };
    let mut ids = BTreeSet::new();
    let mut lines = 0;
    for line in text.lines() {
        let value: serde_json::Value = serde_json::from_str(line)?;
        let id = value
            .pointer("/row/id")
            .and_then(serde_json::Value::as_u64)
            .with_context(|| format!("no row.id in {line}"))?;
        ids.insert(id);
        lines += 1;
    }
    Ok((ids, lines))
}

fn wait_for_ids(worker: &Worker, out: &Path, expected: &BTreeSet<u64>) -> Result<()> {
    wait_until(Duration::from_secs(60), || Ok(&ids_in(out)?.0 == expected)).with_context(|| {
        format!(
            "{} never held exactly the expected ids\n{}",
            out.display(),
            worker.log_tail()
        )
    })
}

/// After the stream was created again: the restarted (or running) worker exits 1 naming the
/// stream, both creation times, the committed sequence and the remedy, and the file still holds
/// the old stream's ids 0..100 alone; then a new state directory reads ids 1000.. of the new
/// stream, every one.
fn assert_refused_then_read_anew(
    worker: &mut Worker,
    dir: &Path,
    name: &str,
    subject: &str,
    out: &Path,
    new_ids: std::ops::Range<u64>,
) -> Result<()> {
    let code = worker.wait_exit(Duration::from_secs(60))?;
    let log = std::fs::read_to_string(worker.log())?;
    assert_eq!(code, Some(1), "the worker fails\n{log}");
    for expected in [
        format!("partition 0: source: stream `{name}` was deleted and created again: partition 0 committed sequence 100 of the stream, but it was created at "),
        ", and the stream of that name now was created at ".to_owned(),
        "; its sequences name other messages, and reading on at 101 would skip the new stream's first 100 message(s). To read the new stream from its beginning, start the pipeline with a new state directory".to_owned(),
    ] {
        assert!(log.contains(&expected), "no `{expected}` in the log\n{log}");
    }
    let (ids, lines) = ids_in(out)?;
    assert_eq!(
        (ids, lines),
        ((0..100).collect(), 100),
        "nothing of the new stream was read under the old position"
    );

    // The remedy: a new state directory reads the new stream from its first message.
    let fresh_out = dir.join("fresh.jsonl");
    let spec = write_spec(dir, "fresh.yaml", name, subject, &fresh_out);
    let mut fresh = Worker::spawn(
        worker_bin!(),
        &spec,
        &dir.join("fresh-state"),
        dir.join("fresh.log"),
    )?;
    wait_for_ids(&fresh, &fresh_out, &new_ids.clone().collect())?;
    fresh.signal("TERM")?;
    assert_eq!(fresh.wait_exit(Duration::from_secs(30))?, Some(0));
    let (ids, lines) = ids_in(&fresh_out)?;
    assert_eq!(
        (ids, lines),
        (new_ids.clone().collect(), new_ids.count()),
        "every message of the new stream, once"
    );
    Ok(())
}

#[test]
fn a_stream_created_again_while_the_worker_is_stopped_stops_the_partition_and_skips_nothing(
) -> Result<()> {
    require_cluster()?;
    let rt = runtime();
    let name = unique_name("nats_again_stopped");
    let subject = format!("{name}.p.0");
    let js = rt.block_on(jetstream_context())?;
    rt.block_on(create_stream(&js, &name))?;
    rt.block_on(publish(&js, &subject, 0..100))?;
    let dir = TestDir::new()?;
    let out = dir.path().join("out.jsonl");
    let spec = write_spec(dir.path(), "spec.yaml", &name, &subject, &out);
    let state = dir.path().join("state");

    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w0.log"))?;
    wait_for_ids(&worker, &out, &(0..100).collect())?;
    worker.signal("TERM")?;
    assert_eq!(worker.wait_exit(Duration::from_secs(30))?, Some(0));

    // The new stream holds more messages (150) than the committed position (100).
    rt.block_on(async {
        js.delete_stream(&name).await?;
        create_stream(&js, &name).await?;
        publish(&js, &subject, 1000..1150).await
    })?;
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w1.log"))?;
    assert_refused_then_read_anew(&mut worker, dir.path(), &name, &subject, &out, 1000..1150)?;
    let _ = rt.block_on(js.delete_stream(&name));
    Ok(())
}

#[test]
fn a_stream_deleted_under_a_running_worker_is_unhealthy_and_created_again_stops_the_partition(
) -> Result<()> {
    require_cluster()?;
    let rt = runtime();
    let name = unique_name("nats_again_running");
    let subject = format!("{name}.p.0");
    let js = rt.block_on(jetstream_context())?;
    rt.block_on(create_stream(&js, &name))?;
    rt.block_on(publish(&js, &subject, 0..100))?;
    let dir = TestDir::new()?;
    let out = dir.path().join("out.jsonl");
    let spec = write_spec(dir.path(), "spec.yaml", &name, &subject, &out);
    let port = free_port();
    let yaml =
        std::fs::read_to_string(&spec)? + &format!("metrics: {{listen: '127.0.0.1:{port}'}}\n");
    std::fs::write(&spec, yaml)?;
    let state = dir.path().join("state");

    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w.log"))?;
    wait_for_ids(&worker, &out, &(0..100).collect())?;
    let gauge = "flow_source_unavailable{pipeline=\"nats_identity\",partition=\"0\"}";
    wait_until(Duration::from_secs(20), || {
        Ok(scrape(port)?.contains(&format!("{gauge} 0\n")))
    })
    .context("the source is not shown available while it reads")?;

    // Deleted: one WARN that says what to do, then quiet waiting.
    rt.block_on(js.delete_stream(&name))?;
    let gone = format!("JetStream stream `{name}` no longer exists: every partition of this source waits for it, reading nothing. If it was deleted by mistake, restore it from a backup (`nats stream restore`); a stream created anew under that name stops the partitions");
    wait_until(Duration::from_secs(20), || {
        Ok(std::fs::read_to_string(worker.log())?.contains(&gone))
    })
    .with_context(|| format!("no `{gone}` in the log\n{}", worker.log_tail()))?;
    std::thread::sleep(Duration::from_secs(3));
    let log = std::fs::read_to_string(worker.log())?;
    assert_eq!(log.matches(&gone).count(), 1, "one WARN per change\n{log}");
    assert!(worker.running(), "a missing stream is waited for\n{log}");
    // `status` (the running worker's snapshot, every 2 s) and `/metrics` show it.
    let waiting = format!("stream `{name}` no longer exists on {NATS_URL}: the partition waits for it, reading nothing. Restore it; a stream created anew under that name stops the partition");
    let mut shown = None;
    wait_until(Duration::from_secs(20), || {
        shown = status_json(worker_bin!(), &state)?
            .and_then(|s| s.pointer("/source_unavailable/nats_identity/0").cloned());
        Ok(shown.is_some())
    })
    .with_context(|| {
        format!(
            "status never showed the source unavailable\n{}",
            worker.log_tail()
        )
    })?;
    assert_eq!(
        shown.as_ref().and_then(|v| v.as_str()),
        Some(waiting.as_str())
    );
    let text = run_worker(
        worker_bin!(),
        &["status", "--state-dir", &state.display().to_string()],
        &[],
        Duration::from_secs(30),
    )?;
    assert!(
        text.stdout
            .contains(&format!("  partition 0: source unavailable: {waiting}\n")),
        "{}",
        text.stdout
    );
    wait_until(Duration::from_secs(20), || {
        Ok(scrape(port)?.contains(&format!("{gauge} 1\n")))
    })
    .context("/metrics never showed the source unavailable")?;

    // Created again with more messages (300) than the committed position (100).
    rt.block_on(async {
        create_stream(&js, &name).await?;
        publish(&js, &subject, 1000..1300).await
    })?;
    assert_refused_then_read_anew(&mut worker, dir.path(), &name, &subject, &out, 1000..1300)?;
    let _ = rt.block_on(js.delete_stream(&name));
    Ok(())
}

#[test]
fn a_missing_stream_is_refused_at_start_with_the_command_that_creates_it() -> Result<()> {
    require_cluster()?;
    let name = unique_name("nats_nosuch");
    let subject = format!("{name}.p.0");
    let dir = TestDir::new()?;
    let out = dir.path().join("out.jsonl");
    let spec = write_spec(dir.path(), "spec.yaml", &name, &subject, &out);
    let run = run_spec(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        Duration::from_secs(60),
    )?;
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    let expected = format!("partition 0: source: no stream named `{name}` on {NATS_URL}; create it with `nats --server {NATS_URL} stream add {name} --subjects '{subject}' --defaults`, or name an existing stream in `parameters.stream`");
    assert!(
        run.stderr.contains(&expected),
        "no `{expected}` in\n{}",
        run.stderr
    );
    assert_eq!(ids_in(&out)?.1, 0);
    Ok(())
}

#[test]
fn a_subject_outside_the_stream_is_refused_at_start_naming_the_stream_subjects() -> Result<()> {
    require_cluster()?;
    let rt = runtime();
    let name = unique_name("nats_outside");
    let js = rt.block_on(jetstream_context())?;
    rt.block_on(create_stream(&js, &name))?;
    rt.block_on(publish(&js, &format!("{name}.p.0"), 0..10))?;
    let dir = TestDir::new()?;
    let out = dir.path().join("out.jsonl");
    let outside = format!("{name}.q.0");
    let spec = write_spec(dir.path(), "spec.yaml", &name, &outside, &out);
    let run = run_spec(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        Duration::from_secs(60),
    )?;
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    let expected = format!("partition 0: source: stream `{name}` does not take subject(s) `{outside}`: its subjects are `{name}.p.*`. Fix `parameters.subjects` / `subject_template`, or add the subjects to the stream");
    assert!(
        run.stderr.contains(&expected),
        "no `{expected}` in\n{}",
        run.stderr
    );
    assert_eq!(ids_in(&out)?.1, 0);
    let _ = rt.block_on(js.delete_stream(&name));
    Ok(())
}

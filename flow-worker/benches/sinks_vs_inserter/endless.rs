//! Endless: the flat-footprint check (the worker with an endless generator; in `push` mode an
//! embedded pipeline an application feeds; in `jetstream` mode the worker reading a stream the
//! bench publishes meanwhile), sampled every 5 s until it is stopped.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use flow_core::sources::generator::{fill_payload, row_values};

use super::{
    dir_bytes, env_parse, spec, Case, ClickHouse, EPOCH_MAX_DURATION_MS, PARTITIONS, PAYLOAD_BYTES,
    ROLE, WORKER,
};

fn vm_rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|line| line.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

pub fn endless(secs: u64) -> Result<()> {
    let rate = env_parse::<u64>("FLOW_BENCH_ENDLESS_RATE")?.unwrap_or(20_000);
    // `push`: the payload mode, through an embedded pipeline fed by the application;
    // `jetstream`: the worker reading a stream published at the rate while it runs.
    let mode = std::env::var("FLOW_BENCH_ENDLESS_MODE").unwrap_or_default();
    let push = mode == "push";
    let (case, table) = match mode.as_str() {
        "push" => (Case::Batching, "bench_endless_push"),
        "jetstream" => (Case::JetStream, "bench_endless_jetstream"),
        "" => (Case::Batching, "bench_endless"),
        other => bail!("FLOW_BENCH_ENDLESS_MODE={other}: expected push, jetstream or nothing"),
    };
    let ch = ClickHouse {
        runtime: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
    };
    ch.drop_table(table, &case.shards())?;
    ch.create_table(table, &case.shards())?;
    let work = std::env::temp_dir().join(format!("flow-bench-endless-{}", std::process::id()));
    let state_dir = work.join("state");
    std::fs::create_dir_all(&work)?;
    let spec_path = work.join("endless.yaml");
    let per_partition = rate.div_ceil(u64::from(PARTITIONS));
    std::fs::write(&spec_path, spec(case, table, 0, per_partition, None))?;
    println!("# endless {}: {secs} s at {rate} rows/s ({per_partition} per partition), samples every 5 s", case.class());
    let mut command = if push {
        let mut command = Command::new(std::env::current_exe()?);
        command
            .env(ROLE, "push")
            .env("FLOW_BENCH_PUSH_RATE", rate.to_string())
            .env("FLOW_BENCH_PUSH_TABLE", table)
            .env("FLOW_BENCH_PUSH_STATE", &state_dir);
        command
    } else {
        let mut command = Command::new(WORKER);
        command
            .args(["--log-format", "json", "run"])
            .arg(&spec_path)
            .arg("--state-dir")
            .arg(&state_dir);
        command
    };
    let publisher = if case == Case::JetStream {
        let input = super::jetstream::EndlessInput::from_env()?;
        println!("# jetstream input: {input:?}");
        Some(super::jetstream::EndlessPublisher::start(rate, input)?)
    } else {
        None
    };
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let stderr = child.stderr.take().context("worker stderr")?;
    let latency: Arc<Mutex<(u64, Option<serde_json::Value>)>> = Arc::default();
    let p99s: Arc<Mutex<Vec<u64>>> = Arc::default();
    let collector = {
        let latency = Arc::clone(&latency);
        let p99s = Arc::clone(&p99s);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let Ok(event) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                // tracing-subscriber's json layout nests the message under `fields` unless the
                // event is flattened; accept either.
                let message = event
                    .pointer("/fields/message")
                    .or_else(|| event.get("message"))
                    .and_then(|m| m.as_str());
                if message == Some("memory") {
                    let field = |name: &str| {
                        event
                            .pointer(&format!("/fields/{name}"))
                            .and_then(|v| v.as_f64())
                            .unwrap_or(f64::NAN)
                    };
                    println!(
                        "   allocator: allocated {:.1} MiB, active {:.1} MiB, resident {:.1} MiB",
                        field("allocated_mib"),
                        field("active_mib"),
                        field("resident_mib")
                    );
                } else if message == Some("delivery latency") {
                    if let Some(p99) = event.pointer("/fields/p99_ms").and_then(|v| v.as_u64()) {
                        p99s.lock().unwrap().push(p99);
                    }
                    let mut latency = latency.lock().unwrap();
                    latency.0 += 1;
                    latency.1 = Some(event.get("fields").cloned().unwrap_or(event));
                } else if matches!(
                    event.get("level").and_then(|l| l.as_str()),
                    Some("ERROR" | "WARN")
                ) {
                    eprintln!("worker: {line}");
                }
            }
        })
    };
    let started = Instant::now();
    let mut samples: Vec<(f64, u64, u64)> = Vec::new();
    while started.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_secs(5));
        if let Some(status) = child.try_wait()? {
            bail!("the worker exited early ({status})");
        }
        let t = started.elapsed().as_secs_f64();
        let rss = vm_rss_kib(child.id()).unwrap_or_default();
        let state = dir_bytes(&state_dir);
        println!(
            "{t:>7.1} s  RSS {:>7.1} MiB  state dir {state:>12} bytes",
            rss as f64 / 1024.0
        );
        samples.push((t, rss, state));
    }
    let published = publisher.map(|publisher| publisher.stop()).transpose()?;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    let status = child.wait()?;
    let _ = collector.join();
    println!("worker stopped by SIGTERM: {status}");
    ensure!(
        !samples.is_empty(),
        "no samples: FLOW_BENCH_ENDLESS_SECS must be at least 5"
    );
    let mean = |pick: &dyn Fn(&(f64, u64, u64)) -> bool, field: fn(&(f64, u64, u64)) -> u64| {
        let chosen: Vec<u64> = samples.iter().filter(|s| pick(s)).map(field).collect();
        chosen.iter().sum::<u64>() as f64 / chosen.len().max(1) as f64
    };
    // Flat means no growth at the end: the last minute against the minute before it. A store
    // that starts empty grows while sled's log reaches its working size (2.6 MB in the 20-minute
    // JetStream run of docs/performance.md), so the first minute is shown but not the reference.
    let last_from = samples.last().map_or(0.0, |s| s.0) - 60.0;
    if secs < 180 {
        println!(
            "(under 180 s the last two minutes overlap the warm-up; the ratios below say little)"
        );
    }
    let first = |s: &(f64, u64, u64)| s.0 <= 60.0;
    let before_last = |s: &(f64, u64, u64)| s.0 > last_from - 60.0 && s.0 <= last_from;
    let last = |s: &(f64, u64, u64)| s.0 > last_from;
    // RSS samples are KiB, state-dir samples bytes; both are shown in MiB.
    for (what, field, per_mib) in [
        ("RSS", (|s: &(f64, u64, u64)| s.1) as fn(&_) -> u64, 1024.0),
        ("state dir", |s| s.2, 1048576.0),
    ] {
        let (start, a, b) = (
            mean(&first, field),
            mean(&before_last, field),
            mean(&last, field),
        );
        println!(
            "{what}: first minute mean {:.1} MiB; minute before the last {:.1} MiB, last minute {:.1} MiB, ratio {:.3} (flat: within 0.90..1.10)",
            start / per_mib,
            a / per_mib,
            b / per_mib,
            b / a.max(1.0)
        );
    }
    let max_state = samples.iter().map(|s| s.2).max().unwrap_or_default();
    println!(
        "state dir peak {max_state} bytes = {:.1} MiB (target <= 64 MiB)",
        max_state as f64 / 1048576.0
    );
    let (events, last_event) = latency.lock().unwrap().clone();
    match last_event {
        Some(event) => println!("delivery latency: {events} events, last {event}"),
        None => println!("delivery latency: none logged"),
    }
    let p99s = p99s.lock().unwrap().clone();
    println!(
        "delivery latency p99 per 60 s window: {p99s:?} ms (max {} ms; target <= 2 x the epoch's max_duration_ms = {} ms)",
        p99s.iter().max().copied().unwrap_or_default(),
        2 * EPOCH_MAX_DURATION_MS
    );
    for (t, rss, state) in &samples {
        if (*t as u64) % 60 < 5 {
            println!(
                "sample {t:>6.0} s  RSS {:>6.1} MiB  state {:>6.1} MiB",
                *rss as f64 / 1024.0,
                *state as f64 / 1048576.0
            );
        }
    }
    let (rows, ids) = ch.counts(table, &case.shards())?;
    println!("table rows {rows}, distinct ids {ids}");
    if let Some(published) = published {
        println!(
            "published {published} rows ({:.0} rows/s); {} read and delivered before the stop",
            published as f64 / secs as f64,
            rows
        );
        ensure!(
            rows <= published,
            "more rows in the table than were published"
        );
    }
    ensure!(
        rows == ids,
        "the exactly-once sink duplicated rows in the endless run"
    );
    if std::env::var_os("FLOW_BENCH_KEEP").is_some() {
        println!("state directory kept in {}", state_dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&work);
        ch.drop_table(table, &case.shards())?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Push: the outbox's payload mode, through an embedded pipeline that an application feeds

/// Pushes `rate` messages per second into one partition through the application's handle, in
/// 10 ms ticks: the generator's values for each offset, built by the producer as an application
/// hands over its own records. Receipts are dropped: the bench measures the outbox, not the
/// producer's bookkeeping.
async fn produce(partition: u32, rate: u64, events: flow_core::PushHandle) {
    use flow_core::{Route, Value};
    let per_tick = rate.div_ceil(100).max(1);
    let mut ticks = tokio::time::interval(Duration::from_millis(10));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut offset = 0u64;
    let mut payload = Vec::with_capacity(PAYLOAD_BYTES);
    loop {
        ticks.tick().await;
        for _ in 0..per_tick {
            let (id, user_id, ts) = row_values(partition, offset, PARTITIONS);
            payload.clear();
            fill_payload(id, PAYLOAD_BYTES, &mut payload);
            let values = [
                Value::Uint(id),
                Value::Uint(u64::from(partition)),
                Value::Uint(offset),
                Value::Uint(user_id),
                Value::Uint(ts),
                Value::Bytes(&payload),
            ];
            if events
                .send(Route::Partition(partition), &values)
                .await
                .is_err()
            {
                return;
            }
            offset += 1;
        }
    }
}

/// The `push` role: an embedded pipeline with flow-core's `PushSource` into `ClickHouseBatchingSink`,
/// fed at `FLOW_BENCH_PUSH_RATE` rows/s until SIGTERM. JSON logs on stderr, like the worker's.
pub fn push_pipeline() -> Result<()> {
    let rate: u64 = env_parse("FLOW_BENCH_PUSH_RATE")?.context("FLOW_BENCH_PUSH_RATE")?;
    let table = std::env::var("FLOW_BENCH_PUSH_TABLE").context("FLOW_BENCH_PUSH_TABLE")?;
    let state = std::env::var_os("FLOW_BENCH_PUSH_STATE").context("FLOW_BENCH_PUSH_STATE")?;
    tracing_subscriber::fmt()
        .json()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let (source, events) = flow_core::PushSource::new(
            "rows",
            flow_core::sources::generator::schema(),
            flow_core::PushOptions::default(),
        );
        let mut registry = flow::registry();
        source.register(&mut registry, "push");
        // The generator's spec with its source swapped for the push class, which takes no
        // parameters.
        let generator = format!(
            "  class: generator\n  parameters: {{count: 0, rate_per_second: 0, payload_bytes: {PAYLOAD_BYTES}}}\n"
        );
        let text = spec(Case::Batching, &table, 0, 0, None).replace(&generator, "  class: push\n");
        anyhow::ensure!(text.contains("class: push"), "the bench spec's source moved: {text}");
        let validated = registry
            .build_yaml(&text)
            .map_err(|err| anyhow::anyhow!("{err}"))?;
        let store = flow_state::StateStore::open(Path::new(&state))?;
        let pipeline = flow_core::Pipeline::new(validated, store.clone());
        let control = pipeline.control();
        tokio::spawn(flow_worker::report_memory());
        for partition in 0..PARTITIONS {
            let rate = rate.div_ceil(u64::from(PARTITIONS));
            tokio::spawn(produce(partition, rate, events.clone()));
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::spawn(async move {
            term.recv().await;
            control.shutdown();
        });
        pipeline.run().await?;
        tokio::task::spawn_blocking(move || store.close()).await??;
        Ok(())
    })
}

//! Commit latency / throughput with fsync on vs off, for 1 KiB and 1 MiB batch payloads.
//! Run with `cargo bench -p flow-state` (plain std timing, prints a table).

// Bench code: a failed unwrap aborts the bench.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use flow_state::{
    BatchStorage, EpochCommit, SealedBatch, SinkEpochCommit, SinkPartition, StateStore,
    StoreOptions,
};

fn commit(partition: u32, n: u64, payload: &[u8]) -> EpochCommit {
    EpochCommit {
        pipeline: "bench".to_owned(),
        partition,
        position: n.to_be_bytes().to_vec(),
        source_dead_letters: Vec::new(),
        sinks: vec![SinkEpochCommit {
            sink: "ch".to_owned(),
            storage: BatchStorage::Payload,
            batches: vec![SealedBatch {
                target: "default.events".to_owned(),
                columns: vec!["id".to_owned(), "body".to_owned()],
                format: "RowBinary".to_owned(),
                token: format!("{partition}-{n}"),
                shard: String::new(),
                first_offset: n,
                last_offset: n,
                rows: 1,
                encoded_bytes: payload.len() as u64,
                plan: "bench-plan".to_owned(),
                sealed_at_ms: 1_700_000_000_000 + n,
                content_hash: n,
                payload: payload.to_vec().into(),
            }],
            dead_letters: Vec::new(),
        }],
        counters: Vec::new(),
    }
}

struct Row {
    fsync: bool,
    payload: usize,
    threads: u32,
    commits: u64,
    elapsed: Duration,
    latencies: Vec<Duration>,
    fsyncs: u64,
    groups: u64,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

fn run(fsync: bool, payload_len: usize, threads: u32, per_thread: u64) -> Row {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open_with(
        dir.path(),
        StoreOptions {
            fsync,
            ..StoreOptions::default()
        },
    )
    .unwrap();
    let payload: Arc<Vec<u8>> = Arc::new((0..payload_len).map(|i| (i * 7 + 3) as u8).collect());
    let barrier = Arc::new(Barrier::new(threads as usize + 1));
    let handles: Vec<_> = (0..threads)
        .map(|partition| {
            let store = store.clone();
            let payload = payload.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let key = SinkPartition::new("bench", "ch", partition);
                let mut latencies = Vec::with_capacity(per_thread as usize);
                barrier.wait();
                for n in 0..per_thread {
                    let c = commit(partition, n, &payload);
                    let started = Instant::now();
                    let receipt = store.commit_blocking(c).unwrap();
                    latencies.push(started.elapsed());
                    // Keep the queue short, as a running pipeline would (not timed).
                    if n >= 4 {
                        store.acknowledge_blocking(&key, n - 4, vec![]).unwrap();
                    }
                    assert_eq!(receipt.seqs("ch"), &[n]);
                }
                latencies
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    let mut latencies: Vec<Duration> = Vec::new();
    for h in handles {
        latencies.extend(h.join().unwrap());
    }
    let elapsed = started.elapsed();
    latencies.sort();
    let stats = store.stats();
    store.close().unwrap();
    Row {
        fsync,
        payload: payload_len,
        threads,
        commits: u64::from(threads) * per_thread,
        elapsed,
        latencies,
        fsyncs: stats.fsyncs,
        groups: stats.groups,
    }
}

fn main() {
    // `cargo bench` passes `--bench`; anything else (e.g. `cargo test --benches`) runs a quick
    // smoke version.
    let quick = !std::env::args().any(|a| a == "--bench");
    let scale = if quick { 20 } else { 1 };
    let mut rows = Vec::new();
    for fsync in [true, false] {
        for (payload, sequential, per_thread) in [(1024usize, 2000u64, 250u64), (1 << 20, 100, 12)]
        {
            rows.push(run(fsync, payload, 1, (sequential / scale).max(2)));
            rows.push(run(fsync, payload, 8, (per_thread / scale).max(2)));
        }
    }
    println!(
        "{:<6} {:>8} {:>7} {:>8} {:>10} {:>10} {:>10} {:>11} {:>10} {:>8}",
        "fsync",
        "payload",
        "threads",
        "commits",
        "p50",
        "p99",
        "max",
        "commits/s",
        "MiB/s",
        "groups"
    );
    for r in &rows {
        let secs = r.elapsed.as_secs_f64();
        println!(
            "{:<6} {:>8} {:>7} {:>8} {:>10.2?} {:>10.2?} {:>10.2?} {:>11.0} {:>10.1} {:>8}",
            if r.fsync { "on" } else { "off" },
            if r.payload >= 1 << 20 {
                "1 MiB".to_owned()
            } else {
                "1 KiB".to_owned()
            },
            r.threads,
            r.commits,
            percentile(&r.latencies, 0.5),
            percentile(&r.latencies, 0.99),
            r.latencies.last().copied().unwrap_or_default(),
            r.commits as f64 / secs,
            (r.commits as f64 * r.payload as f64) / secs / f64::from(1 << 20),
            r.groups,
        );
        let _ = r.fsyncs;
    }
    println!("(groups include acknowledgements, which go through the same committer; fsync=on does one data-file fsync per group)");
}

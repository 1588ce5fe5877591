//! JSON decoding throughput of the broker sources (`format: json`): records/s of
//! `BrokerDecoder::append` on the JetStream bench's messages (six keys: four integers, a
//! datetime in seconds and a 16-character string), against what a
//! hand-written consumer does with the same bytes: `serde_json::from_slice` into a struct with a
//! borrowed payload. `cargo bench -p flow-core --bench json_decode` (plain std timing: warm-up,
//! then the median of `FLOW_BENCH_SAMPLES` runs, default 15, over `FLOW_BENCH_ROWS` records,
//! default 100000).

// Bench code: a failed unwrap aborts the bench.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flow_core::sources::{BrokerDecoder, BrokerFormat, BrokerRecord, OnBadRecord};
use flow_core::{Column, MessageBatch, SourceOutput, StreamSchema};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The messages, as the JetStream bench publishes them.
fn messages(rows: usize) -> Vec<String> {
    (0..rows as u64)
        .map(|id| {
            let mut json = String::new();
            let _ = write!(
                json,
                r#"{{"id":{id},"partition":{},"offset":{},"user_id":{},"ts":{},"payload":"{:016x}"}}"#,
                id % 4,
                id / 4,
                id.wrapping_mul(0x9E37_79B9) % 100_000,
                1_700_000_000 + id / 1000,
                id.wrapping_mul(0x2545_F491_4F6C_DD1D)
            );
            json
        })
        .collect()
}

/// What a hand-written consumer decodes into.
#[derive(serde::Deserialize)]
#[allow(dead_code)]
struct Event<'a> {
    id: u64,
    partition: u32,
    offset: u64,
    user_id: u64,
    ts: u32,
    payload: &'a str,
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn measure(samples: usize, mut run: impl FnMut() -> Duration) -> Duration {
    for _ in 0..3 {
        run();
    }
    median((0..samples).map(|_| run()).collect())
}

fn main() {
    let rows = env_usize("FLOW_BENCH_ROWS", 100_000);
    let samples = env_usize("FLOW_BENCH_SAMPLES", 15);
    let input = messages(rows);
    let schema = StreamSchema::new(
        [
            ("id", "uint64"),
            ("partition", "uint32"),
            ("offset", "uint64"),
            ("user_id", "uint64"),
            ("ts", "datetime"),
            ("payload", "string"),
        ]
        .iter()
        .map(|(name, ty)| Column::new(*name, ty.parse().unwrap()))
        .collect(),
    )
    .unwrap();
    let mut decoder = BrokerDecoder::new(
        0,
        Arc::clone(&schema),
        BrokerFormat::Json,
        OnBadRecord::Stop,
        false,
    );
    let flow = measure(samples, || {
        let mut batch = MessageBatch::new(Arc::clone(&schema));
        let mut dead = Vec::new();
        let started = Instant::now();
        let mut out = SourceOutput {
            batch: &mut batch,
            dead_letters: &mut dead,
        };
        for (position, payload) in input.iter().enumerate() {
            let record = BrokerRecord {
                position: position as u64 + 1,
                payload: payload.as_bytes(),
                origin: "events.0",
                timestamp_seconds: 0,
                key: None,
            };
            decoder.append(&record, &mut out).unwrap();
        }
        let took = started.elapsed();
        assert_eq!(batch.len(), rows);
        took
    });
    let hand = measure(samples, || {
        let started = Instant::now();
        let mut sum = 0u64;
        for payload in &input {
            let event: Event<'_> = serde_json::from_slice(payload.as_bytes()).unwrap();
            sum = sum.wrapping_add(event.id);
        }
        let took = started.elapsed();
        std::hint::black_box(sum);
        took
    });
    let per = |d: Duration| d.as_nanos() as f64 / rows as f64;
    println!(
        "json_decode: {rows} records, median of {samples}: flow BrokerDecoder {:.0} ns/record ({:.2} M/s), \
         hand-written serde_json struct {:.0} ns/record ({:.2} M/s); flow costs {:.2}x",
        per(flow),
        rows as f64 / flow.as_secs_f64() / 1e6,
        per(hand),
        rows as f64 / hand.as_secs_f64() / 1e6,
        per(flow) / per(hand)
    );
}

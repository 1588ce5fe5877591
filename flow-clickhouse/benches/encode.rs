//! RowBinary encoding throughput: rows/s of `RowBinaryEncoder::encode_row` for the generator's
//! table (the types the sinks always had) and for a table of 20 mixed-type columns (decimals,
//! UUID, enum, arrays, a map, a tuple, DateTime64, IPv6, Int128, LowCardinality, Nullable).
//! `cargo bench -p flow-clickhouse --bench encode` (plain std timing: warm-up, then the median of
//! `FLOW_BENCH_SAMPLES` runs, default 15, over a batch of `FLOW_BENCH_ROWS` rows, default 100000).

// Bench code: a failed unwrap aborts the bench.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use flow_clickhouse::testing::{check_mapping, ChType, EncodedColumn, RowBinaryEncoder};
use flow_core::{push_json_text, Column, MessageBatch, MessageId, StreamSchema, Value};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn encoder(columns: &[(&str, &str, &str)]) -> (std::sync::Arc<StreamSchema>, RowBinaryEncoder) {
    let schema = StreamSchema::new(
        columns
            .iter()
            .map(|(name, stream, _)| Column::new(*name, stream.parse().unwrap()))
            .collect(),
    )
    .unwrap();
    let plan = columns
        .iter()
        .enumerate()
        .map(|(i, (name, stream, table))| {
            let ty = ChType::parse(table);
            check_mapping(name, &stream.parse().unwrap(), &ty).unwrap();
            EncodedColumn {
                name: (*name).to_owned(),
                stream_index: i,
                ty,
            }
        })
        .collect();
    (schema, RowBinaryEncoder::new(plan))
}

/// Median rows/s and bytes per row of encoding every row of `batch`, `samples` times.
fn measure(batch: &MessageBatch, encoder: &RowBinaryEncoder, samples: usize) -> (f64, usize) {
    let mut out = Vec::with_capacity(batch.len() * 64);
    let run = |out: &mut Vec<u8>| {
        out.clear();
        let started = Instant::now();
        for row in batch.rows() {
            encoder.encode_row(&row, out).unwrap();
        }
        started.elapsed()
    };
    for _ in 0..3 {
        run(&mut out);
    }
    let mut times: Vec<Duration> = (0..samples).map(|_| run(&mut out)).collect();
    times.sort();
    let median = times[times.len() / 2];
    (
        batch.len() as f64 / median.as_secs_f64(),
        out.len() / batch.len(),
    )
}

fn generator_table(rows: usize) -> (MessageBatch, RowBinaryEncoder) {
    let (schema, encoder) = encoder(&[
        ("id", "uint64", "UInt64"),
        ("partition", "uint32", "UInt32"),
        ("offset", "uint64", "UInt64"),
        ("user_id", "uint64", "UInt64"),
        ("ts", "datetime", "DateTime"),
        ("payload", "string", "String"),
    ]);
    let mut batch = MessageBatch::new(schema);
    let payload = [b'x'; 16];
    for i in 0..rows as u64 {
        let mut row = batch.start_row(MessageId::new(0, i));
        row.push(Value::Uint(i)).unwrap();
        row.push(Value::Uint(0)).unwrap();
        row.push(Value::Uint(i)).unwrap();
        row.push(Value::Uint(i % 1000)).unwrap();
        row.push(Value::Uint(1_700_000_000 + i / 1000)).unwrap();
        row.push(Value::Bytes(&payload)).unwrap();
        row.finish().unwrap();
    }
    (batch, encoder)
}

/// `(name, stream type, table type, JSON value with {i} for the row number)`.
const MIXED: [(&str, &str, &str, &str); 20] = [
    ("id", "uint64", "UInt64", "{i}"),
    ("n32", "int32", "Int32", "{i}"),
    ("ratio", "double", "Float64", "0.25"),
    ("name", "utf8", "String", "\"name-{i}\""),
    ("country", "utf8", "LowCardinality(String)", "\"de\""),
    ("note", "optional<utf8>", "Nullable(String)", "null"),
    ("code", "string", "FixedString(8)", "\"abc\""),
    ("day", "date", "Date", "19000"),
    ("at", "datetime", "DateTime('UTC')", "1700000000"),
    ("price", "decimal(18,4)", "Decimal(18, 4)", "\"{i}.1234\""),
    (
        "big",
        "decimal(38,10)",
        "Decimal(38, 10)",
        "\"-{i}.0000000001\"",
    ),
    (
        "uid",
        "uuid",
        "UUID",
        "\"01234567-89ab-cdef-0123-456789abcdef\"",
    ),
    (
        "kind",
        "utf8",
        "Enum8('click' = 1, 'view' = 2, 'buy' = 3)",
        "\"view\"",
    ),
    ("tags", "list<uint32>", "Array(UInt32)", "[1, 2, 3, {i}]"),
    (
        "amounts",
        "list<optional<decimal(18,4)>>",
        "Array(Nullable(Decimal(18, 4)))",
        "[\"1.5\", null, \"2\"]",
    ),
    (
        "attrs",
        "dict<utf8,uint64>",
        "Map(String, UInt64)",
        "{\"a\": {i}, \"b\": 2}",
    ),
    (
        "pair",
        "tuple<uint8,utf8>",
        "Tuple(UInt8, String)",
        "[1, \"x\"]",
    ),
    ("stamp", "timestamp", "DateTime64(3)", "1700000000123000"),
    ("ip", "ipv6", "IPv6", "\"2001:db8::1\""),
    ("wide", "int128", "Int128", "\"-{i}\""),
];

fn mixed_table(rows: usize) -> (MessageBatch, RowBinaryEncoder) {
    let columns: Vec<(&str, &str, &str)> = MIXED.iter().map(|(n, s, t, _)| (*n, *s, *t)).collect();
    let (schema, encoder) = encoder(&columns);
    let mut batch = MessageBatch::new(schema);
    for i in 0..rows {
        let mut row = batch.start_row(MessageId::new(0, i as u64));
        for (_, _, _, json) in MIXED {
            push_json_text(&mut row, &json.replace("{i}", &i.to_string())).unwrap();
        }
        row.finish().unwrap();
    }
    (batch, encoder)
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is expected.
    let rows = env_usize("FLOW_BENCH_ROWS", 100_000);
    let samples = env_usize("FLOW_BENCH_SAMPLES", 15);
    println!("{:<34} {:>14} {:>10}", "case", "rows/s", "bytes/row");
    let (batch, encoder) = generator_table(rows);
    let (rate, width) = measure(&batch, &encoder, samples);
    println!(
        "{:<34} {:>14.0} {:>10}",
        "generator table (6 columns)", rate, width
    );
    let (batch, encoder) = mixed_table(rows);
    let (rate, width) = measure(&batch, &encoder, samples);
    println!(
        "{:<34} {:>14.0} {:>10}",
        "mixed table (20 columns)", rate, width
    );
}

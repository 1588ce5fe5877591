//! The column types users put in new tables on ClickHouse 24-26, against a real 26.9 (the modern
//! nodes m1 and m2): `JSON` with a typed path, `Array(JSON)`, `Variant`, `Dynamic`, `Time`,
//! `Time64(3)` and `LowCardinality(Nullable(String))`, with the types of today's encoder that
//! 18.16 lacks (`DateTime64`, `Date32`, `Map`, `Int128`, `Bool`, `IPv4`, `IPv6`) and `UUID` and
//! `Nested` (as its arrays), written from their stream types through
//! both exactly-once classes (`ClickHouseBatchingSink` into m1, `ShardedClickHouseBatchingSink`
//! over m1 and m2) and read back by the server's own functions (`variantType`, `dynamicType`,
//! `toString`, the typed path's type) value by value. Bad values go to the dead letters with what
//! is wrong: a JSON value that is not an object and a time beyond ±999:59:59 (which the server
//! would store but read back as the bound) are refused by the encoder naming column and value; a
//! typed path given a value of another type (code 117) and `Nested` arrays of different lengths
//! (code 190) are refused by the server for that row alone. 18.16 has none of these types, so the test is on 26.9 only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use flow_integration::generation::*;
use flow_integration::worker::*;
use flow_integration::*;
use serde_json::{json, Value as Json};

/// Generated rows that must land, ids `0..GOOD`.
const GOOD: u64 = 300;

/// `(column, stream type, table type)`.
const COLUMNS: &[(&str, &str, &str)] = &[
    ("id", "uint64", "UInt64"),
    ("j", "utf8", "JSON(`a.b` UInt32)"),
    ("lj", "list<utf8>", "Array(JSON)"),
    ("vs", "utf8", "Variant(Array(UInt8), String, UInt64)"),
    (
        "vn",
        "optional<uint64>",
        "Variant(Array(UInt8), String, UInt64)",
    ),
    ("va", "list<uint8>", "Variant(Array(UInt8), String, UInt64)"),
    ("d", "optional<int64>", "Dynamic"),
    ("dl", "list<utf8>", "Dynamic"),
    ("dm", "dict<utf8,uint8>", "Dynamic(max_types=4)"),
    ("t", "utf8", "Time"),
    ("ts", "int32", "Time"),
    ("t3", "utf8", "Time64(3)"),
    ("lc", "optional<utf8>", "LowCardinality(Nullable(String))"),
    // What the encoder had before, into the types 18.16 lacks.
    ("dt64", "timestamp", "DateTime64(6)"),
    ("d32", "date32", "Date32"),
    ("m", "dict<utf8,uint64>", "Map(String, UInt64)"),
    ("i128", "int128", "Int128"),
    ("b", "boolean", "Bool"),
    ("ip4", "ipv4", "IPv4"),
    ("ip6", "ipv6", "IPv6"),
    ("u", "uuid", "UUID"),
    ("n.k", "list<utf8>", ""),
    ("n.v", "list<uint32>", ""),
];

/// The `Nested` column whose arrays are `n.k` and `n.v`.
const NESTED: &str = "n Nested(k String, v UInt32)";

/// `[-]HH:MM:SS` of `seconds`, as the server prints a `Time`.
fn clock(seconds: i64) -> String {
    let sign = if seconds < 0 { "-" } else { "" };
    let s = seconds.abs();
    format!("{sign}{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// Row `i` as the jsonl source reads it, and as the `SELECT` below must read it back.
fn good_row(i: u64) -> (Json, Json) {
    let n = i as i64;
    let object = format!(r#"{{"a":{{"b":{i}}},"k":"v{i}"}}"#);
    let seconds = if i.is_multiple_of(2) {
        n * 3601
    } else {
        -n * 59
    };
    let input = json!({
        "id": i,
        "j": object,
        "lj": [format!(r#"{{"x":{i}}}"#), "{}"],
        "vs": format!("s{i}"),
        "vn": if i.is_multiple_of(3) { Json::Null } else { json!(i) },
        "va": [i % 256, 7],
        "d": if i.is_multiple_of(5) { Json::Null } else { json!(-n) },
        "dl": [format!("e{i}")],
        "dm": {"m": i % 256},
        "t": clock(seconds),
        "ts": seconds - 7,
        "t3": format!("{}.{:03}", clock(seconds), i % 1000),
        "lc": if i.is_multiple_of(4) { Json::Null } else { json!(format!("l{}", i % 4)) },
        "dt64": format!("2023-11-14T22:13:{:02}.{:06}Z", i % 60, i * 7),
        "d32": -25_567 + n,
        "m": {"k": i, "z": u64::MAX - i},
        "i128": format!("-170141183460469231731687303715884105{i:03}"),
        "b": i.is_multiple_of(2),
        "ip4": format!("10.0.{}.{}", i / 256, i % 256),
        "ip6": format!("2001:db8::{:x}", i + 1),
        "u": format!("01234567-89ab-cdef-0123-456789ab{i:04x}"),
        "n.k": [format!("k{i}"), ""],
        "n.v": [i, 4_294_967_295u32],
    });
    let expected = json!({
        "id": i,
        "j": object,
        "ab": i,
        "ab_type": "UInt32",
        "lj": format!(r#"['{{"x":{i}}}','{{}}']"#),
        "vs_t": "String",
        "vs": format!("s{i}"),
        "vn_t": if i.is_multiple_of(3) { Json::Null } else { json!("UInt64") },
        "vn": if i.is_multiple_of(3) { Json::Null } else { json!(i.to_string()) },
        "va_t": "Array(UInt8)",
        "va": format!("[{},7]", i % 256),
        "d_t": if i.is_multiple_of(5) { "None" } else { "Int64" },
        "d": if i.is_multiple_of(5) { Json::Null } else { json!((-n).to_string()) },
        "dl_t": "Array(String)",
        "dl": format!("['e{i}']"),
        "dm_t": "Map(String, UInt8)",
        "dm": format!("{{'m':{}}}", i % 256),
        "t": clock(seconds),
        "ts": clock(seconds - 7),
        "t3": format!("{}.{:03}", clock(seconds), i % 1000),
        "lc": if i.is_multiple_of(4) { Json::Null } else { json!(format!("l{}", i % 4)) },
        "dt64": (1_700_000_000 - 20 + i % 60) * 1_000_000 + i * 7,
        "d32": format!("1900-01-01 + {i}"),
        "m": format!("{{'k':{i},'z':{}}}", u64::MAX - i),
        "i128": format!("-170141183460469231731687303715884105{i:03}"),
        "b": i.is_multiple_of(2),
        "ip4": format!("10.0.{}.{}", i / 256, i % 256),
        "ip6": format!("2001:db8::{:x}", i + 1),
        "u": format!("01234567-89ab-cdef-0123-456789ab{i:04x}"),
        "n.k": [format!("k{i}"), ""],
        "n.v": [i, 4_294_967_295u32],
    });
    (input, expected)
}

/// The rows that must become dead letters: `(id, column, reason, server code)`, each a good
/// row with one value replaced.
fn bad_rows() -> Vec<(Json, &'static str, &'static str, Option<u64>)> {
    let with = |id: u64, column: &str, value: Json| {
        let (mut row, _) = good_row(id % 100);
        row["id"] = json!(id);
        row[column] = value;
        row
    };
    vec![
        (
            with(1000, "j", json!("[1,2]")),
            "j",
            "`[1,2]` is JSON but not an object, which a JSON column holds",
            None,
        ),
        (
            with(1001, "t", json!("1000:00:00")),
            "t",
            "`1000:00:00` is not a time Time reads: [-]H:MM:SS with hours up to 999",
            None,
        ),
        (
            with(1002, "ts", json!(3_600_000)),
            "ts",
            "3600000 is outside the range of Time (±999:59:59; the server would read it back as \
             the bound)",
            None,
        ),
        (
            with(1003, "j", json!(r#"{"a":{"b":"x"}}"#)),
            "",
            "cannot parse UInt32 value here",
            Some(117),
        ),
        (
            with(1004, "n.k", json!(["only one"])),
            "",
            "have different array sizes",
            Some(190),
        ),
    ]
}

const SELECT: &str = "SELECT id, toString(j) AS j, j.a.b AS ab, toTypeName(j.a.b) AS ab_type, \
     toString(lj) AS lj, variantType(vs) AS vs_t, toString(vs) AS vs, \
     if(isNull(vn), NULL, toString(variantType(vn))) AS vn_t, if(isNull(vn), NULL, toString(vn)) AS vn, \
     variantType(va) AS va_t, toString(va) AS va, dynamicType(d) AS d_t, if(isNull(d), NULL, toString(d)) AS d, \
     dynamicType(dl) AS dl_t, toString(dl) AS dl, dynamicType(dm) AS dm_t, toString(dm) AS dm, \
     toString(t) AS t, toString(ts) AS ts, toString(t3) AS t3, lc, \
     toUnixTimestamp64Micro(dt64) AS dt64, \
     concat('1900-01-01 + ', toString(dateDiff('day', toDate32('1900-01-01'), d32))) AS d32, \
     toString(m) AS m, toString(i128) AS i128, b, toString(ip4) AS ip4, toString(ip6) AS ip6, \
     toString(u) AS u, `n.k`, `n.v`";

fn spec(dir: &Path, one: &str, sharded: &str) -> PathBuf {
    let mut lines: Vec<String> = (0..GOOD).map(|i| good_row(i).0.to_string()).collect();
    // The bad rows among the good ones, so that each sits inside a batch of good rows.
    for (at, (row, ..)) in bad_rows().into_iter().enumerate() {
        lines.insert(37 + at * 61, row.to_string());
    }
    let input = dir.join("input.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let schema: Vec<String> = COLUMNS
        .iter()
        .map(|(name, ty, _)| format!("{{name: {name}, type: '{ty}'}}"))
        .collect();
    let yaml = format!(
        "pipeline: types_modern\n\
         partitions: 1\n\
         epoch: {{max_messages: 64, max_duration_ms: 200}}\n\
         source:\n  class: jsonl_file\n  parameters: {{files: ['{}'], schema: [{}]}}\n\
         sinks:\n\
         \x20 - name: one\n    sink_class_name: ClickHouseBatchingSink\n    input_stream_ids: [rows]\n    \
         parameters: {{host: '{}', table: {one}, on_bad_rows: dead_letter}}\n\
         \x20 - name: sharded\n    sink_class_name: ShardedClickHouseBatchingSink\n    input_stream_ids: [rows]\n    \
         parameters: {{{}, sharding_key_columns: [id], table: {sharded}, on_bad_rows: dead_letter}}\n",
        input.display(),
        schema.join(", "),
        M1.http_addr(),
        Generation::V26.shard_hosts_param(),
    );
    let path = dir.join("spec.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

/// Every row of `qualified` on `nodes`, by id.
fn read_back(nodes: &[Node], qualified: &str) -> Vec<Json> {
    let mut rows: Vec<Json> = nodes
        .iter()
        .flat_map(|node| {
            query_text(
                node.http_port,
                &format!(
                    "{SELECT} FROM {qualified} ORDER BY id FORMAT JSONEachRow \
                     SETTINGS output_format_json_quote_64bit_integers = 0, prefer_column_name_to_alias = 1"
                ),
            )
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str::<Json>(line).unwrap())
            .collect::<Vec<_>>()
        })
        .collect();
    rows.sort_by_key(|row| row["id"].as_u64());
    rows
}

fn check_rows(sink: &str, rows: &[Json]) {
    assert_eq!(rows.len() as u64, GOOD, "sink `{sink}`: rows");
    for (i, row) in rows.iter().enumerate() {
        let (_, want) = good_row(i as u64);
        for (column, value) in want.as_object().unwrap() {
            assert_eq!(
                &row[column], value,
                "sink `{sink}` row {i} column `{column}`: {row}"
            );
        }
    }
}

fn check_dead_letters(state: &Path) {
    let dead = export_dead_letters(worker_bin!(), state).unwrap();
    for sink in ["one", "sharded"] {
        let mut of_sink: Vec<&Json> = dead.iter().filter(|d| d["sink"] == sink).collect();
        of_sink.sort_by_key(|d| d["row"]["id"].as_u64());
        let expected = bad_rows();
        assert_eq!(of_sink.len(), expected.len(), "sink `{sink}`: {dead:#?}");
        for (d, (row, column, reason, code)) in of_sink.iter().zip(&expected) {
            assert_eq!(d["row"]["id"], row["id"], "{d}");
            assert_eq!(d["code"].as_u64(), *code, "{d}");
            let text = d["reason"].as_str().unwrap();
            assert!(text.contains(reason), "sink `{sink}`: {d}");
            if code.is_none() {
                assert_eq!(d["column"], *column, "{d}");
            }
        }
    }
}

#[test]
fn modern_types_land_value_for_value_through_both_exactly_once_classes_and_bad_values_are_dead_letters(
) {
    let generation = Generation::V26;
    generation.require().unwrap();
    let name = unique_name("it_types_modern");
    let mut columns: Vec<String> = COLUMNS
        .iter()
        .filter(|(_, _, ty)| !ty.is_empty())
        .map(|(column, _, ty)| format!("`{column}` {ty}"))
        .collect();
    columns.push(NESTED.to_owned());
    let columns = columns.join(", ");
    let one = generation
        .create_table_on("default", &format!("{name}_one"), &columns, "id", &[M1])
        .unwrap();
    let sharded = generation
        .create_table_on("default", &format!("{name}_sh"), &columns, "id", &[M1, M2])
        .unwrap();
    let dir = TestDir::new().unwrap();
    let state = dir.path().join("state");
    let spec = spec(dir.path(), &format!("{name}_one"), &format!("{name}_sh"));
    let out = run_spec(worker_bin!(), &spec, &state, Duration::from_secs(120)).unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);

    check_rows("one", &read_back(&[M1], &one.qualified()));
    let rows = read_back(&[M1, M2], &sharded.qualified());
    check_rows("sharded", &rows);
    let (a, b) = (
        rows_on(M1, &sharded.qualified()).unwrap(),
        rows_on(M2, &sharded.qualified()).unwrap(),
    );
    assert!(a > 0 && b > 0, "both shards hold rows: {a} and {b}");
    check_dead_letters(&state);

    // A second run on the same state sends nothing again.
    let again = run_spec(worker_bin!(), &spec, &state, Duration::from_secs(60)).unwrap();
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert_eq!(read_back(&[M1], &one.qualified()).len() as u64, GOOD);
    assert_eq!(
        read_back(&[M1, M2], &sharded.qualified()).len() as u64,
        GOOD
    );
}

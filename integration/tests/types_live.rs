//! The column types of real tables on the 18.16 cluster (issue 10): every type the server has
//! is written from its stream type through the exactly-once sink, read back as JSON and
//! compared value by value with what went in; a stream type whose column type the server lacks
//! is refused at session start with the server's version in the message.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use flow_integration::worker::*;
use flow_integration::*;
use serde_json::{json, Value as Json};

/// `(column, stream type, table type)`.
const COLUMNS: &[(&str, &str, &str)] = &[
    ("id", "uint64", "UInt64"),
    ("d32", "decimal(9,2)", "Decimal(9, 2)"),
    ("d64", "decimal(9,2)", "Decimal(18, 4)"),
    ("d128", "decimal(38,10)", "Decimal(38, 10)"),
    ("u", "uuid", "UUID"),
    ("ut", "utf8", "UUID"),
    ("e8", "utf8", "Enum8('a' = 1, 'b' = -2)"),
    ("e16", "int16", "Enum16('x' = 1000, 'y' = -1000)"),
    (
        "arr",
        "list<optional<decimal(18,4)>>",
        "Array(Nullable(Decimal(18, 4)))",
    ),
    ("n.k", "list<utf8>", ""),
    ("n.v", "list<uint32>", ""),
    (
        "tup",
        "tuple<uint8,optional<utf8>,list<int16>>",
        "Tuple(UInt8, Nullable(String), Array(Int16))",
    ),
    ("opt", "optional<int32>", "Nullable(Int32)"),
    ("lc", "optional<utf8>", "LowCardinality(Nullable(String))"),
    ("fs", "string", "FixedString(4)"),
    ("day", "date", "Date"),
    ("at", "datetime", "DateTime('Europe/Moscow')"),
    ("v4", "ipv4", "UInt32"),
    ("v6", "ipv6", "FixedString(16)"),
];

/// `day` and `at` at the edges of what 18.16 reads back (`readable_dates.rs` has the values
/// beyond them, which are refused).
const INPUT: &[&str] = &[
    r#"{"id":0,"d32":"-9999999.99","d64":"9999999.99","d128":"-9999999999999999999999999999.9999999999","u":"01234567-89ab-cdef-0123-456789abcdef","ut":"ffffffff-ffff-ffff-ffff-ffffffffffff","e8":"b","e16":-1000,"arr":[null,"-99999999999999.9999",null],"n.k":["a","b"],"n.v":[0,4294967295],"tup":[255,null,[-32768,32767]],"opt":-2147483648,"lc":null,"fs":"abcd","day":49710,"at":"2038-01-19 03:14:08","v4":"255.255.255.255","v6":"2001:db8::1"}"#,
    r#"{"id":1,"d32":0,"d64":"-0.01","d128":"0.0000000001","u":"00000000-0000-0000-0000-000000000000","ut":"01234567-89AB-CDEF-0123-456789ABCDEF","e8":"a","e16":1000,"arr":[],"n.k":[],"n.v":[],"tup":[0,"",[]],"opt":null,"lc":"x","fs":"","day":1,"at":86400,"v4":"0.0.0.0","v6":"::"}"#,
    r#"{"id":2,"d32":1.5,"d64":1.5,"d128":12345678901234567890.0123456789,"u":"11111111-2222-3333-4444-555555555555","ut":"01234567-89ab-cdef-0123-456789abcdef","e8":"a","e16":-1000,"arr":["1.2345"],"n.k":["only"],"n.v":[7],"tup":[1,"z",[0]],"opt":2147483647,"lc":"","fs":"ab","day":"2023-11-14","at":"2023-11-14 22:13:20","v4":"10.1.2.3","v6":"10.1.2.3"}"#,
];

/// What each row must read back as (`SELECT` below: decimals and arrays of decimals as text).
/// Row 0's `d128`, the smallest Decimal(38, 10), is checked by equality instead: 18.16's
/// `toString` prints a 38-digit Decimal128 with NUL bytes in it (`-9\0\0...`), even for a value
/// it made itself with `toDecimal128`.
fn expected() -> Vec<Json> {
    vec![
        json!({"id":"0","d32":"-9999999.99","d64":"9999999.9900","u":"01234567-89ab-cdef-0123-456789abcdef","ut":"ffffffff-ffff-ffff-ffff-ffffffffffff","e8":"b","e16":"y","arr":[null,"-99999999999999.9999",null],"n.k":["a","b"],"n.v":[0,4294967295u32],"tup":[255,null,[-32768,32767]],"opt":-2147483648i64,"lc":null,"fs":"abcd","day":49710,"at_s":2147483648u32,"at_text":"2038-01-19 06:14:08","v4":4294967295u32,"v6":"20010DB8000000000000000000000001"}),
        json!({"id":"1","d32":"0.00","d64":"-0.0100","d128":"0.0000000001","u":"00000000-0000-0000-0000-000000000000","ut":"01234567-89ab-cdef-0123-456789abcdef","e8":"a","e16":"x","arr":[],"n.k":[],"n.v":[],"tup":[0,"",[]],"opt":null,"lc":"x","fs":"\u{0}\u{0}\u{0}\u{0}","day":1,"at_s":86400,"at_text":"1970-01-02 03:00:00","v4":0,"v6":"00000000000000000000000000000000"}),
        json!({"id":"2","d32":"1.50","d64":"1.5000","d128":"12345678901234567890.0123456789","u":"11111111-2222-3333-4444-555555555555","ut":"01234567-89ab-cdef-0123-456789abcdef","e8":"a","e16":"y","arr":["1.2345"],"n.k":["only"],"n.v":[7],"tup":[1,"z",[0]],"opt":2147483647,"lc":"","fs":"ab\u{0}\u{0}","day":19675,"at_s":1700000000,"at_text":"2023-11-15 01:13:20","v4":167838211,"v6":"00000000000000000000FFFF0A010203"}),
    ]
}

/// The table, created with the experimental setting LowCardinality needs on 18.16.
struct Table {
    qualified: String,
}

impl Table {
    fn create(name: &str) -> Table {
        let mut columns: Vec<String> = COLUMNS
            .iter()
            .filter(|(_, _, ty)| !ty.is_empty())
            .map(|(column, _, ty)| format!("`{column}` {ty}"))
            .collect();
        columns.insert(9, "n Nested(k String, v UInt32)".to_owned());
        let ddl = replicated_table_ddl("default", name, &columns.join(", "), "id");
        for node in SHARD_A {
            let reply = http_request(
                node.http_port,
                "POST",
                "/?allow_experimental_low_cardinality_type=1",
                &[],
                ddl.as_bytes(),
            )
            .unwrap();
            assert_eq!(reply.status, 200, "{}", reply.text());
        }
        Table {
            qualified: format!("default.{name}"),
        }
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        for node in SHARD_A {
            let _ = exec(
                node.http_port,
                &format!("DROP TABLE IF EXISTS {}", self.qualified),
            );
        }
    }
}

fn spec(
    dir: &std::path::Path,
    pipeline: &str,
    table: &str,
    columns: &[(&str, &str)],
    lines: &[&str],
    extra: &str,
) -> std::path::PathBuf {
    let input = dir.join("input.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let schema: Vec<String> = columns
        .iter()
        .map(|(name, ty)| format!("{{name: '{name}', type: '{ty}'}}"))
        .collect();
    let yaml = format!(
        "pipeline: {pipeline}\n\
         partitions: 1\n\
         epoch: {{max_messages: 100, max_duration_ms: 200}}\n\
         source:\n  class: jsonl_file\n  parameters: {{files: ['{}'], schema: [{}]}}\n\
         sinks:\n  - name: out\n    sink_class_name: ClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{hosts: ['{}', '{}'], database: default, table: {table}{extra}}}\n",
        input.display(),
        schema.join(", "),
        A1.http_addr(),
        A2.http_addr(),
    );
    let path = dir.join("spec.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

#[test]
fn every_type_the_server_has_lands_through_the_exactly_once_sink_value_for_value() {
    wait_for_cluster(Duration::from_secs(60)).unwrap();
    let t = unique_name("it_types");
    let table = Table::create(&t);
    let dir = TestDir::new().unwrap();
    let columns: Vec<(&str, &str)> = COLUMNS.iter().map(|(c, s, _)| (*c, *s)).collect();
    let spec = spec(dir.path(), "types", &t, &columns, INPUT, "");
    let out = run_spec(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        Duration::from_secs(60),
    )
    .unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    sync_replica(A2.http_port, &table.qualified).unwrap();
    for node in SHARD_A {
        let text = query_text(
            node.http_port,
            &format!(
                "SELECT id, toString(d32) AS d32, toString(d64) AS d64, toString(d128) AS d128, u, \
                 ut, e8, e16, arrayMap(x -> toString(x), arr) AS arr, `n.k`, `n.v`, tup, opt, lc, \
                 fs, toUInt16(day) AS day, toString(at) AS at_text, toUnixTimestamp(at) AS at_s, v4, hex(v6) AS v6 \
                 FROM {} ORDER BY id FORMAT JSONEachRow",
                table.qualified
            ),
        )
        .unwrap();
        let rows: Vec<Json> = text
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        let extreme = query_u64(
            node.http_port,
            &format!(
                "SELECT count() FROM {} WHERE id = 0 AND d128 = \
                 toDecimal128('-9999999999999999999999999999.9999999999', 10)",
                table.qualified
            ),
        )
        .unwrap();
        assert_eq!(extreme, 1, "row 0's d128 on {}", node.name);
        let expected = expected();
        assert_eq!(
            rows.len(),
            expected.len(),
            "{} rows on {}",
            rows.len(),
            node.name
        );
        for (row, want) in rows.iter().zip(&expected) {
            for (column, value) in want.as_object().unwrap() {
                assert_eq!(
                    &row[column], value,
                    "row {} column `{column}` on {}",
                    want["id"], node.name
                );
            }
        }
    }
}

#[test]
fn a_stream_type_whose_column_type_the_server_lacks_is_refused_naming_its_version() {
    wait_for_cluster(Duration::from_secs(60)).unwrap();
    let t = unique_name("it_types_old");
    let table =
        ReplicatedTable::create("default", &t, "id UInt64, at DateTime", "id", &SHARD_A).unwrap();
    let dir = TestDir::new().unwrap();
    let spec = spec(
        dir.path(),
        "types_old",
        &t,
        &[("id", "uint64"), ("at", "timestamp")],
        &[r#"{"id":1,"at":"2023-11-14T22:13:20Z"}"#],
        "",
    );
    let out = run_spec(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        Duration::from_secs(60),
    )
    .unwrap();
    assert_ne!(out.code, Some(0));
    assert!(
        out.stderr.contains(
            "column `at`: the stream has timestamp but the table has DateTime; declare the stream \
             column as datetime or change the table column to DateTime64(6) (ClickHouse 18.16.1 \
             has no DateTime64: upgrade the server or keep the stream type)"
        ),
        "{}",
        out.stderr
    );
    assert_eq!(
        query_u64(
            A1.http_port,
            &format!("SELECT count() FROM {}", table.qualified())
        )
        .unwrap(),
        0
    );
}

#[test]
fn a_value_its_column_cannot_hold_becomes_a_dead_letter_naming_column_and_value() {
    wait_for_cluster(Duration::from_secs(60)).unwrap();
    let t = unique_name("it_types_bad");
    let table = ReplicatedTable::create(
        "default",
        &t,
        "id UInt64, kind Enum8('a' = 1, 'b' = 2), price Decimal(5, 2)",
        "id",
        &SHARD_A,
    )
    .unwrap();
    let dir = TestDir::new().unwrap();
    let state = dir.path().join("state");
    let spec = spec(
        dir.path(),
        "types_bad",
        &t,
        &[
            ("id", "uint64"),
            ("kind", "utf8"),
            ("price", "decimal(9,2)"),
        ],
        &[
            r#"{"id":0,"kind":"a","price":"999.99"}"#,
            r#"{"id":1,"kind":"zzz","price":"1"}"#,
            r#"{"id":2,"kind":"b","price":"1000"}"#,
            r#"{"id":3,"kind":"b","price":"-999.99"}"#,
        ],
        ", on_bad_rows: dead_letter",
    );
    let out = run_spec(worker_bin!(), &spec, &state, Duration::from_secs(60)).unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let landed = query_text(
        A1.http_port,
        &format!(
            "SELECT id, kind, toString(price) FROM {} ORDER BY id FORMAT TSV",
            table.qualified()
        ),
    )
    .unwrap();
    assert_eq!(landed, "0\ta\t999.99\n3\tb\t-999.99\n");
    let dead = export_dead_letters(worker_bin!(), &state).unwrap();
    let seen: Vec<(String, String, String)> = dead
        .iter()
        .map(|d| {
            (
                d["message_id"].as_str().unwrap().to_owned(),
                d["column"].as_str().unwrap().to_owned(),
                d["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(seen.len(), 2, "{dead:?}");
    assert_eq!((seen[0].0.as_str(), seen[0].1.as_str()), ("0-1", "kind"));
    assert!(
        seen[0]
            .2
            .contains("`zzz` is not a value of Enum8('a' = 1, 'b' = 2)"),
        "{}",
        seen[0].2
    );
    assert_eq!((seen[1].0.as_str(), seen[1].1.as_str()), ("0-2", "price"));
    assert!(
        seen[1].2.contains("1000.00 does not fit Decimal(5, 2)"),
        "{}",
        seen[1].2
    );
    assert_eq!(dead[1]["row"]["price"], "1000.00");
}

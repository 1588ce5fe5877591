//! Dates and times 18.16 would store but read back as others (issue 24 item 8): `2149-06-06`
//! into `Date` and `4294967295` into `DateTime` are refused before sealing with the range the
//! server reads back, as dead letters under `on_bad_rows: dead_letter` and as the partition's
//! stop otherwise; nothing outside the range lands, and the edges of the range land and read
//! back as sent on both replicas.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use flow_integration::worker::*;
use flow_integration::*;

const DATE_REFUSAL: &str = "2149-06-06 (day 65535) is outside the Date range ClickHouse 18.16.1 \
    reads back (1970-01-02 ..= 2106-02-07): it would be stored and read back as another date. \
    Correct the value at the source, or upgrade the server (21.4 and later read Date up to \
    2149-06-06)";
const DATETIME_REFUSAL: &str = "4294967295 (2106-02-07 06:28:15 UTC) is outside the DateTime \
    range ClickHouse 18.16.1 reads back in every time zone (1970-01-02 00:00:00 ..= 2106-02-05 \
    23:59:59 UTC): it would be stored and read back as another time. Correct the value at the \
    source, or upgrade the server (21.4 and later read DateTime up to 2106-02-07 06:28:15)";

fn spec(dir: &Path, pipeline: &str, table: &str, lines: &[&str], extra: &str) -> PathBuf {
    let input = dir.join("input.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let yaml = format!(
        "pipeline: {pipeline}\n\
         partitions: 1\n\
         epoch: {{max_messages: 100, max_duration_ms: 200}}\n\
         source:\n  class: jsonl_file\n  parameters: {{files: ['{}'], schema: [{{name: id, type: uint64}}, {{name: day, type: date}}, {{name: at, type: datetime}}]}}\n\
         sinks:\n  - name: out\n    sink_class_name: ClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{hosts: ['{}', '{}'], database: default, table: {table}{extra}}}\n",
        input.display(),
        A1.http_addr(),
        A2.http_addr(),
    );
    let path = dir.join("spec.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

fn landed(table: &ReplicatedTable) -> Vec<String> {
    SHARD_A
        .iter()
        .map(|node| {
            sync_replica(node.http_port, &table.qualified()).unwrap();
            query_text(
                node.http_port,
                &format!(
                    "SELECT id, toUInt16(day), toString(day), toUInt32(at), toString(at) FROM {} ORDER BY id FORMAT TSV",
                    table.qualified()
                ),
            )
            .unwrap()
        })
        .collect()
}

#[test]
fn dates_the_server_would_read_back_as_others_become_dead_letters_with_the_range() {
    wait_for_cluster(Duration::from_secs(60)).unwrap();
    let t = unique_name("it_readable_dl");
    let table = ReplicatedTable::create(
        "default",
        &t,
        "id UInt64, day Date, at DateTime('UTC')",
        "id",
        &SHARD_A,
    )
    .unwrap();
    let dir = TestDir::new().unwrap();
    let state = dir.path().join("state");
    let spec = spec(
        dir.path(),
        "readable_dl",
        &t,
        &[
            r#"{"id":0,"day":"2023-11-14","at":"2023-11-14 22:13:20"}"#,
            r#"{"id":1,"day":"2149-06-06","at":1700000000}"#,
            r#"{"id":2,"day":"2023-11-14","at":4294967295}"#,
            r#"{"id":3,"day":"2106-02-07","at":"2106-02-05 23:59:59"}"#,
            r#"{"id":4,"day":"1970-01-02","at":"1970-01-02 00:00:00"}"#,
        ],
        ", on_bad_rows: dead_letter",
    );
    let out = run_spec(worker_bin!(), &spec, &state, Duration::from_secs(60)).unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let expected = "0\t19675\t2023-11-14\t1700000000\t2023-11-14 22:13:20\n\
                    3\t49710\t2106-02-07\t4294857599\t2106-02-05 23:59:59\n\
                    4\t1\t1970-01-02\t86400\t1970-01-02 00:00:00\n";
    assert_eq!(landed(&table), vec![expected, expected]);
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
    assert_eq!((seen[0].0.as_str(), seen[0].1.as_str()), ("0-1", "day"));
    assert!(seen[0].2.contains(DATE_REFUSAL), "{}", seen[0].2);
    assert_eq!((seen[1].0.as_str(), seen[1].1.as_str()), ("0-2", "at"));
    assert!(seen[1].2.contains(DATETIME_REFUSAL), "{}", seen[1].2);
}

#[test]
fn without_dead_letters_a_date_out_of_range_stops_the_partition_and_lands_nothing() {
    wait_for_cluster(Duration::from_secs(60)).unwrap();
    let t = unique_name("it_readable_stop");
    let table = ReplicatedTable::create(
        "default",
        &t,
        "id UInt64, day Date, at DateTime('UTC')",
        "id",
        &SHARD_A,
    )
    .unwrap();
    let dir = TestDir::new().unwrap();
    let state = dir.path().join("state");
    let spec = spec(
        dir.path(),
        "readable_stop",
        &t,
        &[
            r#"{"id":0,"day":"2023-11-14","at":4294967295}"#,
            r#"{"id":1,"day":"2023-11-14","at":1700000000}"#,
        ],
        "",
    );
    let out = run_spec(worker_bin!(), &spec, &state, Duration::from_secs(60)).unwrap();
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(out.stderr.contains("column `at`"), "{}", out.stderr);
    assert!(out.stderr.contains(DATETIME_REFUSAL), "{}", out.stderr);
    assert_eq!(landed(&table), vec![String::new(), String::new()]);
}

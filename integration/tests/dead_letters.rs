//! Rows that fail the checks before sealing, against the real server: with
//! `on_bad_rows: dead_letter` they go to the sink's dead letters (id, column, reason, the row) and
//! every other row lands once; with the default `stop` the run fails naming the first of them.
//! `flow-worker dead-letters export|purge` read and remove them. On both server generations.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::path::{Path, PathBuf};
use std::time::Duration;

use flow_integration::generation::*;
use flow_integration::worker::*;
use flow_integration::*;
use serde_json::Value as Json;

const LINES: u64 = 200;

/// Every tenth line (ids 7, 17, ...) has a name too long for `FixedString(3)`.
fn is_bad(id: u64) -> bool {
    id % 10 == 7
}

fn input_text() -> String {
    (0..LINES)
        .map(|id| {
            let name = if is_bad(id) { "toolong" } else { "abc" };
            format!("{{\"id\": {id}, \"name\": \"{name}\"}}\n")
        })
        .collect()
}

fn write_spec(
    dir: &Path,
    host: Node,
    table: &str,
    class: &str,
    on_bad_rows: Option<&str>,
) -> PathBuf {
    let input = dir.join("input.jsonl");
    std::fs::write(&input, input_text()).unwrap();
    let extra = on_bad_rows.map_or(String::new(), |v| format!(", on_bad_rows: {v}"));
    let yaml = format!(
        "pipeline: dl\n\
         partitions: 1\n\
         epoch: {{max_messages: 64, max_duration_ms: 1000}}\n\
         source:\n  class: jsonl_file\n  parameters: {{files: ['{}'], schema: [{{name: id, type: uint64}}, {{name: name, type: string}}]}}\n\
         sinks:\n  - name: out\n    sink_class_name: {class}\n    input_stream_ids: [rows]\n    parameters: {{host: '{}', database: default, table: {table}{extra}}}\n    dynamic_parameters: {{max_rows_per_batch: 50, retry_backoff: 100ms, max_retry_backoff: 1s}}\n",
        input.display(),
        host.http_addr(),
    );
    let spec = dir.join("spec.yaml");
    std::fs::write(&spec, yaml).unwrap();
    spec
}

fn run_to_end(spec: &Path, state: &Path) -> WorkerOutput {
    run_spec(worker_bin!(), spec, state, Duration::from_secs(120)).unwrap()
}

fn export(state: &Path) -> Vec<Json> {
    export_dead_letters(worker_bin!(), state).unwrap()
}

fn bad_rows_go_to_dead_letters_and_the_rest_lands_once(generation: Generation, class: &str) {
    generation.require().unwrap();
    let t = unique_name("it_dl");
    let shard = generation.shard_a();
    let table = generation
        .create_table_on("default", &t, "id UInt64, name FixedString(3)", "id", shard)
        .unwrap();
    let dir = TestDir::new().unwrap();
    let host = generation.first();
    let spec = write_spec(dir.path(), host, &t, class, Some("dead_letter"));
    let state = dir.path().join("state");
    let out = run_to_end(&spec, &state);
    assert_eq!(out.code, Some(0), "{}", out.stderr);

    let good: Vec<u64> = (0..LINES).filter(|id| !is_bad(*id)).collect();
    generation.sync("default", &t, shard).unwrap();
    let landed = query_u64s(
        host.http_port,
        &format!("SELECT id FROM default.{t} ORDER BY id"),
    )
    .unwrap();
    assert_eq!(landed, good, "every good row once, no bad one");

    let dead = export(&state);
    let ids: Vec<u64> = dead
        .iter()
        .map(|d| d["row"]["id"].as_u64().unwrap())
        .collect();
    let bad: Vec<u64> = (0..LINES).filter(|id| is_bad(*id)).collect();
    assert_eq!(ids, bad);
    for d in &dead {
        let id = d["row"]["id"].as_u64().unwrap();
        assert_eq!(d["pipeline"], "dl");
        assert_eq!(d["sink"], "out");
        // jsonl message ids are `<partition>-<line index>`.
        assert_eq!(d["message_id"], format!("0-{id}"));
        assert_eq!(d["column"], "name");
        assert_eq!(d["code"], Json::Null);
        assert_eq!(d["row"]["name"], "toolong");
        assert!(d["reason"].as_str().unwrap().contains("`name`"), "{d}");
    }

    // purge asks for --yes, then removes them all.
    let state_arg = state.display().to_string();
    let refused = run_worker(
        worker_bin!(),
        &["dead-letters", "purge", "--state-dir", &state_arg],
        &[],
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(refused.code, Some(1), "{}", refused.stderr);
    assert!(refused.stderr.contains("--yes"), "{}", refused.stderr);
    assert_eq!(export(&state).len(), bad.len());
    let purged = run_worker(
        worker_bin!(),
        &["dead-letters", "purge", "--state-dir", &state_arg, "--yes"],
        &[],
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(purged.code, Some(0), "{}", purged.stderr);
    assert_eq!(
        purged.stdout.trim(),
        format!("removed {} dead letter(s)", bad.len())
    );
    assert!(export(&state).is_empty());
    drop(table);
}

fn exactly_once_sets_bad_rows_aside_as_dead_letters_and_lands_the_rest_once(
    generation: Generation,
) {
    bad_rows_go_to_dead_letters_and_the_rest_lands_once(generation, "ClickHouseBatchingSink");
}
each_generation!(sync exactly_once_sets_bad_rows_aside_as_dead_letters_and_lands_the_rest_once);

fn at_least_once_sets_bad_rows_aside_as_dead_letters_and_lands_the_rest_once(
    generation: Generation,
) {
    bad_rows_go_to_dead_letters_and_the_rest_lands_once(generation, "AtLeastOnceClickHouseSink");
}
each_generation!(sync at_least_once_sets_bad_rows_aside_as_dead_letters_and_lands_the_rest_once);

fn by_default_a_bad_row_stops_the_run_naming_its_id_and_column(generation: Generation) {
    generation.require().unwrap();
    let t = unique_name("it_dl_stop");
    let _table = generation
        .create_table_on(
            "default",
            &t,
            "id UInt64, name FixedString(3)",
            "id",
            generation.shard_a(),
        )
        .unwrap();
    let dir = TestDir::new().unwrap();
    let spec = write_spec(
        dir.path(),
        generation.first(),
        &t,
        "ClickHouseBatchingSink",
        None,
    );
    let state = dir.path().join("state");
    let out = run_to_end(&spec, &state);
    assert_ne!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stderr.contains("0-7"), "{}", out.stderr);
    assert!(out.stderr.contains("`name`"), "{}", out.stderr);
    assert!(export(&state).is_empty());
}
each_generation!(sync by_default_a_bad_row_stops_the_run_naming_its_id_and_column);

fn at_most_once_sets_bad_rows_aside_as_dead_letters_and_lands_the_rest_once(
    generation: Generation,
) {
    // No fault is injected, so at-most-once delivers every good row too.
    bad_rows_go_to_dead_letters_and_the_rest_lands_once(generation, "AtMostOnceClickHouseSink");
}
each_generation!(sync at_most_once_sets_bad_rows_aside_as_dead_letters_and_lands_the_rest_once);

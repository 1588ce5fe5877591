//! The sinks' `settings` against the real server: they reach every INSERT (with
//! `max_insert_block_size: 10` and squashing off, one batch of 100 rows lands as 10 parts of 10
//! rows, where without them it is one part), and a setting the server does not list in its
//! `system.settings` refuses the sink's start, naming the setting and the host, before anything
//! is sealed (sent, it would fail every INSERT with code 115). On both server generations.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::time::Duration;

use flow_integration::generation::*;
use flow_integration::worker::*;
use flow_integration::*;

/// Runs 100 rows in one batch through an at-least-once sink on the generation's first host with
/// `settings`, into a fresh `MergeTree` whose merges are stopped; returns the worker's output and
/// the row counts of the parts the inserts made.
fn run_with(generation: Generation, settings: &str) -> (WorkerOutput, Vec<u64>) {
    run_class(
        generation,
        "AtLeastOnceClickHouseSink",
        &format!("host: '{}'", generation.first().http_addr()),
        settings,
    )
}

/// As [`run_with`], for `class` with the host form `hosts` (the first host of each shard holds its
/// own table).
fn run_class(
    generation: Generation,
    class: &str,
    hosts: &str,
    settings: &str,
) -> (WorkerOutput, Vec<u64>) {
    generation.require().unwrap();
    let table = unique_name("it_settings");
    let mut guard = DropGuard::default();
    for node in [generation.shard_a()[0], generation.shard_b()[0]] {
        guard
            .create_merge_tree(node, "default", &table, GENERATOR_COLUMNS, "id")
            .unwrap();
        exec(
            node.http_port,
            &format!("SYSTEM STOP MERGES default.{table}"),
        )
        .unwrap();
    }
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    let parameters = format!("{{{hosts}, table: {table}, settings: {settings}}}");
    let yaml = GeneratorSpec::new("settings", class, parameters)
        .count(100)
        .epoch(100, 5_000)
        .dynamic("{max_rows_per_batch: 1000, retry_backoff: 50ms, max_retry_backoff: 200ms}")
        .yaml();
    std::fs::write(&spec, yaml).unwrap();
    let out = run_spec(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        Duration::from_secs(15),
    )
    .unwrap();
    let parts = query_u64s(
        generation.first().http_port,
        &format!(
            "SELECT rows FROM system.parts WHERE database = 'default' AND table = '{table}' \
             AND active ORDER BY name"
        ),
    )
    .unwrap();
    (out, parts)
}

/// The start's refusal of a setting `host` does not list.
fn unknown_setting_named(host: Node, stderr: &str) -> bool {
    let version = query_text(host.http_port, "SELECT version()").unwrap();
    stderr.contains(&format!(
        "the setting `flow_no_such_setting` of the sink's `settings` is not a setting of \
         ClickHouse {} on {} (it is not in system.settings there)",
        version.trim(),
        host.http_addr()
    ))
}

fn settings_reach_the_insert_and_an_unknown_one_stops_the_sink_naming_it(generation: Generation) {
    let (plain, parts) = run_with(generation, "{}");
    assert_eq!(plain.code, Some(0), "{}", plain.stderr);
    assert_eq!(parts, vec![100], "one batch, one part");

    let (split, parts) = run_with(
        generation,
        "{max_insert_block_size: 10, min_insert_block_size_rows: 0, min_insert_block_size_bytes: 0}",
    );
    assert_eq!(split.code, Some(0), "{}", split.stderr);
    assert_eq!(
        parts,
        vec![10; 10],
        "the server read the batch in blocks of 10"
    );

    let (unknown, parts) = run_with(generation, "{flow_no_such_setting: 1}");
    assert_eq!(unknown.code, Some(1), "{}", unknown.stderr);
    assert!(
        unknown_setting_named(generation.first(), &unknown.stderr),
        "{}",
        unknown.stderr
    );
    assert_eq!(parts, Vec::<u64>::new(), "nothing lands");

    // The sharded exactly-once class checks them on every shard the same way.
    let shards = format!(
        "shard_hosts: {{a: ['{}'], b: ['{}']}}",
        generation.shard_a()[0].http_addr(),
        generation.shard_b()[0].http_addr()
    );
    let (sharded, _) = run_class(
        generation,
        "ShardedClickHouseBatchingSink",
        &shards,
        "{flow_no_such_setting: 1}",
    );
    assert_eq!(sharded.code, Some(1), "{}", sharded.stderr);
    assert!(
        unknown_setting_named(generation.shard_a()[0], &sharded.stderr)
            || unknown_setting_named(generation.shard_b()[0], &sharded.stderr),
        "{}",
        sharded.stderr
    );
}
each_generation!(sync settings_reach_the_insert_and_an_unknown_one_stops_the_sink_naming_it);

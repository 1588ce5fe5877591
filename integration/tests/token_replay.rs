//! A batch the server stored but whose answer was lost, replayed by the next run after a kill -9,
//! is the same part to the server, which keeps one copy, on both server generations. Each side is
//! checked by the server's own records, not by flow's:
//!
//! * ClickHouse 26.9: `system.query_log` (enabled on the modern nodes by `scripts/cluster.sh`)
//!   lists each INSERT's `insert_deduplication_token`: the replayed batch arrives twice under one
//!   token, every batch has the token of its last message, and the table holds every id once.
//!   A token that changed on replay would land the batch twice and fail the count.
//! * ClickHouse 18.16 (no tokens): the replayed block is the same bytes, which the replica's log
//!   reports as a block that already exists.
//!
//! The answer is lost by a proxy in front of the shard's first host that cuts the response of the
//! first INSERT (the server committed, the sink saw a reset); the sink's long retry pause keeps it
//! from retrying before the kill.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use flow_integration::generation::*;
use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;

const MESSAGES: u64 = 3_000;
const BATCH_ROWS: u64 = 1_000;

/// The message id a token names (`<namespace>/<partition>-<offset>` then `:<outbox>`), e.g. `0-999`.
fn token_message(token: &str) -> &str {
    let named = token.rsplit_once('/').map_or(token, |(_, rest)| rest);
    named.split(':').next().unwrap_or(named)
}

async fn a_replayed_batch_is_one_part_to_the_server(generation: Generation) {
    generation.require().unwrap();
    generation.check_version(generation.first()).unwrap();
    let name = unique_name(&format!("token_replay_{}", generation.tag()));
    let shard = generation.shard_a();
    let table = generation
        .create_table_on("default", &name, GENERATOR_COLUMNS, "id", shard)
        .unwrap();
    let qualified = table.qualified();
    let proxy = FaultProxy::start(generation.first().http_addr().parse().unwrap())
        .await
        .unwrap();
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    let yaml = GeneratorSpec::new(
        &format!("replay_{}", generation.tag()),
        "ClickHouseBatchingSink",
        format!(
            "{{host: \"{}\", database: default, table: {name}}}",
            proxy.addr()
        ),
    )
    .epoch(MESSAGES, 500)
    .count(MESSAGES)
    .dynamic(format!(
        "{{max_rows_per_batch: {BATCH_ROWS}, retry_backoff: 10m, max_retry_backoff: 10m}}"
    ))
    .yaml();
    std::fs::write(&spec, yaml).unwrap();
    let state = dir.path().join("state");

    // The first INSERT is stored, its answer lost; the sink waits ten minutes before retrying.
    proxy.set_once_on_insert(Fault::CutResponse);
    let mut first =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run-1.log")).unwrap();
    wait_until(Duration::from_secs(60), || Ok(proxy.stats().cuts == 1))
        .unwrap_or_else(|err| panic!("no INSERT answer was cut ({err:#})\n{}", first.log_tail()));
    wait_until(Duration::from_secs(30), || {
        Ok(rows_on(generation.first(), &qualified)? >= BATCH_ROWS)
    })
    .unwrap();
    let stored_before_kill = rows_on(generation.first(), &qualified).unwrap();
    assert!(
        first.kill_9().unwrap().is_none(),
        "the first run exited before the kill\n{}",
        first.log_tail()
    );

    // The next run replays what it cannot know was stored, then delivers the rest.
    let mut second =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run-2.log")).unwrap();
    let code = second.wait_exit(Duration::from_secs(120)).unwrap();
    assert_eq!(
        code,
        Some(0),
        "the second run failed\n{}",
        second.log_tail()
    );
    generation.sync("default", &name, shard).unwrap();
    for node in shard {
        let (rows, ids) = count_uniq(*node, &qualified).unwrap();
        assert_eq!(
            (rows, ids),
            (MESSAGES, MESSAGES),
            "{}: rows and distinct ids after the replay ({stored_before_kill} rows were stored \
             before the kill)\n{}",
            node.name,
            duplicates_report(&qualified, shard)
        );
    }

    if generation.has_tokens() {
        let tokens = finished_insert_tokens(generation.first(), &qualified).unwrap();
        let messages: Vec<&str> = tokens.iter().map(|t| token_message(t)).collect();
        let mut distinct = messages.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(
            distinct,
            ["0-1999", "0-2999", "0-999"],
            "one token per batch, named by its last message: {tokens:?}"
        );
        let first_batch: Vec<&String> = tokens
            .iter()
            .filter(|t| token_message(t) == "0-999")
            .collect();
        assert!(
            first_batch.len() >= 2 && first_batch.windows(2).all(|w| w[0] == w[1]),
            "the replayed batch reached the server again under the same token: {tokens:?}"
        );
    } else {
        let deduplicated = deduplicated_blocks_logged(generation.first(), &qualified);
        assert!(
            deduplicated >= 1,
            "{} logged no block of {qualified} as already there: the replay was not the same block",
            generation.first().name
        );
    }
}
each_generation!(a_replayed_batch_is_one_part_to_the_server);

//! The deduplication tokens of the exactly-once sinks as a real ClickHouse 26.9 receives them
//! (the modern nodes' `system.query_log` lists each INSERT's settings), and the capability
//! refusals as a real 18.16 answers them. What only a test double can show (async inserts, which
//! the modern nodes run synchronously; scripted error answers; the bytes of each retry) stays in
//! `token_double.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use flow_clickhouse::testing::RendezvousRouter;
use flow_integration::generation::*;
use flow_integration::worker::*;
use flow_integration::*;
use flow_state::StateStore;

/// Runs `count` generator messages (one partition, batches of 4) through `class` with
/// `parameters` on the state directory `state`, to its end.
fn run(dir: &Path, state: &Path, class: &str, parameters: String, count: u64) {
    let spec = dir.join("spec.yaml");
    let yaml = GeneratorSpec::new("tokpipe", class, parameters)
        .epoch(1000, 60_000)
        .count(count)
        .dynamic("{max_rows_per_batch: 4}")
        .yaml();
    std::fs::write(&spec, yaml).unwrap();
    let out = run_spec(worker_bin!(), &spec, state, Duration::from_secs(60)).unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
}

/// The outbox id of a state directory, which names the default token namespace.
fn outbox_id(state: &Path) -> String {
    let store = StateStore::open(state).unwrap();
    let id = store
        .outbox_id()
        .unwrap()
        .expect("a new store has an outbox id");
    store.close().unwrap();
    id.to_string()
}

/// Sharded: every part's token is `<pipeline>.<sink>.<outbox>/<partition>-<last id>:<shard>`,
/// and it reaches the shard it names with exactly the rows routed there; one token per part.
#[test]
fn each_part_reaches_its_shard_under_its_own_token() {
    let generation = Generation::V26;
    generation.require().unwrap();
    let name = unique_name("tokens_sharded");
    let table = generation
        .create_table("default", &name, GENERATOR_COLUMNS, "id")
        .unwrap();
    let dir = TestDir::new().unwrap();
    let state = dir.path().join("state");
    run(
        dir.path(),
        &state,
        "ShardedClickHouseBatchingSink",
        format!(
            "{{{}, sharding_key_columns: [user_id], table: {name}}}",
            generation.shard_hosts_param()
        ),
        10,
    );
    let namespace = format!("tokpipe.out.{}/", outbox_id(&state));
    // The parts the routing rule makes of batches [0..=3], [4..=7], [8..=9] (user_id = id here).
    let router = RendezvousRouter::new(&["a".to_owned(), "b".to_owned()]);
    for (index, (shard, node)) in [("a", M1), ("b", M2)].into_iter().enumerate() {
        let routed = |id: &u64| router.route(&user_routing_key(*id)) == index;
        let expected: BTreeSet<String> = [(0u64, 3u64), (4, 7), (8, 9)]
            .into_iter()
            .filter(|(first, last)| (*first..=*last).any(|id| routed(&id)))
            .map(|(_, last)| format!("{namespace}0-{last}:{shard}"))
            .collect();
        let tokens = finished_insert_tokens(node, &table.qualified()).unwrap();
        let distinct: BTreeSet<String> = tokens.iter().cloned().collect();
        assert_eq!(distinct, expected, "the tokens shard `{shard}` received");
        assert_eq!(
            tokens.len(),
            expected.len(),
            "one INSERT per part: {tokens:?}"
        );
        let ids = query_u64s(
            node.http_port,
            &format!(
                "SELECT id FROM {} ORDER BY id FORMAT TSV",
                table.qualified()
            ),
        )
        .unwrap();
        let want: Vec<u64> = (0..10).filter(routed).collect();
        assert_eq!(ids, want, "the rows on shard `{shard}`");
    }
}

/// The default namespace names the state directory's outbox, so two state directories of one
/// pipeline never send one token for their different rows; an explicit `token_namespace`
/// replaces it.
#[test]
fn the_namespace_is_the_outbox_or_the_token_namespace() {
    let generation = Generation::V26;
    generation.require().unwrap();
    let name = unique_name("tokens_namespace");
    let table = generation
        .create_table_on("default", &name, GENERATOR_COLUMNS, "id", &[M1])
        .unwrap();
    let host = format!("host: '{}'", M1.http_addr());
    let (a, b, c) = (
        TestDir::new().unwrap(),
        TestDir::new().unwrap(),
        TestDir::new().unwrap(),
    );
    let parameters = |extra: &str| format!("{{{host}, table: {name}{extra}}}");
    run(
        a.path(),
        &a.path().join("state"),
        "ClickHouseBatchingSink",
        parameters(""),
        4,
    );
    run(
        b.path(),
        &b.path().join("state"),
        "ClickHouseBatchingSink",
        parameters(""),
        4,
    );
    run(
        c.path(),
        &c.path().join("state"),
        "ClickHouseBatchingSink",
        parameters(", token_namespace: 'team-a/v2.'"),
        4,
    );
    let (id_a, id_b) = (
        outbox_id(&a.path().join("state")),
        outbox_id(&b.path().join("state")),
    );
    assert_ne!(id_a, id_b);
    assert_eq!(
        finished_insert_tokens(M1, &table.qualified()).unwrap(),
        [
            format!("tokpipe.out.{id_a}/0-3"),
            format!("tokpipe.out.{id_b}/0-3"),
            "team-a/v2.0-3".to_owned()
        ]
    );
    // Same rows, three namespaces: the server kept all three copies, as it must.
    assert_eq!(rows_on(M1, &table.qualified()).unwrap(), 12);
}

/// `async_insert: true` against a server that has no such setting (18.16) refuses the start,
/// naming the setting and the way on, before anything is sent.
#[test]
fn async_insert_is_refused_at_the_start_by_a_server_without_it() {
    let generation = Generation::V18;
    generation.require().unwrap();
    let name = unique_name("tokens_async");
    let table = generation
        .create_table_on("default", &name, GENERATOR_COLUMNS, "id", &[A1])
        .unwrap();
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    let yaml = GeneratorSpec::new(
        "tokpipe",
        "ClickHouseBatchingSink",
        format!("{{host: '{}', table: {name}}}", A1.http_addr()),
    )
    .count(10)
    .dynamic("{async_insert: true}")
    .yaml();
    std::fs::write(&spec, yaml).unwrap();
    let out = run_spec(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        Duration::from_secs(60),
    )
    .unwrap();
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!(
            "Refusing to start the ClickHouse sink for default.{name}: `async_insert: true` is set \
             but the server does not know the setting `async_insert` (ClickHouse before 21.11). \
             Set `async_insert: false`"
        )),
        "{}",
        out.stderr
    );
    assert_eq!(rows_on(A1, &table.qualified()).unwrap(), 0);
}

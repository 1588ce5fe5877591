//! An ALTER racing INSERTs (issue 24, item 2; issue 26, item 1).
//!
//! `ADD COLUMN extra UInt8 DEFAULT 0` while parts are in flight stores them with `extra`. The
//! sink sees the change after those INSERTs and adopts it (a column it does not write, added),
//! but a part stored under other columns is another block, which 18.16 (no
//! `insert_deduplication_token`) would not drop as a replay: such a part is looked up on the
//! shard's replicas by its ids in `message_id_column` first (landed: acknowledged without a
//! resend), or, without that parameter, the sink stops with the check to run.
//!
//! The race is made certain by a fault proxy in front of each replica that holds every INSERT for
//! 2 s before passing it on (the sink's columns checks pass at once): at the moment of the ALTER
//! each partition's INSERT is waiting in a proxy, so it reaches the server after the change.
//! With two shards the ALTER reaches shard `a` first: a part stored there under the new columns
//! finds the shards disagreeing, and the sink waits for them to agree before it checks the part.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 6;
const PER_PARTITION: u64 = 3_000;

/// What the run with the racing ALTER left.
struct Raced {
    table: ReplicatedTable,
    code: Option<i32>,
    log: String,
}

/// Where the table lives and which hosts the ALTER reaches first.
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// Shard `a` only, one ALTER (which replication brings to its second replica).
    OneShard,
    /// Shards `a` and `b`, sharded by `user_id`: the ALTER reaches shard `a`, and shard `b` only
    /// after the sink has seen the hosts disagree.
    TwoShards,
}

const DISAGREEING: &str =
    "the hosts do not agree on the new ones yet: the sink waits until they do";

fn alter_racing_inserts(tag: &str, layout: Layout, extra_parameters: &str) -> Raced {
    require_cluster().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let proxies: Vec<FaultProxy> = SHARD_A
        .iter()
        .map(|node| {
            let upstream: SocketAddr = node.http_addr().parse().unwrap();
            runtime.block_on(FaultProxy::start(upstream)).unwrap()
        })
        .collect();
    let name = unique_name(tag);
    let nodes: &[Node] = match layout {
        Layout::OneShard => &SHARD_A,
        Layout::TwoShards => &NODES,
    };
    let table = ReplicatedTable::create("default", &name, GENERATOR_COLUMNS, "id", nodes).unwrap();
    let qualified = table.qualified();
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    let state = dir.path().join("state");
    let (class, hosts) = match layout {
        Layout::OneShard => (
            "ClickHouseBatchingSink",
            format!("hosts: ['{}', '{}']", proxies[0].addr(), proxies[1].addr()),
        ),
        Layout::TwoShards => (
            "ShardedClickHouseBatchingSink",
            format!(
                "shard_hosts: {{a: ['{}', '{}'], b: ['{}', '{}']}}, sharding_key_columns: [user_id]",
                proxies[0].addr(),
                proxies[1].addr(),
                B1.http_addr(),
                B2.http_addr()
            ),
        ),
    };
    let parameters = format!("{{{hosts}, table: {name}{extra_parameters}}}");
    std::fs::write(
        &spec,
        GeneratorSpec::new(tag, class, parameters)
            .partitions(PARTITIONS)
            .epoch(250, 200)
            .count(PER_PARTITION)
            .rate(500)
            .dynamic("{max_rows_per_batch: 250, retry_backoff: 100ms, write_timeout: 20s}")
            .yaml(),
    )
    .unwrap();
    let mut worker =
        Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w1.log")).unwrap();
    wait_until(Duration::from_secs(60), || {
        Ok(count_uniq(A1, &qualified)?.0 >= 1_500)
    })
    .unwrap_or_else(|err| panic!("{err:#}: nothing landed\n{}", worker.log_tail()));
    for proxy in &proxies {
        proxy.set_on_inserts(Fault::Latency(Duration::from_secs(2)));
    }
    // Every partition's next INSERT to shard `a` is now held in a proxy.
    std::thread::sleep(Duration::from_millis(1_500));
    let alter = format!("ALTER TABLE {qualified} ADD COLUMN extra UInt8 DEFAULT 0");
    exec(A1.http_port, &alter).unwrap();
    let log_has = |line: &str| {
        wait_until(Duration::from_secs(60), || {
            Ok(std::fs::read_to_string(worker.log())?.contains(line))
        })
        .unwrap_or_else(|err| panic!("{err:#}: no `{line}`\n{}", worker.log_tail()));
    };
    if layout == Layout::TwoShards {
        // The held INSERTs land on shard `a` under the new columns within 0.5 s; shard `b`
        // answers the old ones until its own ALTER.
        std::thread::sleep(Duration::from_secs(3));
        exec(B1.http_port, &alter).unwrap();
    }
    log_has("column `extra` UInt8 DEFAULT 0 added");
    for proxy in &proxies {
        proxy.set(Fault::Pass);
    }
    let code = worker.wait_exit(Duration::from_secs(120)).unwrap();
    for &node in nodes {
        sync_when_writable(node, "default", &name, Duration::from_secs(60)).unwrap();
    }
    Raced {
        table,
        code,
        log: std::fs::read_to_string(worker.log()).unwrap(),
    }
}

/// The parts found in the table by their ids and not sent again.
fn found_by_id(log: &str) -> usize {
    let found = log
        .matches("is in the table already (every one of its `id` ids, once): acknowledged without sending it again")
        .count();
    println!("parts found in the table and not sent again: {found}");
    found
}

#[test]
fn parts_that_landed_while_a_column_was_added_are_found_by_id_and_not_sent_again() {
    let Raced { table, code, log } = alter_racing_inserts(
        "alter_race_ids",
        Layout::OneShard,
        ", message_id_column: id",
    );
    assert_eq!(code, Some(0), "{log}");
    let total = PARTITIONS * PER_PARTITION;
    for node in SHARD_A {
        assert_eq!(
            count_uniq(node, &table.qualified()).unwrap(),
            (total, total),
            "every id once on {}",
            node.name
        );
    }
    assert!(found_by_id(&log) > 0, "{log}");
}

#[test]
fn a_part_stored_while_the_shards_disagree_on_the_columns_waits_for_them_and_is_found_by_id() {
    let Raced { table, code, log } = alter_racing_inserts(
        "alter_race_shards",
        Layout::TwoShards,
        ", message_id_column: id",
    );
    assert_eq!(code, Some(0), "{log}");
    let total = PARTITIONS * PER_PARTITION;
    assert_eq!(
        landed_on_both_shards(&table.qualified()).unwrap(),
        (total, total),
        "every id once"
    );
    assert!(found_by_id(&log) > 0, "{log}");
    // Whether the check after a held INSERT met the shards disagreeing depends on when shard
    // `a`'s second replica took the ALTER (its current host may still answer the old columns,
    // which agree with shard `b`); without the wait, such a meeting gives the part up, which
    // the exit code and the counts above catch.
    println!(
        "the sink waited for disagreeing shards: {}",
        log.contains(DISAGREEING)
    );
}

#[test]
fn without_an_id_column_such_a_part_stops_the_sink_with_the_check_to_run() {
    let Raced { table, code, log } = alter_racing_inserts("alter_race_noid", Layout::OneShard, "");
    assert_eq!(code, Some(1), "{log}");
    for expected in [
        "Not sending a part again into ClickHouse: default.",
        "was sent while the table's columns changed, so it may be in the table under other columns",
        "The sink cannot check this: `message_id_column` is not set. Check on every replica: `SELECT count(), uniqExact(ID), min(ID), max(ID) FROM default.",
        "Then set `message_id_column: ID` in the sink's parameters and restart",
    ] {
        assert!(log.contains(expected), "no `{expected}` in\n{log}");
    }
    // Nothing was sent twice meanwhile.
    let (rows, distinct) = count_uniq(A1, &table.qualified()).unwrap();
    assert_eq!(rows, distinct);
    assert!(rows < PARTITIONS * PER_PARTITION);
}

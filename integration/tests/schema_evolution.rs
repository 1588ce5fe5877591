//! Online schema evolution under an exactly-once sharded sink with kill -9s (issue 26, item 1,
//! live test (a)).
//!
//! While a generator writes through `ShardedClickHouseBatchingSink` into two shards (of two
//! replicas on ClickHouse 18.16, of one node on 26.9, where batches carry tokens), the table gets a column added with a DEFAULT, the stream's `partition` widened from
//! UInt32 to UInt64, and a column the stream does not write dropped; the worker is killed with
//! SIGKILL after each change and started again, as a supervisor would, and nothing else is done
//! by hand. Each change is adopted without a restart (the log says so), batches sealed before
//! the widening are re-encoded or found in the table by their ids, and in the end every id is
//! in the table once with the generator's values and the new column filled.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use flow_integration::generation::*;
use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 2;
const PER_PARTITION: u64 = 12_000;

/// Runs `alter` (with `{table}`) on one host of each shard and waits until every node's
/// `system.columns` holds `present` columns satisfying `condition` (on `name` and `type`).
fn alter_everywhere(
    generation: Generation,
    qualified: &str,
    table: &str,
    alter: &str,
    (condition, present): (&str, u64),
) {
    for node in [generation.shard_a()[0], generation.shard_b()[0]] {
        exec(node.http_port, &alter.replace("{table}", qualified)).unwrap();
    }
    for node in generation.nodes() {
        wait_until(Duration::from_secs(60), || {
            Ok(query_u64(
                node.http_port,
                &format!(
                    "SELECT count() FROM system.columns WHERE database = 'default' AND table = '{table}' AND {condition}"
                ),
            )? == present)
        })
        .unwrap();
    }
}

fn log_has(worker: &Worker, needle: &str) {
    wait_until(Duration::from_secs(60), || {
        Ok(std::fs::read_to_string(worker.log())?.contains(needle))
    })
    .unwrap_or_else(|err| panic!("{err:#}: no `{needle}` in the log\n{}", worker.log_tail()));
}

fn added_widened_and_dropped_columns_are_adopted_under_kill_9s_with_every_id_once(
    generation: Generation,
) {
    generation.require().unwrap();
    let t = unique_name("schema_evolution");
    let table = generation
        .create_table(
            "default",
            &t,
            &format!("{GENERATOR_COLUMNS}, note String DEFAULT 'unfed'"),
            "id",
        )
        .unwrap();
    let qualified = table.qualified();
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    let state = dir.path().join("state");
    let parameters = format!(
        "{{{}, sharding_key_columns: [user_id], table: {t}, message_id_column: id, schema_refresh_interval_ms: 500}}",
        generation.shard_hosts_param()
    );
    std::fs::write(
        &spec,
        GeneratorSpec::new("evolution", "ShardedClickHouseBatchingSink", parameters)
            .partitions(PARTITIONS)
            .epoch(500, 200)
            .count(PER_PARTITION)
            .rate(1_000)
            .dynamic("{max_rows_per_batch: 250, retry_backoff: 100ms}")
            .yaml(),
    )
    .unwrap();
    let mut runs = 0;
    let mut spawn = || {
        runs += 1;
        Worker::spawn(
            worker_bin!(),
            &spec,
            &state,
            dir.path().join(format!("worker-{runs}.log")),
        )
        .unwrap()
    };
    let landed = || landed_on_shards(generation, &qualified).unwrap().0;
    let progress = |worker: &Worker, by: u64| {
        let from = landed();
        wait_until(Duration::from_secs(60), || Ok(landed() >= from + by))
            .unwrap_or_else(|err| panic!("{err:#}: no progress\n{}", worker.log_tail()));
    };
    let mut logs = Vec::new();
    let mut worker = spawn();
    progress(&worker, 2_000);
    // Each change under the running sink, adopted (the log line names it), then a kill -9 and
    // a restart. The widening leaves batches sealed for UInt32 pending at the kill.
    let changes = [
        (
            "ALTER TABLE {table} ADD COLUMN region String DEFAULT 'eu'",
            ("name = 'region'", 1),
            "column `region` String DEFAULT 'eu' added",
        ),
        (
            "ALTER TABLE {table} MODIFY COLUMN partition UInt64",
            ("name = 'partition' AND type = 'UInt64'", 1),
            "column `partition` UInt32 is now `partition` UInt64",
        ),
        (
            "ALTER TABLE {table} DROP COLUMN note",
            ("name = 'note'", 0),
            "column `note` String DEFAULT 'unfed' dropped",
        ),
    ];
    for (index, (alter, columns, adopted)) in changes.into_iter().enumerate() {
        if index > 0 {
            worker = spawn();
            progress(&worker, 1_000);
        }
        alter_everywhere(generation, &qualified, &t, alter, columns);
        log_has(&worker, adopted);
        worker.kill_9().unwrap();
        logs.push(std::fs::read_to_string(worker.log()).unwrap());
    }
    let mut worker = spawn();
    let code = worker.wait_exit(Duration::from_secs(120)).unwrap();
    logs.push(std::fs::read_to_string(worker.log()).unwrap());
    let all = logs.join("\n");
    assert_eq!(code, Some(0), "{}", worker.log_tail());

    generation.sync("default", &t, &generation.nodes()).unwrap();
    let total = PARTITIONS * PER_PARTITION;
    let first_hosts = [generation.shard_a()[0], generation.shard_b()[0]];
    let landed = landed_on_shards(generation, &qualified).unwrap();
    assert!(
        landed == (total, total),
        "every id once: {landed:?} (rows, distinct ids) of {total}\n{}",
        duplicates_report(&qualified, &first_hosts)
    );
    for node in first_hosts {
        let wrong = query_u64(
            node.http_port,
            &format!("SELECT count() FROM {qualified} WHERE partition != id % 2 OR user_id != id % 1000 OR region != 'eu'"),
        )
        .unwrap();
        assert_eq!(
            wrong, 0,
            "rows with a value not the generator's on {}",
            node.name
        );
    }
    assert_eq!(
        pipeline_status(worker_bin!(), &state, "evolution")
            .unwrap()
            .unwrap()
            .batches(),
        0
    );
    let adopted = all
        .matches("the table's columns changed compatibly: adopted without a restart")
        .count();
    let found = all.matches("is in the table already").count();
    let widened = all.matches("is re-encoded for the wider column").count();
    println!(
        "adoptions logged: {adopted}; pending parts found in the table by id: {found}; re-encoded for the widened column: {widened}"
    );
    assert!(adopted >= 3, "{all}");
    assert!(!all.contains("changed incompatibly"), "{all}");
}
each_generation!(sync added_widened_and_dropped_columns_are_adopted_under_kill_9s_with_every_id_once);

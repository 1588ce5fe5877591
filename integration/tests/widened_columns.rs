//! A table column widened by `MODIFY COLUMN` under a generator (issue 24 item 9). The
//! generator's types are fixed (`partition` is uint32), so "declare the stream column as
//! uint64" could not be followed: now a column wider than the stream's type that holds every
//! value of it is accepted and written as its own type. A widening under a running sink is
//! adopted without a restart (issue 26, item 1): batches sealed before it are re-encoded for the
//! wider type where no attempt of theirs can be in the table, and every id lands once. A
//! narrowing is refused with the ALTER that fixes the table.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use flow_integration::worker::*;
use flow_integration::*;

const WIDENED: &str =
    "id UInt64, partition UInt64, offset UInt64, user_id UInt64, ts DateTime, payload String";

fn spec(pipeline: &str, table: &str, per_partition: u64, rate: u64) -> GeneratorSpec {
    GeneratorSpec::new(
        pipeline,
        "ClickHouseBatchingSink",
        format!(
            "{{hosts: ['{}', '{}'], database: default, table: {table}}}",
            A1.http_addr(),
            A2.http_addr()
        ),
    )
    .partitions(2)
    .epoch(500, 200)
    .count(per_partition)
    .rate(rate)
    .dynamic("{max_rows_per_batch: 500}")
}

/// Rows whose `partition` or `user_id` is not the generator's (`id % 2`, `id % 1000`).
fn wrong_rows(qualified: &str) -> u64 {
    query_u64(
        A1.http_port,
        &format!(
            "SELECT count() FROM {qualified} WHERE partition != id % 2 OR user_id != id % 1000"
        ),
    )
    .unwrap()
}

/// Alters `partition` to `ty` on a1 and waits until both replicas describe it so.
fn alter_partition(qualified: &str, ty: &str) {
    exec(
        A1.http_port,
        &format!("ALTER TABLE {qualified} MODIFY COLUMN partition {ty}"),
    )
    .unwrap();
    for node in SHARD_A {
        wait_until(Duration::from_secs(60), || {
            Ok(query_text(
                node.http_port,
                &format!("SELECT type FROM system.columns WHERE database = 'default' AND table = '{}' AND name = 'partition' FORMAT TSV", qualified.trim_start_matches("default.")),
            )?
            .trim()
                == ty)
        })
        .unwrap();
    }
}

/// Widens `partition` to UInt64 under the running `worker` and waits until its log says the
/// sink adopted the wider column.
fn widen_under(worker: &Worker, log: &std::path::Path, qualified: &str) {
    alter_partition(qualified, "UInt64");
    let adopted = "column `partition` UInt32 is now `partition` UInt64";
    wait_until(Duration::from_secs(60), || {
        Ok(std::fs::read_to_string(log)?.contains(adopted))
    })
    .unwrap_or_else(|err| panic!("{err:#}: no `{adopted}` in the log\n{}", worker.log_tail()));
}

#[test]
fn a_generator_writes_into_a_column_widened_from_its_type() {
    wait_for_cluster(Duration::from_secs(60)).unwrap();
    let t = unique_name("it_widened");
    let table = ReplicatedTable::create("default", &t, WIDENED, "id", &SHARD_A).unwrap();
    let dir = TestDir::new().unwrap();
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("widened", &t, 1_000, 0).yaml()).unwrap();
    let out = run_spec(
        worker_bin!(),
        &spec_path,
        &dir.path().join("state"),
        Duration::from_secs(120),
    )
    .unwrap();
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let qualified = table.qualified();
    assert_eq!(count_uniq(A1, &qualified).unwrap(), (2_000, 2_000));
    assert_eq!(wrong_rows(&qualified), 0);
}

#[test]
fn a_narrowed_column_is_refused_with_the_alter_that_fixes_the_table() {
    wait_for_cluster(Duration::from_secs(60)).unwrap();
    let t = unique_name("it_narrowed");
    let table = ReplicatedTable::create(
        "default",
        &t,
        "id UInt64, partition UInt16, offset UInt64, user_id UInt64, ts DateTime, payload String",
        "id",
        &SHARD_A,
    )
    .unwrap();
    let dir = TestDir::new().unwrap();
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("narrowed", &t, 100, 0).yaml()).unwrap();
    let out = run_spec(
        worker_bin!(),
        &spec_path,
        &dir.path().join("state"),
        Duration::from_secs(120),
    )
    .unwrap();
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    let expected = format!(
        "column `partition`: the stream has uint32 but the table has UInt16; declare the stream \
         column as uint16 or change the table column to UInt32. Where the stream's types are \
         fixed by its source (a generator), change the table: `ALTER TABLE `default`.`{t}` \
         MODIFY COLUMN `partition` UInt32` on every host, then restart"
    );
    assert!(out.stderr.contains(&expected), "{}", out.stderr);
    assert_eq!(count_uniq(A1, &table.qualified()).unwrap(), (0, 0));
}

#[test]
fn a_widening_under_a_running_sink_is_adopted_and_earlier_batches_are_re_encoded() {
    const PER_PARTITION: u64 = 20_000;
    wait_for_cluster(Duration::from_secs(60)).unwrap();
    let t = unique_name("it_widen_live");
    let table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &SHARD_A).unwrap();
    let qualified = table.qualified();
    let dir = TestDir::new().unwrap();
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(
        &spec_path,
        spec("widen_live", &t, PER_PARTITION, 2_000).yaml(),
    )
    .unwrap();
    let state = dir.path().join("state");
    let log = dir.path().join("worker.log");
    let mut worker = Worker::spawn(worker_bin!(), &spec_path, &state, log.clone()).unwrap();
    wait_until(Duration::from_secs(60), || {
        Ok(count_uniq(A1, &qualified)?.0 >= 2_000)
    })
    .unwrap();
    // Widened under the running sink: adopted at the next batch, no restart.
    widen_under(&worker, &log, &qualified);
    let code = worker.wait_exit(Duration::from_secs(120)).unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(code, Some(0), "{text}");
    println!(
        "batches re-encoded for the widened column: {}",
        text.matches("is re-encoded for the wider column").count()
    );
    sync_when_writable(A1, "default", &t, Duration::from_secs(60)).unwrap();
    assert_eq!(
        count_uniq(A1, &qualified).unwrap(),
        (2 * PER_PARTITION, 2 * PER_PARTITION),
        "every id once"
    );
    assert_eq!(wrong_rows(&qualified), 0);
    assert_eq!(
        pipeline_status(worker_bin!(), &state, "widen_live")
            .unwrap()
            .unwrap()
            .batches(),
        0
    );
}

/// An INSERT on its way while the column is widened: the proxy holds it until the sink adopted
/// the wider column, then the server reads its UInt32 bytes as UInt64 and refuses it (code 33,
/// `CANNOT_READ_ALL_DATA`). That answered refusal stored nothing, so the part is re-encoded for
/// the wider column at its next attempt; the sink must not give up, and every id lands once.
#[test]
fn an_insert_refused_because_a_widening_ran_under_it_is_re_encoded_at_the_next_attempt() {
    const ROWS: u64 = 2_000;
    wait_for_cluster(Duration::from_secs(60)).unwrap();
    let t = unique_name("it_widen_held");
    let table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &SHARD_A).unwrap();
    let qualified = table.qualified();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let proxy = rt
        .block_on(flow_integration::proxy::FaultProxy::start(
            A1.http_addr().parse().unwrap(),
        ))
        .unwrap();
    proxy.set_on_inserts(flow_integration::proxy::Fault::Hold);
    let dir = TestDir::new().unwrap();
    let spec_path = dir.path().join("spec.yaml");
    let yaml = GeneratorSpec::new(
        "widen_held",
        "ClickHouseBatchingSink",
        format!(
            "{{host: '{}', database: default, table: {t}, schema_refresh_interval_ms: 200}}",
            proxy.addr()
        ),
    )
    .partitions(2)
    .epoch(500, 200)
    .count(ROWS / 2)
    .dynamic("{max_rows_per_batch: 500, write_timeout: 60s, retry_backoff: 100ms}")
    .yaml();
    std::fs::write(&spec_path, yaml).unwrap();
    let log = dir.path().join("worker.log");
    let state = dir.path().join("state");
    let mut worker = Worker::spawn(worker_bin!(), &spec_path, &state, log.clone()).unwrap();
    wait_until(Duration::from_secs(60), || Ok(proxy.stats().held >= 1))
        .unwrap_or_else(|err| panic!("{err:#}: no INSERT held\n{}", worker.log_tail()));
    widen_under(&worker, &log, &qualified);
    proxy.set(flow_integration::proxy::Fault::Pass);
    let code = worker.wait_exit(Duration::from_secs(120)).unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("CANNOT_READ_ALL_DATA"),
        "the held INSERT was not refused for its narrower bytes: {text}"
    );
    assert!(
        text.contains("is re-encoded for the wider column"),
        "{text}"
    );
    sync_when_writable(A1, "default", &t, Duration::from_secs(60)).unwrap();
    assert_eq!(
        count_uniq(A1, &qualified).unwrap(),
        (ROWS, ROWS),
        "every id once"
    );
    assert_eq!(wrong_rows(&qualified), 0);
}

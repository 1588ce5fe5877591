//! Table templates for the classes without an outbox (issue 26 item 2): the generator's three
//! partitions into `<name>_{partition}` through `AtLeastOnceClickHouseSink` and
//! `AtMostOnceClickHouseSink` (ordered mode), with `<name>_2` missing at first.
//!
//! With `missing_table: dead_letter` (the default) the rows of partition 2 are dead letters
//! naming the table, committed with their epochs, while the other two tables get every row;
//! once the table exists, `dead-letters requeue` puts them into the sink's outbox and `drain`
//! sends them (after the INSERT leaves the outbox for at-least-once, before it for at-most-once).
//! With `missing_table: wait` the partition waits, and lands every row once the table exists.
//! No fault is injected, so both classes deliver every row exactly once and the counts are exact.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result};
use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 3;
/// Messages per partition.
const COUNT: u64 = 1_500;
/// The generator's columns.
const COLUMNS: &str =
    "id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime, payload String";
const CLASSES: [&str; 2] = ["AtLeastOnceClickHouseSink", "AtMostOnceClickHouseSink"];

fn create(name: &str, partition: u64) -> Result<ReplicatedTable> {
    let table = format!("{name}_{partition}");
    ReplicatedTable::create("default", &table, COLUMNS, "id", &SHARD_A)
}

fn spec(dir: &Path, pipeline: &str, class: &str, name: &str, extra: &str) -> Result<PathBuf> {
    let parameters = format!(
        "{{hosts: ['{}', '{}'], table: '{name}_{{partition}}'{extra}}}",
        A1.http_addr(),
        A2.http_addr()
    );
    let yaml = GeneratorSpec::new(pipeline, class, parameters)
        .partitions(PARTITIONS)
        .count(COUNT)
        .epoch(500, 300)
        .dynamic("{max_rows_per_batch: 200, retry_backoff: 100ms, max_retry_backoff: 1s}")
        .yaml();
    let spec = dir.join("spec.yaml");
    std::fs::write(&spec, yaml)?;
    Ok(spec)
}

/// One test run's tables (`_0` and `_1` exist, `_2` not yet), spec and state directory.
struct Setup {
    name: String,
    present: [ReplicatedTable; 2],
    dir: TestDir,
    spec: PathBuf,
    state: PathBuf,
}

impl Setup {
    /// `extra`: more sink parameters, each after a comma.
    fn new(prefix: &str, class: &str, extra: &str) -> Result<Setup> {
        let name = unique_name(prefix);
        let present = [create(&name, 0)?, create(&name, 1)?];
        let dir = TestDir::new()?;
        let spec = spec(dir.path(), prefix, class, &name, extra)?;
        let state = dir.path().join("state");
        Ok(Setup {
            name,
            present,
            dir,
            spec,
            state,
        })
    }
}

/// Every row of a table written by one partition, once.
fn assert_every_row_once(table: &ReplicatedTable, class: &str) -> Result<()> {
    let qualified = table.qualified();
    for node in SHARD_A {
        sync_when_writable(node, "default", &table.table, Duration::from_secs(60))?;
        assert_eq!(
            count_uniq(node, &qualified)?,
            (COUNT, COUNT),
            "{class}: {qualified} on {} holds every row of its partition once",
            node.name
        );
    }
    Ok(())
}

/// `status` shows one line per table under each sink partition: partitions 0 and 1 inserted
/// their tables' rows in batches cut by epoch (500 rows) and `max_rows_per_batch` (200): 9
/// each; partition 2's 1,500 requeued rows went together, cut only by `max_rows_per_batch`: 8
/// batches, not one INSERT per row.
fn assert_status_per_table(state: &Path, name: &str) -> Result<()> {
    let state_arg = state.display().to_string();
    let status = run_worker(
        worker_bin!(),
        &["status", "--state-dir", &state_arg],
        &[],
        Duration::from_secs(30),
    )?;
    assert_eq!(status.code, Some(0), "{}", status.stderr);
    for (table, rest) in [
        (0, " rows in 9 batches delivered, 0 insert errors\n"),
        (1, " rows in 9 batches delivered, 0 insert errors\n"),
        (2, " rows in 8 batches delivered, 0 insert errors\n"),
    ] {
        let line = format!("    table {name}_{table}: {COUNT}{rest}");
        assert!(status.stdout.contains(&line), "{line} in {}", status.stdout);
    }
    Ok(())
}

/// Both classes: the rows naming the missing table are dead letters naming it (the same text as
/// the exactly-once classes), the other tables get every row; once the table exists, `requeue`
/// and `drain` land the set-aside rows, exactly once each, and no dead letter is left.
// One test per class, so that the classes run side by side (each has its own tables).
#[test]
fn at_least_once_rows_naming_a_missing_table_are_dead_letters_and_land_once_requeued() -> Result<()>
{
    missing_table_rows_are_dead_letters_and_land_once_requeued(CLASSES[0])
}

#[test]
fn at_most_once_rows_naming_a_missing_table_are_dead_letters_and_land_once_requeued() -> Result<()>
{
    missing_table_rows_are_dead_letters_and_land_once_requeued(CLASSES[1])
}

#[test]
fn at_least_once_with_missing_table_wait_rows_wait_for_their_table_and_land_once() -> Result<()> {
    missing_table_wait_rows_land_once(CLASSES[0])
}

#[test]
fn at_most_once_with_missing_table_wait_rows_wait_for_their_table_and_land_once() -> Result<()> {
    missing_table_wait_rows_land_once(CLASSES[1])
}

fn missing_table_rows_are_dead_letters_and_land_once_requeued(class: &str) -> Result<()> {
    require_cluster()?;
    {
        let Setup {
            name,
            present,
            dir: _dir,
            spec,
            state,
        } = Setup::new("tno", class, "")?;
        let out = run_spec(worker_bin!(), &spec, &state, Duration::from_secs(120))?;
        assert_eq!(out.code, Some(0), "{class}: {}", out.stderr);
        for table in &present {
            assert_every_row_once(table, class)?;
        }

        let letters = export_dead_letters(worker_bin!(), &state)?;
        let target = format!("default.{name}_2");
        let mut offsets = BTreeSet::new();
        for letter in &letters {
            let reason = letter["reason"].as_str().unwrap_or_default();
            assert_eq!(
                letter["table"].as_str(),
                Some(target.as_str()),
                "{class}: {letter}"
            );
            assert_eq!(
                letter["row"]["partition"].as_u64(),
                Some(2),
                "{class}: {letter}"
            );
            assert!(
                reason.starts_with(&format!(
                    "table `default`.`{name}_2` does not exist: the table does not exist on 127.0.0.1:181"
                )) && reason.ends_with(&format!(
                    "Create `default`.`{name}_2` on every host of every shard. Create it, then `flow-worker dead-letters requeue` sends this row to it"
                )),
                "{class}: {reason}"
            );
            offsets.insert(
                letter["row"]["offset"]
                    .as_u64()
                    .context("a row without its offset")?,
            );
        }
        assert_eq!(
            offsets,
            (0..COUNT).collect::<BTreeSet<u64>>(),
            "{class}: exactly partition 2's rows are set aside, each once"
        );
        assert_eq!(letters.len() as u64, COUNT, "{class}");

        let missing = create(&name, 2)?;
        let requeue = dead_letters_command(worker_bin!(), "requeue", &state)?;
        assert_eq!(
            requeue.code,
            Some(0),
            "{class}: {}{}",
            requeue.stdout,
            requeue.stderr
        );
        assert!(
            requeue
                .stdout
                .contains(&format!("requeued {COUNT} dead letter(s) into the outbox")),
            "{class}: {}",
            requeue.stdout
        );
        let drain = drain_spec(worker_bin!(), &spec, &state, Duration::from_secs(120))?;
        assert_eq!(drain.code, Some(0), "{class}: {}", drain.stderr);
        for table in present.iter().chain([&missing]) {
            assert_every_row_once(table, class)?;
        }
        assert_eq!(
            export_dead_letters(worker_bin!(), &state)?.len(),
            0,
            "{class}"
        );
        // A second drain has nothing left to send: the requeued rows left the outbox.
        let again = drain_spec(worker_bin!(), &spec, &state, Duration::from_secs(60))?;
        assert_eq!(again.code, Some(0), "{class}: {}", again.stderr);
        assert_every_row_once(&missing, class)?;
        if class == "AtLeastOnceClickHouseSink" {
            assert_status_per_table(&state, &name)?;
        }
        println!("{class}: {COUNT} rows set aside while `{name}_2` was missing, requeued and landed once");
    }
    Ok(())
}

/// Both classes with `missing_table: wait`: the worker says it waits and keeps running while
/// the table is missing (the epoch is not committed, so the wait loses nothing even at most
/// once); once it exists every row lands once, and nothing is a dead letter.
fn missing_table_wait_rows_land_once(class: &str) -> Result<()> {
    require_cluster()?;
    {
        let Setup {
            name,
            present,
            dir,
            spec,
            state,
        } = Setup::new("tnw", class, ", missing_table: wait")?;
        let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run.log"))?;
        let waiting = format!("table `default`.`{name}_2` named by a row does not exist");
        wait_until(Duration::from_secs(30), || {
            Ok(std::fs::read_to_string(worker.log())?.contains(&waiting))
        })?;
        assert!(worker.running(), "{class}: {}", worker.log_tail());
        let missing = create(&name, 2)?;
        assert_eq!(
            worker.wait_exit(Duration::from_secs(120))?,
            Some(0),
            "{class}: {}",
            worker.log_tail()
        );
        for table in present.iter().chain([&missing]) {
            assert_every_row_once(table, class)?;
        }
        assert_eq!(
            export_dead_letters(worker_bin!(), &state)?.len(),
            0,
            "{class}"
        );
    }
    Ok(())
}

//! Many tables from one stream (issue 26 item 2): a JetStream stream of three event kinds into
//! three tables by `table: '<name>_{kind}'` through the sharded exactly-once sink, with `kill -9`s
//! and one table (`_buy`) created only mid-run.
//!
//! The first run reads the first half of the stream while `_buy` does not exist: its `buy` rows
//! become dead letters naming the table, the others land. The table is then created and the
//! worker killed twice more while the second half is published: the second half's `buy` rows
//! land in `_buy`. `dead-letters requeue` then puts the set-aside rows back and `drain` sends
//! them: every message is once in its table, on the shard it routes to, on both replicas. One
//! message whose kind makes no table name (`a-b`) is a dead letter naming the value and is kept
//! by the requeue.
//!
//! The other tests: `max_tables`, `missing_table: wait`, and the broker subject naming the tables
//! (`{subject[2]}` and a `tables:` map). Every test runs on both server generations (on 26.9 a
//! shard is one node, so there is no replica to compare).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use async_nats::jetstream;
use flow_integration::generation::*;
use flow_integration::nats::new_stream;
use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 4;
/// Messages 0..HALF are read before `_buy` exists, HALF..TOTAL after. An exactly-once sink
/// sends each requeued row as an INSERT of its own (2,000 here), which bounds HALF in CI.
const HALF: u64 = 6_000;
const TOTAL: u64 = 12_000;
/// The message whose kind makes no table name.
const BAD_ID: u64 = TOTAL;
const KINDS: [&str; 3] = ["click", "view", "buy"];
const COLUMNS: &str = "id UInt64, kind String, payload String";

fn kind(id: u64) -> &'static str {
    if id == BAD_ID {
        "a-b"
    } else {
        KINDS[(id % 3) as usize]
    }
}

/// Publishes `ids` (id `k` to subject `<prefix>.<subject(k)>`), awaiting the acknowledgements
/// of every 500: the client holds a publish back while too many are unanswered.
async fn publish(
    js: &jetstream::Context,
    prefix: &str,
    subject: fn(u64) -> String,
    ids: impl Iterator<Item = u64>,
) -> Result<()> {
    let ids: Vec<u64> = ids.collect();
    for chunk in ids.chunks(500) {
        let mut acks = Vec::with_capacity(chunk.len());
        for &id in chunk {
            let body = format!(
                r#"{{"id": {id}, "kind": "{}", "payload": "message {id}"}}"#,
                kind(id)
            );
            acks.push(
                js.publish(format!("{prefix}.{}", subject(id)), body.into())
                    .await?,
            );
        }
        for ack in acks {
            ack.await?;
        }
    }
    Ok(())
}

fn write_spec(generation: Generation, dir: &Path, stream: &str, name: &str) -> PathBuf {
    let yaml = format!(
        "pipeline: tables_it\npartitions: {PARTITIONS}\nepoch: {{max_messages: 3000, max_duration_ms: 300}}\n\
         source:\n  class: nats_jetstream\n  parameters:\n    servers: ['nats://{}']\n    stream: {stream}\n    subject_template: '{stream}.p.{{partition}}'\n    format: json\n    schema: [{{name: id, type: uint64}}, {{name: kind, type: string}}, {{name: payload, type: string}}]\n\
         sinks:\n  - name: out\n    sink_class_name: ShardedClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{{}, database: default, table: '{name}_{{kind}}'}}\n    dynamic_parameters: {{max_rows_per_batch: 1000, retry_backoff: 100ms, max_retry_backoff: 1s}}\n",
        nats::NATS_ADDR,
        generation.shard_hosts_param(),
    );
    let spec = dir.join("spec.yaml");
    std::fs::write(&spec, yaml).unwrap();
    spec
}

/// The subject of message `id` in the first test: one per partition.
fn by_partition(id: u64) -> String {
    (id % PARTITIONS).to_string()
}

/// Waits until `status` shows every partition of `pipeline` caught up with the stream.
fn wait_caught_up(state: &Path, worker: &Worker, pipeline: &str, partitions: u64) -> Result<()> {
    let mut lags = Vec::new();
    wait_until(Duration::from_secs(60), || {
        lags = partition_lags(worker_bin!(), state, pipeline)?;
        Ok(lags.len() == partitions as usize && lags.iter().all(|&lag| lag == Some(0)))
    })
    .with_context(|| format!("status shows lags {lags:?}\n{}", worker.log_tail()))
}

/// Each table's (rows, distinct ids) on both shards against the ids expected, with the doubled
/// ids and their parts where a table holds more rows than ids.
fn landed_report(generation: Generation, wanted: &[(&ReplicatedTable, u64)]) -> String {
    let mut report = String::new();
    let first_hosts = [generation.shard_a()[0], generation.shard_b()[0]];
    for (table, ids) in wanted {
        let qualified = table.qualified();
        let landed = landed_on_shards(generation, &qualified)
            .map(|(rows, distinct)| format!("{rows} rows, {distinct} ids"))
            .unwrap_or_else(|err| format!("unreadable: {err:#}"));
        report.push_str(&format!("  {qualified}: {landed}, expected {ids}\n"));
        report.push_str(&duplicates_report(&qualified, &first_hosts));
    }
    report
}

fn ids_of(kind_name: &str, range: std::ops::Range<u64>) -> u64 {
    range.filter(|&id| kind(id) == kind_name).count() as u64
}

/// The replicas of each shard hold the same rows (nothing to compare where a shard is one node).
fn replicas_agree(generation: Generation, qualified: &str) -> Result<()> {
    for shard in [generation.shard_a(), generation.shard_b()] {
        for pair in shard.windows(2) {
            assert_eq!(
                count_uniq(pair[0], qualified)?,
                count_uniq(pair[1], qualified)?,
                "{qualified} on {} and {}",
                pair[0].name,
                pair[1].name
            );
        }
    }
    Ok(())
}

/// `sql` (a count) summed over the first host of each shard.
fn summed_over_shards(generation: Generation, sql: &str) -> Result<u64> {
    Ok(query_u64(generation.shard_a()[0].http_port, sql)?
        + query_u64(generation.shard_b()[0].http_port, sql)?)
}

fn three_kinds_land_once_in_their_tables_and_rows_of_a_table_created_mid_run_are_requeued(
    generation: Generation,
) -> Result<()> {
    generation.require()?;
    let rt = tokio::runtime::Runtime::new()?;
    let name = unique_name("tables_it");
    let js = rt.block_on(new_stream(&name))?;
    let prefix = format!("{name}.p");
    let click = generation.create_table("default", &format!("{name}_click"), COLUMNS, "id")?;
    let view = generation.create_table("default", &format!("{name}_view"), COLUMNS, "id")?;
    let dir = TestDir::new()?;
    let spec = write_spec(generation, dir.path(), &name, &name);
    let state = dir.path().join("state");
    rt.block_on(publish(
        &js,
        &prefix,
        by_partition,
        (0..HALF).chain([BAD_ID]),
    ))?;

    // Run 1: `_buy` does not exist; the whole first half is committed.
    let log = |n: u32| dir.path().join(format!("w{n}.log"));
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, log(0))?;
    wait_caught_up(&state, &worker, "tables_it", PARTITIONS)?;
    worker.kill_9()?;
    let buy = generation.create_table("default", &format!("{name}_buy"), COLUMNS, "id")?;

    // Runs 2 to 4: the second half is published while the worker is killed twice.
    worker = Worker::spawn(worker_bin!(), &spec, &state, log(1))?;
    let publisher = {
        let (js, prefix) = (js.clone(), prefix.clone());
        rt.spawn(async move { publish(&js, &prefix, by_partition, HALF..TOTAL).await })
    };
    for run in 2..4 {
        std::thread::sleep(Duration::from_millis(2_000));
        if worker.exited()?.is_some() {
            bail!("the worker exited on its own\n{}", worker.log_tail());
        }
        worker.kill_9()?;
        worker = Worker::spawn(worker_bin!(), &spec, &state, log(run))?;
    }
    rt.block_on(publisher)??;
    let wanted = [
        (&click, ids_of("click", 0..TOTAL)),
        (&view, ids_of("view", 0..TOTAL)),
        (&buy, ids_of("buy", HALF..TOTAL)),
    ];
    let landed = wait_until(Duration::from_secs(60), || {
        for (table, ids) in &wanted {
            if landed_on_shards(generation, &table.qualified())? != (*ids, *ids) {
                return Ok(false);
            }
        }
        Ok(true)
    });
    if let Err(err) = landed {
        // A panic keeps the test directory (every worker's log) and the tables.
        panic!(
            "not every message landed once ({err:#}); (rows, distinct ids) per table against the ids expected:\n{}\n{}",
            landed_report(generation, &wanted),
            worker.log_tail()
        );
    }
    wait_caught_up(&state, &worker, "tables_it", PARTITIONS)?;
    worker.kill_9()?;

    // The first half's `buy` rows are dead letters naming the table; the `a-b` one names its value.
    let letters = export_dead_letters(worker_bin!(), &state)?;
    let buy_target = format!("default.{name}_buy");
    let mut set_aside = BTreeSet::new();
    let mut bad = Vec::new();
    for letter in &letters {
        let reason = letter["reason"].as_str().unwrap_or_default();
        let id = letter["row"]["id"]
            .as_u64()
            .context("a dead letter without its row id")?;
        if letter["table"].as_str() == Some(buy_target.as_str()) {
            assert!(
                reason.starts_with(&format!(
                    "table `default`.`{name}_buy` does not exist: the table does not exist on 127.0.0.1:1812"
                )) && reason.ends_with(&format!(
                    "Create `default`.`{name}_buy` on every host of every shard. Create it, then `flow-worker dead-letters requeue` sends this row to it"
                )),
                "{reason}"
            );
            set_aside.insert(id);
        } else {
            bad.push((id, reason.to_owned()));
        }
    }
    let first_half_buys: BTreeSet<u64> = (0..HALF).filter(|&id| kind(id) == "buy").collect();
    assert_eq!(
        set_aside, first_half_buys,
        "exactly the first half's buy rows are set aside"
    );
    assert_eq!(
        bad,
        vec![(
            BAD_ID,
            format!("table template `{name}_{{kind}}`: column `kind` holds `a-b`, which makes the table name `{name}_a-b`; a table name may only contain letters, digits and `_`. Fix the message, or map the value before this sink")
        )]
    );

    // Requeue: the set-aside rows go back to the outbox, the bad one stays; drain sends them.
    let requeue = dead_letters_command(worker_bin!(), "requeue", &state)?;
    assert_eq!(
        requeue.code,
        Some(1),
        "{}{}",
        requeue.stdout,
        requeue.stderr
    );
    assert!(
        requeue.stdout.contains(&format!(
            "requeued {} dead letter(s) into the outbox",
            first_half_buys.len()
        )) && requeue
            .stdout
            .contains("1 dead letter(s) cannot be requeued and were kept"),
        "{}",
        requeue.stdout
    );
    let (spec_arg, state_arg) = (spec.display().to_string(), state.display().to_string());
    let drain = run_worker(
        worker_bin!(),
        &["drain", &spec_arg, "--state-dir", &state_arg],
        &[],
        // A bound against a hang, not a timing check: each requeued row is its own INSERT,
        // 2,000 of them; 4,000 took a loaded 2-core machine over 60 s.
        Duration::from_secs(180),
    )?;
    assert_eq!(drain.code, Some(0), "{}", drain.stderr);

    for table in [&click, &view, &buy] {
        generation.sync("default", &table.table, &generation.nodes())?;
    }
    for (table, kind_name) in [(&click, "click"), (&view, "view"), (&buy, "buy")] {
        let qualified = table.qualified();
        let (rows, distinct) = landed_on_shards(generation, &qualified)?;
        assert_eq!(
            (rows, distinct),
            (ids_of(kind_name, 0..TOTAL), ids_of(kind_name, 0..TOTAL)),
            "{qualified}: every {kind_name} message once"
        );
        let other = summed_over_shards(
            generation,
            &format!("SELECT count() FROM {qualified} WHERE kind != '{kind_name}'"),
        )?;
        assert_eq!(other, 0, "{qualified} holds only {kind_name} rows");
        replicas_agree(generation, &qualified)?;
    }
    assert_eq!(export_dead_letters(worker_bin!(), &state)?.len(), 1);
    println!(
        "{TOTAL} messages into 3 tables over 4 runs; {} rows set aside while `_buy` was missing, requeued and landed once",
        first_half_buys.len()
    );
    let _ = rt.block_on(js.delete_stream(&name));
    Ok(())
}
each_generation!(
    sync three_kinds_land_once_in_their_tables_and_rows_of_a_table_created_mid_run_are_requeued
);

/// The generator's columns.
const GENERATOR_COLUMNS: &str =
    "id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime, payload String";

/// `max_tables` bounds the tables a template's rows may name: four partitions each naming a
/// table of their own (`{partition}`) under `max_tables: 3` write exactly three tables, and every
/// row of the fourth (whichever partition came last) is a dead letter naming the bound.
fn rows_naming_a_table_beyond_max_tables_are_dead_letters(generation: Generation) -> Result<()> {
    generation.require()?;
    let name = unique_name("maxt");
    let shard = generation.shard_a();
    let tables = (0..PARTITIONS)
        .map(|p| {
            generation.create_table_on(
                "default",
                &format!("{name}_{p}"),
                GENERATOR_COLUMNS,
                "id",
                shard,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let dir = TestDir::new()?;
    let spec = dir.path().join("spec.yaml");
    let parameters = format!(
        "{{{}, table: '{name}_{{partition}}', max_tables: 3}}",
        generation.hosts_param()
    );
    let yaml = GeneratorSpec::new("max_tables", "ClickHouseBatchingSink", parameters)
        .partitions(PARTITIONS)
        .count(500)
        .yaml();
    std::fs::write(&spec, yaml)?;
    let state = dir.path().join("state");
    let out = run_spec(worker_bin!(), &spec, &state, Duration::from_secs(120))?;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let mut counts = Vec::new();
    for table in &tables {
        generation.sync("default", &table.table, shard)?;
        counts.push(count_uniq(generation.first(), &table.qualified())?);
    }
    let written = counts.iter().filter(|&&c| c == (500, 500)).count();
    let empty = counts.iter().filter(|&&c| c == (0, 0)).count();
    assert_eq!((written, empty), (3, 1), "{counts:?}");
    let letters = export_dead_letters(worker_bin!(), &state)?;
    assert_eq!(letters.len(), 500);
    for letter in &letters {
        let reason = letter["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains(
                "but the sink's rows already named max_tables (3) tables; raise max_tables"
            ),
            "{reason}"
        );
    }
    Ok(())
}
each_generation!(sync rows_naming_a_table_beyond_max_tables_are_dead_letters);

/// `missing_table: wait`: a partition whose rows name a table that does not exist waits for it
/// (its epoch vetoed and read again) instead of setting rows aside; once the table is created
/// every row lands in it once, and there is no dead letter.
fn with_missing_table_wait_rows_wait_for_their_table_and_land_once_it_exists(
    generation: Generation,
) -> Result<()> {
    generation.require()?;
    let name = unique_name("waitt");
    let dir = TestDir::new()?;
    let spec = dir.path().join("spec.yaml");
    let parameters = format!(
        "{{{}, table: '{name}_{{partition}}', missing_table: wait}}",
        generation.hosts_param()
    );
    let yaml = GeneratorSpec::new("missing_wait", "ClickHouseBatchingSink", parameters)
        .partitions(1)
        .count(2_000)
        .yaml();
    std::fs::write(&spec, yaml)?;
    let state = dir.path().join("state");
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run.log"))?;
    // The worker says it waits, and is still running, before the table exists.
    let waiting = format!("table `default`.`{name}_0` named by a row does not exist");
    wait_until(Duration::from_secs(30), || {
        Ok(std::fs::read_to_string(worker.log())?.contains(&waiting))
    })?;
    assert!(worker.running(), "{}", worker.log_tail());
    let table = generation.create_table_on(
        "default",
        &format!("{name}_0"),
        GENERATOR_COLUMNS,
        "id",
        generation.shard_a(),
    )?;
    assert_eq!(
        worker.wait_exit(Duration::from_secs(60))?,
        Some(0),
        "{}",
        worker.log_tail()
    );
    generation.sync("default", &table.table, generation.shard_a())?;
    assert_eq!(
        count_uniq(generation.first(), &table.qualified())?,
        (2_000, 2_000)
    );
    assert_eq!(export_dead_letters(worker_bin!(), &state)?.len(), 0);
    Ok(())
}
each_generation!(sync with_missing_table_wait_rows_wait_for_their_table_and_land_once_it_exists);

/// The event subjects of the subject test, one per partition: `<stream>.p.<event>`.
const EVENTS: [&str; 3] = ["created", "cancelled", "shipped"];
const EVENT_MESSAGES: u64 = 6_000;

fn by_event(id: u64) -> String {
    EVENTS[(id % 3) as usize].to_owned()
}

/// The broker subject names the tables: three JetStream subjects `<stream>.p.created`,
/// `.cancelled`, `.shipped` (one per partition) into `<name>_<event>` by `{subject[2]}`, and into
/// `<name>_m_<event>` by a `tables:` map, through two sharded exactly-once sinks of one pipeline,
/// with a `kill -9` while the second half is published: every message once in its event's
/// table of each sink, on both replicas, and no dead letter.
fn jetstream_subjects_name_the_tables_by_token_and_by_map_once_across_a_kill(
    generation: Generation,
) -> Result<()> {
    generation.require()?;
    let rt = tokio::runtime::Runtime::new()?;
    let name = unique_name("subj_it");
    let js = rt.block_on(new_stream(&name))?;
    let prefix = format!("{name}.p");
    let mut tables = Vec::new();
    for event in EVENTS {
        for table in [format!("{name}_{event}"), format!("{name}_m_{event}")] {
            tables.push((
                event,
                generation.create_table("default", &table, COLUMNS, "id")?,
            ));
        }
    }
    let dir = TestDir::new()?;
    let shard_hosts = generation.shard_hosts_param();
    let subjects: Vec<String> = EVENTS.iter().map(|e| format!("'{prefix}.{e}'")).collect();
    let map: Vec<String> = EVENTS
        .iter()
        .map(|e| format!("'{prefix}.{e}': {name}_m_{e}"))
        .collect();
    let sink = |sink: &str, target: &str| {
        format!(
            "  - name: {sink}\n    sink_class_name: ShardedClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{{shard_hosts}, database: default, {target}}}\n    dynamic_parameters: {{max_rows_per_batch: 500, retry_backoff: 100ms, max_retry_backoff: 1s}}\n"
        )
    };
    let yaml = format!(
        "pipeline: subjects_it\npartitions: 3\nepoch: {{max_messages: 1000, max_duration_ms: 300}}\n\
         source:\n  class: nats_jetstream\n  parameters:\n    servers: ['nats://{}']\n    stream: {name}\n    subjects: [{}]\n    format: json\n    schema: [{{name: id, type: uint64}}, {{name: kind, type: string}}, {{name: payload, type: string}}]\n\
         sinks:\n{}{}",
        nats::NATS_ADDR,
        subjects.join(", "),
        sink("tokens", &format!("table: '{name}_{{subject[2]}}'")),
        sink("mapped", &format!("tables: {{{}}}", map.join(", "))),
    );
    let spec = dir.path().join("spec.yaml");
    std::fs::write(&spec, yaml)?;
    let state = dir.path().join("state");
    let half = EVENT_MESSAGES / 2;
    rt.block_on(publish(&js, &prefix, by_event, 0..half))?;

    let log = |n: u32| dir.path().join(format!("w{n}.log"));
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, log(0))?;
    let publisher = {
        let (js, prefix) = (js.clone(), prefix.clone());
        rt.spawn(async move { publish(&js, &prefix, by_event, half..EVENT_MESSAGES).await })
    };
    // Killed once the first rows landed, while the second half is being published.
    wait_until(Duration::from_secs(30), || {
        if worker.exited()?.is_some() {
            bail!("the worker exited on its own\n{}", worker.log_tail());
        }
        landed_on_shards(generation, &tables[0].1.qualified()).map(|(rows, _)| rows > 0)
    })?;
    let at_kill = landed_on_shards(generation, &tables[0].1.qualified())?.0;
    worker.kill_9()?;
    worker = Worker::spawn(worker_bin!(), &spec, &state, log(1))?;
    rt.block_on(publisher)??;
    let per_event = EVENT_MESSAGES / 3;
    wait_until(Duration::from_secs(60), || {
        for (_, table) in &tables {
            if landed_on_shards(generation, &table.qualified())?.0 != per_event {
                return Ok(false);
            }
        }
        Ok(true)
    })
    .with_context(|| format!("not every message landed\n{}", worker.log_tail()))?;
    wait_caught_up(&state, &worker, "subjects_it", 3)?;
    worker.kill_9()?;

    for (event, table) in &tables {
        let qualified = table.qualified();
        generation.sync("default", &table.table, &generation.nodes())?;
        assert_eq!(
            landed_on_shards(generation, &qualified)?,
            (per_event, per_event),
            "{qualified}: every {event} message once"
        );
        let stray_sql = format!(
            "SELECT count() FROM {qualified} WHERE id % 3 != {}",
            EVENTS.iter().position(|e| e == event).unwrap_or_default()
        );
        let stray = summed_over_shards(generation, &stray_sql)?;
        assert_eq!(stray, 0, "{qualified} holds only {event} messages");
        replicas_agree(generation, &qualified)?;
    }
    assert_eq!(export_dead_letters(worker_bin!(), &state)?.len(), 0);
    println!(
        "{EVENT_MESSAGES} messages of 3 subjects into 3 tables by `{{subject[2]}}` and 3 by `tables:`, across a kill -9 (at {at_kill} of {per_event} rows in the first): every message once"
    );
    let _ = rt.block_on(js.delete_stream(&name));
    Ok(())
}
each_generation!(sync jetstream_subjects_name_the_tables_by_token_and_by_map_once_across_a_kill);

/// Rows requeued while their table is still missing do not wedge their partition (issue 46
/// item 6): the next run sets them aside again as `missing_table: dead_letter` says, with the
/// same reason and table, and exits 0; once the table exists, a requeue lands each row once.
fn requeued_rows_for_a_table_still_missing_go_back_to_the_dead_letters(
    generation: Generation,
) -> Result<()> {
    const ROWS: u64 = 200;
    generation.require()?;
    let name = unique_name("tables_requeue_missing");
    let present =
        generation.create_table("default", &format!("{name}_0"), GENERATOR_COLUMNS, "id")?;
    let dir = TestDir::new()?;
    let (spec, state) = (dir.path().join("spec.yaml"), dir.path().join("state"));
    let parameters = format!(
        "{{{}, table: '{name}_{{partition}}'}}",
        generation.hosts_param()
    );
    std::fs::write(
        &spec,
        GeneratorSpec::new("requeue_missing", "ClickHouseBatchingSink", parameters)
            .partitions(2)
            .count(ROWS)
            .epoch(100, 200)
            .yaml(),
    )?;
    let run = |n: u32| -> Result<Worker> {
        let log = dir.path().join(format!("w{n}.log"));
        let mut worker = Worker::spawn(worker_bin!(), &spec, &state, log)?;
        let code = worker.wait_exit(Duration::from_secs(60))?;
        anyhow::ensure!(
            code == Some(0),
            "run {n}: exit {code:?}\n{}",
            worker.log_tail()
        );
        Ok(worker)
    };
    let missing_target = format!("default.{name}_1");
    let set_aside = || -> Result<usize> {
        let letters = export_dead_letters(worker_bin!(), &state)?;
        for letter in &letters {
            let reason = letter["reason"].as_str().unwrap_or_default();
            anyhow::ensure!(
                letter["table"].as_str() == Some(missing_target.as_str())
                    && reason.starts_with(&format!("table `default`.`{name}_1` does not exist")),
                "a dead letter not for the missing table: {letter}"
            );
        }
        Ok(letters.len())
    };
    let requeue = || -> Result<()> {
        let out = dead_letters_command(worker_bin!(), "requeue", &state)?;
        anyhow::ensure!(
            out.code == Some(0)
                && out
                    .stdout
                    .contains(&format!("requeued {ROWS} dead letter(s)")),
            "{}{}",
            out.stdout,
            out.stderr
        );
        Ok(())
    };

    run(1)?;
    assert_eq!(set_aside()?, ROWS as usize, "partition 1's rows set aside");
    requeue()?;
    let second = run(2)?;
    assert_eq!(set_aside()?, ROWS as usize, "set aside again, each once");
    let log = std::fs::read_to_string(second.log())?;
    assert!(
        log.contains("a requeued row's table still does not exist"),
        "{log}"
    );

    let created =
        generation.create_table("default", &format!("{name}_1"), GENERATOR_COLUMNS, "id")?;
    requeue()?;
    run(3)?;
    assert_eq!(set_aside()?, 0);
    for table in [&present, &created] {
        generation.sync("default", &table.table, &generation.nodes())?;
        let landed = landed_on_shards(generation, &table.qualified())?;
        assert_eq!(
            landed,
            (ROWS, ROWS),
            "{}: every row once",
            table.qualified()
        );
    }
    Ok(())
}
each_generation!(sync requeued_rows_for_a_table_still_missing_go_back_to_the_dead_letters);

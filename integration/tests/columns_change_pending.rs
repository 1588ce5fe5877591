//! A batch a killed run stored without acknowledging it, still pending in the next run when the
//! table's columns change, lands once (ClickHouse 18.16: no `insert_deduplication_token`).
//!
//! Under other columns the same bytes are another block, so the server would not drop a resend
//! as a replay. Run 1 seals one batch; its INSERT is held at a proxy, the worker frozen, the
//! INSERT let through (stored) and the worker killed: the batch is pending, nothing marks it.
//! Run 2 starts under the same columns; its attempt is held, a column is added and adopted, and
//! the held attempt is cut: the retry would go out under the new columns. The sink must instead
//! look for the batch's ids in the table, find them and acknowledge it without a resend.
//!
//! The same holds for a table of a template (issue 46 item 5), whose columns change while the
//! worker is stopped: the start-time check compares them with those the table's own attempts
//! were made under (a record per table, not one per partition shared by its tables).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use flow_integration::generation::*;
use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;

const ROWS: u64 = 300;

/// Polls `reached` every 20 ms until it holds; fails naming `what` once `timeout` passed.
fn wait_for(what: &str, timeout: Duration, mut reached: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !reached() {
        assert!(Instant::now() < deadline, "{what} within {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_stored_unacknowledged_batch_pending_across_a_column_change_is_found_not_sent_again() {
    require_cluster().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let t = unique_name("columns_pending");
    let table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &[A1]).unwrap();
    let qualified = table.qualified();
    let proxy = rt
        .block_on(FaultProxy::start(A1.http_addr().parse().unwrap()))
        .unwrap();
    let dir = TestDir::new().unwrap();
    let (spec, state) = (dir.join("spec.yaml"), dir.join("state"));
    let parameters = format!(
        "{{host: '{}', table: {t}, message_id_column: id, schema_refresh_interval_ms: 200}}",
        proxy.addr()
    );
    std::fs::write(
        &spec,
        GeneratorSpec::new("pending", "ClickHouseBatchingSink", parameters)
            .epoch(10_000, 200)
            .count(ROWS)
            .dynamic("{retry_backoff: 100ms, max_retry_backoff: 200ms}")
            .yaml(),
    )
    .unwrap();
    let held = || proxy.stats().held;
    let rows = || query_u64(A1.http_port, &format!("SELECT count() FROM {qualified}")).unwrap();

    // Run 1: the batch is stored while the worker is frozen, then the worker is killed.
    proxy.set_on_inserts(Fault::Hold);
    let mut first = Worker::spawn(worker_bin!(), &spec, &state, dir.join("worker-1.log")).unwrap();
    wait_for("run 1's INSERT held", Duration::from_secs(30), || {
        held() >= 1
    });
    first.signal("STOP").unwrap();
    proxy.set_on_inserts(Fault::Pass);
    wait_for("run 1's batch stored", Duration::from_secs(30), || {
        rows() == ROWS
    });
    first.kill_9().unwrap();

    // Run 2: its attempt is held while a column is added and adopted, then cut.
    proxy.set_on_inserts(Fault::Hold);
    let mut second = Worker::spawn(worker_bin!(), &spec, &state, dir.join("worker-2.log")).unwrap();
    wait_for("run 2's INSERT held", Duration::from_secs(30), || {
        held() >= 2
    });
    exec(
        A1.http_port,
        &format!("ALTER TABLE {qualified} ADD COLUMN region String DEFAULT 'eu'"),
    )
    .unwrap();
    wait_until(Duration::from_secs(30), || {
        Ok(std::fs::read_to_string(second.log())?
            .contains("column `region` String DEFAULT 'eu' added"))
    })
    .unwrap_or_else(|err| panic!("{err:#}: the addition not adopted\n{}", second.log_tail()));
    let cuts = proxy.stats().cuts;
    proxy.set_on_inserts(Fault::CutRequestAfter(1));
    wait_for("run 2's held INSERT cut", Duration::from_secs(30), || {
        proxy.stats().cuts > cuts
    });
    proxy.set_on_inserts(Fault::Pass);
    let code = second.wait_exit(Duration::from_secs(60)).unwrap();
    assert_eq!(code, Some(0), "{}", second.log_tail());

    let (count, unique) = count_uniq(A1, &qualified).unwrap();
    assert!(
        (count, unique) == (ROWS, ROWS),
        "every id once: ({count}, {unique}) (rows, distinct ids) of {ROWS}\n{}",
        duplicates_report(&qualified, &[A1])
    );
    let log = std::fs::read_to_string(second.log()).unwrap();
    assert!(
        log.contains("is in the table already"),
        "the batch was not looked for in the table:\n{log}"
    );
    println!("proxy: {:?}", proxy.stats());
}

/// A templated exactly-once sink's part, stored by a run killed before its acknowledgement and
/// pending while a column is added with the worker stopped, lands once: the next run finds it
/// in the table by id (18.16, no tokens) or its token is recognised (26.9).
fn a_templated_tables_part_stored_before_a_kill_and_pending_across_an_alter_lands_once(
    generation: Generation,
) -> anyhow::Result<()> {
    generation.require()?;
    let node = generation.first();
    let name = unique_name("columns_pending_tpl");
    let t = format!("{name}_0");
    let table = generation.create_table_on("default", &t, GENERATOR_COLUMNS, "id", &[node])?;
    let qualified = table.qualified();
    let rt = tokio::runtime::Runtime::new()?;
    let proxy = rt.block_on(FaultProxy::start(node.http_addr().parse()?))?;
    let dir = TestDir::new()?;
    let (spec, state) = (dir.join("spec.yaml"), dir.join("state"));
    let parameters = format!(
        "{{host: '{}', table: '{name}_{{partition}}', message_id_column: id}}",
        proxy.addr()
    );
    std::fs::write(
        &spec,
        GeneratorSpec::new("pending_tpl", "ClickHouseBatchingSink", parameters)
            .epoch(10_000, 200)
            .count(ROWS)
            .dynamic("{retry_backoff: 100ms, max_retry_backoff: 200ms}")
            .yaml(),
    )?;
    let rows = || query_u64(node.http_port, &format!("SELECT count() FROM {qualified}"));

    // Run 1: the part is stored while the worker is frozen, then the worker is killed.
    proxy.set_on_inserts(Fault::Hold);
    let mut first = Worker::spawn(worker_bin!(), &spec, &state, dir.join("worker-1.log"))?;
    wait_for("run 1's INSERT held", Duration::from_secs(30), || {
        proxy.stats().held >= 1
    });
    first.signal("STOP")?;
    proxy.set_on_inserts(Fault::Pass);
    wait_for("run 1's part stored", Duration::from_secs(30), || {
        rows().is_ok_and(|n| n == ROWS)
    });
    first.kill_9()?;

    // With the worker stopped, the table gets a column; run 2 starts with the part pending.
    exec(
        node.http_port,
        &format!("ALTER TABLE {qualified} ADD COLUMN region String DEFAULT 'eu'"),
    )?;
    let mut second = Worker::spawn(worker_bin!(), &spec, &state, dir.join("worker-2.log"))?;
    let code = second.wait_exit(Duration::from_secs(60))?;
    anyhow::ensure!(
        code == Some(0),
        "run 2 exit {code:?}\n{}",
        second.log_tail()
    );

    let (count, unique) = count_uniq(node, &qualified)?;
    anyhow::ensure!(
        (count, unique) == (ROWS, ROWS),
        "every id once: ({count}, {unique}) (rows, distinct ids) of {ROWS}\n{}",
        duplicates_report(&qualified, &[node])
    );
    if !generation.has_tokens() {
        let log = std::fs::read_to_string(second.log())?;
        anyhow::ensure!(
            log.contains("is in the table already"),
            "the part was not looked for in the table:\n{log}"
        );
    }
    Ok(())
}
each_generation!(sync a_templated_tables_part_stored_before_a_kill_and_pending_across_an_alter_lands_once);

//! A full disk under the state directory (issue 13, item 5): the worker stops with one clear
//! error and a non-zero exit within seconds, instead of hanging in the store's flush; a later run
//! with space continues. The state directory is a small tmpfs mounted for the test (the tests run
//! as root, as CI does); the sink writes to a table on a1.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use flow_integration::worker::Worker;
use flow_integration::{
    exec, query_u64, replicated_table_ddl, unique_name, wait_for_cluster, worker_bin, A1, HOST,
};

/// Unmounts the tmpfs when the test ends, however it ends.
struct Mounted<'a>(&'a Path);

impl Drop for Mounted<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0).status();
    }
}

#[test]
fn a_full_state_disk_stops_the_worker_with_one_clear_error_within_seconds() -> anyhow::Result<()> {
    wait_for_cluster(Duration::from_secs(120))?;
    let table = unique_name("harden_disk_full");
    // Replicated (one replica): 18.16 deduplicates a replayed INSERT only there.
    exec(
        A1.http_port,
        &replicated_table_ddl(
            "default",
            &table,
            "id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime, payload String",
            "id",
        ),
    )?;
    let dir = flow_integration::TestDir::new()?;
    let disk = dir.path().join("disk");
    std::fs::create_dir(&disk)?;
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=3m", "tmpfs"])
        .arg(&disk)
        .status()
        .context("running mount")?;
    ensure!(
        mounted.success(),
        "cannot mount a tmpfs (the tests need root)"
    );
    let _unmount = Mounted(&disk);
    // Leave the store a few hundred kilobytes.
    std::fs::write(disk.join("filler"), vec![0u8; 2700 * 1024])?;

    let spec = dir.path().join("spec.yaml");
    std::fs::write(
        &spec,
        format!(
            "pipeline: harden_disk_full\nepoch: {{max_messages: 100, max_duration_ms: 10}}\nsource: {{class: generator, parameters: {{count: 0, payload_bytes: 4, rate_per_second: 20000}}}}\nsinks:\n  - name: out\n    sink_class_name: ClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{host: '{HOST}:{}', table: {table}}}\n    dynamic_parameters: {{max_rows_per_batch: 100}}\n",
            A1.http_port
        ),
    )?;
    let state = disk.join("state");
    let started = Instant::now();
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run1.log"))?;
    let code = worker
        .wait_exit(Duration::from_secs(60))
        .context("the worker must stop by itself on a full disk")?;
    let log = std::fs::read_to_string(worker.log())?;
    ensure!(code == Some(1), "exit {code:?}\n{log}");
    ensure!(
        log.contains("No space left on device"),
        "the error must name the cause\n{log}"
    );
    ensure!(
        started.elapsed() < Duration::from_secs(45),
        "took {:?}",
        started.elapsed()
    );

    // With space again, the next run goes on from the committed state (the first run committed
    // well below this count): every id lands once.
    std::fs::remove_file(disk.join("filler"))?;
    let finite = std::fs::read_to_string(&spec)?
        .replace("count: 0", "count: 100000")
        .replace("rate_per_second: 20000", "rate_per_second: 0");
    std::fs::write(&spec, finite)?;
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("run2.log"))?;
    let code = worker.wait_exit(Duration::from_secs(120))?;
    let log = std::fs::read_to_string(worker.log())?;
    ensure!(code == Some(0), "exit {code:?}\n{log}");
    let rows = query_u64(
        A1.http_port,
        &format!("SELECT count() FROM default.{table}"),
    )?;
    let distinct = query_u64(
        A1.http_port,
        &format!("SELECT uniqExact(id) FROM default.{table}"),
    )?;
    ensure!(
        rows == 100_000 && distinct == 100_000,
        "{rows} rows, {distinct} distinct\n{log}"
    );
    exec(A1.http_port, &format!("DROP TABLE default.{table}"))?;
    Ok(())
}

//! The examples of `examples/` (crate `flow-examples`) run as programs against the local cluster:
//! each writes to a table of its own and checks its result itself (exit 0 only if its counts are
//! exact); the test checks the table once more (rows and distinct ids on both replicas after
//! `SYSTEM SYNC REPLICA`). The examples are built as bins of this package (`src/bin/*-it.rs`).
//! Also: the README's embedding program is `examples/generator_to_clickhouse.rs`, verbatim.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use flow_integration::*;

/// The binary of example `name`: built with this package (`src/bin/<name>-it.rs` includes the
/// example's source), so that it is as fresh as this test.
fn example_bin(name: &str) -> Result<PathBuf> {
    let bin = match name {
        "generator_to_clickhouse" => env!("CARGO_BIN_EXE_generator-to-clickhouse-it"),
        "custom_plugins" => env!("CARGO_BIN_EXE_custom-plugins-it"),
        other => bail!("no binary is built for example `{other}`"),
    };
    Ok(PathBuf::from(bin))
}

/// Runs example `name` with `args`, failing on a non-zero exit or after `timeout` (then killed).
fn run_example(name: &str, args: &[&str], timeout: Duration) -> Result<String> {
    let bin = example_bin(name)?;
    let mut child = Command::new(&bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let deadline = Instant::now() + timeout;
    while child.try_wait()?.is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("example {name} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let output = child.wait_with_output()?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        bail!("example {name} failed ({}): {stdout}", output.status);
    }
    Ok(stdout)
}

/// Rows and distinct ids of `default.<table>` on each replica of shard `a`, after syncing it.
fn counts_on_shard_a(table: &str) -> Result<Vec<Vec<u64>>> {
    SHARD_A
        .iter()
        .map(|node| {
            sync_replica(node.http_port, &format!("default.{table}"))?;
            query_u64s(
                node.http_port,
                &format!("SELECT count(), uniqExact(id) FROM default.{table}"),
            )
        })
        .collect()
}

/// Drops the table an example created on both replicas of shard `a`, whatever the outcome.
fn drop_afterwards(table: &str) -> DropGuard {
    DropGuard {
        tables: SHARD_A
            .iter()
            .map(|node| (node.http_port, format!("default.{table}")))
            .collect(),
    }
}

const SHARD_A_HOSTS: &str = "127.0.0.1:18123,127.0.0.1:18124";

#[test]
fn generator_to_clickhouse_lands_every_generated_row_once_on_both_replicas() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let table = unique_name("example_generator");
    let _drop = drop_afterwards(&table);
    let out = run_example(
        "generator_to_clickhouse",
        &[&table, SHARD_A_HOSTS],
        Duration::from_secs(180),
    )
    .unwrap();
    assert!(
        out.contains(&format!(
            "127.0.0.1:18124: 10000 rows, 10000 distinct ids in {table}"
        )),
        "{out}"
    );
    assert_eq!(
        counts_on_shard_a(&table).unwrap(),
        vec![vec![10_000, 10_000], vec![10_000, 10_000]]
    );
}

#[test]
fn custom_plugins_lands_every_line_once_and_counts_every_word() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let table = unique_name("example_custom");
    let _drop = drop_afterwards(&table);
    let out = run_example(
        "custom_plugins",
        &[&table, SHARD_A_HOSTS],
        Duration::from_secs(180),
    )
    .unwrap();
    // 3000 lines `line <i>` plus i % 7 times ` word`, in 3 partitions by i % 3.
    assert!(
        out.contains("WordTotals per partition: {0: 4999, 1: 4998, 2: 4997}"),
        "{out}"
    );
    assert_eq!(
        counts_on_shard_a(&table).unwrap(),
        vec![vec![3000, 3000], vec![3000, 3000]]
    );
}

#[test]
fn the_readme_embedding_program_is_the_generator_example_verbatim() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let example =
        std::fs::read_to_string(root.join("examples/generator_to_clickhouse.rs")).unwrap();
    let section = readme
        .split_once("## Embedding a pipeline in a Rust program")
        .map(|(_, rest)| rest)
        .unwrap_or_default();
    let program = section
        .split_once("```rust\n")
        .and_then(|(_, rest)| rest.split_once("```\n"))
        .map(|(program, _)| program)
        .unwrap_or_default();
    assert_eq!(program, example);
}

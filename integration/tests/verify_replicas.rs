//! `flow-worker verify` against a real orphan part (issue 13, case 10), made on shard a the way
//! a ZooKeeper outage makes one: a1 writes a part whose ZooKeeper records are lost (the INSERT
//! that was answered 319), the same rows then land again as a proper part (flow's retry), so a1
//! holds them twice and a2 once. The lost records are removed with ZooKeeper's own CLI while a2's
//! fetches are stopped. `verify` must name a1 and the part, and pass once a1 is re-attached.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use flow_integration::generation::*;
use flow_integration::worker::*;
use flow_integration::*;

const ZK_CLI: &str = "/usr/share/zookeeper/bin/zkCli.sh";

/// Runs one zkCli command against the cluster's ZooKeeper; returns its stdout.
fn zk_cli(args: &[&str]) -> Result<String> {
    let out = Command::new(ZK_CLI)
        .args(["-server", "127.0.0.1:12181"])
        .args(args)
        .output()
        .with_context(|| format!("running {ZK_CLI}"))?;
    ensure!(out.status.success(), "zkCli {args:?}: {:?}", out.status);
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The children zkCli's `ls` printed last (`[a, b]`).
fn zk_children(path: &str) -> Result<Vec<String>> {
    let out = zk_cli(&["ls", path])?;
    let list = out
        .lines()
        .rev()
        .find(|l| l.starts_with('['))
        .with_context(|| format!("no listing of {path} in {out:?}"))?;
    Ok(list
        .trim_matches(|c| c == '[' || c == ']')
        .split(", ")
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect())
}

fn active_parts(node: Node, database: &str, table: &str) -> Result<String> {
    query_text(
        node.http_port,
        &format!("SELECT name FROM system.parts WHERE database = '{database}' AND table = '{table}' AND active ORDER BY name FORMAT TSV"),
    )
}

fn write_spec(dir: &Path, table: &str, hosts: &[Node]) -> Result<std::path::PathBuf> {
    let spec = dir.join("spec.yaml");
    let hosts: Vec<String> = hosts
        .iter()
        .map(|n| format!("'{}'", n.http_addr()))
        .collect();
    std::fs::write(
        &spec,
        format!(
            "pipeline: verify_orphans\nsource:\n  class: generator\n  parameters: {{count: 10}}\nsinks:\n  - name: ch\n    sink_class_name: ClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{hosts: [{}], table: {table}}}\n",
            hosts.join(", ")
        ),
    )?;
    Ok(spec)
}

#[test]
fn verify_names_the_replica_holding_an_orphan_part_and_passes_after_reattaching_it() -> Result<()> {
    wait_for_cluster(Duration::from_secs(120))?;
    let name = unique_name("verify_orphans");
    let table = ReplicatedTable::create("default", &name, "id UInt64", "id", &[A1, A2])?;
    let qualified = table.qualified();
    let dir = TestDir::new()?;
    let spec = write_spec(dir.path(), &name, &SHARD_A)?;

    exec(
        A1.http_port,
        &format!("INSERT INTO {qualified} SELECT number FROM system.numbers LIMIT 100"),
    )?;
    sync_replica(A2.http_port, &qualified)?;
    let (code, sinks) = verify_json(worker_bin!(), &spec)?;
    assert_eq!(code, Some(0), "{sinks:?}");
    assert_eq!(sinks[0]["shards"][0]["verdict"]["verdict"], "consistent");

    // The ambiguous INSERT: a1 keeps the part, its ZooKeeper records go.
    let zk_path = query_text(
        A1.http_port,
        &format!("SELECT zookeeper_path FROM system.replicas WHERE database = 'default' AND table = '{name}' FORMAT TSV"),
    )?
    .trim()
    .to_owned();
    exec(A2.http_port, &format!("SYSTEM STOP FETCHES {qualified}"))?;
    let before = active_parts(A1, "default", &name)?;
    // insert_deduplicate=0: the lost INSERT registered no block id, so the retry is not dropped.
    let reply = http_request(
        A1.http_port,
        "POST",
        "/?insert_deduplicate=0",
        &[],
        format!("INSERT INTO {qualified} SELECT number + 100 FROM system.numbers LIMIT 10")
            .as_bytes(),
    )?;
    ensure!(reply.status == 200, "orphan insert: {}", reply.text());
    let after = active_parts(A1, "default", &name)?;
    let orphan = after
        .lines()
        .find(|p| !before.lines().any(|b| b == *p))
        .context("the new part")?
        .to_owned();
    for entry in zk_children(&format!("{zk_path}/replicas/a2/queue"))? {
        zk_cli(&["delete", &format!("{zk_path}/replicas/a2/queue/{entry}")])?;
    }
    zk_cli(&[
        "deleteall",
        &format!("{zk_path}/replicas/a1/parts/{orphan}"),
    ])?;
    // a2 re-reads its (now empty) queue; the retry lands the same rows as a proper part.
    reattach(A2, &qualified)?;
    exec(
        A1.http_port,
        &format!("INSERT INTO {qualified} SELECT number + 100 FROM system.numbers LIMIT 10"),
    )?;
    sync_replica(A2.http_port, &qualified)?;
    assert_eq!(count_uniq(A1, &qualified)?, (120, 110));
    assert_eq!(count_uniq(A2, &qualified)?, (110, 110));

    let (code, sinks) = verify_json(worker_bin!(), &spec)?;
    assert_eq!(code, Some(2), "{sinks:?}");
    let verdict = &sinks[0]["shards"][0]["verdict"];
    assert_eq!(verdict["verdict"], "diverged", "{verdict}");
    assert_eq!(
        verdict["replicas"],
        serde_json::json!([A1.http_addr()]),
        "{verdict}"
    );
    assert_eq!(
        reported_orphans(&sinks),
        vec![(A1.http_addr(), orphan.clone(), 10)]
    );

    reattach(A1, &qualified)?;
    assert_eq!(count_uniq(A1, &qualified)?, (110, 110));
    let (code, sinks) = verify_json(worker_bin!(), &spec)?;
    assert_eq!(code, Some(0), "{sinks:?}");
    assert_eq!(sinks[0]["shards"][0]["verdict"]["rows"], 110);
    Ok(())
}

/// Issue 24 item 12: a plain MergeTree table on two hosts holds independent rows, so their
/// counts differ; `verify` must say the table does not replicate (nothing to compare), exit 0,
/// and not call it diverged nor advise DETACH/ATTACH. On 18.16 the hosts are a1 and a2; on 26.9
/// m1 and m2 with the table a modern exactly-once user has there (MergeTree with a
/// deduplication window), since the modern nodes cannot replicate at all.
fn verify_says_a_plain_merge_tree_does_not_replicate(generation: Generation) -> Result<()> {
    generation.require()?;
    let name = unique_name("verify_plain");
    let hosts = &generation.nodes()[..2];
    let engine = match generation {
        Generation::V18 => "MergeTree ORDER BY id".to_owned(),
        Generation::V26 => generation.engine("default", &name, "id"),
    };
    let mut tables = DropGuard::default();
    for node in hosts {
        tables.create(
            node.http_port,
            &format!("default.{name}"),
            &format!("CREATE TABLE default.{name} (id UInt64) ENGINE = {engine}"),
        )?;
    }
    exec(
        hosts[0].http_port,
        &format!("INSERT INTO default.{name} SELECT number FROM system.numbers LIMIT 10"),
    )?;
    let dir = TestDir::new()?;
    let spec = write_spec(dir.path(), &name, hosts)?;
    let (first, second) = (hosts[0].http_addr(), hosts[1].http_addr());

    let (code, sinks) = verify_json(worker_bin!(), &spec)?;
    assert_eq!(code, Some(0), "{sinks:?}");
    assert_eq!(
        sinks[0]["shards"][0]["verdict"],
        serde_json::json!({
            "verdict": "not_replicated",
            "engine": "MergeTree",
            "endpoints": [first, second],
        })
    );

    let spec_arg = spec.display().to_string();
    let out = run_worker(
        worker_bin!(),
        &["verify", &spec_arg],
        &[],
        Duration::from_secs(60),
    )?;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(
        out.stdout,
        format!(
            "sink `ch`:\n  the table: not replicated: default.{name} is a MergeTree table on {first}, {second}, which does not replicate, so there are no replicas to compare and nothing was checked; each endpoint's table holds only the rows sent to it. For replicas that verify can compare, use a ReplicatedMergeTree table\n    {first}: 10 rows\n    {second}: 0 rows\n",
        )
    );
    Ok(())
}
each_generation!(sync verify_says_a_plain_merge_tree_does_not_replicate);

/// Issue 46 item 4: a templated sink's tables are each verified (on `acbb5bf` verify asked for a
/// table literally named by the template, was answered UNKNOWN_TABLE and exited 1): the two
/// tables `<name>_{partition}` names are reported, a table the template cannot name is not.
fn verify_checks_every_table_a_template_names(generation: Generation) -> Result<()> {
    generation.require()?;
    let name = unique_name("verify_tpl");
    let hosts = generation.shard_a();
    let _zero =
        generation.create_table_on("default", &format!("{name}_0"), "id UInt64", "id", hosts)?;
    let _one =
        generation.create_table_on("default", &format!("{name}_1"), "id UInt64", "id", hosts)?;
    let _other =
        generation.create_table_on("default", &format!("{name}x"), "id UInt64", "id", hosts)?;
    let dir = TestDir::new()?;
    let spec = dir.path().join("spec.yaml");
    std::fs::write(
        &spec,
        format!(
            "pipeline: verify_tpl\nsource:\n  class: generator\n  parameters: {{count: 10}}\nsinks:\n  - name: ch\n    sink_class_name: ClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{{}, table: '{name}_{{partition}}'}}\n",
            generation.hosts_param()
        ),
    )?;
    let (code, sinks) = verify_json(worker_bin!(), &spec)?;
    assert_eq!(code, Some(0), "{sinks:?}");
    let tables: Vec<&str> = sinks[0]["shards"]
        .as_array()
        .context("shards")?
        .iter()
        .filter_map(|shard| shard["table"].as_str())
        .collect();
    assert_eq!(
        tables,
        [format!("default.{name}_0"), format!("default.{name}_1")],
        "{sinks:?}"
    );
    Ok(())
}
each_generation!(sync verify_checks_every_table_a_template_names);

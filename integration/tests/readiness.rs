//! `/health` and `/ready` on the metrics listener, against the real cluster: a sharded
//! exactly-once pipeline whose shard `b` sits behind fault proxies that refuse from the start.
//! While `b` refuses, `/health` is 200 and `/ready` is 503 naming shard `b` and its hosts; once
//! the proxies forward, the sink admits `b`'s hosts and `/ready` turns 200, and the run ends
//! with every id once.

use std::io::{Read, Write};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use flow_integration::proxy::{shard_b_proxies, Fault};
use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 2;
const PER_PARTITION: u64 = 2_000;

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `GET path`: the status code and the body.
fn get(port: u16, path: &str) -> Result<(u16, String)> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: flow\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    let Some((head, body)) = answer.split_once("\r\n\r\n") else {
        bail!("no HTTP answer: {answer:?}");
    };
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no status code")?;
    Ok((code, body.to_owned()))
}

#[test]
fn ready_is_503_naming_a_shard_down_from_the_start_and_200_once_it_answers() -> Result<()> {
    wait_for_cluster(Duration::from_secs(120))?;
    let runtime = tokio::runtime::Runtime::new()?;
    let proxies = runtime.block_on(shard_b_proxies(Fault::Refuse))?;
    let name = unique_name("it_ready");
    let table = ReplicatedTable::create("default", &name, GENERATOR_COLUMNS, "id", &NODES)?;
    let dir = TestDir::new()?;
    let spec = dir.path().join("spec.yaml");
    let port = free_port()?;
    let parameters = format!(
        "{{shard_hosts: {{a: ['{}', '{}'], b: ['{}', '{}']}}, sharding_key_columns: [user_id], table: {name}}}",
        A1.http_addr(),
        A2.http_addr(),
        proxies[0].addr(),
        proxies[1].addr()
    );
    let yaml = GeneratorSpec::new("ready", "ShardedClickHouseBatchingSink", parameters)
        .partitions(PARTITIONS)
        .epoch(500, 200)
        .count(PER_PARTITION)
        .rate(500)
        .dynamic("{max_rows_per_batch: 500, retry_backoff: 100ms, max_retry_backoff: 1s, write_timeout: 2s}")
        .yaml();
    std::fs::write(
        &spec,
        format!("{yaml}\nmetrics: {{listen: '127.0.0.1:{port}'}}\n"),
    )?;
    let state = dir.path().join("state");
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w.log"))?;

    // The session starts on shard a alone; b stays unready while its hosts refuse.
    let expected = format!(
        "shard `b` of `default`.`{name}`: none of its hosts ({}, {}) has answered since the session started; its batches wait",
        proxies[0].addr(),
        proxies[1].addr()
    );
    let mut unready = None;
    wait_until(Duration::from_secs(10), || {
        let Ok((code, body)) = get(port, "/ready") else {
            return Ok(false);
        };
        let found = code == 503 && body.contains(&expected);
        if found {
            unready = Some(body);
        }
        Ok(found)
    })
    .with_context(|| format!("/ready never named shard b\n{}", worker.log_tail()))?;
    let body: serde_json::Value = serde_json::from_str(unready.as_deref().unwrap_or(""))?;
    assert_eq!(
        body,
        serde_json::json!({
            "ready": false,
            "not_ready": [{"component": "ready/out", "reason": expected}],
        })
    );
    assert_eq!(
        get(port, "/health")?,
        (200, "{\"status\":\"alive\"}\n".to_owned())
    );
    // Still unready a moment later: b's batches wait.
    std::thread::sleep(Duration::from_millis(1_500));
    assert_eq!(get(port, "/ready")?.0, 503, "{}", worker.log_tail());

    for proxy in &proxies {
        proxy.set(Fault::Pass);
    }
    wait_until(Duration::from_secs(15), || {
        Ok(get(port, "/ready").is_ok_and(|(code, _)| code == 200))
    })
    .with_context(|| {
        format!(
            "/ready did not turn 200 once b answered\n{}",
            worker.log_tail()
        )
    })?;
    assert_eq!(
        get(port, "/ready")?,
        (200, "{\"not_ready\":[],\"ready\":true}\n".to_owned())
    );
    let code = worker.wait_exit(Duration::from_secs(30))?;
    ensure!(code == Some(0), "the worker failed\n{}", worker.log_tail());
    for node in NODES {
        sync_when_writable(node, "default", &name, Duration::from_secs(30))?;
    }
    let total = PARTITIONS * PER_PARTITION;
    assert_eq!(landed_on_both_shards(&table.qualified())?, (total, total));
    Ok(())
}

/// Issue 46 item 7: a shard that answered and then refuses every INSERT turns `/ready` 503
/// naming it once `unready_after_ms` has passed (on `acbb5bf` it stayed 200, `ready: true`,
/// while the shard's batches grew), and 200 again once it takes INSERTs; every id lands once.
#[test]
fn ready_turns_503_once_every_insert_into_a_shard_has_failed_for_unready_after() -> Result<()> {
    wait_for_cluster(Duration::from_secs(120))?;
    let runtime = tokio::runtime::Runtime::new()?;
    let proxies = runtime.block_on(shard_b_proxies(Fault::Pass))?;
    let name = unique_name("it_unready");
    let table = ReplicatedTable::create("default", &name, GENERATOR_COLUMNS, "id", &NODES)?;
    let dir = TestDir::new()?;
    let spec = dir.path().join("spec.yaml");
    let port = free_port()?;
    let per_partition = 4_000;
    let parameters = format!(
        "{{shard_hosts: {{a: ['{}', '{}'], b: ['{}', '{}']}}, sharding_key_columns: [user_id], table: {name}, unready_after_ms: 1000}}",
        A1.http_addr(),
        A2.http_addr(),
        proxies[0].addr(),
        proxies[1].addr()
    );
    let yaml = GeneratorSpec::new("unready", "ShardedClickHouseBatchingSink", parameters)
        .partitions(PARTITIONS)
        .epoch(500, 200)
        .count(per_partition)
        .rate(500)
        .dynamic("{max_rows_per_batch: 500, retry_backoff: 100ms, max_retry_backoff: 500ms, write_timeout: 2s}")
        .yaml();
    std::fs::write(
        &spec,
        format!("{yaml}\nmetrics: {{listen: '127.0.0.1:{port}'}}\n"),
    )?;
    let state = dir.path().join("state");
    let mut worker = Worker::spawn(worker_bin!(), &spec, &state, dir.path().join("w.log"))?;
    wait_until(Duration::from_secs(15), || {
        Ok(rows_on_node(B1, &table.qualified()) > 0
            && get(port, "/ready").is_ok_and(|(code, _)| code == 200))
    })
    .with_context(|| format!("shard b never took rows\n{}", worker.log_tail()))?;

    for proxy in &proxies {
        proxy.set(Fault::Refuse);
    }
    let prefix = format!("shard `b` of `default`.`{name}`: every INSERT has failed for ");
    let mut body = String::new();
    wait_until(Duration::from_secs(10), || {
        let Ok((code, text)) = get(port, "/ready") else {
            return Ok(false);
        };
        body = text;
        Ok(code == 503 && body.contains(&prefix))
    })
    .with_context(|| format!("/ready never named shard b: {body}\n{}", worker.log_tail()))?;
    assert!(
        body.contains("(unready_after_ms 1000); its batches wait in the outbox"),
        "{body}"
    );

    for proxy in &proxies {
        proxy.set(Fault::Pass);
    }
    wait_until(Duration::from_secs(15), || {
        Ok(get(port, "/ready").is_ok_and(|(code, _)| code == 200))
    })
    .with_context(|| format!("/ready did not turn 200 again\n{}", worker.log_tail()))?;
    let code = worker.wait_exit(Duration::from_secs(60))?;
    ensure!(code == Some(0), "the worker failed\n{}", worker.log_tail());
    for node in NODES {
        sync_when_writable(node, "default", &name, Duration::from_secs(30))?;
    }
    let total = PARTITIONS * per_partition;
    assert_eq!(landed_on_both_shards(&table.qualified())?, (total, total));
    Ok(())
}

fn rows_on_node(node: Node, qualified: &str) -> u64 {
    query_u64(node.http_port, &format!("SELECT count() FROM {qualified}")).unwrap_or(0)
}

//! `drain` and `status` in cluster mode (issue 27 item 4): two workers of one JetStream pipeline
//! (`run --cluster`) seal every message into batches whose INSERTs their proxies hold back, and
//! are killed with `kill -9`. `status --cluster` shows every row pending in ZooKeeper; a drain is
//! refused while a worker still runs (naming it); once the killed workers' sessions expired,
//! `drain --cluster` from a new state directory takes every partition, delivers what ZooKeeper
//! holds pending and leaves nothing pending: every message once on its shard. A worker stopped by
//! SIGTERM leaves the members at once, before its session would have expired.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use anyhow::{ensure, Context as _, Result};
use flow_integration::nats::{new_stream, publish_id_rows};
use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 4;
const MESSAGES: u64 = 4_000;
const USERS: u64 = 100;
const SESSION_TIMEOUT_MS: &str = "4000";

struct Setup {
    dir: TestDir,
    spec: String,
    cluster: String,
    proxies: Vec<FaultProxy>,
}

async fn setup(name: &str) -> Result<Setup> {
    let js = new_stream(name).await?;
    publish_id_rows(&js, &format!("{name}.p"), 0..MESSAGES, PARTITIONS, USERS).await?;
    let mut proxies = Vec::new();
    for node in NODES {
        let proxy = FaultProxy::start(node.http_addr().parse()?).await?;
        proxy.set_on_inserts(Fault::Hold);
        proxies.push(proxy);
    }
    let hosts = |i: usize| format!("['{}', '{}']", proxies[i].addr(), proxies[i + 1].addr());
    let yaml = format!(
        "pipeline: {name}\npartitions: {PARTITIONS}\nepoch: {{max_messages: 500, max_duration_ms: 300}}\n\
         source:\n  class: nats_jetstream\n  parameters:\n    servers: ['nats://{}']\n    stream: {name}\n    subject_template: '{name}.p.{{partition}}'\n    format: json\n    schema: [{{name: id, type: uint64}}, {{name: user_id, type: uint64}}, {{name: payload, type: string}}]\n\
         sinks:\n  - name: out\n    sink_class_name: ShardedClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{shard_hosts: {{a: {}, b: {}}}, database: default, table: {name}, sharding_key_columns: [user_id]}}\n    dynamic_parameters: {{max_rows_per_batch: 500, retry_backoff: 100ms, max_retry_backoff: 1s, write_timeout: 5s}}\n",
        nats::NATS_ADDR,
        hosts(0),
        hosts(2),
    );
    let dir = TestDir::new()?;
    let spec = dir.path().join("spec.yaml");
    std::fs::write(&spec, yaml)?;
    Ok(Setup {
        spec: spec.display().to_string(),
        cluster: format!("zk://127.0.0.1:12181/flow-it/{}", unique_name("drain")),
        dir,
        proxies,
    })
}

impl Setup {
    fn status(&self, pipeline: &str) -> Result<serde_json::Value> {
        let args = [
            "status",
            "--cluster",
            &self.cluster,
            "--pipeline",
            pipeline,
            "--json",
        ];
        let out = run_worker(worker_bin!(), &args, &[], Duration::from_secs(30))?;
        ensure!(
            out.code == Some(0),
            "status --cluster: {}{}",
            out.stdout,
            out.stderr
        );
        Ok(serde_json::from_str(&out.stdout)?)
    }

    /// `count` workers joined to the cluster, each with its own state directory and log.
    fn start_workers(&self, count: usize) -> Result<Vec<Worker>> {
        let spec = std::path::Path::new(&self.spec);
        let extra = [
            "--cluster",
            &self.cluster,
            "--session-timeout-ms",
            SESSION_TIMEOUT_MS,
        ];
        (0..count)
            .map(|slot| {
                let state = self.dir.path().join(format!("state{slot}"));
                let log = self.dir.path().join(format!("w{slot}.log"));
                Worker::spawn_with(worker_bin!(), spec, &state, &extra, log)
            })
            .collect()
    }

    fn drain(&self, state: &str) -> Result<WorkerOutput> {
        let state = self.dir.path().join(state).display().to_string();
        let args = [
            "drain",
            &self.spec,
            "--state-dir",
            &state,
            "--cluster",
            &self.cluster,
        ];
        run_worker(worker_bin!(), &args, &[], Duration::from_secs(120))
    }
}

/// Rows pending in ZooKeeper over every partition.
fn pending_rows(status: &serde_json::Value) -> u64 {
    let partitions = status["partitions"].as_array().cloned().unwrap_or_default();
    partitions
        .iter()
        .flat_map(|p| p["pending"].as_array().cloned().unwrap_or_default())
        .filter_map(|b| b["rows"].as_u64())
        .sum()
}

#[test]
fn a_cluster_drain_delivers_what_killed_workers_left_pending_in_zookeeper() -> Result<()> {
    require_cluster()?;
    let rt = tokio::runtime::Runtime::new()?;
    let name = unique_name("cdrain");
    let table = ReplicatedTable::create(
        "default",
        &name,
        "id UInt64, user_id UInt64, payload String",
        "id",
        &NODES,
    )?;
    let setup = rt.block_on(setup(&name))?;
    let mut workers = setup.start_workers(2)?;
    let logs = |workers: &[Worker]| workers.iter().map(Worker::log_tail).collect::<String>();
    wait_until(Duration::from_secs(60), || {
        Ok(pending_rows(&setup.status(&name)?) == MESSAGES)
    })
    .with_context(|| {
        format!(
            "not every message sealed while INSERTs were held\n{}",
            logs(&workers)
        )
    })?;

    let refused = setup.drain("drain_refused")?;
    assert_eq!(
        refused.code,
        Some(1),
        "{}{}",
        refused.stdout,
        refused.stderr
    );
    assert!(
        refused
            .stderr
            .contains(&format!("workers still run pipeline `{name}`"))
            && refused.stderr.contains("stop every worker of the pipeline"),
        "{}",
        refused.stderr
    );

    for worker in &mut workers {
        worker.kill_9()?;
    }
    // The killed workers' sessions expire (4 s) and take their member nodes and leases along.
    wait_until(Duration::from_secs(30), || {
        Ok(setup.status(&name)?["members"]
            .as_array()
            .is_some_and(Vec::is_empty))
    })?;
    let status = setup.status(&name)?;
    assert_eq!(pending_rows(&status), MESSAGES, "{status}");
    for proxy in &setup.proxies {
        proxy.set(Fault::Pass);
    }

    let drained = setup.drain("drain_state")?;
    assert_eq!(
        drained.code,
        Some(0),
        "{}{}",
        drained.stdout,
        drained.stderr
    );
    assert!(
        drained
            .stdout
            .contains(&format!("drained pipeline `{name}`"))
            && drained
                .stdout
                .contains(&format!("{MESSAGES} row(s) delivered")),
        "{}",
        drained.stdout
    );
    let after = setup.status(&name)?;
    assert_eq!(pending_rows(&after), 0, "{after}");
    let qualified = table.qualified();
    for node in NODES {
        sync_when_writable(node, "default", &name, Duration::from_secs(60))?;
    }
    assert_eq!(landed_on_both_shards(&qualified)?, (MESSAGES, MESSAGES));
    for [first, second] in [SHARD_A, SHARD_B] {
        assert_eq!(
            count_uniq(first, &qualified)?,
            count_uniq(second, &qualified)?
        );
    }
    check_routing(
        &[("a", SHARD_A.to_vec()), ("b", SHARD_B.to_vec())],
        &qualified,
        USERS,
    )?;

    Ok(())
}

/// A worker stopped by SIGTERM leaves the members at once: the others need not wait for its
/// session (4 s) to end before they take its partitions.
#[test]
fn a_worker_stopped_by_sigterm_leaves_the_members_at_once() -> Result<()> {
    require_cluster()?;
    let rt = tokio::runtime::Runtime::new()?;
    let name = unique_name("cleave");
    // The sink checks its table at start.
    let _table = ReplicatedTable::create(
        "default",
        &name,
        "id UInt64, user_id UInt64, payload String",
        "id",
        &NODES,
    )?;
    let setup = rt.block_on(setup(&name))?;
    for proxy in &setup.proxies {
        proxy.set(Fault::Pass);
    }
    let mut workers = setup.start_workers(2)?;
    let members = |setup: &Setup| -> Result<usize> {
        Ok(setup.status(&name)?["members"]
            .as_array()
            .map_or(0, Vec::len))
    };
    wait_until(Duration::from_secs(30), || Ok(members(&setup)? == 2))?;
    workers[0].signal("TERM")?;
    let code = workers[0].wait_exit(Duration::from_secs(30))?;
    assert_eq!(code, Some(0), "{}", workers[0].log_tail());
    let left_at = std::time::Instant::now();
    assert_eq!(members(&setup)?, 1, "{}", workers[0].log_tail());
    assert!(left_at.elapsed() < Duration::from_secs(3));
    workers[1].signal("TERM")?;
    assert_eq!(workers[1].wait_exit(Duration::from_secs(30))?, Some(0));
    Ok(())
}

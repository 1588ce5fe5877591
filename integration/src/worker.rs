//! Helpers for tests that run pipelines against the cluster: generator specs, the worker binary
//! `flow-worker-it` (spawned on a spec and a state directory, SIGKILLed, waited for, asked for
//! `status --json`), in-process runs, the guard that restores the cluster, and the end-state checks
//! (per-replica counts, routing).
//!
//! The binary's path is only known to the test crates (`CARGO_BIN_EXE_flow-worker-it`): they pass
//! it in, usually as [`worker_bin!()`](crate::worker_bin).

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use flow_clickhouse::testing::RendezvousRouter;
use flow_core::{Pipeline, PipelineSpec, Registry, RunReport, RuntimeError};
use flow_state::StateStore;

use crate::{cluster_sh, exec, query_text, query_u64, query_u64s, sync_replica, wait_until, Node};

/// The path of the worker binary `flow-worker-it`, for test crates of this package (where cargo
/// sets `CARGO_BIN_EXE_flow-worker-it`).
#[macro_export]
macro_rules! worker_bin {
    () => {
        ::std::path::Path::new(env!("CARGO_BIN_EXE_flow-worker-it"))
    };
}

/// The columns of a table that takes the generator's stream as it is.
pub const GENERATOR_COLUMNS: &str =
    "id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime, payload String";

/// `FLOW_FAULT_SEED` if set to a number, else `default`.
pub fn fault_seed(default: u64) -> u64 {
    std::env::var("FLOW_FAULT_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default)
}

// ---------------------------------------------------------------------------------------------
// Specs

/// A pipeline spec: a generator source into one sink.
///
/// Defaults: 1 partition, epochs of `{max_messages: 1000, max_duration_ms: 500}`, 100 messages per
/// partition, no rate limit, 8-byte payloads, sink `out`, `dynamic_parameters: {}`, and the
/// outbox's default (bounds for this replayable source) unless `FLOW_TEST_OUTBOX_PAYLOADS=always`
/// is set: then every spec built here stores payloads, so the whole suite (fault suite and kill -9
/// tests included) runs in the outbox's other mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratorSpec {
    pub pipeline: String,
    pub partitions: u64,
    pub epoch_max_messages: u64,
    pub epoch_max_duration_ms: u64,
    /// Messages per partition.
    pub count: u64,
    /// Messages per second and partition.
    pub rate_per_second: Option<u64>,
    pub payload_bytes: u64,
    pub sink_name: String,
    pub sink_class: String,
    /// The sink's `parameters`, a YAML flow mapping (`{host: ..., table: ...}`).
    pub parameters: String,
    /// The sink's `dynamic_parameters`, a YAML flow mapping.
    pub dynamic_parameters: String,
    /// `outbox: {payloads: always}`.
    pub store_payloads: bool,
}

impl GeneratorSpec {
    pub fn new(pipeline: &str, sink_class: &str, parameters: impl Into<String>) -> GeneratorSpec {
        GeneratorSpec {
            pipeline: pipeline.to_owned(),
            partitions: 1,
            epoch_max_messages: 1000,
            epoch_max_duration_ms: 500,
            count: 100,
            rate_per_second: None,
            payload_bytes: 8,
            sink_name: "out".to_owned(),
            sink_class: sink_class.to_owned(),
            parameters: parameters.into(),
            dynamic_parameters: "{}".to_owned(),
            store_payloads: std::env::var("FLOW_TEST_OUTBOX_PAYLOADS").as_deref() == Ok("always"),
        }
    }

    /// Stores payloads in the outbox (`outbox: {payloads: always}`).
    pub fn store_payloads(mut self) -> GeneratorSpec {
        self.store_payloads = true;
        self
    }

    pub fn partitions(mut self, partitions: u64) -> GeneratorSpec {
        self.partitions = partitions;
        self
    }

    pub fn epoch(mut self, max_messages: u64, max_duration_ms: u64) -> GeneratorSpec {
        self.epoch_max_messages = max_messages;
        self.epoch_max_duration_ms = max_duration_ms;
        self
    }

    /// Messages per partition.
    pub fn count(mut self, count: u64) -> GeneratorSpec {
        self.count = count;
        self
    }

    /// Messages per second and partition.
    pub fn rate(mut self, per_second: u64) -> GeneratorSpec {
        self.rate_per_second = Some(per_second);
        self
    }

    pub fn payload_bytes(mut self, bytes: u64) -> GeneratorSpec {
        self.payload_bytes = bytes;
        self
    }

    pub fn sink_name(mut self, name: &str) -> GeneratorSpec {
        self.sink_name = name.to_owned();
        self
    }

    pub fn dynamic(mut self, dynamic_parameters: impl Into<String>) -> GeneratorSpec {
        self.dynamic_parameters = dynamic_parameters.into();
        self
    }

    /// The spec as YAML.
    pub fn yaml(&self) -> String {
        let rate = self
            .rate_per_second
            .map(|r| format!("rate_per_second: {r}, "))
            .unwrap_or_default();
        let outbox = if self.store_payloads {
            "outbox: {payloads: always}\n"
        } else {
            ""
        };
        format!(
            "pipeline: {pipeline}\n\
             partitions: {partitions}\n\
             epoch: {{max_messages: {max_messages}, max_duration_ms: {max_ms}}}\n\
             {outbox}source:\n  class: generator\n  parameters: {{count: {count}, {rate}payload_bytes: {payload}}}\n\
             sinks:\n  - name: {sink}\n    sink_class_name: {class}\n    input_stream_ids: [rows]\n    parameters: {parameters}\n    dynamic_parameters: {dynamic}\n",
            pipeline = self.pipeline,
            partitions = self.partitions,
            max_messages = self.epoch_max_messages,
            max_ms = self.epoch_max_duration_ms,
            count = self.count,
            payload = self.payload_bytes,
            sink = self.sink_name,
            class = self.sink_class,
            parameters = self.parameters,
            dynamic = self.dynamic_parameters,
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The worker binary

/// The log filter of a spawned worker: `RUST_LOG` if set, else info with the sinks' delivery
/// decisions (each stored part and acknowledged batch, at debug), which a failed test's kept
/// logs ([`crate::TestDir`]) then show.
fn worker_log_filter() -> String {
    std::env::var("RUST_LOG").unwrap_or_else(|_| {
        "info,flow_clickhouse::delivery=debug,flow_clickhouse::exactly_once=debug".to_owned()
    })
}

/// A running `flow-worker-it run SPEC --state-dir STATE`, its stderr going to a log file; SIGKILLed
/// when dropped (so a failing test leaves no process behind).
#[derive(Debug)]
pub struct Worker {
    child: Option<Child>,
    log: PathBuf,
}

impl Worker {
    pub fn spawn(bin: &Path, spec: &Path, state: &Path, log: PathBuf) -> Result<Worker> {
        Worker::spawn_with(bin, spec, state, &[], log)
    }

    /// As [`Worker::spawn`], with `extra` arguments after the state directory (`--cluster ...`).
    pub fn spawn_with(
        bin: &Path,
        spec: &Path,
        state: &Path,
        extra: &[&str],
        log: PathBuf,
    ) -> Result<Worker> {
        let file =
            File::create(&log).with_context(|| format!("creating the log {}", log.display()))?;
        let child = Command::new(bin)
            .arg("run")
            .arg(spec)
            .arg("--state-dir")
            .arg(state)
            .args(extra)
            .env("RUST_LOG", worker_log_filter())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {} run {}", bin.display(), spec.display()))?;
        Ok(Worker {
            child: Some(child),
            log,
        })
    }

    /// The worker's log (its stderr).
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Whether the process has not been seen exiting or killed yet.
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    fn child(&mut self) -> Result<&mut Child> {
        self.child
            .as_mut()
            .ok_or_else(|| anyhow!("no worker process: it has exited or was killed already"))
    }

    /// `Some(exit code)` once the worker has exited (it is then no longer [`running`](Self::running)),
    /// `None` while it runs. An error if there is no process (exited or killed before).
    pub fn exited(&mut self) -> Result<Option<Option<i32>>> {
        let status = self
            .child()?
            .try_wait()
            .context("checking on the worker process")?;
        Ok(status.map(|status| {
            self.child = None;
            status.code()
        }))
    }

    /// SIGKILLs the worker (std's `kill()` is SIGKILL on Unix) and reaps it. `Some(status)` if the
    /// kill failed because the process had already exited on its own, `None` if it was killed. An
    /// error if there is no process (exited or killed before).
    pub fn kill_9(&mut self) -> Result<Option<ExitStatus>> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| anyhow!("no worker process: it has exited or was killed already"))?;
        let killed = child.kill().is_ok();
        let status = child.wait().context("waiting for the killed worker")?;
        Ok(if killed { None } else { Some(status) })
    }

    /// Sends the signal `name` (`HUP`, `TERM`, ...) to the running worker through `kill(1)`.
    pub fn signal(&self, name: &str) -> Result<()> {
        let child = self
            .child
            .as_ref()
            .ok_or_else(|| anyhow!("no worker process: it has exited or was killed already"))?;
        let status = Command::new("kill")
            .args(["-s", name, &child.id().to_string()])
            .status()
            .with_context(|| format!("running kill -s {name}"))?;
        if !status.success() {
            bail!("kill -s {name} {} failed: {status}", child.id());
        }
        Ok(())
    }

    /// Waits up to `timeout` for the worker to exit on its own; its exit code. An error (with the
    /// log's tail) if it is still running then.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<Option<i32>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(code) = self.exited()? {
                return Ok(code);
            }
            if Instant::now() >= deadline {
                bail!(
                    "the worker did not finish within {timeout:?}\n{}",
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The last 40 lines of the log, with a header naming it.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let start = lines.len().saturating_sub(40);
        format!(
            "--- last lines of {} ---\n{}",
            self.log.display(),
            lines[start..].join("\n")
        )
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What a finished `flow-worker-it` printed.
#[derive(Debug, Clone)]
pub struct WorkerOutput {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `flow-worker-it ARGS` (stdin closed) with extra environment to its end; an error, after
/// killing it, if it runs longer than `timeout`.
pub fn run_worker(
    bin: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    timeout: Duration,
) -> Result<WorkerOutput> {
    run_worker_in(None, bin, args, env, timeout)
}

/// [`run_worker`] started in the working directory `cwd` (`None`: this process's).
pub fn run_worker_in(
    cwd: Option<&Path>,
    bin: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    timeout: Duration,
) -> Result<WorkerOutput> {
    let dir = tempfile::tempdir().context("creating a directory for the worker's output")?;
    let (out_path, err_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut command = Command::new(bin);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(File::create(&out_path).context("creating the stdout file")?)
        .stderr(File::create(&err_path).context("creating the stderr file")?);
    for (k, v) in env {
        command.env(k, v);
    }
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    let what = format!("flow-worker-it {}", args.join(" "));
    let mut child = command
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(err) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(err).with_context(|| format!("checking on {what}"));
            }
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{what} did not finish within {timeout:?}; stderr:\n{}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok(WorkerOutput {
        code: status.code(),
        stdout: std::fs::read_to_string(&out_path).context("reading the worker's stdout")?,
        stderr: std::fs::read_to_string(&err_path).context("reading the worker's stderr")?,
    })
}

/// `flow-worker-it run SPEC --state-dir STATE` to its end (finite sources), within `timeout`.
pub fn run_spec(bin: &Path, spec: &Path, state: &Path, timeout: Duration) -> Result<WorkerOutput> {
    let (spec, state) = (spec.display().to_string(), state.display().to_string());
    run_worker(bin, &["run", &spec, "--state-dir", &state], &[], timeout)
}

/// `flow-worker-it drain SPEC --state-dir STATE`: delivers what the outbox holds, within
/// `timeout`.
pub fn drain_spec(
    bin: &Path,
    spec: &Path,
    state: &Path,
    timeout: Duration,
) -> Result<WorkerOutput> {
    let (spec, state) = (spec.display().to_string(), state.display().to_string());
    run_worker(bin, &["drain", &spec, "--state-dir", &state], &[], timeout)
}

/// `flow-worker-it dead-letters ACTION --state-dir STATE` (the worker must not be running).
pub fn dead_letters_command(bin: &Path, action: &str, state: &Path) -> Result<WorkerOutput> {
    let state = state.display().to_string();
    run_worker(
        bin,
        &["dead-letters", action, "--state-dir", &state],
        &[],
        Duration::from_secs(60),
    )
}

/// The lines of `dead-letters export`, parsed.
pub fn export_dead_letters(bin: &Path, state: &Path) -> Result<Vec<serde_json::Value>> {
    let out = dead_letters_command(bin, "export", state)?;
    if out.code != Some(0) {
        bail!("dead-letters export exited {:?}: {}", out.code, out.stderr);
    }
    out.stdout
        .lines()
        .map(|line| serde_json::from_str(line).with_context(|| format!("parsing {line}")))
        .collect()
}

/// `flow-worker-it status --json --state-dir STATE` (the worker must not be running): the JSON
/// summary, or `None` if nothing was ever committed there (not a flow state directory yet). An
/// error, with stderr, if the command fails otherwise.
pub fn status_json(bin: &Path, state: &Path) -> Result<Option<serde_json::Value>> {
    let out = Command::new(bin)
        .args(["status", "--json", "--state-dir"])
        .arg(state)
        .output()
        .context("running flow-worker-it status")?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("not a flow state directory") {
            return Ok(None);
        }
        bail!("status failed: {stderr}");
    }
    serde_json::from_slice(&out.stdout)
        .map(Some)
        .context("parsing the output of status --json")
}

/// One pipeline's part of `status --json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PipelineStatus {
    /// Per sink partition: (partition, undelivered batches, undelivered rows).
    pub undelivered: Vec<(u64, u64, u64)>,
    /// The committed position of each partition (a generator's offset).
    pub positions: Vec<u64>,
}

impl PipelineStatus {
    /// Undelivered batches over all sink partitions.
    pub fn batches(&self) -> u64 {
        self.undelivered.iter().map(|u| u.1).sum()
    }

    /// Undelivered rows over all sink partitions.
    pub fn rows(&self) -> u64 {
        self.undelivered.iter().map(|u| u.2).sum()
    }

    /// Reads `pipeline` from a `status --json` summary (empty if the pipeline is absent).
    pub fn from_summary(summary: &serde_json::Value, pipeline: &str) -> Result<PipelineStatus> {
        let pipeline = &summary["pipelines"][pipeline];
        let number = |v: &serde_json::Value, field: &str| {
            v[field]
                .as_u64()
                .ok_or_else(|| anyhow!("no numeric `{field}` in {v}"))
        };
        let undelivered = match pipeline["sinks"].as_array() {
            Some(sinks) => sinks
                .iter()
                .map(|s| {
                    Ok((
                        number(s, "partition")?,
                        number(s, "undelivered")?,
                        number(s, "rows")?,
                    ))
                })
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        let positions = match pipeline["positions"].as_object() {
            Some(p) => p
                .values()
                .map(|v| {
                    let hex = v["hex"]
                        .as_str()
                        .ok_or_else(|| anyhow!("no `hex` in the position {v}"))?;
                    u64::from_str_radix(hex, 16)
                        .with_context(|| format!("the position {hex:?} is not one u64"))
                })
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        Ok(PipelineStatus {
            undelivered,
            positions,
        })
    }
}

/// [`status_json`] reduced to one pipeline: `None` if nothing was ever committed in `state`.
pub fn pipeline_status(bin: &Path, state: &Path, pipeline: &str) -> Result<Option<PipelineStatus>> {
    status_json(bin, state)?
        .map(|summary| PipelineStatus::from_summary(&summary, pipeline))
        .transpose()
}

// ---------------------------------------------------------------------------------------------
// In-process runs

/// Builds `yaml` with `registry` and runs it in this process on a state store in `state_dir`; an
/// error if the spec does not build or the run takes longer than `timeout` (unreachable endpoints
/// are waited for without limit, so a node stopped by another test binary fails the test instead
/// of hanging it). The inner result is the pipeline's own.
pub async fn run_pipeline(
    registry: &Registry,
    yaml: &str,
    state_dir: &Path,
    timeout: Duration,
) -> Result<Result<RunReport, RuntimeError>> {
    let spec = PipelineSpec::from_yaml(yaml).context("the spec does not parse")?;
    let validated = registry
        .build(&spec)
        .context("the spec does not validate")?;
    let store = StateStore::open(state_dir).context("opening the state store")?;
    let result = tokio::time::timeout(timeout, Pipeline::new(validated, store.clone()).run())
        .await
        .map_err(|_| {
            anyhow!("the pipeline did not finish within {timeout:?} (is a cluster node down?)")
        })?;
    store.close().context("closing the state store")?;
    Ok(result)
}

// ---------------------------------------------------------------------------------------------
// The cluster

/// Restores the cluster (`cluster.sh up`) when dropped, even after a failed assertion.
#[derive(Debug)]
pub struct ClusterGuard;

impl Drop for ClusterGuard {
    fn drop(&mut self) {
        match cluster_sh(&["up"]) {
            Ok(_) => println!("cluster restored (cluster.sh up)"),
            Err(err) => eprintln!("restoring the cluster failed: {err:#}"),
        }
    }
}

/// Waits up to `timeout` for the node's replica of `database.table` to be writable (a replica
/// restarted after a crash may stay read-only until its old ZooKeeper session expires; `SYNC
/// REPLICA` needs it active), then runs `SYSTEM SYNC REPLICA` on it.
pub fn sync_when_writable(
    node: Node,
    database: &str,
    table: &str,
    timeout: Duration,
) -> Result<()> {
    wait_until(timeout, || {
        query_u64(
            node.http_port,
            &format!(
                "SELECT is_readonly FROM system.replicas WHERE database = '{database}' AND table = '{table}'"
            ),
        )
        .map(|readonly| readonly == 0)
    })
    .with_context(|| format!("{database}.{table} on {} stays read-only", node.name))?;
    sync_replica(node.http_port, &format!("{database}.{table}"))
        .with_context(|| format!("syncing {database}.{table} on {}", node.name))
}

/// `SELECT count(), uniqExact(id) FROM qualified` on the node.
pub fn count_uniq(node: Node, qualified: &str) -> Result<(u64, u64)> {
    let sql = format!("SELECT count(), uniqExact(id) FROM {qualified} FORMAT TSV");
    match query_u64s(node.http_port, &sql)?[..] {
        [count, unique] => Ok((count, unique)),
        ref other => bail!("unexpected answer {other:?} to `{sql}` on {}", node.name),
    }
}

/// `SELECT count(), uniqExact(id), sum(id) FROM qualified` on the node.
pub fn count_uniq_sum(node: Node, qualified: &str) -> Result<(u64, u64, u64)> {
    let sql = format!("SELECT count(), uniqExact(id), sum(id) FROM {qualified} FORMAT TSV");
    match query_u64s(node.http_port, &sql)?[..] {
        [count, unique, sum] => Ok((count, unique, sum)),
        ref other => bail!("unexpected answer {other:?} to `{sql}` on {}", node.name),
    }
}

/// The routing key of a row keyed by one UInt64 column (`sharding_key_columns: [user_id]`): tag 2
/// and the value little-endian, as `flow_clickhouse::routing::routing_key` encodes it.
pub fn user_routing_key(user: u64) -> Vec<u8> {
    let mut key = vec![2u8];
    key.extend_from_slice(&user.to_le_bytes());
    key
}

/// Checks that every replica of every shard holds exactly the user_ids in `0..users` that the
/// rendezvous router over these shard names sends to that shard (`SELECT DISTINCT user_id`).
/// Returns, per shard, how many user_ids it holds.
pub fn check_routing(
    shards: &[(&str, Vec<Node>)],
    qualified: &str,
    users: u64,
) -> Result<Vec<(String, usize)>> {
    let names: Vec<String> = shards.iter().map(|(s, _)| (*s).to_owned()).collect();
    let router = RendezvousRouter::new(&names);
    let mut held = Vec::new();
    for (shard, nodes) in shards {
        let expected: BTreeSet<u64> = (0..users)
            .filter(|&u| router.shards()[router.route(&user_routing_key(u))] == *shard)
            .collect();
        for node in nodes {
            let actual: BTreeSet<u64> = query_u64s(
                node.http_port,
                &format!("SELECT DISTINCT user_id FROM {qualified} FORMAT TSV"),
            )?
            .into_iter()
            .collect();
            if actual != expected {
                let missing: Vec<&u64> = expected.difference(&actual).take(10).collect();
                let unexpected: Vec<&u64> = actual.difference(&expected).take(10).collect();
                bail!(
                    "user_ids on shard `{shard}` ({}) differ from the routing: {} there, {} \
                     routed; missing e.g. {missing:?}, not routed there e.g. {unexpected:?}",
                    node.name,
                    actual.len(),
                    expected.len()
                );
            }
        }
        held.push(((*shard).to_owned(), expected.len()));
    }
    Ok(held)
}

/// `flow-worker-it verify SPEC --json`: its exit code and one JSON object per sink.
pub fn verify_json(bin: &Path, spec: &Path) -> Result<(Option<i32>, Vec<serde_json::Value>)> {
    let spec = spec.display().to_string();
    let out = run_worker(
        bin,
        &["verify", &spec, "--json"],
        &[],
        Duration::from_secs(60),
    )?;
    let sinks = out
        .stdout
        .lines()
        .map(|line| serde_json::from_str(line).with_context(|| format!("verify printed {line:?}")))
        .collect::<Result<Vec<serde_json::Value>>>()
        .with_context(|| format!("verify's stderr: {}", out.stderr))?;
    Ok((out.code, sinks))
}

/// The orphan parts `verify --json` reported, as (endpoint, part, rows).
pub fn reported_orphans(sinks: &[serde_json::Value]) -> Vec<Orphan> {
    let mut orphans = Vec::new();
    let shards = sinks
        .iter()
        .filter_map(|s| s["shards"].as_array())
        .flatten();
    for replica in shards.filter_map(|s| s["replicas"].as_array()).flatten() {
        let parts = replica["replication"]["orphan_parts"].as_array();
        for part in parts.into_iter().flatten() {
            orphans.push((
                replica["endpoint"].as_str().unwrap_or_default().to_owned(),
                part["name"].as_str().unwrap_or_default().to_owned(),
                part["rows"].as_u64().unwrap_or_default(),
            ));
        }
    }
    orphans
}

/// An orphan part `verify --json` named: (replica endpoint, part, rows).
pub type Orphan = (String, String, u64);

/// Runs `verify SPEC --json` (whose hosts are `nodes`' HTTP addresses) after a run. An orphan
/// part it names (an INSERT answered 319 during a ZooKeeper fault left its part active on the
/// replica that wrote it, and the retry delivered the rows again; docs/guarantees.md) is repaired
/// as `verify` says, by re-attaching `qualified` on that replica, and `verify` must then exit 0.
/// Returns the orphan parts repaired; any other divergence, or a replica `verify` names that is
/// not one of `nodes`, is an error.
pub fn repair_orphans(
    bin: &Path,
    spec: &Path,
    qualified: &str,
    nodes: &[Node],
) -> Result<Vec<Orphan>> {
    let (code, sinks) = verify_json(bin, spec)?;
    let orphans = reported_orphans(&sinks);
    if code == Some(0) {
        return Ok(orphans);
    }
    if code != Some(2) || orphans.is_empty() {
        bail!("verify exited {code:?} without an orphan part to repair: {sinks:?}");
    }
    let mut replicas: Vec<&str> = orphans.iter().map(|(r, _, _)| r.as_str()).collect();
    replicas.sort_unstable();
    replicas.dedup();
    for endpoint in replicas {
        let node = nodes
            .iter()
            .find(|n| n.http_addr() == endpoint)
            .with_context(|| format!("verify named a replica {endpoint} not among {nodes:?}"))?;
        reattach(*node, qualified)?;
    }
    let (database, table) = qualified
        .split_once('.')
        .with_context(|| format!("{qualified} is not database.table"))?;
    for node in nodes {
        sync_when_writable(*node, database, table, Duration::from_secs(90))?;
    }
    let (code, sinks) = verify_json(bin, spec)?;
    if code != Some(0) {
        bail!("verify after re-attaching exited {code:?}: {sinks:?}");
    }
    Ok(orphans)
}

/// `DETACH TABLE` then `ATTACH TABLE` on `node`: a replicated table re-reads its parts and sets
/// aside those ZooKeeper does not list (the repair `verify` names for an orphan part).
pub fn reattach(node: Node, qualified: &str) -> Result<()> {
    exec(node.http_port, &format!("DETACH TABLE {qualified}"))?;
    exec(node.http_port, &format!("ATTACH TABLE {qualified}"))
        .with_context(|| format!("re-attaching {qualified} on {}", node.name))
}

/// Each partition's lag in `status --json` of `pipeline`, in partition order.
pub fn partition_lags(bin: &Path, state: &Path, pipeline: &str) -> Result<Vec<Option<u64>>> {
    let summary = status_json(bin, state)?.context("no status yet")?;
    let positions = summary
        .pointer(&format!("/pipelines/{pipeline}/positions"))
        .and_then(|p| p.as_object())
        .context("no positions in status")?;
    Ok(positions
        .values()
        .map(|p| p.get("lag").and_then(serde_json::Value::as_u64))
        .collect())
}

/// For a failed "every id once": on each of `nodes`, the rows whose `id` is there more than
/// once (the first 40, every column and the part holding it) and the parts holding them, so that
/// the failure shows whether the copies are whole batches, pieces or garbled rows.
pub fn duplicates_report(qualified: &str, nodes: &[Node]) -> String {
    let twice = format!("id IN (SELECT id FROM {qualified} GROUP BY id HAVING count() > 1)");
    let queries = [
        format!("SELECT *, _part FROM {qualified} WHERE {twice} ORDER BY id, _part LIMIT 40 FORMAT TSVWithNames"),
        format!("SELECT _part, count() AS rows, min(id), max(id), countIf({twice}) AS copied FROM {qualified} GROUP BY _part HAVING copied > 0 ORDER BY _part FORMAT TSVWithNames"),
    ];
    let mut report = String::new();
    for node in nodes {
        for sql in &queries {
            let answer = query_text(node.http_port, sql).unwrap_or_else(|err| format!("{err:#}"));
            report.push_str(&format!("--- {}: {sql}\n{answer}\n", node.name));
        }
    }
    report
}

/// Rows on shard a plus shard b (first replica of each), and their distinct ids.
pub fn landed_on_both_shards(qualified: &str) -> Result<(u64, u64)> {
    let (ca, ua) = count_uniq(crate::A1, qualified)?;
    let (cb, ub) = count_uniq(crate::B1, qualified)?;
    Ok((ca + cb, ua + ub))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_yaml_parses_to_the_fields() -> Result<()> {
        let yaml = GeneratorSpec::new("p", "ClickHouseBatchingSink", "{host: 'h:1', table: t}")
            .partitions(4)
            .epoch(5000, 1000)
            .count(75)
            .rate(10)
            .payload_bytes(16)
            .sink_name("events")
            .dynamic("{retry_backoff: 250ms}")
            .yaml();
        let v: serde_yaml::Value = serde_yaml::from_str(&yaml)?;
        assert_eq!(v["partitions"], 4);
        assert_eq!(v["epoch"]["max_duration_ms"], 1000);
        assert_eq!(v["source"]["parameters"]["rate_per_second"], 10);
        assert_eq!(v["sinks"][0]["name"], "events");
        assert_eq!(v["sinks"][0]["parameters"]["table"], "t");
        assert_eq!(
            v["sinks"][0]["dynamic_parameters"]["retry_backoff"],
            "250ms"
        );
        let plain: serde_yaml::Value =
            serde_yaml::from_str(&GeneratorSpec::new("p", "C", "{}").yaml())?;
        assert!(plain["source"]["parameters"]
            .get("rate_per_second")
            .is_none());
        Ok(())
    }

    #[test]
    fn reads_a_pipeline_status() -> Result<()> {
        let summary = serde_json::json!({"pipelines": {"p": {
            "positions": {"0": {"hex": "00000000000000ff"}, "1": {"hex": "0000000000000010"}},
            "sinks": [{"partition": 0, "undelivered": 2, "rows": 30}, {"partition": 1, "undelivered": 1, "rows": 5}]
        }}});
        let st = PipelineStatus::from_summary(&summary, "p")?;
        assert_eq!(st.positions, [255, 16]);
        assert_eq!((st.batches(), st.rows()), (3, 35));
        assert_eq!(
            PipelineStatus::from_summary(&summary, "other")?,
            PipelineStatus::default()
        );
        Ok(())
    }
}

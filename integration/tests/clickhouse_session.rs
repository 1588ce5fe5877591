//! The writer session's rejection rules against the real cluster (`scripts/cluster.sh up`): every
//! rule that refuses a start is triggered once and its message checked by its key phrases, and the
//! accepted variants (single-host MergeTree, extra table columns, passwords, HTTPS) run to the end.
//!
//! Pipelines are built in-process (`flow_worker::registry()`, a temp state store) where the error
//! value is enough: the session starts on the first write, so a refused start surfaces as a
//! `RuntimeError::PartitionsFailed` carrying the `SinkError::Refused` text. The CLI paths
//! (`validate`, the topology guard across restarts, passwords from the environment) use the worker
//! binary `flow-worker-it` and check its exit status and stderr.
//!
//! Every test uses its own tables (`unique_name`) and drops them. The tests fail, not skip, without
//! a cluster; they wait a while for it, since other test binaries stop and restart replicas.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use flow_core::registry::{BuildResult, SinkBuildContext};
use flow_core::{
    Epoch, EpochOutcome, Registry, RunReport, RuntimeError, Sink, SinkContext, SinkError,
    SinkFactory,
};
use flow_integration::generation::*;
use flow_integration::worker::*;
use flow_integration::*;
use flow_state::SealedBatch;

const ROWS: u64 = 100;

fn cluster() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
}

/// One partition of `count` generator messages into sink `out`.
fn spec(pipeline: &str, class: &str, parameters: &str, dynamic: &str, count: u64) -> String {
    GeneratorSpec::new(pipeline, class, parameters)
        .partitions(1)
        .epoch(1000, 500)
        .count(count)
        .payload_bytes(8)
        .sink_name("out")
        .dynamic(dynamic)
        .yaml()
}

/// An unsharded exactly-once sink on a1 writing `table`.
fn a1_spec(table: &str) -> String {
    spec(
        "session",
        "ClickHouseBatchingSink",
        &format!("{{host: '{}', table: {table}}}", A1.http_addr()),
        "{retry_backoff: 100ms, max_retry_backoff: 2s}",
        ROWS,
    )
}

async fn run_with(registry: &Registry, yaml: &str, dir: &Path) -> Result<RunReport, RuntimeError> {
    run_pipeline(registry, yaml, dir, RUN_TIMEOUT)
        .await
        .unwrap()
}

async fn run(yaml: &str) -> Result<RunReport, RuntimeError> {
    let dir = TestDir::new().unwrap();
    run_with(&flow_worker::registry(), yaml, dir.path()).await
}

/// Runs `yaml`, which must be refused at session start; returns the error text after checking
/// its shape.
async fn refusal(yaml: &str, table: &str) -> String {
    let err = match run(yaml).await {
        Ok(report) => panic!("the run was expected to be refused, but it finished: {report:?}"),
        Err(err) => err,
    };
    assert!(
        matches!(err, RuntimeError::PartitionsFailed(_)),
        "unexpected error kind: {err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "Refusing to start the ClickHouse sink for default.{table}: "
        )),
        "{text}"
    );
    text
}

fn assert_has(text: &str, phrase: &str) {
    assert!(text.contains(phrase), "expected\n  {phrase}\nin\n  {text}");
}

fn count(port: u16, table: &str, filter: &str) -> u64 {
    query_u64(
        port,
        &format!("SELECT count() FROM default.{table} {filter}"),
    )
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// The worker binary.

/// Runs `flow-worker-it ARGS` with extra environment, killing it after `timeout`.
fn worker(args: &[&str], env: &[(&str, &str)], timeout: Duration) -> WorkerOutput {
    run_worker(worker_bin!(), args, env, timeout).unwrap_or_else(|err| panic!("{err:#}"))
}

const RUN_TIMEOUT: Duration = Duration::from_secs(180);

fn worker_run(spec_path: &Path, state: &Path, env: &[(&str, &str)]) -> WorkerOutput {
    worker(
        &[
            "run",
            spec_path.to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
        ],
        env,
        RUN_TIMEOUT,
    )
}

fn worker_status(state: &Path) -> serde_json::Value {
    let out = worker(
        &["status", "--state-dir", state.to_str().unwrap(), "--json"],
        &[],
        Duration::from_secs(60),
    );
    assert_eq!(out.code, Some(0), "status failed: {}", out.stderr);
    serde_json::from_str(&out.stdout).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Engines.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distributed_target_is_refused_with_the_reason() {
    cluster();
    let local = unique_name("it_sess_local");
    let dist = unique_name("it_sess_dist");
    let local_table =
        ReplicatedTable::create("default", &local, GENERATOR_COLUMNS, "id", &[A1]).unwrap();
    let mut guard = DropGuard::default();
    guard
        .create(
            A1.http_port,
            &format!("default.{dist}"),
            &format!(
                "CREATE TABLE default.{dist} AS default.{local} ENGINE = Distributed({CLUSTER_NAME}, default, {local})"
            ),
        )
        .unwrap();
    let text = refusal(&a1_spec(&dist), &dist).await;
    assert_has(
        &text,
        &format!(
            "{dist} is a Distributed table on 127.0.0.1:18123. The sink routes rows to shards \
             itself and needs each shard's local table"
        ),
    );
    assert_has(
        &text,
        "Set `table` to the local table and list the shards in `shard_hosts`",
    );
    drop(guard);
    drop(local_table);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_engine_is_refused_only_the_merge_tree_family() {
    cluster();
    let t = unique_name("it_sess_log");
    let mut guard = DropGuard::default();
    guard
        .create(
            A1.http_port,
            &format!("default.{t}"),
            &format!("CREATE TABLE default.{t} ({GENERATOR_COLUMNS}) ENGINE = Log"),
        )
        .unwrap();
    let text = refusal(&a1_spec(&t), &t).await;
    assert_has(
        &text,
        &format!(
            "{t} has engine Log on 127.0.0.1:18123; only the MergeTree family is supported \
             (ReplicatedMergeTree recommended), since exactly-once needs its block deduplication"
        ),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_differing_between_shards_is_refused() {
    cluster();
    let t = unique_name("it_sess_schema");
    let on_a = ReplicatedTable::create("default", &t, "id UInt64, x String", "id", &[A1]).unwrap();
    let on_b = ReplicatedTable::create("default", &t, "id UInt64, x UInt8", "id", &[B1]).unwrap();
    let yaml = spec(
        "session",
        "ShardedClickHouseBatchingSink",
        &format!(
            "{{shard_hosts: {{a: ['{}'], b: ['{}']}}, table: {t}}}",
            A1.http_addr(),
            B1.http_addr()
        ),
        "{}",
        ROWS,
    );
    let text = refusal(&yaml, &t).await;
    assert_has(
        &text,
        "the table's schema differs between hosts: column 2 is `x` String on host \
         127.0.0.1:18123 of shard `a` but `x` UInt8 on host 127.0.0.1:18125 of shard `b`. Make \
         the tables identical (name, type, default kind and expression, in order)",
    );
    drop((on_a, on_b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_replicating_through_different_zookeeper_paths_are_refused() {
    cluster();
    let t = unique_name("it_sess_zk");
    let path = |n: &str| format!("/clickhouse/tables/it_sess_zk/{t}/{n}");
    let mut guard = DropGuard::default();
    for (node, n) in [(A1, "one"), (A2, "two")] {
        guard
            .create(
                node.http_port,
                &format!("default.{t}"),
                &format!(
                    "CREATE TABLE default.{t} ({GENERATOR_COLUMNS}) ENGINE = \
                     ReplicatedMergeTree('{}', 'r') ORDER BY id",
                    path(n)
                ),
            )
            .unwrap();
    }
    let yaml = spec(
        "session",
        "ClickHouseBatchingSink",
        &format!(
            "{{hosts: ['{}', '{}'], table: {t}}}",
            A1.http_addr(),
            A2.http_addr()
        ),
        "{}",
        ROWS,
    );
    let text = refusal(&yaml, &t).await;
    assert_has(
        &text,
        &format!(
            "host 127.0.0.1:18124 replicates through ZooKeeper path \"{}\" but host \
             127.0.0.1:18123 through \"{}\": they are different tables, not replicas of one. Point \
             every host of the shard at replicas sharing one zookeeper_path",
            path("two"),
            path("one")
        ),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_merge_tree_on_several_hosts_is_refused_but_one_host_is_accepted() {
    cluster();
    let t = unique_name("it_sess_plain");
    let mut guard = DropGuard::default();
    for node in [A1, A2] {
        guard
            .create_merge_tree(node, "default", &t, GENERATOR_COLUMNS, "id")
            .unwrap();
    }
    let several = spec(
        "session",
        "ClickHouseBatchingSink",
        &format!(
            "{{hosts: ['{}', '{}'], table: {t}}}",
            A1.http_addr(),
            A2.http_addr()
        ),
        "{}",
        ROWS,
    );
    let text = refusal(&several, &t).await;
    assert_has(
        &text,
        &format!("{t} is a MergeTree table, which does not replicate: the sink cannot prove that the 2 hosts"),
    );
    assert_has(&text, "Use ReplicatedMergeTree, or list one host");

    // One host: accepted (exactly-once degrades to at-least-once, with a warning); rows land.
    let report = run(&a1_spec(&t)).await.unwrap();
    assert_eq!(report.messages(), ROWS);
    assert_eq!(count(A1.http_port, &t, ""), ROWS);
    assert_eq!(
        query_u64(
            A1.http_port,
            &format!("SELECT uniqExact(id) FROM default.{t}")
        )
        .unwrap(),
        ROWS
    );
    assert_eq!(count(A2.http_port, &t, ""), 0, "a2 is not part of the sink");
}

/// The table's own `SETTINGS` override the server defaults of the dedup window, and a window too
/// small for the sink is warned about with the table's value and the attributes the reference
/// names. On 18.16 the replicated table's two windows (blocks and seconds); on 26.9 the plain
/// MergeTree's `non_replicated_deduplication_window`, which has no seconds bound.
fn table_level_dedup_window_too_small_is_warned_with_the_table_value(generation: Generation) {
    generation.require().unwrap();
    let host = generation.first();
    let t = unique_name("it_sess_window");
    let engine = match generation {
        Generation::V18 => format!(
            "ReplicatedMergeTree('/clickhouse/tables/a/default.{t}', 'a1') ORDER BY id \
             SETTINGS replicated_deduplication_window = 5, replicated_deduplication_window_seconds = 60"
        ),
        Generation::V26 => {
            "MergeTree ORDER BY id SETTINGS non_replicated_deduplication_window = 5".to_owned()
        }
    };
    let mut guard = DropGuard::default();
    guard
        .create(
            host.http_port,
            &format!("default.{t}"),
            &format!("CREATE TABLE default.{t} ({GENERATOR_COLUMNS}) ENGINE = {engine}"),
        )
        .unwrap();
    let dir = TestDir::new().unwrap();
    let path = dir.path().join("spec.yaml");
    std::fs::write(
        &path,
        spec(
            "session",
            "ClickHouseBatchingSink",
            &format!("{{host: '{}', table: {t}}}", host.http_addr()),
            "{retry_backoff: 100ms, max_retry_backoff: 2s, replay_horizon: 1h}",
            ROWS,
        ),
    )
    .unwrap();
    let out = worker_run(&path, &dir.path().join("state"), &[]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(count(host.http_port, &t, ""), ROWS);

    let warning = |setting: &str| -> String {
        out.stderr
            .lines()
            .find(|l| l.contains("WARN") && l.contains(&format!("DedupWindowSetting={setting} ")))
            .unwrap_or_else(|| panic!("no warning for {setting} in:\n{}", out.stderr))
            .to_owned()
    };
    // One partition can have 8 queued batches and 1 in flight: 9 blocks against a window of 5.
    let blocks_setting = match generation {
        Generation::V18 => "replicated_deduplication_window",
        Generation::V26 => "non_replicated_deduplication_window",
    };
    let blocks = warning(blocks_setting);
    for field in [
        "Database=default",
        &format!("Table={t}"),
        "DedupWindow=5 ",
        "DedupWindowSource=table",
        "BlocksInFlight=9",
        &format!("Raise {blocks_setting} on the table to at least 9"),
    ] {
        assert_has(&blocks, field);
    }
    let windows = if generation == Generation::V18 {
        let seconds = warning("replicated_deduplication_window_seconds");
        for field in [
            "Database=default",
            &format!("Table={t}"),
            "DedupWindow=60 ",
            "DedupWindowSource=table",
            "ReplayHorizon=3600",
            "shorter than replay_horizon (3600 s)",
        ] {
            assert_has(&seconds, field);
        }
        2
    } else {
        1
    };
    assert_eq!(
        out.stderr.matches("DedupWindowSetting=").count(),
        windows,
        "{}",
        out.stderr
    );
    drop(guard);
}
each_generation!(sync table_level_dedup_window_too_small_is_warned_with_the_table_value);

// ---------------------------------------------------------------------------------------------
// Columns.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn column_type_mismatch_names_the_column_both_types_and_the_fix() {
    cluster();
    let t = unique_name("it_sess_type");
    let table = ReplicatedTable::create(
        "default",
        &t,
        "id UInt64, partition UInt32, offset UInt64, user_id UInt32, ts DateTime, payload String",
        "id",
        &[A1],
    )
    .unwrap();
    let text = refusal(&a1_spec(&t), &t).await;
    assert_has(
        &text,
        "column `user_id`: the stream has uint64 but the table has UInt32; declare the stream \
         column as uint32 or change the table column to UInt64",
    );
    drop(table);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_column_missing_from_the_table_is_refused() {
    cluster();
    let t = unique_name("it_sess_missing_col");
    let table = ReplicatedTable::create(
        "default",
        &t,
        "id UInt64, partition UInt32, offset UInt64, user_id UInt64, ts DateTime",
        "id",
        &[A1],
    )
    .unwrap();
    let text = refusal(&a1_spec(&t), &t).await;
    assert_has(
        &text,
        &format!(
            "the stream column `payload` is not a column of default.{t}; add it to the table or \
             drop it from the stream"
        ),
    );
    drop(table);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_columns_absent_from_the_stream_are_not_sent() {
    cluster();
    let t = unique_name("it_sess_extra_col");
    let table = ReplicatedTable::create(
        "default",
        &t,
        &format!("{GENERATOR_COLUMNS}, note String DEFAULT 'x'"),
        "id",
        &[A1],
    )
    .unwrap();
    let report = run(&a1_spec(&t)).await.unwrap();
    assert_eq!(report.messages(), ROWS);
    assert_eq!(count(A1.http_port, &t, ""), ROWS);
    assert_eq!(count(A1.http_port, &t, "WHERE note = 'x'"), ROWS);
    drop(table);
}

/// The capability probe decides what exactly-once rests on. A column filled by `DEFAULT now()`
/// differs in a replay, so without `insert_deduplication_token` (18.16) the replay could not be
/// recognised and the sink refuses to start; a server with tokens (26.9) recognises the replay
/// by its token, so the sink starts, says it uses tokens, and every row lands once.
async fn non_deterministic_default_refuses_exactly_once_only_without_tokens(
    generation: Generation,
) {
    generation.require().unwrap();
    let host = generation.first();
    let t = unique_name("it_sess_now");
    let table = generation
        .create_table_on(
            "default",
            &t,
            &format!("{GENERATOR_COLUMNS}, ins DateTime DEFAULT now()"),
            "id",
            &[host],
        )
        .unwrap();
    let yaml = spec(
        "session",
        "ClickHouseBatchingSink",
        &format!("{{host: '{}', table: {t}}}", host.http_addr()),
        "{retry_backoff: 100ms, max_retry_backoff: 2s}",
        ROWS,
    );
    if generation.has_tokens() {
        let dir = TestDir::new().unwrap();
        let path = dir.path().join("spec.yaml");
        std::fs::write(&path, &yaml).unwrap();
        let out = worker_run(&path, &dir.path().join("state"), &[]);
        assert_eq!(out.code, Some(0), "{}", out.stderr);
        let started = out
            .stderr
            .lines()
            .find(|l| l.contains("ClickHouse writer session started"))
            .unwrap_or_else(|| panic!("no session start in:\n{}", out.stderr));
        assert_has(started, "tokens=true");
        assert!(
            !out.stderr.contains("has no `insert_deduplication_token`"),
            "{}",
            out.stderr
        );
        assert_eq!(count(host.http_port, &t, ""), ROWS);
        assert_eq!(count(host.http_port, &t, "WHERE ins > 0"), ROWS);
    } else {
        let text = refusal(&yaml, &t).await;
        assert_has(
            &text,
            "the column `ins` is filled by DEFAULT now() on every insert, so a replayed batch would \
             not be bit-identical and this server (no insert_deduplication_token) could not recognise \
             it as a replay; exactly-once is impossible. Send the column from the stream, make its \
             default deterministic, or use AtLeastOnceClickHouseSink",
        );
        assert_eq!(count(host.http_port, &t, ""), 0);
    }
    drop(table);
}
each_generation!(non_deterministic_default_refuses_exactly_once_only_without_tokens);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_table_is_refused_naming_the_table() {
    cluster();
    let t = unique_name("it_sess_absent");
    let text = refusal(&a1_spec(&t), &t).await;
    assert_has(
        &text,
        &format!(
            "the table does not exist on 127.0.0.1:18123. Create `default`.`{t}` on every host of \
             every shard"
        ),
    );
}

// ---------------------------------------------------------------------------------------------
// Connection options.

#[test]
fn tls_option_without_enable_tls_fails_validation_with_its_path() {
    // No connection is made: no cluster needed.
    let dir = TestDir::new().unwrap();
    let path = dir.path().join("spec.yaml");
    std::fs::write(
        &path,
        spec(
            "session",
            "ClickHouseBatchingSink",
            "{host: '127.0.0.1:18123', table: t, tls_ca_files: [x]}",
            "{}",
            ROWS,
        ),
    )
    .unwrap();
    let out = worker(
        &["validate", path.to_str().unwrap()],
        &[],
        Duration::from_secs(60),
    );
    assert_eq!(out.code, Some(1), "{}\n{}", out.stdout, out.stderr);
    let lines: Vec<&str> = out
        .stdout
        .lines()
        .chain(out.stderr.lines())
        .filter(|l| l.starts_with("sinks[0].parameters.tls_ca_files:"))
        .collect();
    assert_eq!(
        lines,
        ["sinks[0].parameters.tls_ca_files: tls_ca_files requires `enable_tls: true`; enable TLS, or remove tls_ca_files"],
        "{}\n{}",
        out.stdout,
        out.stderr
    );
}

#[test]
fn password_from_the_environment_works_and_a_wrong_one_fails_with_code_193() {
    cluster();
    let t = unique_name("it_sess_pw");
    let table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &[A1]).unwrap();
    let dir = TestDir::new().unwrap();
    let path = dir.path().join("spec.yaml");
    std::fs::write(
        &path,
        spec(
            "session",
            "ClickHouseBatchingSink",
            &format!(
                "{{host: '{}', table: {t}, user: {SECRET_USER}, password_env_var: FLOW_IT_CH_PASSWORD}}",
                A1.http_addr()
            ),
            "{retry_backoff: 100ms, max_retry_backoff: 2s}",
            ROWS,
        ),
    )
    .unwrap();

    let wrong = worker_run(
        &path,
        &dir.path().join("state-wrong"),
        &[("FLOW_IT_CH_PASSWORD", "not-the-password")],
    );
    assert_ne!(wrong.code, Some(0), "{}", wrong.stderr);
    assert_has(&wrong.stderr, "code 193");
    assert_has(&wrong.stderr, "Wrong password for user flow_secret");
    assert_eq!(count(A1.http_port, &t, ""), 0);

    let right = worker_run(
        &path,
        &dir.path().join("state-right"),
        &[("FLOW_IT_CH_PASSWORD", SECRET_PASSWORD)],
    );
    assert_eq!(right.code, Some(0), "{}", right.stderr);
    assert_eq!(count(A1.http_port, &t, ""), ROWS);
    drop(table);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_the_cluster_ca_runs() {
    cluster();
    let t = unique_name("it_sess_tls");
    let table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &[A1]).unwrap();
    let yaml = spec(
        "session",
        "ClickHouseBatchingSink",
        &format!(
            "{{host: '127.0.0.1:{}', enable_tls: true, tls_ca_files: ['{}'], table: {t}}}",
            A1.https_port,
            tls_ca_cert().display()
        ),
        "{retry_backoff: 100ms, max_retry_backoff: 2s}",
        ROWS,
    );
    let report = run(&yaml).await.unwrap();
    assert_eq!(report.messages(), ROWS);
    assert_eq!(count(A1.http_port, &t, ""), ROWS);
    drop(table);
}

// ---------------------------------------------------------------------------------------------
// The topology guard across restarts.

/// Wraps a sink so that batches are committed into the outbox but never handed to its delivery
/// queue: the state a `kill -9` right after a commit leaves behind.
struct LosesDeliveries {
    inner: Box<dyn Sink>,
}

#[async_trait]
impl Sink for LosesDeliveries {
    async fn open(&mut self) -> Result<(), SinkError> {
        self.inner.open().await
    }
    async fn write_epoch(&mut self, epoch: &Epoch<'_>) -> Result<EpochOutcome, SinkError> {
        self.inner.write_epoch(epoch).await
    }
    async fn committed(&mut self, _batches: Vec<(u64, SealedBatch)>) -> Result<(), SinkError> {
        Ok(())
    }
    async fn drain(&mut self) -> Result<(), SinkError> {
        self.inner.drain().await
    }
    async fn close(&mut self) -> Result<(), SinkError> {
        self.inner.close().await
    }
}

struct LosesDeliveriesFactory(Arc<dyn SinkFactory>);

impl SinkFactory for LosesDeliveriesFactory {
    fn create(&self, ctx: SinkContext) -> Result<Box<dyn Sink>, SinkError> {
        Ok(Box::new(LosesDeliveries {
            inner: self.0.create(ctx)?,
        }))
    }
}

/// The lossy sink is registered under the real class's name: the runs after it use that class,
/// and a spec naming another class than the one that sealed the pending batches is refused by
/// the runtime's sink guard before any sink opens.
const LOSSY_CLASS: &str = "ShardedClickHouseBatchingSink";

/// The worker's registry with `ShardedClickHouseBatchingSink` wrapped by [`LosesDeliveries`].
fn registry_with_lossy_sink() -> Registry {
    let mut registry = flow_worker::registry();
    let inner = registry
        .sink("ShardedClickHouseBatchingSink")
        .cloned()
        .unwrap();
    registry.register_sink(
        LOSSY_CLASS,
        Arc::new(
            move |ctx: &SinkBuildContext<'_>,
                  parameters: &serde_yaml::Value,
                  dynamic: &serde_yaml::Value|
                  -> BuildResult<Arc<dyn SinkFactory>> {
                Ok(Arc::new(LosesDeliveriesFactory(inner(
                    ctx, parameters, dynamic,
                )?)))
            },
        ),
    );
    registry
}

/// The sharded spec of the topology test: epochs of 50 messages, one batch per epoch.
fn topology_spec(class: &str, table: &str, key: &str, count: u64) -> String {
    GeneratorSpec::new(
        "topo",
        class,
        format!(
            "{{shard_hosts: {{a: ['{}', '{}'], b: ['{}', '{}']}}, table: {table}, \
             sharding_key_columns: [{key}]}}",
            A1.http_addr(),
            A2.http_addr(),
            B1.http_addr(),
            B2.http_addr()
        ),
    )
    .partitions(1)
    .epoch(50, 60_000)
    .count(count)
    .payload_bytes(8)
    .sink_name("out")
    .dynamic("{retry_backoff: 100ms, max_retry_backoff: 2s, max_rows_per_batch: 1000}")
    .yaml()
}

/// Rows of the table over both shards and distinct ids among them (after syncing the replicas
/// read).
fn total_rows(table: &str) -> (u64, u64) {
    let q = format!("default.{table}");
    let mut rows = 0;
    let mut ids = std::collections::BTreeSet::new();
    for node in [A1, B1] {
        sync_replica(node.http_port, &q).unwrap();
        for id in query_u64s(node.http_port, &format!("SELECT id FROM {q}")).unwrap() {
            rows += 1;
            ids.insert(id);
        }
    }
    (rows, ids.len() as u64)
}

/// How undelivered batches are kept deterministically: the first run uses a wrapper class (in this
/// process) that commits every epoch's batches into the outbox but never hands them to the
/// delivery queue — exactly the state that `kill -9` right after a commit leaves, without racing
/// a delivery that normally takes a millisecond. State is keyed by pipeline and sink name, not by
/// class, so the worker binary then finds those batches. (Killing the worker at the right moment,
/// or making shard b undeliverable, would be timing-dependent or would need node faults, which this
/// file does not inject.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_change_is_refused_while_batches_are_undelivered_then_adopted_once_drained() {
    cluster();
    let t = unique_name("it_sess_topo");
    let table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &NODES).unwrap();
    let dir = TestDir::new().unwrap();
    let state = dir.path().join("state");
    let spec_path = dir.path().join("spec.yaml");

    // 1. Four epochs are committed, nothing is delivered.
    let report = run_with(
        &registry_with_lossy_sink(),
        &topology_spec(LOSSY_CLASS, &t, "user_id", 200),
        &state,
    )
    .await
    .unwrap();
    assert_eq!(report.messages(), 200);
    assert_eq!(total_rows(&t).0, 0, "nothing may have been delivered");

    let status = worker_status(&state);
    let sink = &status["pipelines"]["topo"]["sinks"][0];
    assert_eq!(sink["sink"], "out");
    // One batch per epoch, a part per shard (200 distinct user_ids reach both shards).
    assert_eq!(sink["undelivered"], 8, "{sink}");
    assert_eq!(sink["rows"], 200, "{sink}");
    assert_eq!(sink["oldest"]["last_offset"], 49, "{sink}");
    let persisted_routing = sink["fingerprints"]["routing"].as_str().unwrap().to_owned();
    let by_user_id = flow_clickhouse::testing::topology_fingerprint(
        &["user_id".to_owned()],
        Some(&["a".to_owned(), "b".to_owned()]),
    );
    let by_id = flow_clickhouse::testing::topology_fingerprint(
        &["id".to_owned()],
        Some(&["a".to_owned(), "b".to_owned()]),
    );
    assert_eq!(persisted_routing, by_user_id);

    // 2. The changed routing is refused while those batches wait.
    std::fs::write(
        &spec_path,
        topology_spec("ShardedClickHouseBatchingSink", &t, "id", 200),
    )
    .unwrap();
    let refused = worker_run(&spec_path, &state, &[]);
    assert_ne!(refused.code, Some(0), "{}", refused.stderr);
    for phrase in [
        "Refusing to start the ClickHouse sink: the shard topology changed while 8 batch(es) are still undelivered",
        "Restore the previous shard_hosts / sharding_key_columns, deliver the pending batches with `flow-worker drain SPEC` (docs/operations.md, runbook \"Topology change\"), then apply the change",
        &format!("persisted_topology_fingerprint = {by_user_id}"),
        &format!("spec_topology_fingerprint      = {by_id}"),
        "oldest_undelivered_batch_bound = 0-49",
    ] {
        assert_has(&refused.stderr, phrase);
    }
    assert_eq!(total_rows(&t).0, 0);
    assert_eq!(
        worker_status(&state)["pipelines"]["topo"]["sinks"][0]["undelivered"],
        8
    );

    // 3. With the original spec the backlog drains.
    std::fs::write(
        &spec_path,
        topology_spec("ShardedClickHouseBatchingSink", &t, "user_id", 200),
    )
    .unwrap();
    let drained = worker_run(&spec_path, &state, &[]);
    assert_eq!(drained.code, Some(0), "{}", drained.stderr);
    assert_eq!(total_rows(&t), (200, 200));
    let sink = worker_status(&state)["pipelines"]["topo"]["sinks"][0].clone();
    assert_eq!(sink["undelivered"], 0, "{sink}");

    // 4. Now the change is accepted: the drained partition adopts the new routing and writes the
    //    next messages with it.
    std::fs::write(
        &spec_path,
        topology_spec("ShardedClickHouseBatchingSink", &t, "id", 300),
    )
    .unwrap();
    let changed = worker_run(&spec_path, &state, &[]);
    assert_eq!(changed.code, Some(0), "{}", changed.stderr);
    assert_eq!(total_rows(&t), (300, 300));
    let sink = worker_status(&state)["pipelines"]["topo"]["sinks"][0].clone();
    assert_eq!(sink["undelivered"], 0, "{sink}");
    let fingerprints: BTreeMap<String, String> =
        serde_json::from_value(sink["fingerprints"].clone()).unwrap();
    assert_eq!(fingerprints["routing"], by_id);
    drop(table);
}

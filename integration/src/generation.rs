//! The server generations the delivery tests run on, as one dimension of a test: the same test
//! body takes a [`Generation`] and finds there its shards, its table engine and what the server
//! can do, and [`each_generation!`](crate::each_generation) makes one test per generation of it.
//!
//! * [`Generation::V18`]: Debian's ClickHouse 18.16, two shards of two ReplicatedMergeTree
//!   replicas (`a1`, `a2` / `b1`, `b2`) sharing ZooKeeper. No `insert_deduplication_token`:
//!   exactly-once rests on block deduplication by content and the check by ids.
//! * [`Generation::V26`]: ClickHouse 26.9 (PyPI's chdb-core, `scripts/cluster.sh`'s `m1`, `m2`),
//!   two single-node shards of plain MergeTree tables with `non_replicated_deduplication_window`.
//!   Exactly-once rests on `insert_deduplication_token`. It cannot replicate (no interserver
//!   listener) and has no async insert queue, so a test of replicas or of async inserts is not a
//!   test of this generation.

use std::fmt;

use anyhow::{bail, Result};

use crate::{exec, ping, query_u64, Node, ReplicatedTable, A1, A2, B1, B2, HOST};

/// Modern node `m1`: shard `a` of the modern generation.
pub const M1: Node = Node {
    name: "m1",
    shard: "a",
    http_port: 18127,
    tcp_port: 19004,
    https_port: 0,
};
/// Modern node `m2`: shard `b` of the modern generation.
pub const M2: Node = Node {
    name: "m2",
    shard: "b",
    http_port: 18128,
    tcp_port: 19005,
    https_port: 0,
};

/// The blocks a modern test table remembers for deduplication: far more than any test sends
/// (the server's default, 0, turns deduplication of plain MergeTree tables off).
pub const MODERN_DEDUP_WINDOW: u64 = 10_000;

/// A server generation of the local cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Generation {
    /// ClickHouse 18.16, replicated through ZooKeeper, no deduplication tokens.
    V18,
    /// ClickHouse 26.9, single-node MergeTree shards, deduplication tokens.
    V26,
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Generation::V18 => "ClickHouse 18.16",
            Generation::V26 => "ClickHouse 26.9",
        })
    }
}

impl Generation {
    /// Both generations, the older first.
    pub const ALL: [Generation; 2] = [Generation::V18, Generation::V26];

    /// A short tag for names of tables and pipelines: `v18` or `v26`.
    pub fn tag(self) -> &'static str {
        match self {
            Generation::V18 => "v18",
            Generation::V26 => "v26",
        }
    }

    /// The hosts of shard `a`.
    pub fn shard_a(self) -> &'static [Node] {
        match self {
            Generation::V18 => &[A1, A2],
            Generation::V26 => &[M1],
        }
    }

    /// The hosts of shard `b`.
    pub fn shard_b(self) -> &'static [Node] {
        match self {
            Generation::V18 => &[B1, B2],
            Generation::V26 => &[M2],
        }
    }

    /// The shards by name, `a` first.
    pub fn shards(self) -> Vec<(&'static str, Vec<Node>)> {
        vec![
            ("a", self.shard_a().to_vec()),
            ("b", self.shard_b().to_vec()),
        ]
    }

    /// Every node of the generation, shard `a` first.
    pub fn nodes(self) -> Vec<Node> {
        self.shard_a()
            .iter()
            .chain(self.shard_b())
            .copied()
            .collect()
    }

    /// The first host of shard `a`: where a single-host test writes and reads.
    pub fn first(self) -> Node {
        self.shard_a()[0]
    }

    /// Are a shard's hosts replicas of one another?
    pub fn replicates(self) -> bool {
        self == Generation::V18
    }

    /// Does the server know `insert_deduplication_token`?
    pub fn has_tokens(self) -> bool {
        self == Generation::V26
    }

    /// The unsharded sinks' host parameter for shard `a`: `hosts: [...]` for several hosts,
    /// `host: ...` for one (the sinks refuse a one-entry `hosts` list).
    pub fn hosts_param(self) -> String {
        match self.shard_a() {
            [one] => format!("host: \"{HOST}:{}\"", one.http_port),
            hosts => format!("hosts: [{}]", quoted_addrs(hosts)),
        }
    }

    /// `shard_hosts: {a: [...], b: [...]}`, the sharded sink's parameter.
    pub fn shard_hosts_param(self) -> String {
        format!(
            "shard_hosts: {{a: [{}], b: [{}]}}",
            quoted_addrs(self.shard_a()),
            quoted_addrs(self.shard_b())
        )
    }

    /// The engine clause of a delivery test's table: ReplicatedMergeTree on 18.16, MergeTree with a
    /// deduplication window on 26.9.
    pub fn engine(self, database: &str, table: &str, order_by: &str) -> String {
        match self {
            Generation::V18 => format!(
                "ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{database}.{table}', '{{replica}}') \
                 ORDER BY {order_by}"
            ),
            Generation::V26 => format!(
                "MergeTree ORDER BY {order_by} SETTINGS non_replicated_deduplication_window = \
                 {MODERN_DEDUP_WINDOW}"
            ),
        }
    }

    /// `CREATE TABLE IF NOT EXISTS database.table (columns) ENGINE = <engine>`.
    pub fn table_ddl(self, database: &str, table: &str, columns: &str, order_by: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {database}.{table} ({columns}) ENGINE = {}",
            self.engine(database, table, order_by)
        )
    }

    /// Creates the table on `nodes` (of this generation), dropped with the guard.
    pub fn create_table_on(
        self,
        database: &str,
        table: &str,
        columns: &str,
        order_by: &str,
        nodes: &[Node],
    ) -> Result<ReplicatedTable> {
        let ddl = self.table_ddl(database, table, columns, order_by);
        ReplicatedTable::create_by(database, table, &ddl, nodes)
    }

    /// Creates the table on every node of the generation.
    pub fn create_table(
        self,
        database: &str,
        table: &str,
        columns: &str,
        order_by: &str,
    ) -> Result<ReplicatedTable> {
        self.create_table_on(database, table, columns, order_by, &self.nodes())
    }

    /// Ok if every node of the generation (and, for 18.16, ZooKeeper) answers; otherwise an error
    /// naming the nodes that do not and telling how to start them. Tests call it first so that
    /// they fail, not skip, without their servers.
    pub fn require(self) -> Result<()> {
        if self == Generation::V18 {
            return crate::require_cluster();
        }
        let down: Vec<String> = self
            .nodes()
            .iter()
            .filter(|n| !ping(n.http_port))
            .map(|n| format!("{} ({})", n.name, n.http_addr()))
            .collect();
        if down.is_empty() {
            return Ok(());
        }
        bail!(
            "the modern nodes of the local cluster are not running (not answering: {}); start them \
             with `scripts/cluster.sh up`",
            down.join(", ")
        )
    }

    /// Makes what landed on `nodes` readable on every one of them: `SYSTEM SYNC REPLICA` where the
    /// generation replicates, nothing where each shard is one node.
    pub fn sync(self, database: &str, table: &str, nodes: &[Node]) -> Result<()> {
        if !self.replicates() {
            return Ok(());
        }
        for node in nodes {
            crate::worker::sync_when_writable(
                *node,
                database,
                table,
                std::time::Duration::from_secs(90),
            )?;
        }
        Ok(())
    }

    /// The server's version as `SELECT version()` prints it, checked against the generation.
    pub fn check_version(self, node: Node) -> Result<String> {
        let version = crate::query_text(node.http_port, "SELECT version()")?
            .trim()
            .to_owned();
        let major = version.split('.').next().unwrap_or_default();
        let want = match self {
            Generation::V18 => "18",
            Generation::V26 => "26",
        };
        if major != want {
            bail!(
                "{} ({}) runs ClickHouse {version}, not {self}",
                node.name,
                node.http_addr()
            );
        }
        Ok(version)
    }
}

/// How many INSERTs into `qualified` `node` recognised as a replay of a block it already held,
/// by the server's own records: on 18.16 the replica's log lines `Block with ID ... already
/// exists`, on 26.9 the finished INSERTs of its query log whose token an earlier one carried.
pub fn replays_recognised(generation: Generation, node: Node, qualified: &str) -> Result<usize> {
    match generation {
        Generation::V18 => Ok(crate::deduplicated_blocks_logged(node, qualified)),
        Generation::V26 => {
            let tokens = finished_insert_tokens(node, qualified)?;
            let distinct: std::collections::BTreeSet<&String> = tokens.iter().collect();
            Ok(tokens.len() - distinct.len())
        }
    }
}

/// The deduplication token of each INSERT into `qualified` that the modern `node` finished, in
/// the order they finished (its `system.query_log`, flushed first).
pub fn finished_insert_tokens(node: Node, qualified: &str) -> Result<Vec<String>> {
    exec(node.http_port, "SYSTEM FLUSH LOGS")?;
    let text = crate::query_text(
        node.http_port,
        &format!(
            "SELECT Settings['insert_deduplication_token'] FROM system.query_log \
             WHERE type = 'QueryFinish' AND query_kind = 'Insert' AND has(tables, '{qualified}') \
             ORDER BY event_time_microseconds FORMAT TSV"
        ),
    )?;
    Ok(text.lines().map(str::to_owned).collect())
}

/// Rows and distinct ids of `qualified` summed over the first host of each shard.
pub fn landed_on_shards(generation: Generation, qualified: &str) -> Result<(u64, u64)> {
    let mut rows = 0;
    let mut ids = 0;
    for shard in [generation.shard_a(), generation.shard_b()] {
        let (r, i) = crate::worker::count_uniq(shard[0], qualified)?;
        rows += r;
        ids += i;
    }
    Ok((rows, ids))
}

/// `SELECT count() FROM qualified` on a node.
pub fn rows_on(node: Node, qualified: &str) -> Result<u64> {
    query_u64(node.http_port, &format!("SELECT count() FROM {qualified}"))
}

fn quoted_addrs(nodes: &[Node]) -> String {
    nodes
        .iter()
        .map(|n| format!("\"{HOST}:{}\"", n.http_port))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One test per server generation from a function that takes a [`Generation`]:
/// `each_generation!(name)` defines the module `name` with the tests `name::v18` and `name::v26`,
/// each calling `name(Generation::…)`. `async` (the default) runs it on a two-thread tokio
/// runtime, `sync` calls a plain function. The function returns `anyhow::Result<()>` or `()`.
#[macro_export]
macro_rules! each_generation {
    ($name:ident) => {
        $crate::each_generation!(async $name);
    };
    (async $name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn v18() -> ::anyhow::Result<()> {
                ::anyhow::Result::<()>::from($crate::generation::GenerationOutcome::from(
                    super::$name($crate::generation::Generation::V18).await,
                ))
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn v26() -> ::anyhow::Result<()> {
                ::anyhow::Result::<()>::from($crate::generation::GenerationOutcome::from(
                    super::$name($crate::generation::Generation::V26).await,
                ))
            }
        }
    };
    (sync $name:ident) => {
        mod $name {
            #[test]
            fn v18() -> ::anyhow::Result<()> {
                ::anyhow::Result::<()>::from($crate::generation::GenerationOutcome::from(super::$name(
                    $crate::generation::Generation::V18,
                )))
            }
            #[test]
            fn v26() -> ::anyhow::Result<()> {
                ::anyhow::Result::<()>::from($crate::generation::GenerationOutcome::from(super::$name(
                    $crate::generation::Generation::V26,
                )))
            }
        }
    };
}

/// What a test body of [`each_generation!`](crate::each_generation) returned, so that bodies may
/// return `()` (and panic) or `anyhow::Result<()>`.
#[derive(Debug)]
pub struct GenerationOutcome(Result<()>);

impl From<()> for GenerationOutcome {
    fn from((): ()) -> Self {
        GenerationOutcome(Ok(()))
    }
}

impl From<Result<()>> for GenerationOutcome {
    fn from(result: Result<()>) -> Self {
        GenerationOutcome(result)
    }
}

impl From<GenerationOutcome> for Result<()> {
    fn from(outcome: GenerationOutcome) -> Self {
        outcome.0
    }
}

//! The server generation the bench writes to (`FLOW_BENCH_SERVER`): the local cluster's
//! ClickHouse 18.16 nodes (two shards of two ReplicatedMergeTree replicas, the default) or its
//! modern 26.9 nodes (two single-node shards of MergeTree tables with a deduplication window,
//! where the exactly-once classes send tokens). Every process of a bench run (orchestrator,
//! runner, hand-written loop) reads the same variable, so they agree.

use std::sync::OnceLock;

use anyhow::{bail, Result};

/// A server generation of the local cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    /// ClickHouse 18.16: a1, a2 (shard a), b1, b2 (shard b).
    V18,
    /// ClickHouse 26.9: m1 (shard a), m2 (shard b).
    V26,
}

const V18_SHARD_A: &[&str] = &["127.0.0.1:18123", "127.0.0.1:18124"];
const V18_SHARD_B: &[&str] = &["127.0.0.1:18125", "127.0.0.1:18126"];
const V26_SHARD_A: &[&str] = &["127.0.0.1:18127"];
const V26_SHARD_B: &[&str] = &["127.0.0.1:18128"];

impl Server {
    /// `FLOW_BENCH_SERVER`: unset, `18` or `18.16` for the older nodes, `26` or `26.9` for the
    /// modern ones. Read once per process.
    pub fn get() -> Result<Server> {
        static SERVER: OnceLock<Result<Server, String>> = OnceLock::new();
        let parsed = SERVER.get_or_init(|| {
            match std::env::var("FLOW_BENCH_SERVER").as_deref().map(str::trim) {
                Err(_) | Ok("") | Ok("18") | Ok("18.16") => Ok(Server::V18),
                Ok("26") | Ok("26.9") => Ok(Server::V26),
                Ok(other) => Err(format!(
                    "FLOW_BENCH_SERVER={other}: expected 18.16 (the default) or 26.9"
                )),
            }
        });
        match parsed {
            Ok(server) => Ok(*server),
            Err(message) => bail!("{message}"),
        }
    }

    /// [`Server::get`] where the orchestrator has already checked the variable (its first step).
    pub fn current() -> Server {
        Server::get().expect("FLOW_BENCH_SERVER is checked when the bench starts")
    }

    /// The ClickHouse version the nodes run, for the report.
    pub fn version(self) -> &'static str {
        match self {
            Server::V18 => "18.16",
            Server::V26 => "26.9",
        }
    }

    /// Shard `a`, and with `sharded` shard `b`; the first host of each is where its rows are
    /// written by the loop and counted.
    pub fn shards(self, sharded: bool) -> Vec<&'static [&'static str]> {
        let (a, b) = match self {
            Server::V18 => (V18_SHARD_A, V18_SHARD_B),
            Server::V26 => (V26_SHARD_A, V26_SHARD_B),
        };
        if sharded {
            vec![a, b]
        } else {
            vec![a]
        }
    }

    /// Every node.
    pub fn nodes(self) -> Vec<&'static str> {
        self.shards(true).into_iter().flatten().copied().collect()
    }

    /// The first host of shard `a`.
    pub fn first(self) -> &'static str {
        self.shards(false)[0][0]
    }

    /// The engine of a bench table. `old_parts_lifetime = 30`: an endless run at 200k rows/s
    /// merges so much that parts merged away (kept 8 minutes by default) once filled this
    /// machine's disk; it changes nothing the client measures.
    pub fn engine(self, table: &str) -> String {
        match self {
            Server::V18 => format!(
                "ReplicatedMergeTree('/clickhouse/tables/{{shard}}/default.{table}', '{{replica}}') \
                 ORDER BY id SETTINGS old_parts_lifetime = 30"
            ),
            Server::V26 => "MergeTree ORDER BY id SETTINGS old_parts_lifetime = 30, \
                            non_replicated_deduplication_window = 1000"
                .to_owned(),
        }
    }

    /// Whether a shard's hosts replicate (and a count must wait for `SYNC REPLICA`).
    pub fn replicates(self) -> bool {
        self == Server::V18
    }

    /// A sink's host parameters: `shard_hosts` over both shards with `sharded`, else shard `a`
    /// as `hosts` (or `host` for a one-host shard, which the sinks require).
    pub fn host_parameters(self, sharded: bool) -> String {
        let list = |hosts: &[&str]| {
            hosts
                .iter()
                .map(|h| format!("'{h}'"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let shards = self.shards(sharded);
        match (sharded, shards[0]) {
            (true, _) => format!(
                "shard_hosts: {{a: [{}], b: [{}]}}",
                list(shards[0]),
                list(shards[1])
            ),
            (false, [one]) => format!("host: '{one}'"),
            (false, hosts) => format!("hosts: [{}]", list(hosts)),
        }
    }

    /// Whether a process (by its `comm` in `/proc/PID/stat`) is one of this generation's servers:
    /// `clickhouse-server` and ZooKeeper's JVM, or the modern nodes' Python (chdb-core runs the
    /// server inside it).
    pub fn is_server_process(self, comm: &str) -> bool {
        match self {
            Server::V18 => comm == "clickhouse-serv" || comm == "java",
            Server::V26 => comm.starts_with("python"),
        }
    }
}

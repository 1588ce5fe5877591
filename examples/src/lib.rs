//! Examples of embedding flow pipelines in Rust programs through the `flow` facade:
//! `generator_to_clickhouse.rs` (the generator into an exactly-once ClickHouse sink, the
//! README's embedding program) and `custom_plugins.rs` (a program's own source and sink next to
//! the built-in plugins). Each checks its result and exits non-zero on a mismatch.
//!
//! This library holds what the examples need around the pipeline but is not about flow: the
//! ClickHouse table they write to ([`ExampleTable`]), created if missing and counted afterwards.

use std::time::Duration;

use anyhow::{ensure, Context};

/// A table of the local cluster (`scripts/cluster.sh up`) on the replicas of one shard.
#[derive(Clone, Debug)]
pub struct ExampleTable {
    /// The table in database `default`.
    pub table: String,
    /// `host:port` of the HTTP interface of each replica.
    pub hosts: Vec<String>,
}

impl ExampleTable {
    /// From the program's arguments `[TABLE] [HOST,HOST...]`, else `FLOW_EXAMPLE_TABLE` and
    /// `FLOW_EXAMPLE_HOSTS`, else `default_table` on the replicas of shard `a`.
    pub fn from_args(default_table: &str) -> ExampleTable {
        let mut args = std::env::args().skip(1);
        let mut arg = |var: &str, default: &str| {
            args.next()
                .or_else(|| std::env::var(var).ok())
                .unwrap_or_else(|| default.to_owned())
        };
        let table = arg("FLOW_EXAMPLE_TABLE", default_table);
        let hosts = arg("FLOW_EXAMPLE_HOSTS", "127.0.0.1:18123,127.0.0.1:18124");
        ExampleTable {
            table,
            hosts: hosts.split(',').map(str::to_owned).collect(),
        }
    }

    /// Creates the table with `columns` (`id UInt64, ...`, ordered by `id`) on every host, as a
    /// ReplicatedMergeTree (`{shard}` and `{replica}` are macros of every node), if missing.
    pub async fn create(&self, columns: &str) -> anyhow::Result<()> {
        let table = &self.table;
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS default.{table} ({columns}) ENGINE = \
             ReplicatedMergeTree('/clickhouse/tables/{{shard}}/default.{table}', '{{replica}}') ORDER BY id"
        );
        for host in &self.hosts {
            let created = client(host).query(&ddl).execute();
            tokio::time::timeout(Duration::from_secs(30), created)
                .await
                .with_context(|| format!("creating {table} on {host}: no answer"))?
                .with_context(|| format!("creating {table} on {host}"))?;
        }
        Ok(())
    }

    /// Fails unless every host holds exactly `expected` rows with `expected` distinct ids, once
    /// it has fetched what the other replicas took (`SYSTEM SYNC REPLICA`).
    pub async fn check_rows(&self, expected: u64) -> anyhow::Result<()> {
        let table = &self.table;
        for host in &self.hosts {
            let client = client(host);
            let sync = format!("SYSTEM SYNC REPLICA default.{table}");
            let synced = client.query(&sync).execute().await;
            synced.with_context(|| format!("{sync} on {host}"))?;
            let count = format!("SELECT count(), uniqExact(id) FROM default.{table}");
            let counted = client.query(&count).fetch_one::<(u64, u64)>().await;
            let (rows, ids) = counted.with_context(|| format!("{count} on {host}"))?;
            println!("{host}: {rows} rows, {ids} distinct ids in {table}");
            ensure!(
                rows == expected && ids == expected,
                "{host} holds {rows} rows with {ids} distinct ids in {table}; expected {expected}"
            );
        }
        Ok(())
    }
}

fn client(host: &str) -> clickhouse::Client {
    clickhouse::Client::default()
        .with_url(format!("http://{host}"))
        .with_validation(false)
}

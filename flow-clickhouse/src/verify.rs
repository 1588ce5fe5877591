//! Checking that the replicas of every shard hold the same rows (`flow-worker verify`).
//!
//! An INSERT answered with an ambiguous error (code 319 "Unknown status, client must retry" during
//! a ZooKeeper outage) can leave its part active on the replica that wrote it although the part
//! never reached ZooKeeper; flow's retry then lands the rows properly, and that replica holds them
//! twice until the server's part check drops the orphan or the table is re-attached. Such a part
//! is visible as an active local part missing from the replica's part list in ZooKeeper, which is
//! what this check looks for, besides comparing the replicas' row counts.
//!
//! A replica whose replication queue is not empty may still be catching up: its counts are
//! reported, but a difference is called unsettled, not diverged.
//!
//! A plain (non-replicated) MergeTree table has no replicas: each endpoint's table holds only the
//! rows sent to it, so differing counts are expected and no repair applies. Such a shard is
//! reported as not replicated rather than compared.
//!
//! A sink that writes many tables is checked table by table: each of its `tables` map, or each
//! table of its database that its template can name ([`verify_sink`]).

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use futures_util::future::join_all;
use serde::Serialize;
use thiserror::Error;

use crate::config::guarantee::SinkClass;
use crate::config::params::{self, SinkParams};
use crate::server::classify::ClassifiedError;
use crate::server::client::{
    build_shards, json_text, json_u64, quote_literal, quote_table, ClientsError, EndpointClient,
};
use crate::server::probe::EngineKind;
use crate::tables::template::Piece;
use flow_core::Violation;

/// Why a sink could not be verified at all.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// The HTTP clients of the sink's endpoints could not be built (TLS files, the password).
    #[error("cannot build the clients of the sink: {0}")]
    Clients(#[source] ClientsError),
    /// The sink's parameters do not validate.
    #[error("invalid sink parameters: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Parameters(Vec<Violation>),
    /// No host answered which tables a table template names.
    #[error("cannot list the tables of the template `{template}`: {endpoint} answered")]
    Unreachable {
        /// The template's text.
        template: String,
        /// The last host asked.
        endpoint: String,
        /// Its answer.
        #[source]
        error: ClassifiedError,
    },
}

/// One active part that a replica serves but ZooKeeper does not list for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OrphanPart {
    /// The part's name in `system.parts`.
    pub name: String,
    /// Rows in the part.
    pub rows: u64,
}

/// What one endpoint of a shard holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ReplicaState {
    /// The endpoint asked, `host:port`.
    pub endpoint: String,
    /// Rows the table holds there.
    pub rows: u64,
    /// The table's engine there (`system.tables.engine`), e.g. `ReplicatedMergeTree`.
    pub engine: String,
    /// `None` for a table that does not replicate.
    pub replication: Option<Replication>,
}

/// The replication side of a replica.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Replication {
    /// The replica's name in ZooKeeper (`system.replicas.replica_name`).
    pub replica_name: String,
    /// Entries the replica has still to execute (fetches, merges).
    pub queue_size: u64,
    /// The replica is read-only (it lost its ZooKeeper session or metadata).
    pub readonly: bool,
    /// Active local parts ZooKeeper does not list for the replica.
    pub orphan_parts: Vec<OrphanPart>,
}

/// The outcome for one shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum ShardVerdict {
    /// Every replica holds the same number of rows and no orphan part.
    Consistent {
        /// Rows each replica holds.
        rows: u64,
    },
    /// Replicas differ while some replication queue is not empty: they may still converge.
    Unsettled,
    /// Replicas hold orphan parts (`orphans`), or, with every queue empty, a count that differs
    /// from the most common one: they need a repair.
    Diverged {
        /// The endpoints that need a repair.
        replicas: Vec<String>,
        /// Whether orphan parts are the reason (otherwise a differing row count).
        orphans: bool,
    },
    /// The table does not replicate (a plain MergeTree) on these endpoints: there are no replicas
    /// to compare, and nothing was checked.
    NotReplicated {
        /// The engine of the table there, e.g. `MergeTree`.
        engine: String,
        /// The endpoints where the table does not replicate.
        endpoints: Vec<String>,
    },
    /// An endpoint could not be asked.
    Unreachable {
        /// The endpoint, `host:port`.
        endpoint: String,
        /// Why it could not be asked.
        error: String,
    },
}

/// The replicas of one shard and what they were found to be.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ShardReport {
    /// `""` for the unsharded forms.
    pub shard: String,
    /// `database.table`.
    pub table: String,
    /// Every endpoint of the shard.
    pub replicas: Vec<ReplicaState>,
    /// What they were found to be.
    pub verdict: ShardVerdict,
}

impl ShardReport {
    fn judge(shard: String, table: String, replicas: Vec<ReplicaState>) -> ShardReport {
        // Comparing independent tables would call their (expected) difference a divergence and
        // advise a repair that cannot apply.
        let plain: Vec<&ReplicaState> = replicas
            .iter()
            .filter(|r| EngineKind::of(&r.engine) == Some(EngineKind::Plain))
            .collect();
        if let Some(first) = plain.first() {
            let verdict = ShardVerdict::NotReplicated {
                engine: first.engine.clone(),
                endpoints: plain.iter().map(|r| r.endpoint.clone()).collect(),
            };
            return ShardReport {
                shard,
                table,
                replicas,
                verdict,
            };
        }
        let orphaned: Vec<String> = replicas
            .iter()
            .filter(|r| {
                r.replication
                    .as_ref()
                    .is_some_and(|x| !x.orphan_parts.is_empty())
            })
            .map(|r| r.endpoint.clone())
            .collect();
        let rows: BTreeSet<u64> = replicas.iter().map(|r| r.rows).collect();
        let settled = replicas
            .iter()
            .all(|r| r.replication.as_ref().is_none_or(|x| x.queue_size == 0));
        let verdict = if !orphaned.is_empty() {
            ShardVerdict::Diverged {
                replicas: orphaned,
                orphans: true,
            }
        } else if rows.len() <= 1 {
            ShardVerdict::Consistent {
                rows: rows.first().copied().unwrap_or(0),
            }
        } else if !settled {
            ShardVerdict::Unsettled
        } else {
            // No orphan to blame: name the replicas off the most common count, or all of them
            // when no count is the most common.
            let holding = |n: u64| replicas.iter().filter(|r| r.rows == n).count();
            let mut by_holders: Vec<(usize, u64)> = rows.iter().map(|&n| (holding(n), n)).collect();
            by_holders.sort_unstable_by(|a, b| b.cmp(a));
            let most = match by_holders[..] {
                [(first, n), (second, _), ..] if first > second => Some(n),
                _ => None,
            };
            let odd = replicas
                .iter()
                .filter(|r| most != Some(r.rows))
                .map(|r| r.endpoint.clone())
                .collect();
            ShardVerdict::Diverged {
                replicas: odd,
                orphans: false,
            }
        };
        ShardReport {
            shard,
            table,
            replicas,
            verdict,
        }
    }
}

impl fmt::Display for ShardReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shard = if self.shard.is_empty() {
            "the table".to_owned()
        } else {
            format!("shard `{}`", self.shard)
        };
        match &self.verdict {
            ShardVerdict::Consistent { rows } => {
                write!(f, "{shard}: consistent, {rows} rows on every replica")?
            }
            ShardVerdict::Unsettled => write!(
                f,
                "{shard}: replicas differ while replication is still running; run verify again once the queues are empty"
            )?,
            ShardVerdict::Diverged {
                replicas,
                orphans: true,
            } => write!(
                f,
                "{shard}: DIVERGED: orphan parts on {}. An orphan part is one that an INSERT answered ambiguously (code 319) left active although it never reached ZooKeeper; its rows were also delivered by the retry, so they are there twice. Repair: `DETACH TABLE {table}` then `ATTACH TABLE {table}` on that replica (it then sets aside parts ZooKeeper does not know), or restart it; then run verify again",
                replicas.join(", "),
                table = self.table
            )?,
            ShardVerdict::Diverged {
                replicas,
                orphans: false,
            } => write!(
                f,
                "{shard}: DIVERGED: the row count differs at {}, with every replication queue empty. Repair: `SYSTEM SYNC REPLICA {table}` there; if the counts still differ, `DETACH TABLE {table}` then `ATTACH TABLE {table}` (or a restart) makes the replica check its parts against ZooKeeper; then run verify again",
                replicas.join(", "),
                table = self.table
            )?,
            ShardVerdict::NotReplicated { engine, endpoints } => write!(
                f,
                "{shard}: not replicated: {table} is a {engine} table on {}, which does not replicate, so there are no replicas to compare and nothing was checked; each endpoint's table holds only the rows sent to it. For replicas that verify can compare, use a ReplicatedMergeTree table",
                endpoints.join(", "),
                table = self.table
            )?,
            ShardVerdict::Unreachable { endpoint, error } => {
                write!(f, "{shard}: cannot ask {endpoint}: {error}")?
            }
        }
        for replica in &self.replicas {
            write!(f, "\n  {}: {} rows", replica.endpoint, replica.rows)?;
            if let Some(replication) = &replica.replication {
                write!(
                    f,
                    ", replica `{}`, queue {}",
                    replication.replica_name, replication.queue_size
                )?;
                if replication.readonly {
                    write!(f, ", read-only")?;
                }
                for part in &replication.orphan_parts {
                    write!(f, "\n    orphan part {} ({} rows)", part.name, part.rows)?;
                }
            }
        }
        Ok(())
    }
}

/// The shard reports of a spec's sink entry (its class name and both parameter sections, its
/// relative paths resolved against `paths`), each endpoint given the sink's `write_timeout`;
/// `None` when the class is not a ClickHouse sink.
pub async fn verify_sink(
    class_name: &str,
    parameters: &serde_yaml::Value,
    dynamic: &serde_yaml::Value,
    paths: flow_core::SpecPaths<'_>,
) -> Result<Option<Vec<ShardReport>>, VerifyError> {
    let Some(class) = SinkClass::from_class_name(class_name) else {
        return Ok(None);
    };
    let (params, dynamic) =
        params::parse(class, parameters, dynamic, paths).map_err(VerifyError::Parameters)?;
    let mut reports = Vec::new();
    for table in resolved_tables(&params, dynamic.write_timeout).await? {
        let one = SinkParams {
            table,
            table_template: None,
            tables: Default::default(),
            ..params.clone()
        };
        reports.extend(verify_replicas(&one, dynamic.write_timeout).await?);
    }
    Ok(Some(reports))
}

/// The tables a sink writes: its `table`; each table of its `tables` map; for a template, every
/// table of its database that the template can name (its literal text, each placeholder one or
/// more name characters) on the first host of any shard, since the values its rows held are
/// not known here. A host that cannot be asked leaves its tables to the others; none answering
/// is [`VerifyError::Unreachable`].
async fn resolved_tables(
    params: &SinkParams,
    timeout: Duration,
) -> Result<Vec<String>, VerifyError> {
    if !params.tables.is_empty() {
        let names: BTreeSet<String> = params.tables.values().cloned().collect();
        return Ok(names.into_iter().collect());
    }
    let Some(template) = &params.table_template else {
        return Ok(vec![params.table.clone()]);
    };
    let pattern: String = template
        .pieces
        .iter()
        .map(|piece| match piece {
            Piece::Literal(text) => text.clone(),
            Piece::Column(_) | Piece::Subject(_) => "[A-Za-z0-9_]+".to_owned(),
        })
        .collect();
    let sql = format!(
        "SELECT name FROM system.tables WHERE database = {} AND match(name, {}) ORDER BY name",
        quote_literal(&params.database),
        quote_literal(&format!("^{pattern}$"))
    );
    let shards = build_shards(params).map_err(VerifyError::Clients)?;
    let mut names = BTreeSet::new();
    let mut failure = None;
    for endpoint in shards.iter().filter_map(|shard| shard.endpoints.first()) {
        match endpoint.query_json(&sql, timeout).await {
            Ok(rows) => names.extend(rows.iter().map(|row| json_text(row, "name"))),
            Err(err) => failure = Some((endpoint.endpoint.to_string(), err)),
        }
    }
    match failure {
        Some((endpoint, error)) if names.is_empty() => Err(VerifyError::Unreachable {
            template: template.text.clone(),
            endpoint,
            error,
        }),
        _ => Ok(names.into_iter().collect()),
    }
}

/// Asks every endpoint of every shard of a sink; see the module doc.
pub async fn verify_replicas(
    params: &SinkParams,
    timeout: Duration,
) -> Result<Vec<ShardReport>, VerifyError> {
    let shards = build_shards(params).map_err(VerifyError::Clients)?;
    let table = format!("{}.{}", params.database, params.table);
    let mut reports = Vec::new();
    for shard in &shards {
        let asked = join_all(
            shard
                .endpoints
                .iter()
                .map(|endpoint| replica_state(endpoint, params, timeout)),
        )
        .await;
        let mut replicas = Vec::new();
        let mut unreachable = None;
        for (endpoint, state) in shard.endpoints.iter().zip(asked) {
            match state {
                Ok(state) => replicas.push(state),
                Err(err) => {
                    unreachable.get_or_insert((endpoint.endpoint.to_string(), err.to_string()));
                }
            }
        }
        reports.push(match unreachable {
            Some((endpoint, error)) => ShardReport {
                shard: shard.name.clone(),
                table: table.clone(),
                replicas,
                verdict: ShardVerdict::Unreachable { endpoint, error },
            },
            None => ShardReport::judge(shard.name.clone(), table.clone(), replicas),
        });
    }
    Ok(reports)
}

/// The rows, replication state and orphan parts of one endpoint. The local parts are read before
/// and after ZooKeeper's list, and only a part present both times counts as an orphan, so a part
/// committed while the check runs is never blamed.
async fn replica_state(
    endpoint: &EndpointClient,
    params: &SinkParams,
    timeout: Duration,
) -> Result<ReplicaState, ClassifiedError> {
    let spec = params;
    let (db, table) = (quote_literal(&spec.database), quote_literal(&spec.table));
    let count = endpoint
        .query_json(
            &format!(
                "SELECT count() AS rows FROM {}",
                quote_table(&spec.database, &spec.table)
            ),
            timeout,
        )
        .await?;
    let rows = count.first().and_then(|r| json_u64(r, "rows")).unwrap_or(0);
    let engine = endpoint
        .query_json(
            &format!("SELECT engine FROM system.tables WHERE database = {db} AND name = {table}"),
            timeout,
        )
        .await?
        .first()
        .map(|r| json_text(r, "engine"))
        .unwrap_or_default();
    let replicas = endpoint
        .query_json(
            &format!(
                "SELECT zookeeper_path, replica_name, queue_size, is_readonly FROM system.replicas WHERE database = {db} AND table = {table}"
            ),
            timeout,
        )
        .await?;
    let Some(replica) = replicas.first() else {
        return Ok(ReplicaState {
            endpoint: endpoint.endpoint.to_string(),
            rows,
            engine,
            replication: None,
        });
    };
    let replica_name = json_text(replica, "replica_name");
    let zk_parts_path = format!(
        "{}/replicas/{replica_name}/parts",
        json_text(replica, "zookeeper_path").trim_end_matches('/')
    );
    let before = active_parts(endpoint, &db, &table, timeout).await?;
    let in_zookeeper: BTreeSet<String> = endpoint
        .query_json(
            &format!(
                "SELECT name FROM system.zookeeper WHERE path = {}",
                quote_literal(&zk_parts_path)
            ),
            timeout,
        )
        .await?
        .iter()
        .map(|r| json_text(r, "name"))
        .collect();
    let after = active_parts(endpoint, &db, &table, timeout).await?;
    let orphan_parts = before
        .into_iter()
        .filter(|part| !in_zookeeper.contains(&part.name) && after.contains(part))
        .collect();
    Ok(ReplicaState {
        endpoint: endpoint.endpoint.to_string(),
        rows,
        engine,
        replication: Some(Replication {
            replica_name,
            queue_size: json_u64(replica, "queue_size").unwrap_or(0),
            readonly: json_u64(replica, "is_readonly").unwrap_or(0) != 0,
            orphan_parts,
        }),
    })
}

async fn active_parts(
    endpoint: &EndpointClient,
    db: &str,
    table: &str,
    timeout: Duration,
) -> Result<Vec<OrphanPart>, ClassifiedError> {
    Ok(endpoint
        .query_json(
            &format!(
                "SELECT name, rows FROM system.parts WHERE database = {db} AND table = {table} AND active ORDER BY name"
            ),
            timeout,
        )
        .await?
        .iter()
        .map(|r| OrphanPart {
            name: json_text(r, "name"),
            rows: json_u64(r, "rows").unwrap_or(0),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(endpoint: &str, rows: u64, queue: u64, orphans: &[(&str, u64)]) -> ReplicaState {
        ReplicaState {
            endpoint: endpoint.to_owned(),
            rows,
            engine: "ReplicatedMergeTree".to_owned(),
            replication: Some(Replication {
                replica_name: endpoint.to_owned(),
                queue_size: queue,
                readonly: false,
                orphan_parts: orphans
                    .iter()
                    .map(|(name, rows)| OrphanPart {
                        name: (*name).to_owned(),
                        rows: *rows,
                    })
                    .collect(),
            }),
        }
    }

    #[test]
    fn equal_counts_without_orphans_are_consistent() {
        let report = ShardReport::judge(
            "a".into(),
            "default.t".into(),
            vec![replica("a1", 500, 0, &[]), replica("a2", 500, 0, &[])],
        );
        assert_eq!(report.verdict, ShardVerdict::Consistent { rows: 500 });
    }

    #[test]
    fn an_orphan_part_names_its_replica_even_with_a_busy_queue() {
        let report = ShardReport::judge(
            "a".into(),
            "default.t".into(),
            vec![
                replica("a1", 768, 2, &[("all_358_358_0", 268)]),
                replica("a2", 500, 0, &[]),
            ],
        );
        assert_eq!(
            report.verdict,
            ShardVerdict::Diverged {
                replicas: vec!["a1".into()],
                orphans: true
            }
        );
        let text = report.to_string();
        assert!(
            text.contains("orphan part all_358_358_0 (268 rows)"),
            "{text}"
        );
        assert!(text.contains("ATTACH TABLE default.t"), "{text}");
    }

    #[test]
    fn different_counts_with_a_queue_are_unsettled_and_without_one_diverged() {
        let busy = ShardReport::judge(
            "a".into(),
            "default.t".into(),
            vec![replica("a1", 500, 0, &[]), replica("a2", 400, 3, &[])],
        );
        assert_eq!(busy.verdict, ShardVerdict::Unsettled);
        let idle = ShardReport::judge(
            "a".into(),
            "default.t".into(),
            vec![
                replica("a1", 500, 0, &[]),
                replica("a2", 400, 0, &[]),
                replica("a3", 500, 0, &[]),
            ],
        );
        assert_eq!(
            idle.verdict,
            ShardVerdict::Diverged {
                replicas: vec!["a2".into()],
                orphans: false
            }
        );
    }

    #[test]
    fn a_plain_merge_tree_is_not_replicated_whatever_its_counts() {
        let plain = |endpoint: &str, rows: u64| ReplicaState {
            endpoint: endpoint.to_owned(),
            rows,
            engine: "MergeTree".to_owned(),
            replication: None,
        };
        let report = ShardReport::judge(
            String::new(),
            "default.t".into(),
            vec![plain("a1", 10), plain("a2", 0)],
        );
        assert_eq!(
            report.verdict,
            ShardVerdict::NotReplicated {
                engine: "MergeTree".into(),
                endpoints: vec!["a1".into(), "a2".into()]
            }
        );
        assert_eq!(
            report.to_string(),
            "the table: not replicated: default.t is a MergeTree table on a1, a2, which does not replicate, so there are no replicas to compare and nothing was checked; each endpoint's table holds only the rows sent to it. For replicas that verify can compare, use a ReplicatedMergeTree table\n  a1: 10 rows\n  a2: 0 rows"
        );
    }
}

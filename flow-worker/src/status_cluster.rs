//! `flow-worker status --cluster URL --pipeline NAME`: a pipeline run by several workers, as
//! ZooKeeper holds it: the live members, each partition's owner and lease, and the partition's
//! committed position, pending batches and dead letters (whichever worker owns it).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use flow_state::cluster::{Cluster, ClusterUrl, OwnerStatus};
use flow_state::zk::{read_partition, ZkPartitionState};
use flow_state::PositionInfo;
use serde::Serialize;

/// How long `status` waits for ZooKeeper: it is asked by an operator who waits for the answer.
const SESSION_TIMEOUT: Duration = Duration::from_secs(5);

/// What `status --cluster` shows.
#[derive(Debug, Serialize)]
struct ClusterStatus {
    cluster: String,
    pipeline: String,
    members: BTreeSet<String>,
    partitions: Vec<PartitionStatus>,
}

/// One partition, as ZooKeeper holds it.
#[derive(Debug, Serialize)]
struct PartitionStatus {
    partition: u32,
    /// The worker that took the partition last.
    owner: String,
    /// Its generation (bumped at each take).
    generation: i32,
    /// The worker whose live session holds the lease: `None` while no worker runs it.
    lease_holder: Option<String>,
    position: Option<PositionInfo>,
    pending: Vec<PendingBatch>,
    dead_letters: usize,
    /// `<owner>/<name>` -> value: the partition's counters over every run.
    counters: BTreeMap<String, u64>,
}

/// One pending batch: its bounds, which a new owner rebuilds and sends under the same token.
#[derive(Debug, Serialize)]
struct PendingBatch {
    sink: String,
    seq: u64,
    shard: String,
    token: String,
    first_offset: u64,
    last_offset: u64,
    rows: u64,
    sealed_at_ms: u64,
}

pub fn status(url: &ClusterUrl, pipeline: &str, json: bool) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let status = runtime.block_on(read(url, pipeline))?;
    let text = if json {
        format!("{}\n", serde_json::to_string_pretty(&status)?)
    } else {
        render(&status)
    };
    crate::stdout::write_all(&text)?;
    Ok(ExitCode::SUCCESS)
}

async fn read(url: &ClusterUrl, pipeline: &str) -> anyhow::Result<ClusterStatus> {
    let reader = format!("status-{}", std::process::id());
    let cluster = Cluster::connect(url, &reader, SESSION_TIMEOUT)
        .await
        .with_context(|| format!("connecting to the cluster at {url}"))?;
    let members = cluster
        .member_list(pipeline)
        .await
        .context("reading the pipeline's members")?;
    let owners = cluster
        .owners(pipeline)
        .await
        .context("reading the partitions' owners")?;
    let mut partitions = Vec::with_capacity(owners.len());
    for (partition, owner) in owners {
        let state = read_partition(cluster.client(), url.root(), pipeline, partition)
            .await
            .with_context(|| format!("reading partition {partition}'s state"))?;
        partitions.push(PartitionStatus::new(partition, owner, state));
    }
    cluster.close().await;
    Ok(ClusterStatus {
        cluster: url.to_string(),
        pipeline: pipeline.to_owned(),
        members,
        partitions,
    })
}

impl PartitionStatus {
    fn new(partition: u32, owner: OwnerStatus, state: ZkPartitionState) -> PartitionStatus {
        let pending = state
            .pending
            .into_iter()
            .map(|(sink, stored)| PendingBatch {
                sink,
                seq: stored.seq,
                shard: stored.batch.shard,
                token: stored.batch.token,
                first_offset: stored.batch.first_offset,
                last_offset: stored.batch.last_offset,
                rows: stored.batch.rows,
                sealed_at_ms: stored.batch.sealed_at_ms,
            })
            .collect();
        let counters = state
            .counters
            .into_iter()
            .map(|c| (format!("{}/{}", c.owner, c.name), c.value))
            .collect();
        PartitionStatus {
            partition,
            owner: owner.worker_id,
            generation: owner.generation,
            lease_holder: owner.lease_holder,
            position: state.position.as_deref().map(PositionInfo::of),
            pending,
            dead_letters: state.dead_letters,
            counters,
        }
    }

    /// `running on W` / `not running (last owner W)`.
    fn ownership(&self) -> String {
        match &self.lease_holder {
            Some(holder) => format!("{holder} (generation {})", self.generation),
            None => format!(
                "nobody (last owner {}, generation {})",
                self.owner, self.generation
            ),
        }
    }
}

fn render(status: &ClusterStatus) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "pipeline `{}` in cluster {}",
        status.pipeline, status.cluster
    );
    let members: Vec<&str> = status.members.iter().map(String::as_str).collect();
    let _ = writeln!(
        out,
        "members ({}): {}",
        members.len(),
        if members.is_empty() {
            "none (no worker runs this pipeline now)".to_owned()
        } else {
            members.join(", ")
        }
    );
    if status.partitions.is_empty() {
        let _ = writeln!(
            out,
            "no partition was ever taken: no worker ran pipeline `{}` under this path",
            status.pipeline
        );
        return out;
    }
    for p in &status.partitions {
        let position = p.position.as_ref().map_or("none", |pos| pos.value.as_str());
        let rows: u64 = p.pending.iter().map(|b| b.rows).sum();
        let _ = writeln!(
            out,
            "partition {}: owned by {}; position {position}; pending {} batch(es), {rows} row(s); dead letters {}",
            p.partition,
            p.ownership(),
            p.pending.len(),
            p.dead_letters
        );
        for batch in &p.pending {
            let shard = if batch.shard.is_empty() {
                String::new()
            } else {
                format!(" shard {}", batch.shard)
            };
            let _ = writeln!(
                out,
                "  {} #{}{shard}: ids {}..={}, {} row(s), token {}",
                batch.sink,
                batch.seq,
                batch.first_offset,
                batch.last_offset,
                batch.rows,
                batch.token
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition(lease_holder: Option<&str>, pending: Vec<PendingBatch>) -> PartitionStatus {
        PartitionStatus {
            partition: 3,
            owner: "w-1".to_owned(),
            generation: 7,
            lease_holder: lease_holder.map(str::to_owned),
            position: Some(PositionInfo::of(b"120")),
            pending,
            dead_letters: 1,
            counters: BTreeMap::new(),
        }
    }

    #[test]
    fn render_names_members_owner_position_and_each_pending_batch() {
        let batch = PendingBatch {
            sink: "ch".to_owned(),
            seq: 4,
            shard: "a".to_owned(),
            token: "3-120:a".to_owned(),
            first_offset: 101,
            last_offset: 120,
            rows: 20,
            sealed_at_ms: 0,
        };
        let status = ClusterStatus {
            cluster: "zk://127.0.0.1:12181/flow".to_owned(),
            pipeline: "p".to_owned(),
            members: ["w-1".to_owned(), "w-2".to_owned()].into(),
            partitions: vec![partition(Some("w-1"), vec![batch])],
        };
        assert_eq!(
            render(&status),
            "pipeline `p` in cluster zk://127.0.0.1:12181/flow\n\
             members (2): w-1, w-2\n\
             partition 3: owned by w-1 (generation 7); position 120; pending 1 batch(es), 20 row(s); dead letters 1\n  \
             ch #4 shard a: ids 101..=120, 20 row(s), token 3-120:a\n"
        );
    }

    #[test]
    fn a_partition_without_a_lease_holder_names_its_last_owner() {
        let status = ClusterStatus {
            cluster: "zk://h:1/x".to_owned(),
            pipeline: "p".to_owned(),
            members: BTreeSet::new(),
            partitions: vec![partition(None, Vec::new())],
        };
        let text = render(&status);
        assert!(
            text.contains("members (0): none (no worker runs this pipeline now)\n"),
            "{text}"
        );
        assert!(
            text.contains("partition 3: owned by nobody (last owner w-1, generation 7); position 120; pending 0 batch(es), 0 row(s); dead letters 1\n"),
            "{text}"
        );
    }
}

//! The status of a pipeline, as `flow-worker status --json` shows it: the store's summary
//! (positions, undelivered batches, fingerprints, dead letters, persisted counters) completed with
//! what only the running process knows (each partition's source lag, what each sink saw since the
//! start). Reading it also refreshes the backlog and lag gauges of the metrics, so that the worker's
//! snapshot task and a [`PipelineHandle`](crate::PipelineHandle) keep `/metrics` current the same
//! way. The snapshot also names, under [`SOURCE_UNAVAILABLE`], the partitions whose source cannot
//! read and waits (a broker stream that disappeared).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use flow_core::{Metrics, PipelineControl};
use flow_state::{StateError, StateStore, StateSummary};

/// Why a status could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StatusError {
    /// The state store could not be read (or opened, for a stopped pipeline).
    #[error("reading the state store in `{dir}`: {source}")]
    Store {
        /// The state directory.
        dir: PathBuf,
        /// What the store said.
        #[source]
        source: StateError,
    },
    /// The blocking task reading the store panicked or was cancelled.
    #[error("the task reading the state store failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// The status snapshot could not be written.
    #[error("writing the status snapshot `{path}`: {source}")]
    WriteSnapshot {
        /// The snapshot file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The status could not be encoded as JSON.
    #[error("encoding the status snapshot: {0}")]
    Encode(#[source] serde_json::Error),
}

/// The key of the status snapshot under which a running worker names, per pipeline and
/// partition, what keeps the partition's source from reading ([`LiveStatus::source_unavailable`]);
/// absent while nothing does. The store's summary has no such field: it is a live figure.
pub const SOURCE_UNAVAILABLE: &str = "source_unavailable";

/// The file a running pipeline refreshes with its status, which `flow-worker status` shows while
/// the pipeline holds the store's lock.
pub fn snapshot_path(state_dir: &Path) -> PathBuf {
    state_dir.join("status-snapshot.json")
}

/// The status of a running pipeline: reads its store and completes the summary with the
/// process's own figures.
#[derive(Clone)]
pub struct LiveStatus {
    pipeline: String,
    store: StateStore,
    control: PipelineControl,
    metrics: Arc<Metrics>,
}

impl LiveStatus {
    /// The status of pipeline `pipeline` (its name), running on `store` with `control` and
    /// `metrics` (from [`flow_core::Pipeline::control`] and [`flow_core::Pipeline::metrics`]).
    pub fn new(
        pipeline: impl Into<String>,
        store: StateStore,
        control: PipelineControl,
        metrics: Arc<Metrics>,
    ) -> LiveStatus {
        LiveStatus {
            pipeline: pipeline.into(),
            store,
            control,
            metrics,
        }
    }

    /// The summary of every pipeline in the store (read off the runtime threads), with this
    /// pipeline's source lag per partition and what its sinks saw since the start; sets the
    /// backlog and lag gauges of the metrics from it.
    pub async fn summary(&self) -> Result<StateSummary, StatusError> {
        let reader = self.store.clone();
        let mut summary = tokio::task::spawn_blocking(move || reader.summary())
            .await
            .map_err(StatusError::Task)?
            .map_err(|source| StatusError::Store {
                dir: self.store.dir().to_path_buf(),
                source,
            })?;
        if let Some(running) = summary.pipelines.get_mut(&self.pipeline) {
            for (&partition, position) in &mut running.positions {
                position.lag = self.control.source_lag(partition);
                let unavailable = self.control.source_unavailable(partition).is_some();
                self.metrics
                    .observe_source_unavailable(&self.pipeline, partition, unavailable);
                let stalled = self.control.source_stalled_pulls(partition);
                self.metrics
                    .observe_source_stalled_pulls(&self.pipeline, partition, stalled);
            }
            let now_ms = flow_core::delivery::now_ms();
            self.metrics
                .observe_summary(&self.pipeline, running, now_ms);
            self.metrics.fill_run_status(&self.pipeline, running);
        }
        Ok(summary)
    }

    /// What keeps each partition of `summary`'s running pipeline from reading right now while
    /// its source waits, by partition; empty while nothing does.
    pub fn source_unavailable(&self, summary: &StateSummary) -> BTreeMap<u32, String> {
        summary
            .pipelines
            .get(&self.pipeline)
            .map(|running| {
                running
                    .positions
                    .keys()
                    .filter_map(|&p| self.control.source_unavailable(p).map(|what| (p, what)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Writes `summary` (with [`SOURCE_UNAVAILABLE`] when a partition's source waits) to the
    /// [`snapshot_path`] of the store's directory, atomically (a temporary file, then a rename),
    /// off the runtime threads.
    pub async fn write_snapshot(&self, summary: &StateSummary) -> Result<(), StatusError> {
        let mut value = serde_json::to_value(summary).map_err(StatusError::Encode)?;
        let unavailable = self.source_unavailable(summary);
        if let (false, Some(object)) = (unavailable.is_empty(), value.as_object_mut()) {
            let by_pipeline = BTreeMap::from([(self.pipeline.clone(), unavailable)]);
            object.insert(
                SOURCE_UNAVAILABLE.to_owned(),
                serde_json::to_value(by_pipeline).map_err(StatusError::Encode)?,
            );
        }
        let bytes = serde_json::to_vec(&value).map_err(StatusError::Encode)?;
        let path = snapshot_path(self.store.dir());
        tokio::task::spawn_blocking(move || {
            let temporary = path.with_extension("json.tmp");
            std::fs::write(&temporary, bytes)
                .and_then(|()| std::fs::rename(&temporary, &path))
                .map_err(|source| StatusError::WriteSnapshot { path, source })
        })
        .await
        .map_err(StatusError::Task)?
    }
}

/// The summary of a state directory no process holds (a pipeline that ended): opens the store
/// off the runtime threads, reads it and closes it.
pub async fn read_state_dir(state_dir: &Path) -> Result<StateSummary, StatusError> {
    let dir = state_dir.to_path_buf();
    let read = tokio::task::spawn_blocking(move || {
        let store = StateStore::open(&dir)?;
        let summary = store.summary();
        let closed = store.close();
        let summary = summary?;
        closed.map(|()| summary)
    });
    read.await
        .map_err(StatusError::Task)?
        .map_err(|source| StatusError::Store {
            dir: state_dir.to_path_buf(),
            source,
        })
}

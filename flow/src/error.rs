//! What can go wrong when a program starts, stops, reloads or inspects a pipeline.

use std::time::Duration;

use flow_core::{RuntimeError, SpecError};

use crate::live_status::StatusError;
use crate::metrics_endpoint::MetricsEndpointError;
use crate::store_lifecycle::StoreError;

/// An error of a [`PipelineHandle`](crate::PipelineHandle).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandleError {
    /// The spec is invalid; `violations` names every problem with its path in the spec.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// Neither the options nor the spec name a state directory.
    #[error("no state directory: set `state_dir` in the spec or StartOptions::state_dir")]
    NoStateDir,
    /// The state store could not be opened or closed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The metrics endpoint could not start.
    #[error(transparent)]
    MetricsEndpoint(#[from] MetricsEndpointError),
    /// The run failed (a partition failed, or the store belongs to another pipeline).
    #[error("the pipeline failed: {0}")]
    Run(#[source] RuntimeError),
    /// `stop` asked the pipeline to stop but it had not ended within the timeout; it goes on
    /// stopping, and `wait` returns its report once it ends.
    #[error(
        "the pipeline did not stop within {0:?}; it is still stopping (call wait() for its report)"
    )]
    StopTimeout(Duration),
    /// The run's report was already returned by an earlier `wait` or `stop`.
    #[error("the pipeline's run already ended and its report was returned")]
    AlreadyEnded,
    /// The task running the pipeline panicked or was cancelled.
    #[error("the pipeline's task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// The status could not be read.
    #[error(transparent)]
    Status(#[from] StatusError),
}

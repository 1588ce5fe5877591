//! What can go wrong when a program starts, stops, reloads or inspects a pipeline.

use std::path::PathBuf;
use std::time::Duration;

use flow_core::{RuntimeError, SpecError};
use flow_state::StateError;

use crate::live_status::StatusError;
use crate::metrics_endpoint::MetricsEndpointError;

/// An error of a [`PipelineHandle`](crate::PipelineHandle).
#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    /// The spec is invalid; `violations` names every problem with its path in the spec.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// Neither the options nor the spec name a state directory.
    #[error("no state directory: set `state_dir` in the spec or StartOptions::state_dir")]
    NoStateDir,
    /// The state store could not be opened (another process holds it, or the disk failed).
    #[error("cannot open the state directory `{dir}`: {source}")]
    OpenStore {
        /// The state directory.
        dir: PathBuf,
        /// Why it could not be opened.
        #[source]
        source: StateError,
    },
    /// The metrics endpoint could not start.
    #[error(transparent)]
    MetricsEndpoint(#[from] MetricsEndpointError),
    /// The run failed (a partition failed, or the store belongs to another pipeline).
    #[error("the pipeline failed: {0}")]
    Run(#[source] RuntimeError),
    /// The run ended but the state store did not close cleanly; what was committed is durable.
    #[error("closing the state store in `{dir}`: {source}")]
    CloseStore {
        /// The state directory.
        dir: PathBuf,
        /// Why it did not close.
        #[source]
        source: StateError,
    },
    /// The state store did not close within its bounded wait (its writes are blocked: a full
    /// disk?); what was committed is durable.
    #[error("the state store in `{dir}` did not close within {timeout:?} (is the disk full?); what was committed is durable")]
    CloseTimeout {
        /// The state directory.
        dir: PathBuf,
        /// How long closing was waited for.
        timeout: Duration,
    },
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

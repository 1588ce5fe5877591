//! Opening and closing a pipeline's state store from async code, as the worker and a
//! [`PipelineHandle`](crate::PipelineHandle) do: off the runtime threads (sled blocks), and
//! closing with a bounded wait, since a committer blocked in the file system (a full disk) must
//! not keep a program from ending when what was committed is durable anyway. A pipeline that
//! finds no earlier state in its directory says so loudly: a state directory looked for in the
//! wrong place reads as a first start and sends everything again.

use std::path::{Path, PathBuf};
use std::time::Duration;

use flow_state::{StateError, StateStore, StoreOptions};
use tracing::{error, warn};

/// How long closing the state store may take before giving up on it.
pub const STORE_CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a state store could not be opened or closed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be opened (another process holds it, or the disk failed).
    #[error("cannot open the state directory `{dir}`: {source}")]
    Open {
        /// The state directory.
        dir: PathBuf,
        /// What the store said; it names another process only when one holds the directory.
        #[source]
        source: StateError,
    },
    /// The store did not close cleanly; what was committed is durable.
    #[error("closing the state store in `{dir}`: {source}")]
    Close {
        /// The state directory.
        dir: PathBuf,
        /// Why it did not close.
        #[source]
        source: StateError,
    },
    /// The store did not close within [`STORE_CLOSE_TIMEOUT`] (its writes are blocked: a full
    /// disk?); what was committed is durable.
    #[error("the state store in `{dir}` did not close within {timeout:?} (its writes are blocked: is the disk full?); what was committed is durable")]
    CloseTimeout {
        /// The state directory.
        dir: PathBuf,
        /// How long closing was waited for.
        timeout: Duration,
    },
    /// The blocking task opening or closing the store panicked or was cancelled.
    #[error("the task opening or closing the state store failed: {0}")]
    Task(#[source] tokio::task::JoinError),
}

/// How long `run` and `drain` wait for the lock of a state directory another process holds: long
/// enough for the lock of a worker killed just before to be let go (see
/// [`StoreOptions::lock_wait`]), short enough to tell at once of a worker that runs on it.
const RESTART_LOCK_WAIT: Duration = Duration::from_secs(3);

/// Opens (or creates) the state store in `state_dir` off the runtime threads, waiting 3 s for a
/// lock held (the lock of a worker that has just exited is let go within it).
pub async fn open_state_store(state_dir: &Path) -> Result<StateStore, StoreError> {
    let dir = state_dir.to_path_buf();
    let options = StoreOptions {
        lock_wait: RESTART_LOCK_WAIT,
        ..StoreOptions::default()
    };
    tokio::task::spawn_blocking(move || StateStore::open_with(&dir, options))
        .await
        .map_err(StoreError::Task)?
        .map_err(|source| StoreError::Open {
            dir: state_dir.to_path_buf(),
            source,
        })
}

/// Warns, one line for the whole pipeline, when `store` holds no committed position for any of
/// the `partitions` partitions of `pipeline`: its source reads from the beginning. Returns
/// whether it warned. On a first start that is expected; for a pipeline that ran before it means
/// its state directory is elsewhere, and starting again would send everything again.
pub fn warn_if_no_earlier_state(
    store: &StateStore,
    pipeline: &str,
    partitions: u32,
) -> Result<bool, StateError> {
    for partition in 0..partitions {
        if store.position(pipeline, partition)?.is_some() {
            return Ok(false);
        }
    }
    let dir = store.dir().display();
    warn!(pipeline, state_dir = %dir, "no earlier state at {dir}: reading from the beginning. Expected on a first start; if pipeline `{pipeline}` ran before, its state directory is elsewhere: stop now and point `state_dir` (or --state-dir) at it, or everything is sent again");
    Ok(true)
}

/// Closes `store` (every clone of it) off the runtime threads, giving up after
/// [`STORE_CLOSE_TIMEOUT`], which is logged.
pub async fn close_state_store(store: StateStore) -> Result<(), StoreError> {
    let dir = store.dir().to_path_buf();
    let closing = tokio::task::spawn_blocking(move || store.close());
    match tokio::time::timeout(STORE_CLOSE_TIMEOUT, closing).await {
        Ok(Ok(closed)) => closed.map_err(|source| StoreError::Close { dir, source }),
        Ok(Err(err)) => Err(StoreError::Task(err)),
        Err(_) => {
            error!(state_dir = %dir.display(), timeout_s = STORE_CLOSE_TIMEOUT.as_secs(), "the state store did not close in time (its writes are blocked: is the disk full?); going on without it, what was committed is durable");
            Err(StoreError::CloseTimeout {
                dir,
                timeout: STORE_CLOSE_TIMEOUT,
            })
        }
    }
}

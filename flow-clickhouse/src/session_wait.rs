//! Starting the writer session while endpoints may be unreachable: unreachable endpoints are
//! waited for (with the growing pause of [`crate::backoff`]), warning on the first failure and then every
//! [`SESSION_WAIT_WARNING_INTERVAL`]; a target that cannot be written refuses the start; a stop
//! ends the wait. Whether to wait again is the retry decision inserts use ([`should_retry`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use flow_core::SinkError;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::backoff::RetryBackoff;
use crate::classify::should_retry;
use crate::session::WriterSession;
use crate::sink_state::SinkShared;

/// How often a session start that keeps failing on unreachable endpoints warns again.
pub const SESSION_WAIT_WARNING_INTERVAL: Duration = Duration::from_secs(30);

/// Why a session start ended without a session.
pub(crate) enum SessionWait {
    /// The pipeline began stopping while an endpoint was unreachable.
    Stopped,
    Refused(SinkError),
}

/// Starts the session of `shared`, waiting out unreachable endpoints; see the module doc.
pub(crate) async fn wait_for_session(
    shared: &SinkShared,
    stop: &mut watch::Receiver<bool>,
) -> Result<Arc<WriterSession>, SessionWait> {
    let params = &shared.params.spec;
    let waiting_since = Instant::now();
    let mut attempts = 0u32;
    let mut last_warning: Option<Instant> = None;
    let backoff = RetryBackoff::default();
    loop {
        let dynamic = shared.dynamic();
        attempts = attempts.saturating_add(1);
        let result = WriterSession::start(
            shared.class,
            &shared.params,
            &dynamic,
            &shared.stream,
            shared.partitions,
        )
        .await;
        match result {
            Ok(session) => {
                if attempts > 1 {
                    info!(
                        database = %params.database,
                        table = %params.table,
                        attempts,
                        waited_s = waiting_since.elapsed().as_secs(),
                        "ClickHouse writer session started after waiting for unreachable endpoints"
                    );
                }
                return Ok(Arc::new(session));
            }
            Err(err) if should_retry(err.class(), attempts, dynamic.max_insert_attempts) => {
                let due =
                    last_warning.is_none_or(|at| at.elapsed() >= SESSION_WAIT_WARNING_INTERVAL);
                if due {
                    warn!(
                        database = %params.database,
                        table = %params.table,
                        attempts,
                        waited_s = waiting_since.elapsed().as_secs(),
                        error = %err,
                        "cannot start the ClickHouse writer session yet; retrying with a pause growing from retry_backoff to max_retry_backoff. Check that every listed host is up and reachable from this worker"
                    );
                    last_warning = Some(Instant::now());
                }
                let pause = backoff
                    .failed(dynamic.retry_backoff, dynamic.retry_backoff_cap())
                    .max(Duration::from_millis(100));
                // As in `insert_part`: a stop (or a pipeline gone) ends the wait.
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.wait_for(|s| *s) => return Err(SessionWait::Stopped),
                }
            }
            Err(err) => return Err(SessionWait::Refused(err.into_sink_error())),
        }
    }
}

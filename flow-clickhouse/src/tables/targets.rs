//! The tables one sink with a table template writes ([`Targets`]): per resolved table its own
//! shared state ([`TableTarget`]: parameters with the table resolved, writer session, schema
//! check, give-up latch, routing fingerprint), made when a row first names the table.
//!
//! A table that does not exist is remembered as missing for [`MISSING_RECHECK`] only, then
//! looked up again: a table created while the pipeline runs is written from the first epoch
//! sealed after it is found.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flow_core::SinkError;
use tokio::sync::watch;

use crate::delivery::sink_state::{SinkShared, TableSession};
use crate::exactly_once::state::ExactlyOnce;

/// How long a table found missing is taken as missing before it is looked up again (each
/// look-up probes every host of every shard).
pub const MISSING_RECHECK: Duration = Duration::from_secs(1);

/// One resolved table of a sink.
pub struct TableTarget {
    pub shared: Arc<SinkShared>,
    pub exactly_once: Arc<ExactlyOnce>,
    /// When the table was last found missing, and the probe's text.
    missing: Mutex<Option<(Instant, String)>>,
}

/// What [`TableTarget::state`] found.
pub enum TableState {
    Up(Arc<crate::server::session::WriterSession>),
    /// The table does not exist on a shard: why, as the probe said.
    Missing(String),
    /// The pipeline began stopping before the session started.
    Stopping,
}

impl TableTarget {
    /// The table's session, or that it does not exist (looked up again after
    /// [`MISSING_RECHECK`]).
    pub async fn state(&self, stop: &watch::Receiver<bool>) -> Result<TableState, SinkError> {
        if let Some((at, reason)) = self.missing().as_ref() {
            if at.elapsed() < MISSING_RECHECK {
                return Ok(TableState::Missing(reason.clone()));
            }
        }
        Ok(match self.shared.table_session(stop).await? {
            TableSession::Up(session) => {
                *self.missing() = None;
                TableState::Up(session)
            }
            TableSession::Missing(err) => {
                let reason = err.to_string();
                *self.missing() = Some((Instant::now(), reason.clone()));
                TableState::Missing(reason)
            }
            TableSession::Stopping => TableState::Stopping,
        })
    }

    fn missing(&self) -> std::sync::MutexGuard<'_, Option<(Instant, String)>> {
        self.missing
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Every table a sink's rows named so far, by name.
pub struct Targets {
    /// The sink's own state: its parameters (with the template) and dynamic parameters.
    pub base: Arc<SinkShared>,
    tables: Mutex<BTreeMap<String, Arc<TableTarget>>>,
}

impl Targets {
    pub fn new(base: Arc<SinkShared>) -> Targets {
        Targets {
            base,
            tables: Mutex::new(BTreeMap::new()),
        }
    }

    /// The target of `table`, made on first use.
    pub fn get(&self, table: &str) -> Arc<TableTarget> {
        let mut tables = self.tables();
        if let Some(target) = tables.get(table) {
            return Arc::clone(target);
        }
        let target = self.target(table);
        tables.insert(table.to_owned(), Arc::clone(&target));
        target
    }

    fn target(&self, table: &str) -> Arc<TableTarget> {
        let shared = self.base.for_table(table);
        Arc::new(TableTarget {
            exactly_once: Arc::new(ExactlyOnce::new(&shared)),
            shared,
            missing: Mutex::new(None),
        })
    }

    /// The table of a stored batch's `target` (`<database>.<table>`), refused when it is in
    /// another database than the sink's.
    pub fn of_stored(&self, target: &str) -> Result<Arc<TableTarget>, SinkError> {
        let database = &self.base.params.database;
        match target.split_once('.') {
            Some((db, table)) if db == database => Ok(self.get(table)),
            _ => Err(SinkError::Refused(format!(
                "a pending batch is for `{target}`, which is not a table of database `{database}` that this sink writes; set `database` back to the one it had when the batch was sealed, or drain the outbox with that spec first"
            ))),
        }
    }

    /// Whether rows may name `table`: it has a target already, or one is made for it while
    /// fewer than `max_tables` exist. Decided under the map's lock, so that partitions naming
    /// new tables at once cannot together pass the bound.
    pub fn admit(&self, table: &str, max_tables: usize) -> bool {
        let mut tables = self.tables();
        if tables.contains_key(table) {
            return true;
        }
        if tables.len() >= max_tables {
            return false;
        }
        tables.insert(table.to_owned(), self.target(table));
        true
    }

    /// Every target made so far.
    pub fn all(&self) -> Vec<Arc<TableTarget>> {
        self.tables().values().cloned().collect()
    }

    /// New dynamic parameters for the sink and every table.
    pub fn reconfigure(&self, dynamic: &serde_yaml::Value) -> Result<(), SinkError> {
        self.base.reconfigure(dynamic)?;
        for target in self.all() {
            target.shared.reconfigure(dynamic)?;
        }
        Ok(())
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<TableTarget>>> {
        self.tables
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

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

use flow_core::{Readiness, SinkError, SinkMetrics};
use tokio::sync::watch;

use crate::config::params::MissingTable;
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

    /// Why the table was last found missing, if it was and was not found since.
    fn missing_reason(&self) -> Option<String> {
        self.missing().as_ref().map(|(_, reason)| reason.clone())
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

    /// Has `/ready` ask this sink about each of its tables (one probe per sink: each
    /// partition's call replaces the last).
    pub fn register_readiness(self: &Arc<Self>, metrics: &SinkMetrics) {
        let probe: Arc<dyn Readiness> = Arc::clone(self) as Arc<dyn Readiness>;
        metrics.register_readiness(Arc::downgrade(&probe));
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<TableTarget>>> {
        self.tables
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Not ready: each table the rows named whose session is not up, by name: missing (with the
/// probe's reason and what its rows do meanwhile), not started, or with a shard none of whose
/// hosts answered. A table no row named yet is not asked about.
impl Readiness for Targets {
    fn not_ready(&self) -> Vec<String> {
        let database = &self.base.params.database;
        let meanwhile = match self.base.params.missing_table {
            MissingTable::DeadLetter => "its rows are set aside as dead letters",
            MissingTable::Wait => "its partitions wait for it (missing_table: wait)",
        };
        let mut not_ready = Vec::new();
        for (table, target) in self.tables().iter() {
            match target.missing_reason() {
                Some(reason) => not_ready.push(format!(
                    "table `{database}`.`{table}` does not exist ({reason}); {meanwhile}"
                )),
                None => not_ready.extend(target.shared.not_ready()),
            }
        }
        not_ready
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use flow_core::registry::{SinkBuildContext, SourceSubjects};

    use super::*;
    use crate::config::guarantee::SinkClass;
    use crate::delivery::sink_state::build_shared;

    /// The targets of an at-least-once sink over the generator's stream with `parameters` (a
    /// YAML flow mapping, `table` a template).
    pub(crate) fn targets_of(parameters: &str) -> Targets {
        let inputs = [("rows".to_owned(), flow_core::sources::generator::schema())];
        let ctx = SinkBuildContext {
            pipeline: "p",
            sink: "s",
            class: SinkClass::AtLeastOnce.class_name(),
            partitions: 1,
            epoch: flow_core::EpochSettings::default(),
            inputs: &inputs,
            subjects: SourceSubjects::Unknown,
            paths: flow_core::SpecPaths::working_directory(),
        };
        let parameters: serde_yaml::Value = serde_yaml::from_str(parameters).unwrap();
        let base = build_shared(
            SinkClass::AtLeastOnce,
            &ctx,
            &parameters,
            &serde_yaml::Value::Null,
        )
        .unwrap();
        Targets::new(base)
    }

    fn targets(missing_table: &str) -> Targets {
        targets_of(&format!(
            "{{host: '127.0.0.1:1', table: 't_{{partition}}', missing_table: {missing_table}}}"
        ))
    }

    #[test]
    fn readiness_names_each_table_whose_session_is_not_up() {
        let targets = targets("dead_letter");
        assert_eq!(
            targets.not_ready(),
            Vec::<String>::new(),
            "no table named yet"
        );
        targets.get("t_0");
        let missing = targets.get("t_1");
        *missing.missing() = Some((Instant::now(), "no such table on 127.0.0.1:1".to_owned()));
        assert_eq!(
            targets.not_ready(),
            vec![
                "the ClickHouse writer session for `default`.`t_0` has not started: waiting for its hosts to answer (the log says which do not)".to_owned(),
                "table `default`.`t_1` does not exist (no such table on 127.0.0.1:1); its rows are set aside as dead letters".to_owned(),
            ]
        );
        let waiting = targets_waiting();
        assert_eq!(
            waiting,
            vec!["table `default`.`t_2` does not exist (gone); its partitions wait for it (missing_table: wait)".to_owned()]
        );
    }

    fn targets_waiting() -> Vec<String> {
        let targets = targets("wait");
        *targets.get("t_2").missing() = Some((Instant::now(), "gone".to_owned()));
        targets.not_ready()
    }
}

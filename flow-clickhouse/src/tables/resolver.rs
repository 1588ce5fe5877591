//! Which table each row of an epoch goes to ([`Resolver`]), shared by every class with a table
//! template: the rows resolved by the partition's template in message order, the `max_tables`
//! bound, and what a row whose table does not exist becomes (a dead letter naming the table, or
//! a wait under `missing_table: wait`, [`Resolver::missing`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use flow_core::{DeadRow, Epoch, EpochOutcome, Row, SinkError, TableRow};
use flow_state::DeadLetter;

use tokio::sync::watch;

use crate::config::params::MissingTable;
use crate::delivery::cutter::{BatchCutter, EpochCut};
use crate::delivery::sink_state::SinkShared;
use crate::server::session::WriterSession;
use crate::tables::requeued::requeued_token;
use crate::tables::targets::{TableState, TableTarget, Targets};
use crate::tables::template::BoundTemplate;

/// How long an epoch vetoed under `missing_table: wait` waits before it is read again.
pub const MISSING_TABLE_WAIT: Duration = Duration::from_secs(1);

/// Resolves the rows of one sink partition to their tables.
pub struct Resolver {
    pub targets: Arc<Targets>,
    template: Arc<BoundTemplate>,
    /// The name being resolved (reused across rows).
    name: String,
}

/// The rows of one epoch by table, in message order within each table.
pub struct Resolved {
    /// Table index (into `tables`) of each row; `None`: the row names no valid table.
    pub of_row: Vec<Option<usize>>,
    /// The tables named, in name order.
    pub tables: Vec<String>,
    pub dead_letters: Vec<DeadLetter>,
}

/// What [`Resolver::table`] found for one table of an epoch.
pub enum TableTurn {
    Up(Arc<TableTarget>, Arc<WriterSession>),
    /// The table is missing and its rows are dead letters now.
    Skip,
    /// The epoch ends here with this outcome.
    Outcome(EpochOutcome),
}

impl Resolved {
    /// Whether row `index` goes to table `t`.
    pub fn is_of(&self, index: usize, t: usize) -> bool {
        self.of_row.get(index).copied().flatten() == Some(t)
    }

    /// Cuts the epoch's rows of table `t` for `target` as one table's sink would; the rows its
    /// checks set aside join the dead letters.
    pub async fn cut_table(
        &mut self,
        cutter: &mut BatchCutter,
        (target, session): (&TableTarget, &WriterSession),
        epoch: &Epoch<'_>,
        t: usize,
    ) -> Result<EpochCut, SinkError> {
        let mut cut = cutter
            .cut_epoch_rows(&target.shared, session, epoch, |index| self.is_of(index, t))
            .await?;
        self.dead_letters.append(&mut cut.dead_letters);
        Ok(cut)
    }
}

impl Resolver {
    pub fn new(targets: Arc<Targets>, template: Arc<BoundTemplate>) -> Resolver {
        Resolver {
            targets,
            template,
            name: String::new(),
        }
    }

    /// Resolves every row's table; a row whose value makes no valid name, or that names one
    /// table more than `max_tables` allows, is a dead letter.
    pub fn resolve(&mut self, epoch: &Epoch<'_>) -> Result<Resolved, SinkError> {
        let [batch] = epoch.inputs else {
            return Err(SinkError::Refused(
                "a ClickHouse sink reads exactly one stream".to_owned(),
            ));
        };
        let mut by_name: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        let mut dead_letters = Vec::new();
        let mut of_row = vec![None; batch.len()];
        let max_tables = self.targets.base.params.max_tables;
        for (index, row) in batch.rows().enumerate() {
            if let Err(err) = self.template.resolve(&row, &mut self.name) {
                dead_letters.push(self.dead_letter(&row, err.to_string()));
                continue;
            }
            if let Some(rows) = by_name.get_mut(self.name.as_str()) {
                rows.push(index);
                continue;
            }
            if !self.targets.admit(&self.name, max_tables) {
                let reason = too_many_tables(&self.name, max_tables);
                dead_letters.push(self.dead_letter(&row, reason));
                continue;
            }
            by_name.insert(self.name.clone(), vec![index]);
        }
        let mut tables = Vec::with_capacity(by_name.len());
        for (t, (name, rows)) in by_name.into_iter().enumerate() {
            for index in rows {
                of_row[index] = Some(t);
            }
            tables.push(name);
        }
        Ok(Resolved {
            of_row,
            tables,
            dead_letters,
        })
    }

    /// The session of table `t` of `resolved`, or what its rows become without one: `Skip`
    /// once set aside as dead letters (missing table), `Outcome` for the epoch when it waits
    /// for the table or the pipeline is stopping ([`Resolver::missing`]).
    pub async fn table(
        &self,
        epoch: &Epoch<'_>,
        resolved: &mut Resolved,
        t: usize,
        stop: &watch::Receiver<bool>,
        token_prefix: &str,
    ) -> Result<TableTurn, SinkError> {
        let target = self.targets.get(&resolved.tables[t]);
        Ok(match target.state(stop).await? {
            TableState::Up(session) => TableTurn::Up(target, session),
            TableState::Stopping => TableTurn::Outcome(SinkShared::not_started()),
            TableState::Missing(reason) => {
                match self.missing(epoch, resolved, t, &reason, token_prefix) {
                    Some(wait) => TableTurn::Outcome(wait),
                    None => TableTurn::Skip,
                }
            }
        })
    }

    /// What the rows of table `t` (`table`, found missing for `reason`) become: `Some` veto
    /// under `missing_table: wait` (the epoch is not committed and is read again), else `None`
    /// with each row's dead letter added to `resolved`, keeping the table and the token a
    /// requeue sends it under.
    fn missing(
        &self,
        epoch: &Epoch<'_>,
        resolved: &mut Resolved,
        t: usize,
        reason: &str,
        token_prefix: &str,
    ) -> Option<EpochOutcome> {
        let database = &self.targets.base.params.database;
        let table = resolved.tables[t].clone();
        if self.targets.base.params.missing_table == MissingTable::Wait {
            return Some(EpochOutcome::Veto {
                reason: format!(
                    "table `{database}`.`{table}` named by a row does not exist ({reason}); waiting for it (missing_table: wait)"
                ),
                retry_after: MISSING_TABLE_WAIT,
            });
        }
        let why = missing_table_reason(database, &table, reason);
        if let [batch] = epoch.inputs {
            for (index, row) in batch.rows().enumerate() {
                if resolved.is_of(index, t) {
                    let letter = self.missing_table_letter(&row, &table, why.clone(), token_prefix);
                    resolved.dead_letters.push(letter);
                }
            }
        }
        None
    }

    fn dead_letter(&self, row: &Row<'_>, reason: String) -> DeadLetter {
        DeadLetter {
            partition: row.id().partition,
            offset: Some(row.id().offset),
            reason,
            payload: DeadRow::encode(row, &self.columns(), None, None, None),
        }
    }

    /// The dead letter of a row whose table does not exist: it keeps the table and the token a
    /// requeue sends it under ([`crate::tables::requeued`]).
    fn missing_table_letter(
        &self,
        row: &Row<'_>,
        table: &str,
        reason: String,
        token_prefix: &str,
    ) -> DeadLetter {
        let id = row.id();
        let for_table = TableRow {
            target: format!("{}.{table}", self.targets.base.params.database),
            token: requeued_token(token_prefix, table, id.partition, id.offset),
        };
        DeadLetter {
            partition: id.partition,
            offset: Some(id.offset),
            reason,
            payload: DeadRow::encode_for_table(row, &self.columns(), &for_table),
        }
    }

    /// The input stream's column names (a dead row's values by name).
    fn columns(&self) -> Vec<String> {
        let stream = &self.targets.base.stream;
        stream.columns().iter().map(|c| c.name.clone()).collect()
    }
}

/// The dead letter reason of a row whose table does not exist (every class says the same).
pub fn missing_table_reason(database: &str, table: &str, reason: &str) -> String {
    format!(
        "table `{database}`.`{table}` does not exist: {reason}. Create it, then `flow-worker dead-letters requeue` sends this row to it"
    )
}

/// Why a row naming one table more than `max_tables` allows is a dead letter.
fn too_many_tables(table: &str, max_tables: usize) -> String {
    format!(
        "the row names table `{table}`, but the sink's rows already named max_tables ({max_tables}) tables; raise max_tables if the template's column really has that many values (each table keeps a writer session), or template over a column with fewer"
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use flow_core::{MessageBatch, MessageId, Value};

    use super::*;
    use crate::tables::targets::tests::targets_of;
    use crate::tables::template::TableTemplate;

    /// A resolver of `t_{partition}` with `extra` sink parameters.
    fn resolver(extra: &str) -> Resolver {
        let targets = targets_of(&format!(
            "{{host: '127.0.0.1:1', table: 't_{{partition}}'{extra}}}"
        ));
        let template = TableTemplate::parse("t_{partition}")
            .unwrap()
            .bind(&targets.base.stream)
            .unwrap();
        Resolver::new(Arc::new(targets), Arc::new(template))
    }

    /// Rows of the generator's stream at offsets 0.., their `partition` column as given.
    fn batch(partitions: &[u64]) -> MessageBatch {
        let mut batch = MessageBatch::new(flow_core::sources::generator::schema());
        for (offset, &partition) in (0u64..).zip(partitions) {
            let mut w = batch.start_row(MessageId::new(0, offset));
            w.push(Value::Uint(offset)).unwrap();
            w.push(Value::Uint(partition)).unwrap();
            w.push(Value::Uint(offset)).unwrap();
            w.push(Value::Uint(1)).unwrap();
            w.push(Value::Uint(0)).unwrap();
            w.push(Value::Bytes(b"x")).unwrap();
            w.finish().unwrap();
        }
        batch
    }

    fn epoch<'a>(inputs: &'a [&'a MessageBatch]) -> Epoch<'a> {
        Epoch {
            number: 0,
            started_ms: 0,
            max_messages: 10,
            inputs,
        }
    }

    #[test]
    fn rows_go_to_their_tables_in_name_order_and_a_missing_tables_rows_become_its_dead_letters() {
        let mut resolver = resolver("");
        let rows = batch(&[1, 0, 1]);
        let inputs = [&rows];
        let mut resolved = resolver.resolve(&epoch(&inputs)).unwrap();
        assert_eq!(resolved.tables, ["t_0", "t_1"]);
        assert_eq!(resolved.of_row, [Some(1), Some(0), Some(1)]);
        let missing = resolver.missing(&epoch(&inputs), &mut resolved, 1, "gone", "p/");
        assert!(missing.is_none());
        let letters: Vec<(Option<u64>, &str)> = resolved
            .dead_letters
            .iter()
            .map(|d| (d.offset, d.reason.as_str()))
            .collect();
        let reason = "table `default`.`t_1` does not exist: gone. Create it, then `flow-worker dead-letters requeue` sends this row to it";
        assert_eq!(letters, [(Some(0), reason), (Some(2), reason)]);
        let dead = DeadRow::decode(&resolved.dead_letters[1].payload).unwrap();
        let for_table = dead.for_table.unwrap();
        assert_eq!(
            (for_table.target.as_str(), for_table.token.as_str()),
            ("default.t_1", "p/t_1/requeued/0-2")
        );
    }

    #[test]
    fn under_missing_table_wait_the_epoch_waits_and_nothing_is_set_aside() {
        let mut resolver = resolver(", missing_table: wait");
        let rows = batch(&[3]);
        let inputs = [&rows];
        let mut resolved = resolver.resolve(&epoch(&inputs)).unwrap();
        match resolver.missing(&epoch(&inputs), &mut resolved, 0, "gone", "p/") {
            Some(EpochOutcome::Veto {
                reason,
                retry_after,
            }) => {
                assert_eq!(reason, "table `default`.`t_3` named by a row does not exist (gone); waiting for it (missing_table: wait)");
                assert_eq!(retry_after, MISSING_TABLE_WAIT);
            }
            other => panic!("expected a veto, got {other:?}"),
        }
        assert!(resolved.dead_letters.is_empty());
    }

    #[test]
    fn a_row_naming_one_table_more_than_max_tables_is_a_dead_letter_naming_the_bound() {
        let mut resolver = resolver(", max_tables: 1");
        let rows = batch(&[0, 1, 0]);
        let inputs = [&rows];
        let resolved = resolver.resolve(&epoch(&inputs)).unwrap();
        assert_eq!(resolved.tables, ["t_0"]);
        assert_eq!(resolved.of_row, [Some(0), None, Some(0)]);
        assert_eq!(resolved.dead_letters.len(), 1);
        assert_eq!(resolved.dead_letters[0].offset, Some(1));
        assert!(resolved.dead_letters[0].reason.starts_with(
            "the row names table `t_1`, but the sink's rows already named max_tables (1) tables"
        ));
    }
}

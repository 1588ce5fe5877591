//! The table's columns, checked around every INSERT against those the session planned for.
//!
//! RowBinary carries no types: the server reads each value by the column's type *now*. An
//! `ALTER TABLE ... MODIFY COLUMN` under a running sink would make it parse the old layout as the
//! new types and store garbage without an error (a `UInt64` read as `Float64`), and a column added
//! with a non-deterministic DEFAULT would make replays differ. The sink therefore reads the
//! table's columns (`DESCRIBE TABLE`, which touches only this table, unlike `system.columns`, which
//! 18.16 answered in 0.5 s under load) from the host it is about to write to before each attempt,
//! and refuses to send when they differ from the session's; it reads them again after a
//! successful INSERT, so that a change that raced the INSERT is reported with the part it may have
//! garbled instead of passing silently. An INSERT that starts within [`FRESH`] of such a
//! verification on the same host relies on it instead of asking again: under load that halves the
//! queries, for a window of the same order as the one any check leaves before the server parses
//! the body. A difference makes the sink re-read the table's columns and decide whether to adopt
//! them ([`crate::server::session::WriterSession::refresh_columns`]); what it cannot adopt stops
//! it with the reason.

use std::sync::atomic::Ordering;
use std::time::Duration;

use flow_core::delivery::now_ms;

use crate::server::classify::{ClassifiedError, ErrorClass};
use crate::server::client::{json_text, quote_literal, quote_table, EndpointClient};

/// One column of the table as the server describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColumnMeta {
    pub name: String,
    pub type_text: String,
    pub default_kind: String,
    pub default_expression: String,
}

/// How long a verification of a host's columns covers the next INSERT there.
pub const FRESH: Duration = Duration::from_millis(100);

/// What the columns of one table must stay.
#[derive(Clone, Debug)]
pub struct ColumnsGuard {
    sql: String,
    expected: Vec<ColumnMeta>,
}

impl ColumnsGuard {
    /// The query reading `database.table`'s columns in table order before and after each
    /// INSERT: `DESCRIBE TABLE` touches only this table (see the module doc).
    pub fn query(database: &str, table: &str) -> String {
        format!("DESCRIBE TABLE {}", quote_table(database, table))
    }

    /// The query the session start reads `database.table`'s columns with: `system.columns`
    /// (18.16 has it, with `default_kind`), in table order, its kind named as `DESCRIBE`
    /// names it (`default_type`) so that [`read_columns`] reads both answers alike and the
    /// guard compares like with like.
    pub fn system_columns_query(database: &str, table: &str) -> String {
        format!(
            "SELECT name, type, default_kind AS default_type, default_expression FROM system.columns WHERE database = {} AND table = {}",
            quote_literal(database),
            quote_literal(table)
        )
    }

    pub fn new(sql: String, expected: Vec<ColumnMeta>) -> ColumnsGuard {
        ColumnsGuard { sql, expected }
    }

    /// The columns every INSERT is checked against.
    pub fn expected(&self) -> &[ColumnMeta] {
        &self.expected
    }

    /// Before an INSERT: an error when the columns on `endpoint` are not the expected ones (a
    /// permanent one naming the difference), or cannot be read (classified as the failure is).
    pub async fn before_insert(
        &self,
        endpoint: &EndpointClient,
        timeout: Duration,
    ) -> Result<(), ClassifiedError> {
        let checked = endpoint.columns_checked_ms.load(Ordering::Relaxed);
        if now_ms().saturating_sub(checked) < FRESH.as_millis() as u64 {
            return Ok(());
        }
        match self.difference(endpoint, timeout).await? {
            None => {
                endpoint.columns_checked_ms.store(now_ms(), Ordering::Relaxed);
                Ok(())
            }
            Some(diff) => Err(changed(format!(
                "the table's columns changed since the sink planned them ({diff}); nothing was sent, so no value was stored under the old layout. The sink re-reads them: a compatible change is adopted, an incompatible one stops the sink with the reason"
            ))),
        }
    }

    /// After a successful INSERT of the part with `token` (or, without one, of a part of
    /// `shard`): a permanent error when the columns changed meanwhile, since the server may have
    /// read that part with the new types.
    pub async fn after_insert(
        &self,
        endpoint: &EndpointClient,
        timeout: Duration,
        token: Option<&str>,
        shard: &str,
    ) -> Result<(), ClassifiedError> {
        match self.difference(endpoint, timeout).await {
            Ok(None) => {
                endpoint.columns_checked_ms.store(now_ms(), Ordering::Relaxed);
                Ok(())
            }
            Ok(Some(diff)) => Err(changed(format!(
                "the table's columns changed while {} was being inserted ({diff}): the INSERT succeeded, so its rows are in the table, perhaps stored with the new columns; check them and delete them if garbled. Reverting the change does not make a resend safe: under other columns the part is another block, which the server does not recognise as a replay. The exactly-once classes keep the part pending and ask the shard's replicas for its message ids (`message_id_column`) before sending it again",
                match token {
                    Some(token) => format!("the part with token {token}"),
                    None => format!("a part of shard `{shard}`"),
                }
            ))),
            // The INSERT itself succeeded; an unreadable check is caught by the next one.
            Err(_) => Ok(()),
        }
    }

    async fn difference(
        &self,
        endpoint: &EndpointClient,
        timeout: Duration,
    ) -> Result<Option<String>, ClassifiedError> {
        let now = read_columns(endpoint, &self.sql, timeout).await?;
        Ok(describe_difference(&self.expected, &now))
    }
}

/// The columns `sql` (see [`ColumnsGuard::query`] and [`ColumnsGuard::system_columns_query`])
/// describes on `endpoint`, in table order.
pub async fn read_columns(
    endpoint: &EndpointClient,
    sql: &str,
    timeout: Duration,
) -> Result<Vec<ColumnMeta>, ClassifiedError> {
    Ok(endpoint
        .query_json(sql, timeout)
        .await?
        .iter()
        .map(|row| ColumnMeta {
            name: json_text(row, "name"),
            type_text: json_text(row, "type"),
            default_kind: json_text(row, "default_type"),
            default_expression: json_text(row, "default_expression"),
        })
        .collect())
}

/// `columns` as one text (name, type, default kind and expression, in table order), what the
/// exactly-once classes remember as the columns a partition's attempts were made under.
pub fn columns_text(columns: &[ColumnMeta]) -> String {
    columns
        .iter()
        .map(|c| {
            format!(
                "{}\t{}\t{}\t{}",
                c.name, c.type_text, c.default_kind, c.default_expression
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn changed(message: String) -> ClassifiedError {
    ClassifiedError {
        class: ErrorClass::Permanent,
        code: None,
        message,
    }
}

/// The first difference between the expected columns and the current ones, in words.
fn describe_difference(expected: &[ColumnMeta], now: &[ColumnMeta]) -> Option<String> {
    let show = |c: &ColumnMeta| {
        let default = if c.default_kind.is_empty() {
            String::new()
        } else {
            format!(" {} {}", c.default_kind, c.default_expression)
        };
        format!("`{}` {}{default}", c.name, c.type_text)
    };
    for (i, (was, is)) in expected.iter().zip(now).enumerate() {
        if was != is {
            return Some(format!(
                "column {} was {}, is now {}",
                i + 1,
                show(was),
                show(is)
            ));
        }
    }
    match expected.len().cmp(&now.len()) {
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Less => Some(format!(
            "column {} was added: {}",
            expected.len() + 1,
            show(&now[expected.len()])
        )),
        std::cmp::Ordering::Greater => Some(format!(
            "column {} was dropped: {}",
            now.len() + 1,
            show(&expected[now.len()])
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(name: &str, ty: &str, kind: &str, expr: &str) -> ColumnMeta {
        ColumnMeta {
            name: name.to_owned(),
            type_text: ty.to_owned(),
            default_kind: kind.to_owned(),
            default_expression: expr.to_owned(),
        }
    }

    #[test]
    fn a_changed_type_an_added_default_and_a_dropped_column_are_each_named() {
        let expected = vec![
            col("id", "UInt64", "", ""),
            col("user_id", "UInt64", "", ""),
        ];
        assert_eq!(describe_difference(&expected, &expected), None);
        let modified = vec![
            col("id", "UInt64", "", ""),
            col("user_id", "Float64", "", ""),
        ];
        assert_eq!(
            describe_difference(&expected, &modified).as_deref(),
            Some("column 2 was `user_id` UInt64, is now `user_id` Float64")
        );
        let mut added = expected.clone();
        added.push(col("ts2", "DateTime", "DEFAULT", "now()"));
        assert_eq!(
            describe_difference(&expected, &added).as_deref(),
            Some("column 3 was added: `ts2` DateTime DEFAULT now()")
        );
        assert_eq!(
            describe_difference(&expected, &expected[..1]).as_deref(),
            Some("column 2 was dropped: `user_id` UInt64")
        );
    }
}

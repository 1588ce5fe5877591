//! Online schema evolution: what a change of the table's columns under a running sink means
//! for it ([`decide`]).
//!
//! The sink writes an explicit column list (the stream's columns), so a change of a column the
//! stream does not write (added, dropped, its type or default changed) leaves every byte the
//! sink sends meaning what it meant: it is adopted. A column the stream writes may only widen,
//! so that every value of its old type is a value of the new one (the widenings the session
//! start accepts, [`crate::encode::chtype::is_widening`]); new batches are then encoded for the
//! wider type. Anything else stops the sink: a dropped column the stream writes has nowhere to
//! go, and a narrowing or another type would store (or refuse) values the stream's batches were
//! encoded and sealed for. Whatever [`crate::server::session`]'s planning refuses at a start (a
//! non-deterministic DEFAULT on a server without tokens, a MATERIALIZED column in the stream)
//! stops it too: one rule for a start and a change.

use flow_core::StreamType;

use crate::encode::chtype::{is_widening, ChType};
use crate::encode::rowbinary::RowBinaryEncoder;
use crate::server::client::quote_ident;
use crate::server::columns_guard::ColumnMeta;

/// What the sink does about the columns it re-read.
#[derive(Debug)]
pub enum ChangeDecision {
    /// The columns are the ones the sink plans for.
    Unchanged,
    /// The change is compatible: new batches are encoded with `encoder`; `changes` says what
    /// changed, in words, for the log.
    Adopt {
        encoder: RowBinaryEncoder,
        changes: Vec<String>,
    },
    /// The change is not: the sink stops with `reason` (what changed, why it cannot go on, and
    /// what to do), its pending batches kept.
    Stop { reason: String },
}

/// Decides about `now`, the columns of `table` (quoted, for messages) re-read while the sink
/// plans for `was` with encoder `fed` (the columns the stream writes). `replan` plans the
/// stream onto `now` as a session start would ([`crate::server::session`]'s `plan_columns`).
pub fn decide(
    table: &str,
    was: &[ColumnMeta],
    now: &[ColumnMeta],
    fed: &RowBinaryEncoder,
    replan: impl FnOnce(&[ColumnMeta]) -> Result<RowBinaryEncoder, String>,
) -> ChangeDecision {
    if was == now {
        return ChangeDecision::Unchanged;
    }
    let keep = "The sink's pending batches stay in the outbox";
    if now.is_empty() {
        // system.columns lists no column: the table itself is gone, not its columns.
        return ChangeDecision::Stop {
            reason: format!(
                "the table {table} is gone (system.columns lists no column of it: dropped, renamed or detached; an INSERT into it fails with code 60 UNKNOWN_TABLE). {keep}; create the table again with its columns (or rename or attach it back) on every host, then restart"
            ),
        };
    }
    let changes = describe_changes(was, now);
    for column in fed.columns() {
        let Some(after) = now.iter().find(|c| c.name == column.name) else {
            return ChangeDecision::Stop {
                reason: format!(
                    "the column {name} the stream writes was dropped from {table}: its values have no column to go to. {keep}; add the column back (`ALTER TABLE {table} ADD COLUMN {name} {ty}` on every host) or remove it from the stream (e.g. with a `project` processor), then restart",
                    name = quote_ident(&column.name),
                    ty = column.ty,
                ),
            };
        };
        let after_ty = ChType::parse(&after.type_text);
        if after_ty != column.ty && !holds_every_value(&column.ty, &after_ty) {
            return ChangeDecision::Stop {
                reason: format!(
                    "the column {name} the stream writes changed type from {was} to {after_ty}, which does not hold every value of {was} (only a widening is adopted while the sink runs): batches sealed for {was} cannot be written to it as they are. {keep}; change the column back (`ALTER TABLE {table} MODIFY COLUMN {name} {was}` on every host) and restart, or drain the sink before changing the type",
                    name = quote_ident(&column.name),
                    was = column.ty,
                ),
            };
        }
    }
    match replan(now) {
        Ok(encoder) => ChangeDecision::Adopt { encoder, changes },
        Err(problems) => ChangeDecision::Stop {
            reason: format!(
                "the table's columns changed ({}) and the stream no longer fits them: {problems}. {keep}; undo the change on every host, or change the stream, then restart",
                changes.join("; ")
            ),
        },
    }
}

/// Whether every value of `old` is a value of `new`, and RowBinary written for the stream's
/// type into `old` can be written into `new` by the same encoder widening: the session start's
/// widenings ([`is_widening`]) between two column types, through Nullable, LowCardinality and
/// Array.
pub fn holds_every_value(old: &ChType, new: &ChType) -> bool {
    if old == new {
        return true;
    }
    match (old, new) {
        (ChType::LowCardinality(old), _) => holds_every_value(old, new),
        (_, ChType::LowCardinality(new)) => holds_every_value(old, new),
        (ChType::Nullable(old), ChType::Nullable(new)) => holds_every_value(old, new),
        // A NULL has no place in a non-Nullable column.
        (ChType::Nullable(_), _) => false,
        (_, ChType::Nullable(new)) => holds_every_value(old, new),
        (ChType::Array(old), ChType::Array(new)) => holds_every_value(old, new),
        (old, new) => stream_type_of(old).is_some_and(|stream| is_widening(&stream, new)),
    }
}

/// The stream type whose natural column type is `ty`, for the scalar types a widening starts
/// from.
fn stream_type_of(ty: &ChType) -> Option<StreamType> {
    Some(match ty {
        ChType::UInt8 => StreamType::Uint8,
        ChType::UInt16 => StreamType::Uint16,
        ChType::UInt32 => StreamType::Uint32,
        ChType::UInt64 => StreamType::Uint64,
        ChType::Int8 => StreamType::Int8,
        ChType::Int16 => StreamType::Int16,
        ChType::Int32 => StreamType::Int32,
        ChType::Int64 => StreamType::Int64,
        ChType::Float32 => StreamType::Float,
        _ => return None,
    })
}

/// Every difference between `was` and `now`, by column name, in words.
fn describe_changes(was: &[ColumnMeta], now: &[ColumnMeta]) -> Vec<String> {
    let show = |c: &ColumnMeta| {
        if c.default_kind.is_empty() {
            format!("{} {}", quote_ident(&c.name), c.type_text)
        } else {
            format!(
                "{} {} {} {}",
                quote_ident(&c.name),
                c.type_text,
                c.default_kind,
                c.default_expression
            )
        }
    };
    let mut changes = Vec::new();
    for after in now {
        match was.iter().find(|c| c.name == after.name) {
            None => changes.push(format!("column {} added", show(after))),
            Some(before) if before != after => {
                changes.push(format!("column {} is now {}", show(before), show(after)))
            }
            Some(_) => {}
        }
    }
    for before in was {
        if !now.iter().any(|c| c.name == before.name) {
            changes.push(format!("column {} dropped", show(before)));
        }
    }
    if changes.is_empty() {
        changes.push("the columns were reordered".to_owned());
    }
    changes
}

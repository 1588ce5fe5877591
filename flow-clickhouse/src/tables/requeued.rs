//! Rows set aside because the table they named did not exist, requeued
//! (`flow-worker dead-letters requeue`) once it does: the outbox entry holds the dead row itself
//! ([`UNENCODED_FORMAT`]), since nothing knew the table's columns when it was set aside; the
//! sink encodes it for the table when it delivers it ([`encode_requeued`]), under the token fixed
//! when it was set aside.

use std::sync::Arc;

use flow_core::{DeadRow, Headroom, MessageBatch, SinkError, TableRow};
use flow_state::SealedBatch;

use crate::delivery::cutter::{BatchCutter, Part};
use crate::delivery::sink_state::SinkShared;
use crate::server::session::{ColumnsPlan, WriterSession};

/// The `format` of an outbox entry holding a dead row's JSON to be encoded at delivery.
pub const UNENCODED_FORMAT: &str = "flow-dead-row";

/// The token of a row of partition `partition` at `offset` set aside for its missing table:
/// apart from the table's batch tokens (`<prefix><table>/<partition>-<last id>`).
pub fn requeued_token(prefix: &str, table: &str, partition: u32, offset: u64) -> String {
    format!("{prefix}{table}/requeued/{partition}-{offset}")
}

/// The outbox entry of a requeued row set aside for its missing table.
pub fn unencoded_batch(
    dead: &DeadRow,
    for_table: &TableRow,
    sealed_at_ms: u64,
) -> Result<SealedBatch, String> {
    let offset = dead
        .message_id
        .parse::<flow_core::MessageId>()
        .map_err(|err| err.to_string())?
        .offset;
    let payload = serde_json::to_vec(dead).map_err(|err| err.to_string())?;
    Ok(SealedBatch {
        target: for_table.target.clone(),
        columns: Vec::new(),
        format: UNENCODED_FORMAT.to_owned(),
        token: for_table.token.clone(),
        // Routed when it is encoded; its lane is the `""` one.
        shard: String::new(),
        first_offset: offset,
        last_offset: offset,
        rows: 1,
        encoded_bytes: payload.len() as u64,
        plan: String::new(),
        sealed_at_ms,
        content_hash: xxhash_rust::xxh64::xxh64(&payload, 0),
        payload: payload.into(),
    })
}

/// Encodes a requeued row (`batch`, of [`UNENCODED_FORMAT`]) for its table as it is now: the
/// batch to send, routed to its shard, under its stored token.
pub fn encode_requeued(
    shared: &SinkShared,
    session: &WriterSession,
    batch: &SealedBatch,
) -> Result<SealedBatch, SinkError> {
    let (part, plan) = encode_requeued_part(shared, session, batch)?;
    Ok(SealedBatch {
        target: batch.target.clone(),
        columns: plan.encoder.column_names(),
        format: part.format.as_str().to_owned(),
        token: batch.token.clone(),
        shard: shared.shard_name(part.shard).to_owned(),
        first_offset: batch.first_offset,
        last_offset: batch.last_offset,
        rows: part.rows,
        encoded_bytes: part.encoded_bytes,
        plan: plan.encoder.plan_fingerprint().to_owned(),
        sealed_at_ms: batch.sealed_at_ms,
        content_hash: part.content_hash,
        payload: part.payload,
    })
}

/// The requeued row of `batch` encoded for its table's columns as they are now (a requeued row
/// was never encoded): its part, routed to its shard, and the plan it was encoded with.
pub fn encode_requeued_part(
    shared: &SinkShared,
    session: &WriterSession,
    batch: &SealedBatch,
) -> Result<(Part, Arc<ColumnsPlan>), SinkError> {
    let plan = session.plan();
    let mut parts = encode_rows(shared, &plan, std::slice::from_ref(batch))?;
    match (parts.pop(), parts.is_empty()) {
        (Some(part), true) => Ok((part, plan)),
        _ => Err(unreadable(
            batch,
            "it fails the table's checks (see the sink's on_bad_rows)",
        )),
    }
}

/// The requeued rows of `batches` (entries of [`UNENCODED_FORMAT`] for one table) encoded for
/// the table as it is now, as one batch: a part per shard that receives rows, so that a requeue
/// of many rows is a few INSERTs, not one per row. `None` when a row cannot be read back or
/// fails the table's checks: the caller sends those entries one by one, and the failing one
/// names itself ([`encode_requeued_part`]).
pub fn encode_requeued_rows(
    shared: &SinkShared,
    session: &WriterSession,
    batches: &[SealedBatch],
) -> Option<Vec<Part>> {
    let parts = encode_rows(shared, &session.plan(), batches).ok()?;
    let rows: u64 = parts.iter().map(|part| part.rows).sum();
    (rows == batches.len() as u64).then_some(parts)
}

/// Encodes the dead rows of `batches` with `plan`, sealed as one batch spanning their offsets.
fn encode_rows(
    shared: &SinkShared,
    plan: &Arc<ColumnsPlan>,
    batches: &[SealedBatch],
) -> Result<Vec<Part>, SinkError> {
    let mut rows = MessageBatch::new(Arc::clone(&shared.stream));
    for batch in batches {
        let dead = DeadRow::decode(&batch.payload).map_err(|err| unreadable(batch, err))?;
        dead.push_into(&mut rows)
            .map_err(|err| unreadable(batch, err))?;
    }
    let mut cutter = BatchCutter::default();
    for row in rows.rows() {
        cutter.push_row(shared, plan, &row)?;
    }
    let first = batches.iter().map(|b| b.first_offset).min().unwrap_or(0);
    let last = batches.iter().map(|b| b.last_offset).max().unwrap_or(0);
    let mut parts = Vec::new();
    cutter.seal(shared, first, last, &mut parts, Headroom::NONE);
    Ok(parts)
}

/// The error of a requeued row (`batch`) that cannot be sent as it is.
fn unreadable(batch: &SealedBatch, why: impl std::fmt::Display) -> SinkError {
    SinkError::Refused(format!(
        "requeued row (token {}) for `{}` cannot be read back: {why}. Purge it with `flow-worker dead-letters purge` and feed the message in again",
        batch.token, batch.target
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::split::requeued_batch;

    fn dead(for_table: Option<TableRow>) -> DeadRow {
        DeadRow {
            message_id: "3-41".to_owned(),
            shard: None,
            column: None,
            code: None,
            row: serde_json::json!({"id": 41, "kind": "buy"}),
            row_base64: Default::default(),
            resend: None,
            for_table,
        }
    }

    #[test]
    fn a_row_set_aside_for_a_missing_table_is_requeued_unencoded_under_its_token() {
        let token = requeued_token("p.s.x/", "events_buy", 3, 41);
        assert_eq!(token, "p.s.x/events_buy/requeued/3-41");
        let row = dead(Some(TableRow {
            target: "default.events_buy".to_owned(),
            token: token.clone(),
        }));
        let batch = requeued_batch(&row, 7).unwrap();
        assert_eq!(
            (
                batch.target.as_str(),
                batch.token.as_str(),
                batch.format.as_str(),
                batch.shard.as_str(),
                batch.first_offset,
                batch.last_offset,
                batch.rows,
                batch.sealed_at_ms,
            ),
            (
                "default.events_buy",
                token.as_str(),
                UNENCODED_FORMAT,
                "",
                41,
                41,
                1,
                7
            )
        );
        assert_eq!(DeadRow::decode(&batch.payload).unwrap(), row);
        // Without a table (nor bytes), nothing can send it again.
        assert_eq!(
            requeued_batch(&dead(None), 7).unwrap_err(),
            "no bytes were kept to send it again (it was set aside before it was encoded, or by a sink without an outbox)"
        );
    }
}

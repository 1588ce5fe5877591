//! Isolating the rows a server refuses (`on_bad_rows: dead_letter`, exactly-once classes).
//!
//! A part the server refused for good with an error its rows may cause
//! ([`is_row_rejection`]) is sent again in pieces: halves, recursively, in row order, until
//! every piece is accepted or is a single row the server still refuses. Pieces are cut by row
//! index within the part, so a replay of the same part (rebuilt identically, or read back from
//! its payload) cuts the same pieces, and each is sent under `<part token>#<first>-<last row>`:
//! a piece that landed before a crash is deduplicated when it is sent again. A piece refused
//! with the code that refused the part is not retried, since the server has answered for those
//! rows already.
//!
//! Before the first piece is sent the part is marked as split in the state store
//! ([`marker_name`]), so a replay never sends the whole part again: once the cause is fixed it
//! would land next to the pieces that already did. The refused rows become dead letters, with
//! their values by column name and their exact bytes, in the same transaction that acknowledges
//! the part and removes its mark.

use bytes::Bytes;
use flow_core::{DeadRow, ResendRow, SinkCount, SinkError, SinkMetrics};
use flow_state::{AckExtras, DeadLetter, SealedBatch, SinkPartition, StateStore};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::config::params::Codec;
use crate::config::topology::ShardIndex;
use crate::delivery::backlog_age::unanswered_marker;
use crate::delivery::insert::{
    insert_part, unconfigured_shard, GiveUpReason, InsertFailure, InsertRequest,
};
use crate::delivery::sink_state::SinkShared;
use crate::encode::compress::{is_framed, seal, unframe};
use crate::encode::row_spans::{row_base64, row_json, RowSpans};
use crate::server::classify::{is_row_rejection, ClassifiedError};
use crate::server::session::WriterSession;
use crate::tables::requeued::unencoded_batch;

/// The sink value that marks pending entry `seq` of `partition` as delivered in pieces.
pub fn marker_name(partition: u32, seq: u64) -> String {
    format!("split/{partition}/{seq}")
}

/// The prefix of every split mark of `partition`.
pub fn marker_prefix(partition: u32) -> String {
    format!("split/{partition}/")
}

/// The marker's value: the refusal's code and text, so that a replay after a stop treats the
/// pieces as the first run did.
fn marker_value(refused: &ClassifiedError) -> Vec<u8> {
    let code = refused.code.map_or_else(String::new, |c| c.to_string());
    format!("{code}\n{}", refused.message).into_bytes()
}

/// The refusal a marker recorded ([`marker_value`]).
pub fn refusal_from_marker(value: &[u8]) -> ClassifiedError {
    let text = String::from_utf8_lossy(value);
    let (code, message) = text.split_once('\n').unwrap_or(("", &text));
    ClassifiedError::from_server(code.parse().ok(), message)
}

/// How delivering a part in pieces ended.
pub enum SplitOutcome {
    /// Every row landed or is a dead letter; the part is acknowledged.
    Delivered,
    /// The pipeline is stopping; the part stays pending (and marked).
    Stopped,
    /// A piece failed for a reason that is not its rows': the sink gives up as for any insert.
    GaveUp(GiveUpReason),
}

/// A part the server refused, as its pieces are cut from it.
pub struct RefusedPart<'a> {
    /// The shard's name, as dead letters and logs show it.
    pub shard: &'a str,
    /// `None` for a stored batch whose shard is not configured any more: sending fails.
    pub shard_index: Option<ShardIndex>,
    /// Its token (exactly-once classes); pieces derive theirs from it, and only rows with a
    /// token can be requeued.
    pub token: Option<&'a str>,
    /// The stored format of the payload.
    pub format: &'a str,
    pub payload: &'a Bytes,
    /// The fingerprint of the plan the payload was encoded with.
    pub plan: &'a str,
    pub first_offset: u64,
    pub last_offset: u64,
    pub rows: u64,
    pub sealed_at_ms: Option<u64>,
    /// The error the whole part was refused with.
    pub refused: &'a ClassifiedError,
}

/// How isolating the refused rows of a part ended.
pub enum Isolated {
    /// Every piece landed or is a single refused row, now a dead letter.
    Done(Vec<DeadLetter>),
    Stopped,
    GaveUp(GiveUpReason),
}

impl<'a> RefusedPart<'a> {
    /// A pending outbox entry as a refused part.
    pub fn of_batch(
        batch: &'a SealedBatch,
        shard_index: Option<ShardIndex>,
        refused: &'a ClassifiedError,
    ) -> RefusedPart<'a> {
        RefusedPart {
            shard: &batch.shard,
            shard_index,
            token: Some(&batch.token),
            format: &batch.format,
            payload: &batch.payload,
            plan: &batch.plan,
            first_offset: batch.first_offset,
            last_offset: batch.last_offset,
            rows: batch.rows,
            sealed_at_ms: Some(batch.sealed_at_ms),
            refused,
        }
    }

    /// Every row of the part as a dead letter with `reason`, without sending anything; each
    /// keeps the token it would have been sent under alone.
    pub fn set_aside(
        &self,
        session: &WriterSession,
        partition: u32,
        reason: &str,
    ) -> Result<Vec<DeadLetter>, SinkError> {
        let (rows, spans) = self.read_rows(session)?;
        (0..spans.rows())
            .map(|index| {
                let token = self.token.map(|t| format!("{t}#{index}-{index}"));
                let encoded = &rows[spans.bytes(index, index + 1)];
                let letter =
                    self.dead_letter(session, partition, index, encoded, token.as_deref())?;
                Ok(letter.with_reason(reason))
            })
            .collect()
    }
}

impl RefusedPart<'_> {
    /// Sends the part in halves, recursively, until each refused row is alone.
    pub async fn isolate(
        &self,
        shared: &SinkShared,
        session: &WriterSession,
        partition: u32,
        metrics: &SinkMetrics,
        stop: &watch::Receiver<bool>,
    ) -> Result<Isolated, SinkError> {
        let (rows, spans) = self.read_rows(session)?;
        warn!(
            database = %session.database,
            table = %session.table,
            shard = %self.shard,
            partition,
            token = self.token.unwrap_or(""),
            rows = spans.rows(),
            error = %self.refused,
            "the server refused a batch; sending it in halves to isolate the rows it refuses (on_bad_rows: dead_letter)"
        );
        let mut pending = vec![(0, spans.rows())];
        let (mut pieces, mut dead) = (0u64, Vec::new());
        let mut stop = stop.clone();
        while let Some((first, end)) = pending.pop() {
            let token = self.token.map(|t| format!("{t}#{first}-{}", end - 1));
            let piece = &rows[spans.bytes(first, end)];
            // Every sealed payload is one frame, compressed or not.
            let (_, payload) = seal(shared.params.codec, piece);
            let inserted = match self.shard_index {
                Some(shard) => {
                    let request = InsertRequest {
                        shard,
                        token: token.as_deref(),
                        payload: &payload,
                        plan: self.plan,
                        compressed: true,
                        sealed_at_ms: self.sealed_at_ms,
                        answered_code: self.refused.code,
                        attempts: None,
                        metrics,
                    };
                    insert_part(shared, session, request, &mut stop).await
                }
                None => Err(unconfigured_shard(shared, self.shard)),
            };
            match inserted {
                Ok(_) => pieces += 1,
                Err(InsertFailure::Stopped) => return Ok(Isolated::Stopped),
                Err(InsertFailure::GaveUp(gave_up)) if is_row_rejection(&gave_up.error) => {
                    if end - first == 1 {
                        let token = token.as_deref();
                        let letter = self.dead_letter(session, partition, first, piece, token)?;
                        dead.push(letter.with_error(&gave_up.error));
                    } else {
                        let middle = first + (end - first) / 2;
                        pending.push((middle, end));
                        pending.push((first, middle));
                    }
                }
                Err(InsertFailure::GaveUp(gave_up)) => {
                    let reason = gave_up.reason(session, self.shard, token.as_deref());
                    return Ok(Isolated::GaveUp(reason));
                }
                Err(other) => return Err(other.into_sink_error()),
            }
        }
        info!(
            database = %session.database,
            table = %session.table,
            shard = %self.shard,
            partition,
            token = self.token.unwrap_or(""),
            pieces,
            dead_rows = dead.len(),
            "refused batch delivered in pieces; the rows the server still refused are dead letters (flow-worker dead-letters export)"
        );
        Ok(Isolated::Done(dead))
    }

    /// The dead row of row `index` (its bytes `encoded`), sent alone under `token`.
    fn dead_letter(
        &self,
        session: &WriterSession,
        partition: u32,
        index: usize,
        encoded: &[u8],
        token: Option<&str>,
    ) -> Result<PendingLetter, SinkError> {
        let plan = session.plan();
        let columns = plan.encoder.columns();
        let row = row_json(columns, encoded).map_err(|err| self.unreadable(err))?;
        let row_base64 = row_base64(columns, encoded).map_err(|err| self.unreadable(err))?;
        // A part that holds every message of its bounds has row i at offset first + i; a sharded
        // part, or one with rows filtered or set aside, only knows its bounds.
        let contiguous = self.last_offset - self.first_offset + 1 == self.rows;
        let offset = contiguous.then_some(self.first_offset + index as u64);
        let message_id = match offset {
            Some(offset) => format!("{partition}-{offset}"),
            None => format!(
                "{partition}-{}..{partition}-{}",
                self.first_offset, self.last_offset
            ),
        };
        let resend = token.map(|token| ResendRow {
            target: format!("{}.{}", session.database, session.table),
            columns: plan.encoder.column_names(),
            format: self.format.to_owned(),
            plan: plan.encoder.plan_fingerprint().to_owned(),
            token: token.to_owned(),
            first_offset: offset.unwrap_or(self.first_offset),
            last_offset: offset.unwrap_or(self.last_offset),
            encoded_hex: ResendRow::hex(encoded),
        });
        let what = match token {
            Some(token) => format!(
                "row {index} of batch {} (token {token})",
                self.token.unwrap_or("")
            ),
            None => format!("row {index} of a batch of messages {message_id}"),
        };
        Ok(PendingLetter {
            partition,
            offset,
            what,
            dead: DeadRow {
                message_id,
                shard: (!self.shard.is_empty()).then(|| self.shard.to_owned()),
                column: None,
                code: None,
                row,
                row_base64,
                resend,
                for_table: None,
            },
        })
    }

    /// The part's encoded rows and where each starts: what both splitting and setting aside
    /// work on.
    fn read_rows(&self, session: &WriterSession) -> Result<(Vec<u8>, RowSpans), SinkError> {
        let rows = unframe(self.format, self.payload).map_err(|err| self.unreadable(err))?;
        let plan = session.plan();
        let spans =
            RowSpans::parse(plan.encoder.columns(), &rows).map_err(|err| self.unreadable(err))?;
        Ok((rows, spans))
    }

    fn unreadable(&self, error: impl std::error::Error + Send + Sync + 'static) -> SinkError {
        SinkError::DeliveryFailed {
            context: format!(
                "the server refused a batch (token {}) and its rows cannot be read back to isolate the refused ones",
                self.token.unwrap_or("none")
            ),
            source: Box::new(error),
        }
    }
}

/// A dead row before the server's error is attached.
struct PendingLetter {
    partition: u32,
    offset: Option<u64>,
    what: String,
    dead: DeadRow,
}

impl PendingLetter {
    fn with_error(mut self, error: &ClassifiedError) -> DeadLetter {
        self.dead.code = error.code.map(i64::from);
        let reason = format!("the server refused {}: {error}", self.what);
        self.into_letter(reason)
    }

    fn with_reason(self, reason: &str) -> DeadLetter {
        let reason = format!("{}: {reason}", self.what);
        self.into_letter(reason)
    }

    fn into_letter(self, reason: String) -> DeadLetter {
        // A DeadRow is plain data: serializing it cannot fail.
        let payload = serde_json::to_vec(&self.dead).unwrap_or_default();
        DeadLetter {
            partition: self.partition,
            offset: self.offset,
            reason,
            payload,
        }
    }
}

/// One pending outbox entry refused by the server, delivered in pieces (exactly-once classes).
pub struct SplitPart<'a> {
    pub shared: &'a SinkShared,
    pub session: &'a WriterSession,
    pub store: &'a StateStore,
    pub key: &'a SinkPartition,
    pub seq: u64,
    pub batch: &'a SealedBatch,
    /// The error the whole part was refused with.
    pub refused: &'a ClassifiedError,
    pub metrics: &'a SinkMetrics,
}

impl SplitPart<'_> {
    /// Marks the entry as split, isolates its refused rows and acknowledges it with them.
    pub async fn deliver(&self, stop: &watch::Receiver<bool>) -> Result<SplitOutcome, SinkError> {
        let marker = marker_name(self.key.partition, self.seq);
        self.store
            .set_sink_value(
                &self.key.pipeline,
                &self.key.sink,
                &marker,
                Some(marker_value(self.refused)),
            )
            .await?;
        let shard = self.session.shard_index(&self.batch.shard);
        let part = RefusedPart::of_batch(self.batch, shard, self.refused);
        let isolated = part
            .isolate(
                self.shared,
                self.session,
                self.key.partition,
                self.metrics,
                stop,
            )
            .await?;
        let dead = match isolated {
            Isolated::Done(dead) => dead,
            Isolated::Stopped => return Ok(SplitOutcome::Stopped),
            Isolated::GaveUp(reason) => return Ok(SplitOutcome::GaveUp(reason)),
        };
        let shard = Some(self.batch.shard.as_str());
        let landed = self.batch.rows.saturating_sub(dead.len() as u64);
        let mut counters = self.metrics.delivered(shard, landed).to_vec();
        counters.push(
            self.metrics
                .add(SinkCount::DeadLetterRows, shard, dead.len() as u64),
        );
        let extras = AckExtras {
            // An unanswered attempt before the refusal leaves a record too.
            removed_sink_values: vec![marker, unanswered_marker(self.key.partition, self.seq)],
            dead_letters: dead,
            counters: counters.clone(),
            ..AckExtras::default()
        };
        self.store
            .acknowledge_with(self.key, self.seq, extras)
            .await?;
        self.metrics.applied(&counters);
        Ok(SplitOutcome::Delivered)
    }
}

/// The outbox entry that sends a requeued dead row again (`flow-worker dead-letters requeue`):
/// its bytes framed as its batch was, under the token it was refused with, so that a requeue
/// repeated after a crash is deduplicated.
pub fn requeued_batch(dead: &DeadRow, sealed_at_ms: u64) -> Result<SealedBatch, String> {
    if let (None, Some(for_table)) = (&dead.resend, &dead.for_table) {
        return unencoded_batch(dead, for_table, sealed_at_ms);
    }
    let resend = dead
        .resend
        .as_ref()
        .ok_or("no bytes were kept to send it again (it was set aside before it was encoded, or by a sink without an outbox)")?;
    let encoded = resend
        .encoded()
        .ok_or("its stored bytes are not hexadecimal")?;
    let codec = if resend
        .format
        .ends_with(crate::encode::compress::LZ4_FORMAT_SUFFIX)
    {
        Some(Codec::Lz4)
    } else if is_framed(&resend.format) {
        Some(Codec::None)
    } else {
        None
    };
    let payload = match codec {
        Some(codec) => seal(codec, &encoded).1,
        None => bytes::Bytes::copy_from_slice(&encoded),
    };
    Ok(SealedBatch {
        target: resend.target.clone(),
        columns: resend.columns.clone(),
        format: resend.format.clone(),
        token: resend.token.clone(),
        shard: dead.shard.clone().unwrap_or_default(),
        first_offset: resend.first_offset,
        last_offset: resend.last_offset,
        rows: 1,
        encoded_bytes: encoded.len() as u64,
        plan: resend.plan.clone(),
        sealed_at_ms,
        content_hash: xxhash_rust::xxh64::xxh64(&encoded, 0),
        payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_keeps_the_refusal_code_and_text() {
        let refused =
            ClassifiedError::from_server(Some(395), "Code: 395. Value passed to 'throwIf'");
        let back = refusal_from_marker(&marker_value(&refused));
        assert_eq!(back, refused);
        let no_code = ClassifiedError::from_server(None, "no code");
        assert_eq!(refusal_from_marker(&marker_value(&no_code)), no_code);
        assert_eq!(marker_name(3, 17), "split/3/17");
        assert!(marker_name(3, 17).starts_with(&marker_prefix(3)));
        assert!(!marker_name(31, 7).starts_with(&marker_prefix(3)));
    }
}

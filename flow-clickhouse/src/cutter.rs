//! Cutting an epoch into encoded per-shard parts: each row is routed to its shard
//! ([`encode_routed`]) and encoded once; [`BatchCutter`] seals the buffers into [`Part`]s at the
//! batch limits.

use bytes::Bytes;
use flow_core::{CapacityDecay, MessageBatch, Row, SinkError};

use crate::compress::{is_framed, seal};
use crate::routing::routing_key;
use crate::session::WriterSession;
use crate::sink_state::SinkShared;

/// One encoded part of a batch for one shard.
#[derive(Debug)]
pub struct Part {
    pub shard: String,
    pub first_offset: u64,
    pub last_offset: u64,
    pub rows: u64,
    /// Bytes of the encoded rows before framing.
    pub encoded_bytes: u64,
    /// xxh64 of the encoded rows before framing (what a rebuilt batch is checked against).
    pub content_hash: u64,
    /// `RowBinary`, or `RowBinary;lz4` for ClickHouse's compression framing.
    pub format: String,
    pub payload: Bytes,
}

impl Part {
    pub fn compressed(&self) -> bool {
        is_framed(&self.format)
    }
}

/// Cuts an epoch's rows into batches (`max_rows_per_batch`, `max_bytes_per_batch`, in message
/// order), routes each row to its shard and encodes it once. Buffers are reused across epochs
/// and give back a burst's capacity after a run of smaller batches.
#[derive(Default)]
pub struct BatchCutter {
    buffers: Vec<Vec<u8>>,
    decay: Vec<CapacityDecay>,
    rows: Vec<u64>,
    key: Vec<u8>,
}

impl BatchCutter {
    /// Appends the parts of `batch` to `parts`, batch by batch, shards in name order.
    pub fn cut(
        &mut self,
        shared: &SinkShared,
        session: &WriterSession,
        batch: &MessageBatch,
        parts: &mut Vec<Part>,
    ) -> Result<(), SinkError> {
        let shards = shared.router.shards().len().max(1);
        self.buffers.resize_with(shards, Vec::new);
        self.decay.resize(shards, CapacityDecay::default());
        self.rows.resize(shards, 0);
        let dynamic = shared.dynamic();
        let max_rows = dynamic.max_rows_per_batch;
        let max_bytes = usize::try_from(dynamic.max_bytes_per_batch).unwrap_or(usize::MAX);
        let mut batch_rows = 0u64;
        let mut batch_bytes = 0usize;
        let mut first_offset = None;
        for row in batch.rows() {
            let (shard, size) =
                encode_routed(shared, session, &row, &mut self.buffers, &mut self.key)?;
            batch_bytes += size;
            self.rows[shard] += 1;
            batch_rows += 1;
            let first = *first_offset.get_or_insert(row.id().offset);
            if batch_rows >= max_rows || batch_bytes >= max_bytes {
                self.seal(shared, first, row.id().offset, parts);
                batch_rows = 0;
                batch_bytes = 0;
                first_offset = None;
            }
        }
        if let (Some(first), Some(last)) = (first_offset, batch.ids().last()) {
            self.seal(shared, first, last.offset, parts);
        }
        Ok(())
    }

    /// Encodes one row into its shard's buffer (rebuilding a batch row by row).
    pub fn push_row(
        &mut self,
        shared: &SinkShared,
        session: &WriterSession,
        row: &Row<'_>,
    ) -> Result<(), SinkError> {
        let shards = shared.router.shards().len().max(1);
        self.buffers.resize_with(shards, Vec::new);
        self.decay.resize(shards, CapacityDecay::default());
        self.rows.resize(shards, 0);
        let (shard, _) = encode_routed(shared, session, row, &mut self.buffers, &mut self.key)?;
        self.rows[shard] += 1;
        Ok(())
    }

    /// Seals what the buffers hold as one batch with the given bounds: one part per shard that
    /// received rows, in shard order.
    pub fn seal(
        &mut self,
        shared: &SinkShared,
        first_offset: u64,
        last_offset: u64,
        parts: &mut Vec<Part>,
    ) {
        for (index, (buffer, decay)) in self.buffers.iter_mut().zip(&mut self.decay).enumerate() {
            if buffer.is_empty() {
                continue;
            }
            let rows = std::mem::take(&mut self.rows[index]);
            let content_hash = xxhash_rust::xxh64::xxh64(buffer, 0);
            let (format, payload) = seal(shared.params.spec.codec, buffer);
            parts.push(Part {
                shard: shared.shard_name(index),
                first_offset,
                last_offset,
                rows,
                encoded_bytes: buffer.len() as u64,
                content_hash,
                format,
                payload,
            });
            // The encode buffer keeps its capacity for the next batch, unless it is oversized.
            let used = buffer.len();
            buffer.clear();
            if decay.should_shrink(used, buffer.capacity()) {
                buffer.shrink_to(used);
            }
        }
    }
}

/// Routes `row` to its shard (always shard 0 unless sharded) and appends its RowBinary
/// encoding to that shard's buffer; returns the shard index and the encoded size.
#[inline]
pub fn encode_routed(
    shared: &SinkShared,
    session: &WriterSession,
    row: &Row<'_>,
    buffers: &mut [Vec<u8>],
    key: &mut Vec<u8>,
) -> Result<(usize, usize), SinkError> {
    let shard = if shared.sharded {
        routing_key(row, &shared.key_columns, key);
        shared.router.route(key)
    } else {
        0
    };
    let buffer = &mut buffers[shard];
    let before = buffer.len();
    session
        .encoder
        .encode_row(row, buffer)
        .map_err(|err| SinkError::Rejected {
            message_id: row.id().to_string(),
            reason: err.to_string(),
        })?;
    Ok((shard, buffer.len() - before))
}

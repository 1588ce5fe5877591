//! Re-encoding rows sealed before a column was widened ([`widen_rows`]).
//!
//! A batch encoded for `UInt32` cannot be sent as it is once the column is `UInt64`: RowBinary
//! carries no types, so the server would read its bytes as the wider type. The widenings the
//! sink adopts ([`crate::server::schema_change`]) keep every value, so each value is rewritten
//! at the wider width (zero- or sign-extended, a `Float32` as the `Float64` of the same value):
//! the bytes the encoder would have written for the wider column from the same stream value.
//! Only a batch that never landed (or whose ids the replicas do not hold) is re-encoded: on a
//! server without `insert_deduplication_token` the re-encoded part is another block than one
//! stored before, so a re-encoded replay of a stored part would land twice.

use crate::encode::chtype::ChType;
use crate::encode::row_spans::{read_leb128, skip_value, take, ReadError};
use crate::encode::rowbinary::EncodedColumn;

/// `data` (RowBinary rows encoded for the columns `old`) as encoded for `new`: the same columns
/// in the same order, each of the same type or a widening of it.
pub fn widen_rows(
    old: &[EncodedColumn],
    new: &[EncodedColumn],
    data: &[u8],
) -> Result<Vec<u8>, ReadError> {
    let mut out = Vec::with_capacity(data.len() * 2);
    let (mut at, mut row) = (0, 0);
    while at < data.len() {
        for (was, now) in old.iter().zip(new) {
            let error = |reason: String| ReadError {
                row,
                column: was.name.clone(),
                reason,
            };
            if was.name != now.name {
                return Err(error(format!(
                    "the plan to widen to has column `{}` in its place",
                    now.name
                )));
            }
            at = if was.ty == now.ty {
                let end = skip_value(&was.ty, data, at).map_err(error)?;
                out.extend_from_slice(&data[at..end]);
                end
            } else {
                widen_value(&was.ty, &now.ty, data, at, &mut out).map_err(error)?
            };
        }
        row += 1;
    }
    Ok(out)
}

/// Writes the value of `old` at `at` as `new` into `out`; returns the offset after it.
fn widen_value(
    old: &ChType,
    new: &ChType,
    data: &[u8],
    at: usize,
    out: &mut Vec<u8>,
) -> Result<usize, String> {
    match (old, new) {
        (ChType::LowCardinality(old), _) => widen_value(old, new, data, at, out),
        (_, ChType::LowCardinality(new)) => widen_value(old, new, data, at, out),
        (ChType::Nullable(old), ChType::Nullable(new)) => {
            let marker = *data.get(at).ok_or("the data ends inside a NULL marker")?;
            out.push(marker);
            if marker == 1 {
                Ok(at + 1)
            } else {
                widen_value(old, new, data, at + 1, out)
            }
        }
        (_, ChType::Nullable(new)) => {
            out.push(0);
            widen_value(old, new, data, at, out)
        }
        (ChType::Array(old), ChType::Array(new)) => {
            let start = at;
            let (count, mut at) = read_leb128(data, at)?;
            out.extend_from_slice(&data[start..at]);
            for _ in 0..count {
                at = widen_value(old, new, data, at, out)?;
            }
            Ok(at)
        }
        (ChType::Float32, ChType::Float64) => {
            let bytes: [u8; 4] = take(data, at, 4)?
                .try_into()
                .map_err(|_| "a Float32 of other than 4 bytes".to_owned())?;
            out.extend_from_slice(&f64::from(f32::from_le_bytes(bytes)).to_le_bytes());
            Ok(at + 4)
        }
        (old, new) => {
            let (Some((width, signed)), Some((to, _))) = (integer(old), integer(new)) else {
                if old == new {
                    let end = skip_value(old, data, at)?;
                    out.extend_from_slice(&data[at..end]);
                    return Ok(end);
                }
                return Err(format!("{old} is not widened to {new} here"));
            };
            let bytes = take(data, at, width)?;
            let negative = signed && bytes[width - 1] & 0x80 != 0;
            out.extend_from_slice(bytes);
            out.extend(std::iter::repeat_n(
                if negative { 0xff } else { 0 },
                to.saturating_sub(width),
            ));
            Ok(at + width)
        }
    }
}

/// The width in bytes and signedness of an integer type.
fn integer(ty: &ChType) -> Option<(usize, bool)> {
    Some(match ty {
        ChType::UInt8 => (1, false),
        ChType::UInt16 => (2, false),
        ChType::UInt32 => (4, false),
        ChType::UInt64 => (8, false),
        ChType::UInt128 => (16, false),
        ChType::UInt256 => (32, false),
        ChType::Int8 => (1, true),
        ChType::Int16 => (2, true),
        ChType::Int32 => (4, true),
        ChType::Int64 => (8, true),
        ChType::Int128 => (16, true),
        ChType::Int256 => (32, true),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use flow_core::{Column, MessageBatch, MessageId, StreamSchema, StreamType, Value};

    use super::*;
    use crate::encode::rowbinary::RowBinaryEncoder;

    fn column(name: &str, index: usize, ty: &str) -> EncodedColumn {
        EncodedColumn::parsed(name, index, ty)
    }

    /// Widened rows are the bytes the encoder writes for the wider columns from the same values.
    #[test]
    fn widened_rows_are_what_the_encoder_writes_for_the_wider_columns() {
        let stream = StreamSchema::new(vec![
            Column::new("a", StreamType::Uint32),
            Column::new("b", StreamType::Int16),
            Column::new("c", StreamType::Float),
            Column::new("d", StreamType::String),
            Column::new("e", StreamType::Optional(Box::new(StreamType::Int32))),
        ])
        .unwrap();
        let narrow = vec![
            column("a", 0, "UInt32"),
            column("b", 1, "Int16"),
            column("c", 2, "Float32"),
            column("d", 3, "String"),
            column("e", 4, "Nullable(Int32)"),
        ];
        let wide = vec![
            column("a", 0, "UInt64"),
            column("b", 1, "Int64"),
            column("c", 2, "Float64"),
            column("d", 3, "String"),
            column("e", 4, "Nullable(Int128)"),
        ];
        let rows = [
            vec![
                Value::Uint(u64::from(u32::MAX)),
                Value::Int(-2),
                Value::Float(0.375),
                Value::Bytes(b"x"),
                Value::Int(-7),
            ],
            vec![
                Value::Uint(7),
                Value::Int(i64::from(i16::MAX)),
                Value::Float(-1.5),
                Value::Bytes(b""),
                Value::Null,
            ],
        ];
        let mut batch = MessageBatch::new(stream);
        for (offset, values) in rows.into_iter().enumerate() {
            let mut writer = batch.start_row(MessageId::new(0, offset as u64));
            for value in values {
                writer.push(value).unwrap();
            }
            writer.finish().unwrap();
        }
        let (mut before, mut after) = (Vec::new(), Vec::new());
        for index in 0..2 {
            RowBinaryEncoder::new(narrow.clone())
                .encode_row(&batch.row(index), &mut before)
                .unwrap();
            RowBinaryEncoder::new(wide.clone())
                .encode_row(&batch.row(index), &mut after)
                .unwrap();
        }
        assert_eq!(widen_rows(&narrow, &wide, &before).unwrap(), after);
    }
}

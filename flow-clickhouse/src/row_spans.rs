//! Reading encoded RowBinary back ([`RowSpans`]): where each row of a part starts, and a row's
//! values by column name. A part the server refuses is split at row boundaries
//! ([`crate::split`]), and a row it still refuses is kept as a dead letter in both forms: its
//! exact bytes (to send it again) and its values (for people and tools).
//!
//! Every type the encoder writes ([`crate::rowbinary`]) is read here; a type added there must be
//! added here too, or splitting a part holding it fails with a clear error instead of guessing.

use serde_json::{Map, Number, Value as Json};

use crate::chtype::ChType;
use crate::rowbinary::EncodedColumn;

/// The rows of one encoded part: `starts[i]..starts[i + 1]` are the bytes of row `i`.
#[derive(Debug)]
pub struct RowSpans {
    starts: Vec<usize>,
}

/// Why encoded rows could not be read back.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[error("row {row}, column `{column}`: {reason}")]
pub struct ReadError {
    pub row: usize,
    pub column: String,
    pub reason: String,
}

impl RowSpans {
    /// Walks every row of `data` (RowBinary in the order of `columns`).
    pub fn parse(columns: &[EncodedColumn], data: &[u8]) -> Result<RowSpans, ReadError> {
        let mut starts = vec![0];
        let mut at = 0;
        while at < data.len() {
            for column in columns {
                at = skip_value(&column.ty, data, at).map_err(|reason| ReadError {
                    row: starts.len() - 1,
                    column: column.name.clone(),
                    reason,
                })?;
            }
            starts.push(at);
        }
        Ok(RowSpans { starts })
    }

    pub fn rows(&self) -> usize {
        self.starts.len() - 1
    }

    /// The byte range of rows `first..end` (row indices).
    pub fn bytes(&self, first: usize, end: usize) -> std::ops::Range<usize> {
        self.starts[first]..self.starts[end]
    }
}

/// The values of one encoded row (exactly one row's bytes) by column name.
pub fn row_json(columns: &[EncodedColumn], row: &[u8]) -> Result<Json, ReadError> {
    let mut object = Map::with_capacity(columns.len());
    let mut at = 0;
    for column in columns {
        let (value, next) = read_value(&column.ty, row, at).map_err(|reason| ReadError {
            row: 0,
            column: column.name.clone(),
            reason,
        })?;
        object.insert(column.name.clone(), value);
        at = next;
    }
    Ok(Json::Object(object))
}

/// The width of a fixed-width type.
fn fixed_width(ty: &ChType) -> Option<usize> {
    Some(match ty {
        ChType::Int8 | ChType::UInt8 | ChType::Bool => 1,
        ChType::Int16 | ChType::UInt16 | ChType::Date => 2,
        ChType::Int32 | ChType::UInt32 | ChType::DateTime | ChType::Float32 => 4,
        ChType::Int64 | ChType::UInt64 | ChType::Float64 => 8,
        ChType::FixedString(n) => *n,
        _ => return None,
    })
}

fn take(data: &[u8], at: usize, len: usize) -> Result<&[u8], String> {
    at.checked_add(len)
        .and_then(|end| data.get(at..end))
        .ok_or_else(|| format!("the data ends inside a value ({len} bytes wanted at byte {at})"))
}

fn read_leb128(data: &[u8], mut at: usize) -> Result<(u64, usize), String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *data
            .get(at)
            .ok_or_else(|| format!("the data ends inside a length at byte {at}"))?;
        at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok((value, at));
        }
    }
    Err(format!("a length longer than 64 bits ends at byte {at}"))
}

/// The offset after the value of `ty` at `at`.
fn skip_value(ty: &ChType, data: &[u8], at: usize) -> Result<usize, String> {
    match ty {
        ChType::Nullable(inner) => match take(data, at, 1)?[0] {
            1 => Ok(at + 1),
            _ => skip_value(inner, data, at + 1),
        },
        ChType::LowCardinality(inner) => skip_value(inner, data, at),
        ChType::String => {
            let (len, start) = read_leb128(data, at)?;
            let len = usize::try_from(len).map_err(|_| format!("a length of {len} bytes"))?;
            take(data, start, len).map(|_| start + len)
        }
        ChType::Unsupported(text) => Err(format!("the type {text} cannot be read")),
        fixed => {
            let width = fixed_width(fixed).unwrap_or(0);
            take(data, at, width).map(|_| at + width)
        }
    }
}

fn read_value(ty: &ChType, data: &[u8], at: usize) -> Result<(Json, usize), String> {
    match ty {
        ChType::Nullable(inner) => match take(data, at, 1)?[0] {
            1 => Ok((Json::Null, at + 1)),
            _ => read_value(inner, data, at + 1),
        },
        ChType::LowCardinality(inner) => read_value(inner, data, at),
        ChType::String => {
            let (len, start) = read_leb128(data, at)?;
            let len = usize::try_from(len).map_err(|_| format!("a length of {len} bytes"))?;
            let bytes = take(data, start, len)?;
            Ok((text(bytes), start + len))
        }
        ChType::FixedString(n) => Ok((text(take(data, at, *n)?), at + n)),
        ChType::Unsupported(text) => Err(format!("the type {text} cannot be read")),
        fixed => {
            let width = fixed_width(fixed).unwrap_or(0);
            let bytes = take(data, at, width)?;
            Ok((number(fixed, bytes), at + width))
        }
    }
}

fn text(bytes: &[u8]) -> Json {
    Json::String(String::from_utf8_lossy(bytes).into_owned())
}

/// A fixed-width value as JSON; `bytes` has the type's width.
fn number(ty: &ChType, bytes: &[u8]) -> Json {
    let mut le = [0u8; 8];
    le[..bytes.len()].copy_from_slice(bytes);
    let unsigned = u64::from_le_bytes(le);
    let float =
        |v: f64| Number::from_f64(v).map_or_else(|| Json::String(v.to_string()), Json::Number);
    match ty {
        ChType::Int8 => Json::from(unsigned as u8 as i8),
        ChType::Int16 => Json::from(unsigned as u16 as i16),
        ChType::Int32 => Json::from(unsigned as u32 as i32),
        ChType::Int64 => Json::from(unsigned as i64),
        ChType::Bool => Json::Bool(unsigned != 0),
        ChType::Float32 => float(f64::from(f32::from_bits(unsigned as u32))),
        ChType::Float64 => float(f64::from_bits(unsigned)),
        _ => Json::from(unsigned),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use flow_core::{Column, MessageBatch, MessageId, StreamSchema, StreamType, Value};

    use super::*;
    use crate::rowbinary::RowBinaryEncoder;

    fn column(name: &str, index: usize, ty: &str) -> EncodedColumn {
        EncodedColumn {
            name: name.to_owned(),
            stream_index: index,
            ty: ChType::parse(ty),
        }
    }

    #[test]
    fn rows_written_by_the_encoder_are_found_and_read_back_by_column_name() {
        let schema = StreamSchema::new(vec![
            Column::new("id", StreamType::Uint64),
            Column::new("name", StreamType::String),
            Column::new("score", StreamType::Int64),
            Column::new("ratio", StreamType::Double),
        ])
        .unwrap();
        let columns = vec![
            column("id", 0, "UInt64"),
            column("name", 1, "Nullable(String)"),
            column("code", 1, "FixedString(4)"),
            column("score", 2, "Int16"),
            column("ratio", 3, "Float32"),
            column("day", 0, "Date"),
        ];
        let encoder = RowBinaryEncoder::new(columns.clone());
        let mut batch = MessageBatch::new(Arc::clone(&schema));
        for (i, name) in ["ab", "", "wxyz"].into_iter().enumerate() {
            let mut row = batch.start_row(MessageId::new(0, i as u64));
            row.push(Value::Uint(i as u64 + 7)).unwrap();
            row.push(Value::Bytes(name.as_bytes())).unwrap();
            row.push(Value::Int(-(i as i64) - 1)).unwrap();
            row.push(Value::Float(0.5)).unwrap();
            row.finish().unwrap();
        }
        let mut data = Vec::new();
        let mut ends = Vec::new();
        for row in batch.rows() {
            encoder.encode_row(&row, &mut data).unwrap();
            ends.push(data.len());
        }
        let spans = RowSpans::parse(&columns, &data).unwrap();
        assert_eq!(spans.rows(), 3);
        assert_eq!(spans.bytes(0, 3), 0..data.len());
        assert_eq!(spans.bytes(1, 2), ends[0]..ends[1]);
        let last = row_json(&columns, &data[spans.bytes(2, 3)]).unwrap();
        assert_eq!(
            last,
            serde_json::json!({"id": 9, "name": "wxyz", "code": "wxyz", "score": -3, "ratio": 0.5, "day": 9})
        );
        let second = row_json(&columns, &data[spans.bytes(1, 2)]).unwrap();
        assert_eq!(second["name"], Json::String(String::new()));
        assert_eq!(second["code"], Json::String("\0\0\0\0".to_owned()));
    }

    #[test]
    fn a_null_marker_skips_its_value_and_a_cut_row_is_an_error_naming_row_and_column() {
        let columns = vec![column("a", 0, "Nullable(UInt32)"), column("s", 0, "String")];
        // Row 0: NULL, "x"; row 1: 5, then a string cut after its length.
        let data = [1, 1, b'x', 0, 5, 0, 0, 0, 3, b'y'];
        let err = RowSpans::parse(&columns, &data).unwrap_err();
        assert_eq!((err.row, err.column.as_str()), (1, "s"));
        assert!(err.reason.contains("ends inside a value"), "{}", err.reason);
        let spans = RowSpans::parse(&columns, &data[..3]).unwrap();
        assert_eq!(spans.rows(), 1);
        assert_eq!(
            row_json(&columns, &data[..3]).unwrap(),
            serde_json::json!({"a": null, "s": "x"})
        );
    }
}

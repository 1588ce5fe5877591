//! Reading encoded RowBinary back ([`RowSpans`]): where each row of a part starts, and a row's
//! values by column name. A part the server refuses is split at row boundaries
//! ([`crate::delivery::split`]), and a row it still refuses is kept as a dead letter in both forms: its
//! exact bytes (to send it again) and its values (for people and tools).
//!
//! Every type the encoder writes ([`crate::encode::rowbinary`]) is read here; a type added there must be
//! added here too, or splitting a part holding it fails with a clear error instead of guessing.

use std::collections::BTreeMap;

use serde_json::{Map, Number, Value as Json};

use flow_core::{base64_of, decimal_width, write_uuid, WideInt};

use crate::encode::chtype::ChType;
use crate::encode::rowbinary::EncodedColumn;
use crate::encode::type_code::{NOTHING, NULLABLE};

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

/// The exact bytes, in base64, of one encoded row's string values that are not UTF-8, by column
/// name ([`row_json`] shows them with U+FFFD). Only top-level strings (also inside `Nullable` or
/// `LowCardinality`) are kept: they are what a raw broker payload lands in.
pub fn row_base64(
    columns: &[EncodedColumn],
    row: &[u8],
) -> Result<BTreeMap<String, String>, ReadError> {
    let mut exact = BTreeMap::new();
    let mut at = 0;
    for column in columns {
        let failed = |reason| ReadError {
            row: 0,
            column: column.name.clone(),
            reason,
        };
        let next = skip_value(&column.ty, row, at).map_err(failed)?;
        if let Some(bytes) = top_level_string(&column.ty, &row[at..next]) {
            if std::str::from_utf8(bytes).is_err() {
                exact.insert(column.name.clone(), base64_of(bytes));
            }
        }
        at = next;
    }
    Ok(exact)
}

/// The bytes of a top-level string value encoded as `value`; `None` for other types and nulls.
fn top_level_string<'a>(ty: &ChType, value: &'a [u8]) -> Option<&'a [u8]> {
    match ty {
        ChType::Nullable(inner) => match value.split_first()? {
            (0, rest) => top_level_string(inner, rest),
            _ => None,
        },
        ChType::LowCardinality(inner) => top_level_string(inner, value),
        ChType::String => {
            let (_, start) = read_leb128(value, 0).ok()?;
            value.get(start..)
        }
        _ => None,
    }
}

/// The width of a fixed-width type.
fn fixed_width(ty: &ChType) -> Option<usize> {
    Some(match ty {
        ChType::Int8 | ChType::UInt8 | ChType::Bool | ChType::Enum8(_) => 1,
        ChType::Int16 | ChType::UInt16 | ChType::Date | ChType::Enum16(_) => 2,
        ChType::Int32
        | ChType::UInt32
        | ChType::DateTime
        | ChType::Float32
        | ChType::Date32
        | ChType::IPv4
        | ChType::Time => 4,
        ChType::Int64
        | ChType::UInt64
        | ChType::Float64
        | ChType::DateTime64(_)
        | ChType::Time64(_) => 8,
        ChType::Int128 | ChType::UInt128 | ChType::Uuid | ChType::IPv6 => 16,
        ChType::Int256 | ChType::UInt256 => 32,
        ChType::Decimal { precision, .. } => decimal_width(*precision),
        ChType::FixedString(n) => *n,
        _ => return None,
    })
}

pub(crate) fn take(data: &[u8], at: usize, len: usize) -> Result<&[u8], String> {
    at.checked_add(len)
        .and_then(|end| data.get(at..end))
        .ok_or_else(|| format!("the data ends inside a value ({len} bytes wanted at byte {at})"))
}

pub(crate) fn read_leb128(data: &[u8], mut at: usize) -> Result<(u64, usize), String> {
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
pub(crate) fn skip_value(ty: &ChType, data: &[u8], at: usize) -> Result<usize, String> {
    match ty {
        ChType::Nullable(inner) => match take(data, at, 1)?[0] {
            1 => Ok(at + 1),
            _ => skip_value(inner, data, at + 1),
        },
        ChType::LowCardinality(inner) => skip_value(inner, data, at),
        ChType::String | ChType::Json => {
            let (len, start) = read_leb128(data, at)?;
            let len = usize::try_from(len).map_err(|_| format!("a length of {len} bytes"))?;
            take(data, start, len).map(|_| start + len)
        }
        ChType::Variant(variants) => match variant_at(variants, data, at)? {
            Some(variant) => skip_value(variant, data, at + 1),
            None => Ok(at + 1),
        },
        ChType::Dynamic => match read_type_code(data, at)? {
            (Some(ty), at) => skip_value(&ty, data, at),
            (None, at) => Ok(at),
        },
        ChType::Array(inner) => {
            let (count, mut at) = read_leb128(data, at)?;
            for _ in 0..count {
                at = skip_value(inner, data, at)?;
            }
            Ok(at)
        }
        ChType::Map(key, value) => {
            let (count, mut at) = read_leb128(data, at)?;
            for _ in 0..count {
                at = skip_value(key, data, at)?;
                at = skip_value(value, data, at)?;
            }
            Ok(at)
        }
        ChType::Tuple(items) => items
            .iter()
            .try_fold(at, |at, item| skip_value(item, data, at)),
        ChType::Unsupported(text) => Err(format!("the type {text} cannot be read")),
        fixed => {
            let width = width_of(fixed)?;
            take(data, at, width).map(|_| at + width)
        }
    }
}

/// The width of a type the callers did not handle as variable-width: one they do not know is an
/// error, never a guess.
fn width_of(ty: &ChType) -> Result<usize, String> {
    fixed_width(ty).ok_or_else(|| format!("the type {ty} cannot be read"))
}

/// The variant whose value follows the discriminator at `at`; `None` for NULL (255).
fn variant_at<'t>(
    variants: &'t [ChType],
    data: &[u8],
    at: usize,
) -> Result<Option<&'t ChType>, String> {
    match take(data, at, 1)?[0] {
        255 => Ok(None),
        d => variants.get(usize::from(d)).map(Some).ok_or_else(|| {
            format!(
                "the discriminator {d} names none of the {} variants",
                variants.len()
            )
        }),
    }
}

/// The type encoded at `at` and the offset after it; `None` for `Nothing`. Reads every code
/// [`crate::encode::type_code::write_type_code`] writes, and `DateTime` / `DateTime64` with a time zone and
/// `FixedString(N)`; another type is an error naming its code.
pub(crate) fn read_type_code(data: &[u8], at: usize) -> Result<(Option<ChType>, usize), String> {
    let code = take(data, at, 1)?[0];
    let at = at + 1;
    let simple = match code {
        NOTHING => return Ok((None, at)),
        0x01 => ChType::UInt8,
        0x02 => ChType::UInt16,
        0x03 => ChType::UInt32,
        0x04 => ChType::UInt64,
        0x05 => ChType::UInt128,
        0x06 => ChType::UInt256,
        0x07 => ChType::Int8,
        0x08 => ChType::Int16,
        0x09 => ChType::Int32,
        0x0a => ChType::Int64,
        0x0b => ChType::Int128,
        0x0c => ChType::Int256,
        0x0d => ChType::Float32,
        0x0e => ChType::Float64,
        0x0f => ChType::Date,
        0x10 => ChType::Date32,
        0x11 => ChType::DateTime,
        0x15 => ChType::String,
        0x1d => ChType::Uuid,
        0x28 => ChType::IPv4,
        0x29 => ChType::IPv6,
        0x2d => ChType::Bool,
        _ => return read_compound(code, data, at).map(|(ty, at)| (Some(ty), at)),
    };
    Ok((Some(simple), at))
}

/// A type code with arguments or nested types, after its code byte.
fn read_compound(code: u8, data: &[u8], at: usize) -> Result<(ChType, usize), String> {
    let nested = |at| match read_type_code(data, at)? {
        (Some(ty), at) => Ok((Box::new(ty), at)),
        (None, _) => Err("a nested type is Nothing".to_owned()),
    };
    let skip_zone = |at| -> Result<usize, String> {
        let (len, at) = read_leb128(data, at)?;
        let len = usize::try_from(len).map_err(|_| format!("a time zone of {len} bytes"))?;
        take(data, at, len).map(|_| at + len)
    };
    Ok(match code {
        0x12 => (ChType::DateTime, skip_zone(at)?),
        0x13 => (ChType::DateTime64(take(data, at, 1)?[0]), at + 1),
        0x14 => (
            ChType::DateTime64(take(data, at, 1)?[0]),
            skip_zone(at + 1)?,
        ),
        0x16 => {
            let (n, at) = read_leb128(data, at)?;
            let n = usize::try_from(n).map_err(|_| format!("a FixedString of {n} bytes"))?;
            (ChType::FixedString(n), at)
        }
        0x19..=0x1c => {
            let args = take(data, at, 2)?;
            let (precision, scale) = (args[0], args[1]);
            (ChType::Decimal { precision, scale }, at + 2)
        }
        0x1e => {
            let (item, at) = nested(at)?;
            (ChType::Array(item), at)
        }
        0x1f => {
            let (count, mut at) = read_leb128(data, at)?;
            let mut items = Vec::new();
            for _ in 0..count {
                let (item, next) = nested(at)?;
                items.push(*item);
                at = next;
            }
            (ChType::Tuple(items), at)
        }
        NULLABLE => {
            let (item, at) = nested(at)?;
            (ChType::Nullable(item), at)
        }
        0x27 => {
            let (key, at) = nested(at)?;
            let (value, at) = nested(at)?;
            (ChType::Map(key, value), at)
        }
        other => return Err(format!("the binary type code {other:#04x} cannot be read")),
    })
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
        ChType::Json => {
            let (value, next) = read_value(&ChType::String, data, at)?;
            // The object itself where the text is one (the encoder checked it), else its text.
            let object = value
                .as_str()
                .and_then(|text| serde_json::from_str::<Json>(text).ok());
            Ok((object.unwrap_or(value), next))
        }
        ChType::Variant(variants) => match variant_at(variants, data, at)? {
            Some(variant) => read_value(variant, data, at + 1),
            None => Ok((Json::Null, at + 1)),
        },
        ChType::Dynamic => match read_type_code(data, at)? {
            (Some(ty), at) => read_value(&ty, data, at),
            (None, at) => Ok((Json::Null, at)),
        },
        ChType::Array(inner) => {
            let (count, mut at) = read_leb128(data, at)?;
            let mut items = Vec::new();
            for _ in 0..count {
                let (item, next) = read_value(inner, data, at)?;
                items.push(item);
                at = next;
            }
            Ok((Json::Array(items), at))
        }
        ChType::Map(key, value) => {
            let (count, mut at) = read_leb128(data, at)?;
            let as_object = matches!(key.as_ref(), ChType::String | ChType::FixedString(_));
            let mut object = Map::new();
            let mut pairs = Vec::new();
            for _ in 0..count {
                let (k, next) = read_value(key, data, at)?;
                let (v, next) = read_value(value, data, next)?;
                at = next;
                match k {
                    Json::String(k) if as_object => {
                        object.insert(k, v);
                    }
                    k => pairs.push(Json::Array(vec![k, v])),
                }
            }
            Ok((
                if as_object {
                    Json::Object(object)
                } else {
                    Json::Array(pairs)
                },
                at,
            ))
        }
        ChType::Tuple(items) => {
            let mut values = Vec::with_capacity(items.len());
            let mut at = at;
            for item in items {
                let (value, next) = read_value(item, data, at)?;
                values.push(value);
                at = next;
            }
            Ok((Json::Array(values), at))
        }
        ChType::Unsupported(text) => Err(format!("the type {text} cannot be read")),
        fixed => {
            let width = width_of(fixed)?;
            let bytes = take(data, at, width)?;
            Ok((scalar(fixed, bytes), at + width))
        }
    }
}

fn text(bytes: &[u8]) -> Json {
    Json::String(String::from_utf8_lossy(bytes).into_owned())
}

/// A fixed-width value as JSON; `bytes` has the type's width. Values a JSON reader's doubles
/// would round (128/256-bit integers, decimals) are strings, as are UUIDs, IPs and enum names.
fn scalar(ty: &ChType, bytes: &[u8]) -> Json {
    let mut le = [0u8; 8];
    let n = bytes.len().min(8);
    le[..n].copy_from_slice(&bytes[..n]);
    let unsigned = u64::from_le_bytes(le);
    let float =
        |v: f64| Number::from_f64(v).map_or_else(|| Json::String(v.to_string()), Json::Number);
    let wide = |signed: bool, scale: u8| {
        let mut text = String::new();
        WideInt::from_le_bytes(bytes, signed).write_decimal(signed, scale, &mut text);
        Json::String(text)
    };
    match ty {
        ChType::Int8 => Json::from(unsigned as u8 as i8),
        ChType::Int16 => Json::from(unsigned as u16 as i16),
        ChType::Int32 | ChType::Date32 => Json::from(unsigned as u32 as i32),
        ChType::Int64 | ChType::DateTime64(_) => Json::from(unsigned as i64),
        ChType::Bool => Json::Bool(unsigned != 0),
        ChType::Float32 => float(f64::from(f32::from_bits(unsigned as u32))),
        ChType::Float64 => float(f64::from_bits(unsigned)),
        ChType::Int128 | ChType::Int256 => wide(true, 0),
        ChType::UInt128 | ChType::UInt256 => wide(false, 0),
        ChType::Decimal { scale, .. } => wide(true, *scale),
        ChType::Uuid => {
            let mut uuid = [0u8; 16];
            for (half, chunk) in uuid.chunks_exact_mut(8).zip(bytes.chunks_exact(8)) {
                for (to, from) in half.iter_mut().zip(chunk.iter().rev()) {
                    *to = *from;
                }
            }
            let mut text = String::new();
            write_uuid(&uuid, &mut text);
            Json::String(text)
        }
        ChType::IPv4 => Json::String(std::net::Ipv4Addr::from(unsigned as u32).to_string()),
        ChType::IPv6 => {
            let mut octets = [0u8; 16];
            octets.copy_from_slice(bytes);
            Json::String(std::net::Ipv6Addr::from(octets).to_string())
        }
        ChType::Time => Json::String(clock(i64::from(unsigned as u32 as i32), 0)),
        ChType::Time64(precision) => Json::String(clock(unsigned as i64, *precision)),
        ChType::Enum8(items) => enum_name(items, i64::from(unsigned as u8 as i8)),
        ChType::Enum16(items) => enum_name(items, i64::from(unsigned as u16 as i16)),
        _ => Json::from(unsigned),
    }
}

/// `[-]HH:MM:SS[.fraction]` of `ticks` of 10^-precision s, as the server prints a `Time64`.
fn clock(ticks: i64, precision: u8) -> String {
    let per_second = 10u64.pow(precision.into());
    let magnitude = ticks.unsigned_abs();
    let (seconds, fraction) = (magnitude / per_second, magnitude % per_second);
    let sign = if ticks < 0 { "-" } else { "" };
    let mut text = format!(
        "{sign}{:02}:{:02}:{:02}",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60
    );
    if precision > 0 {
        text.push_str(&format!(
            ".{fraction:0width$}",
            width = usize::from(precision)
        ));
    }
    text
}

fn enum_name<T: Copy + Into<i64>>(items: &[(String, T)], code: i64) -> Json {
    items
        .iter()
        .find(|(_, c)| (*c).into() == code)
        .map_or_else(|| Json::from(code), |(name, _)| Json::String(name.clone()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use flow_core::{Column, MessageBatch, MessageId, StreamSchema, StreamType, Value};

    use super::*;
    use crate::encode::rowbinary::RowBinaryEncoder;

    fn column(name: &str, index: usize, ty: &str) -> EncodedColumn {
        EncodedColumn::parsed(name, index, ty)
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
    fn string_values_that_are_not_utf8_are_kept_exactly_in_base64_by_column() {
        let columns = vec![
            column("raw", 0, "String"),
            column("maybe", 0, "Nullable(String)"),
            column("low", 0, "LowCardinality(String)"),
            column("fine", 0, "String"),
            column("null", 0, "Nullable(String)"),
        ];
        // raw = ff fe, maybe = ff, low = 80, fine = "ok", null = NULL.
        let data = [2, 0xff, 0xfe, 0, 1, 0xff, 1, 0x80, 2, b'o', b'k', 1];
        let exact = row_base64(&columns, &data).unwrap();
        assert_eq!(
            exact,
            BTreeMap::from([
                ("low".to_owned(), "gA==".to_owned()),
                ("maybe".to_owned(), "/w==".to_owned()),
                ("raw".to_owned(), "//4=".to_owned()),
            ])
        );
        assert_eq!(
            row_json(&columns, &data).unwrap()["raw"],
            Json::String("\u{fffd}\u{fffd}".to_owned())
        );
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

    /// `rows` rows of one value per `(name, stream type, table type, JSON value)`, encoded for
    /// the table types: the columns, the bytes and the length of one row.
    fn encode_rows(
        types: &[(&str, &str, &str, &str)],
        rows: usize,
    ) -> (Vec<EncodedColumn>, Vec<u8>, usize) {
        let schema = StreamSchema::new(
            types
                .iter()
                .map(|(name, ty, _, _)| Column::new(*name, ty.parse().unwrap()))
                .collect(),
        )
        .unwrap();
        let columns: Vec<EncodedColumn> = types
            .iter()
            .enumerate()
            .map(|(i, (name, _, ty, _))| column(name, i, ty))
            .collect();
        let mut batch = MessageBatch::new(schema);
        for _ in 0..rows {
            let mut row = batch.start_row(MessageId::new(0, 0));
            for (_, _, _, json) in types {
                flow_core::push_json_text(&mut row, json).unwrap();
            }
            row.finish().unwrap();
        }
        let encoder = RowBinaryEncoder::new(columns.clone());
        let mut data = Vec::new();
        for row in 0..rows {
            encoder.encode_row(&batch.row(row), &mut data).unwrap();
        }
        let one = data.len() / rows;
        (columns, data, one)
    }

    #[test]
    fn rows_of_the_new_types_are_read_back_as_their_json_forms() {
        let types = [
            ("d", "decimal(9,2)", "Decimal(18, 4)", "\"-12.5\""),
            (
                "u",
                "uuid",
                "UUID",
                "\"01234567-89ab-cdef-0123-456789abcdef\"",
            ),
            ("e", "utf8", "Enum8('a' = 1, 'b' = 2)", "\"b\""),
            ("i4", "ipv4", "IPv4", "\"10.1.2.3\""),
            ("i6", "ipv6", "IPv6", "\"2001:db8::1\""),
            (
                "big",
                "int128",
                "Int128",
                "\"-170141183460469231731687303715884105728\"",
            ),
            ("t", "timestamp", "DateTime64(3)", "1500000"),
            ("day", "date32", "Date32", "-1"),
            (
                "l",
                "list<optional<uint8>>",
                "Array(Nullable(UInt8))",
                "[1, null]",
            ),
            (
                "m",
                "dict<utf8,list<uint32>>",
                "Map(String, Array(UInt32))",
                "{\"k\": [7]}",
            ),
            (
                "p",
                "dict<uint8,utf8>",
                "Map(UInt8, String)",
                "[[1, \"x\"]]",
            ),
            (
                "tu",
                "tuple<uint8,optional<utf8>>",
                "Tuple(UInt8, Nullable(String))",
                "[3, null]",
            ),
        ];
        let (columns, data, _) = encode_rows(&types, 1);
        let spans = RowSpans::parse(&columns, &data).unwrap();
        assert_eq!(spans.rows(), 1);
        assert_eq!(
            row_json(&columns, &data).unwrap(),
            serde_json::json!({
                "d": "-12.5000",
                "u": "01234567-89ab-cdef-0123-456789abcdef",
                "e": "b",
                "i4": "10.1.2.3",
                "i6": "2001:db8::1",
                "big": "-170141183460469231731687303715884105728",
                "t": 1500,
                "day": -1,
                "l": [1, null],
                "m": {"k": [7]},
                "p": [[1, "x"]],
                "tu": [3, null],
            })
        );
    }

    #[test]
    fn rows_of_the_modern_types_are_found_and_read_back_as_their_json_forms() {
        let types = [
            (
                "j",
                "utf8",
                "JSON(`a.b` UInt32)",
                r#""{\"a\": {\"b\": 1}}""#,
            ),
            (
                "vs",
                "utf8",
                "Variant(Array(UInt8), String, UInt64)",
                "\"x\"",
            ),
            (
                "vn",
                "optional<uint64>",
                "Variant(Array(UInt8), String, UInt64)",
                "null",
            ),
            (
                "va",
                "list<uint8>",
                "Variant(Array(UInt8), String, UInt64)",
                "[4]",
            ),
            ("d", "optional<int64>", "Dynamic", "-3"),
            ("dn", "optional<int64>", "Dynamic", "null"),
            ("dm", "dict<utf8,list<uint8>>", "Dynamic", "{\"k\": [1, 2]}"),
            ("t", "utf8", "Time", "\"-05:06:07\""),
            ("t3", "int64", "Time64(3)", "3599999999"),
        ];
        let (columns, data, one) = encode_rows(&types, 2);
        let spans = RowSpans::parse(&columns, &data).unwrap();
        assert_eq!(spans.rows(), 2);
        assert_eq!(spans.bytes(1, 2), one..data.len());
        assert_eq!(
            row_json(&columns, &data[..one]).unwrap(),
            serde_json::json!({
                "j": {"a": {"b": 1}},
                "vs": "x",
                "vn": null,
                "va": [4],
                "d": -3,
                "dn": null,
                "dm": {"k": [1, 2]},
                "t": "-05:06:07",
                "t3": "999:59:59.999",
            })
        );
    }
}

//! The columns most tables are made of (integers, dates, strings, their Nullable and
//! LowCardinality forms), encoded without walking the column type for every value: each column's
//! rule is worked out once per encoder. A value a rule does not take (another kind, out of range,
//! every rarer type) goes through the full encoder, so that it alone words every refusal; the
//! bytes of a taken value are the full encoder's, byte for byte (deduplication compares bytes).

use flow_core::{write_leb128, Value};

use crate::encode::chtype::ChType;
use crate::encode::readable::ReadableRanges;

/// One column's rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FastColumn {
    kind: FastKind,
    /// A `Nullable` column: a marker byte first, and `null` taken.
    nullable: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FastKind {
    /// Unsigned values within `min..=max`, as `width` little-endian bytes.
    Unsigned { width: usize, min: u64, max: u64 },
    /// Signed values within `min..=max`, as `width` little-endian bytes.
    Signed { width: usize, min: i64, max: i64 },
    /// Bytes as a LEB128 length and the bytes.
    String,
    /// Nothing: the full encoder.
    Full,
}

impl FastColumn {
    /// The rule of a column of type `ty` on servers that read back `ranges`.
    pub(super) fn of(ty: &ChType, ranges: &ReadableRanges) -> FastColumn {
        let (nullable, inner) = match strip_low_cardinality(ty) {
            ChType::Nullable(inner) => (true, strip_low_cardinality(inner)),
            other => (false, other),
        };
        let unsigned = |width: usize, min: u64, max: u64| FastKind::Unsigned { width, min, max };
        let signed = |width: usize, min: i64, max: i64| FastKind::Signed { width, min, max };
        let (date, datetime) = (ranges.date_days, ranges.datetime_seconds);
        let kind = match inner {
            ChType::UInt8 => unsigned(1, 0, u8::MAX.into()),
            ChType::UInt16 => unsigned(2, 0, u16::MAX.into()),
            ChType::UInt32 => unsigned(4, 0, u32::MAX.into()),
            ChType::UInt64 => unsigned(8, 0, u64::MAX),
            ChType::Date => unsigned(2, date.0.into(), date.1.into()),
            ChType::DateTime => unsigned(4, datetime.0.into(), datetime.1.into()),
            ChType::Int8 => signed(1, i8::MIN.into(), i8::MAX.into()),
            ChType::Int16 => signed(2, i16::MIN.into(), i16::MAX.into()),
            ChType::Int32 => signed(4, i32::MIN.into(), i32::MAX.into()),
            ChType::Int64 => signed(8, i64::MIN, i64::MAX),
            ChType::String => FastKind::String,
            _ => FastKind::Full,
        };
        FastColumn { kind, nullable }
    }

    /// Appends `value` when the rule takes it; `false` (nothing written) when it does not.
    #[inline]
    pub(super) fn encode(self, value: Value<'_>, out: &mut Vec<u8>) -> bool {
        let marker = |out: &mut Vec<u8>| {
            if self.nullable {
                out.push(0);
            }
        };
        match (self.kind, value) {
            (FastKind::Unsigned { width, min, max }, Value::Uint(v)) if min <= v && v <= max => {
                marker(out);
                put_le(v.to_le_bytes(), width, out);
            }
            (FastKind::Signed { width, min, max }, Value::Int(v)) if min <= v && v <= max => {
                marker(out);
                put_le(v.to_le_bytes(), width, out);
            }
            (FastKind::String, Value::Bytes(bytes)) => {
                marker(out);
                write_leb128(bytes.len() as u64, out);
                out.extend_from_slice(bytes);
            }
            (FastKind::Full, _) => return false,
            (_, Value::Null) if self.nullable => out.push(1),
            _ => return false,
        }
        true
    }
}

/// The low `width` bytes of a little-endian value. Each width is a copy of a size known here: a
/// slice of the run-time width was a call to libc's `memmove` per cell, 3 % of a worker's CPU on
/// the benchmark's four integer columns.
#[inline(always)]
fn put_le(bytes: [u8; 8], width: usize, out: &mut Vec<u8>) {
    match width {
        8 => out.extend_from_slice(&bytes),
        4 => out.extend_from_slice(&[bytes[0], bytes[1], bytes[2], bytes[3]]),
        2 => out.extend_from_slice(&[bytes[0], bytes[1]]),
        1 => out.push(bytes[0]),
        _ => out.extend_from_slice(&bytes[..width.min(8)]),
    }
}

fn strip_low_cardinality(ty: &ChType) -> &ChType {
    match ty {
        ChType::LowCardinality(inner) => strip_low_cardinality(inner),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use flow_core::{Column, MessageBatch, MessageId, StreamSchema, StreamType};

    use super::super::encode_value;
    use super::*;

    #[test]
    fn a_taken_value_has_the_full_encoders_bytes_and_the_rest_is_left_to_it() {
        // `encode_value` reads the row only for packed values, which no rule takes.
        let schema = StreamSchema::new(vec![Column::new("c", StreamType::Uint64)])
            .unwrap_or_else(|e| panic!("{e}"));
        let mut batch = MessageBatch::new(schema);
        let mut row = batch.start_row(MessageId::new(0, 0));
        row.push(Value::Uint(0)).unwrap_or_else(|e| panic!("{e}"));
        row.finish().unwrap_or_else(|e| panic!("{e}"));
        let row = batch.row(0);
        let plain = [
            "UInt8",
            "UInt16",
            "UInt32",
            "UInt64",
            "Int8",
            "Int16",
            "Int32",
            "Int64",
            "Date",
            "DateTime",
            "String",
            "FixedString(3)",
            "Float64",
            "IPv4",
            "Bool",
        ];
        let values = [
            Value::Null,
            Value::Uint(0),
            Value::Uint(1),
            Value::Uint(255),
            Value::Uint(256),
            Value::Uint(86_400),
            Value::Uint(u64::from(u32::MAX)),
            Value::Uint(u64::MAX),
            Value::Int(-129),
            Value::Int(-1),
            Value::Int(5),
            Value::Int(i64::MIN),
            Value::Float(2.5),
            Value::Bool(true),
            Value::Bytes(b"abc"),
            Value::Bytes(&[0xff; 200]),
        ];
        let mut taken = 0;
        for ranges in [
            ReadableRanges::unchecked(),
            ReadableRanges::of_version("18.16.1"),
        ] {
            for name in plain {
                let ty = ChType::parse(name);
                let wrapped = |outer: &str| ChType::parse(&format!("{outer}({name})"));
                let nullable_low = ChType::parse(&format!("Nullable(LowCardinality({name}))"));
                for ty in [
                    ty.clone(),
                    wrapped("Nullable"),
                    wrapped("LowCardinality"),
                    nullable_low,
                ] {
                    let rule = FastColumn::of(&ty, &ranges);
                    for value in values {
                        let mut fast = Vec::new();
                        if !rule.encode(value, &mut fast) {
                            assert!(fast.is_empty(), "{ty} {value:?}: bytes left by a refusal");
                            continue;
                        }
                        taken += 1;
                        let mut full = Vec::new();
                        let result = encode_value(&ty, &ranges, &row, 0, value, &mut full);
                        assert!(
                            result.is_ok(),
                            "{ty} {value:?}: the full encoder refuses it"
                        );
                        assert_eq!(fast, full, "{ty} {value:?} under {ranges:?}");
                    }
                }
            }
        }
        // The count keeps the fast path from silently taking nothing (or less than it did).
        assert_eq!(taken, 268, "values that took the fast path");
    }
}

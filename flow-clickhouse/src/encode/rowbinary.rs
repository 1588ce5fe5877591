//! ClickHouse's RowBinary format: little-endian fixed-width numbers, strings as an unsigned LEB128
//! length and the bytes, `FixedString(N)` as exactly N bytes, `Nullable` as a marker byte
//! (1 = null, 0 = present) followed by the value when present, `LowCardinality(T)` as T,
//! `Bool` as one byte, `Date` as u16 days, `Date32` as i32 days, `DateTime` as u32 seconds,
//! `DateTime64(P)` as i64 ticks of 10^-P s, `Decimal(P, S)` as the value × 10^S in 4/8/16/32
//! bytes, `Int128`..`UInt256` as 16/32 bytes, `UUID` as two u64 halves (high first), `IPv4` as u32,
//! `IPv6` as 16 bytes in network order, `Enum8/16` as their code, `Array(T)` and `Map(K, V)` as a
//! LEB128 count and the items (pairs), `Tuple` as its items in order.
//!
//! Values of wide and nested stream types arrive packed (`flow_core::PackedReader`), in the
//! RowBinary layout of their natural type; the encoder walks the packed value and the column type
//! together, so widening a decimal's scale, adding Nullable markers or mapping enum names costs
//! no allocation.

use std::fmt;

// The packed form's LEB128 is RowBinary's: one writer for both.
use flow_core::{
    check_date32, decimal_width, parse_uuid, write_leb128, PackedError, PackedReader, Row,
    StreamType, Value, WideInt,
};

use crate::encode::chtype::{variant_for, ChType};
use crate::encode::readable::ReadableRanges;

mod dynamic;
mod fast;
mod time;

use fast::FastColumn;

/// One column to encode: where its value is in the stream row and the table type to encode it as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedColumn {
    /// The table column's name.
    pub name: String,
    /// Index of the value in the stream row.
    pub stream_index: usize,
    /// The table column's type, which decides the bytes written.
    pub ty: ChType,
}

#[cfg(test)]
impl EncodedColumn {
    /// The column `name` taking stream value `stream_index`, of the table type written as `ty`.
    pub(crate) fn parsed(name: &str, stream_index: usize, ty: &str) -> EncodedColumn {
        EncodedColumn {
            name: name.to_owned(),
            stream_index,
            ty: ChType::parse(ty),
        }
    }
}

/// Encodes rows in ClickHouse's RowBinary format for an
/// `INSERT INTO t (names...) FORMAT RowBinary`, columns in the plan order.
#[derive(Clone, Debug)]
pub struct RowBinaryEncoder {
    columns: Vec<EncodedColumn>,
    /// See [`RowBinaryEncoder::plan_fingerprint`]; fixed with the columns.
    plan: String,
    /// The `Date` and `DateTime` values the servers read back; not part of the plan, since it
    /// refuses values but never changes the bytes of one it accepts.
    ranges: ReadableRanges,
    /// Each column's common values, encoded without walking its type ([`FastColumn`]).
    fast: Vec<FastColumn>,
}

/// Why a row could not be encoded.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[error("column `{column}`: {reason}")]
pub struct EncodeError {
    /// The table column.
    pub column: String,
    /// Why its value could not be encoded.
    pub reason: String,
}

impl RowBinaryEncoder {
    /// An encoder of `columns`, in that order; computes the plan fingerprint once.
    pub fn new(columns: Vec<EncodedColumn>) -> RowBinaryEncoder {
        let plan = columns
            .iter()
            .map(|c| format!("{} {} <- {}", c.name, c.ty, c.stream_index))
            .collect::<Vec<_>>()
            .join(", ");
        let plan = format!("{:016x}", xxhash_rust::xxh64::xxh64(plan.as_bytes(), 0));
        let ranges = ReadableRanges::unchecked();
        RowBinaryEncoder {
            fast: fast_columns(&columns, &ranges),
            columns,
            plan,
            ranges,
        }
    }

    /// Whether a column is, or holds, `JSON`: its values are sent as text, which the INSERT
    /// must tell the server (`input_format_binary_read_json_as_string`).
    pub fn holds_json(&self) -> bool {
        self.columns.iter().any(|column| column.ty.holds_json())
    }

    /// The same encoder, refusing `Date` and `DateTime` values outside `ranges` (what the
    /// servers probed at the session start read back).
    pub fn with_ranges(mut self, ranges: ReadableRanges) -> RowBinaryEncoder {
        self.fast = fast_columns(&self.columns, &ranges);
        self.ranges = ranges;
        self
    }

    /// The table column names in encoding order, for the `INSERT INTO t (names...)` clause.
    pub fn column_names(&self) -> Vec<String> {
        self.columns.iter().map(|c| c.name.clone()).collect()
    }

    /// The columns in encoding order.
    pub fn columns(&self) -> &[EncodedColumn] {
        &self.columns
    }

    /// Identifies the encoding: table columns, their types and the stream columns they take.
    /// Rows encoded under different plans are different bytes.
    pub fn plan_fingerprint(&self) -> &str {
        &self.plan
    }

    /// Appends one row to `out`. On error `out` is truncated back to its length before the call
    /// (nothing partial is left) and the error names the column and why: null into a
    /// non-Nullable column; a FixedString(N) value longer than N bytes (shorter ones are
    /// zero-padded, as ClickHouse does); a value out of the column's range (e.g. Date beyond
    /// 65535 days, any int outside the target width); a value of the wrong kind. Never silently
    /// replaces a value. No heap allocation per row (beyond `out` growing).
    pub fn encode_row(&self, row: &Row<'_>, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let mark = out.len();
        for (column, fast) in self.columns.iter().zip(&self.fast) {
            let result = if column.stream_index < row.len() {
                let index = column.stream_index;
                let value = row.get(index);
                if fast.encode(value, out) {
                    continue;
                }
                encode_value(&column.ty, &self.ranges, row, index, value, out)
            } else {
                Err(Reason::StreamIndex {
                    index: column.stream_index,
                    width: row.len(),
                })
            };
            if let Err(reason) = result {
                out.truncate(mark);
                return Err(EncodeError {
                    column: column.name.clone(),
                    reason: reason.describe(),
                });
            }
        }
        Ok(())
    }
}

fn fast_columns(columns: &[EncodedColumn], ranges: &ReadableRanges) -> Vec<FastColumn> {
    columns
        .iter()
        .map(|column| FastColumn::of(&column.ty, ranges))
        .collect()
}

/// The failure of one value, kept allocation-free until it is reported (the rare reasons that
/// quote a wide value carry its text, built only on that error path).
#[derive(Debug)]
enum Reason<'t> {
    Null(&'t ChType),
    TooLong {
        len: usize,
        ty: &'t ChType,
    },
    IntOutOfRange {
        value: i128,
        ty: &'t ChType,
    },
    FloatOutOfRange {
        value: f64,
        ty: &'t ChType,
    },
    WrongKind {
        kind: &'static str,
        ty: &'t ChType,
    },
    Unsupported(&'t ChType),
    StreamIndex {
        index: usize,
        width: usize,
    },
    /// A value that does not fit its column, described with the value.
    Value(String),
}

impl Reason<'_> {
    fn describe(&self) -> String {
        match self {
            Reason::Null(ty) => format!("null, but the column type {ty} is not Nullable"),
            Reason::TooLong { len, ty } => {
                format!("a value of {len} bytes is longer than {ty} allows")
            }
            Reason::IntOutOfRange { value, ty } => format!("{value} is out of range for {ty}"),
            Reason::FloatOutOfRange { value, ty } => format!("{value:e} is out of range for {ty}"),
            Reason::WrongKind { kind, ty } => format!("{kind} cannot be written to {ty}"),
            Reason::Unsupported(ty) => format!("the type {ty} cannot be encoded"),
            Reason::StreamIndex { index, width } => {
                format!("stream column index {index} is outside the row of {width} values")
            }
            Reason::Value(text) => text.clone(),
        }
    }
}

/// A packed value that does not hold its type: checked when the row was written, so only a
/// bug gets here, and it is reported rather than panicking.
fn malformed<'t>(err: PackedError) -> Reason<'t> {
    Reason::Value(format!("malformed packed value: {err}"))
}

/// Writes the value of stream column `index` as `ty`. The stream type is looked up only for a
/// packed value: cell values carry what the encoding needs in their kind.
fn encode_value<'t>(
    ty: &'t ChType,
    ranges: &'t ReadableRanges,
    row: &Row<'_>,
    index: usize,
    value: Value<'_>,
    out: &mut Vec<u8>,
) -> Result<(), Reason<'t>> {
    match ty {
        ChType::Nullable(inner) => {
            if let Value::Null = value {
                out.push(1);
                return Ok(());
            }
            out.push(0);
            return encode_value(inner, ranges, row, index, value, out);
        }
        ChType::LowCardinality(inner) => {
            return encode_value(inner, ranges, row, index, value, out)
        }
        ChType::Unsupported(_) => return Err(Reason::Unsupported(ty)),
        ChType::Dynamic => return dynamic::encode_cell(ranges, row.column_type(index), value, out),
        ChType::Variant(variants) => {
            let null = matches!(value, Value::Null);
            let Some(at) = variant(ty, variants, row.column_type(index), null, out)? else {
                return Ok(());
            };
            return encode_value(&variants[at], ranges, row, index, value, out);
        }
        _ => {}
    }
    match value {
        Value::Null => Err(Reason::Null(ty)),
        Value::Packed(bytes) => {
            let mut reader = PackedReader::new(bytes);
            encode_packed(ty, ranges, row.column_type(index).inner(), &mut reader, out)
        }
        value => encode_scalar(ty, ranges, None, value, out),
    }
}

/// Writes one packed value of `stream` as `ty`, walking both types together.
fn encode_packed<'t>(
    ty: &'t ChType,
    ranges: &'t ReadableRanges,
    stream: &StreamType,
    reader: &mut PackedReader<'_>,
    out: &mut Vec<u8>,
) -> Result<(), Reason<'t>> {
    match (ty, stream) {
        (ChType::LowCardinality(inner), _) => encode_packed(inner, ranges, stream, reader, out),
        (ChType::Nullable(inner), StreamType::Optional(item)) => {
            if reader.byte().map_err(malformed)? == 1 {
                out.push(1);
                Ok(())
            } else {
                out.push(0);
                encode_packed(inner, ranges, item, reader, out)
            }
        }
        (ChType::Nullable(inner), _) => {
            out.push(0);
            encode_packed(inner, ranges, stream, reader, out)
        }
        (ChType::Dynamic, _) => dynamic::encode_packed(ranges, stream, reader, out),
        (ChType::Variant(variants), _) => {
            let (null, item) = match stream {
                StreamType::Optional(item) => (reader.byte().map_err(malformed)? == 1, &**item),
                other => (false, other),
            };
            let Some(at) = variant(ty, variants, item, null, out)? else {
                return Ok(());
            };
            encode_packed(&variants[at], ranges, item, reader, out)
        }
        (_, StreamType::Optional(item)) => {
            if reader.byte().map_err(malformed)? == 1 {
                Err(Reason::Null(ty))
            } else {
                encode_packed(ty, ranges, item, reader, out)
            }
        }
        (ChType::Array(inner), StreamType::List(item)) => {
            let count = reader.leb128().map_err(malformed)?;
            write_leb128(count, out);
            for _ in 0..count {
                encode_packed(inner, ranges, item, reader, out)?;
            }
            Ok(())
        }
        (ChType::Map(key_ty, value_ty), StreamType::Dict(key, value)) => {
            let count = reader.leb128().map_err(malformed)?;
            write_leb128(count, out);
            for _ in 0..count {
                encode_packed(key_ty, ranges, key, reader, out)?;
                encode_packed(value_ty, ranges, value, reader, out)?;
            }
            Ok(())
        }
        (ChType::Tuple(types), StreamType::Tuple(items)) if types.len() == items.len() => {
            for (item_ty, item) in types.iter().zip(items) {
                encode_packed(item_ty, ranges, item, reader, out)?;
            }
            Ok(())
        }
        (_, StreamType::List(_) | StreamType::Dict(..) | StreamType::Tuple(_)) => {
            Err(Reason::WrongKind {
                kind: "a nested value",
                ty,
            })
        }
        (_, item) => {
            let value = read_item(item, reader).map_err(malformed)?;
            encode_scalar(ty, ranges, Some(item), value, out)
        }
    }
}

/// Writes the discriminator of a `Variant` value of `stream`: 255 for NULL (`None`: nothing
/// follows), else the place of the variant it is written as (`Some`: that variant's value
/// follows).
fn variant<'t>(
    ty: &'t ChType,
    variants: &[ChType],
    stream: &StreamType,
    null: bool,
    out: &mut Vec<u8>,
) -> Result<Option<usize>, Reason<'t>> {
    if null {
        out.push(VARIANT_NULL);
        return Ok(None);
    }
    // The plan admitted the column only with a variant for the stream type (`fits`).
    let at = variant_for(stream, variants).ok_or_else(|| {
        Reason::Value(format!(
            "no variant of {ty} holds a value of the stream type {stream}"
        ))
    })?;
    // Fewer than 255 variants, as the type's parser checked.
    out.push(at as u8);
    Ok(Some(at))
}

/// The discriminator of a NULL `Variant` value.
const VARIANT_NULL: u8 = 255;

/// One scalar item of a packed value, as the value a cell would hold (wide scalars stay packed).
fn read_item<'v>(
    stream: &StreamType,
    reader: &mut PackedReader<'v>,
) -> Result<Value<'v>, PackedError> {
    Ok(match stream {
        StreamType::Int8 => Value::Int(i8::from_le_bytes(reader.array()?).into()),
        StreamType::Int16 => Value::Int(i16::from_le_bytes(reader.array()?).into()),
        StreamType::Int32 | StreamType::Date32 => {
            Value::Int(i32::from_le_bytes(reader.array()?).into())
        }
        StreamType::Int64 | StreamType::Timestamp => {
            Value::Int(i64::from_le_bytes(reader.array()?))
        }
        StreamType::Uint8 => Value::Uint(reader.byte()?.into()),
        StreamType::Uint16 | StreamType::Date => {
            Value::Uint(u16::from_le_bytes(reader.array()?).into())
        }
        StreamType::Uint32 | StreamType::Datetime | StreamType::Ipv4 => {
            Value::Uint(u32::from_le_bytes(reader.array()?).into())
        }
        StreamType::Uint64 => Value::Uint(u64::from_le_bytes(reader.array()?)),
        StreamType::Float => Value::Float(f32::from_le_bytes(reader.array()?).into()),
        StreamType::Double => Value::Float(f64::from_le_bytes(reader.array()?)),
        StreamType::Boolean => Value::Bool(reader.byte()? == 1),
        StreamType::String | StreamType::Utf8 => Value::Bytes(reader.string()?),
        other => Value::Packed(reader.value(other)?),
    })
}

/// The range of `DateTime64`: 1900-01-01 00:00:00 ..= 2299-12-31 23:59:59 (UTC seconds).
const DATETIME64_SECONDS: (i64, i64) = (-2_208_988_800, 10_413_791_999);

/// Writes a value that is not nested (a cell's, or an item of a packed value) as `ty`. `stream`
/// is the item's type for a packed item (a wide scalar's signedness and meaning come from it);
/// `None` for a cell value, whose kind says it all (a `timestamp` is an `Int` of µs, a
/// `datetime` a `Uint` of seconds). Inlined into the cell path, where the old types' arms are
/// the hot loop of every sink.
#[inline(always)]
fn encode_scalar<'t>(
    ty: &'t ChType,
    ranges: &'t ReadableRanges,
    stream: Option<&StreamType>,
    value: Value<'_>,
    out: &mut Vec<u8>,
) -> Result<(), Reason<'t>> {
    let wrong_kind = || Reason::WrongKind {
        kind: value.kind(),
        ty,
    };
    match ty {
        ChType::Int8 => out.extend_from_slice(&narrow::<i8>(ty, value)?.to_le_bytes()),
        ChType::Int16 => out.extend_from_slice(&narrow::<i16>(ty, value)?.to_le_bytes()),
        ChType::Int32 => out.extend_from_slice(&narrow::<i32>(ty, value)?.to_le_bytes()),
        ChType::Int64 => out.extend_from_slice(&narrow::<i64>(ty, value)?.to_le_bytes()),
        // ClickHouse before 21.12 has no Bool: booleans are stored as UInt8 0/1 there.
        ChType::UInt8 if matches!(value, Value::Bool(_)) => {
            out.push(u8::from(value == Value::Bool(true)))
        }
        ChType::UInt8 => out.extend_from_slice(&narrow::<u8>(ty, value)?.to_le_bytes()),
        ChType::UInt16 => out.extend_from_slice(&narrow::<u16>(ty, value)?.to_le_bytes()),
        // Stored as any u16 / u32, but read back as another date outside the server's range.
        ChType::Date => {
            let days = narrow::<u16>(ty, value)?;
            if !ranges.date_fits(days) {
                return Err(Reason::Value(ranges.date_refusal(days)));
            }
            out.extend_from_slice(&days.to_le_bytes())
        }
        ChType::DateTime if !matches!(value, Value::Bytes(_)) => {
            let seconds = narrow::<u32>(ty, value)?;
            if !ranges.datetime_fits(seconds) {
                return Err(Reason::Value(ranges.datetime_refusal(seconds)));
            }
            out.extend_from_slice(&seconds.to_le_bytes())
        }
        ChType::UInt32 | ChType::IPv4 if !matches!(value, Value::Bytes(_)) => {
            out.extend_from_slice(&narrow::<u32>(ty, value)?.to_le_bytes())
        }
        ChType::UInt64 => out.extend_from_slice(&narrow::<u64>(ty, value)?.to_le_bytes()),
        ChType::Int128 | ChType::UInt128 | ChType::Int256 | ChType::UInt256 => {
            let (width, signed) = match ty {
                ChType::Int128 => (16, true),
                ChType::UInt128 => (16, false),
                ChType::Int256 => (32, true),
                _ => (32, false),
            };
            let wide = wide_integer(ty, stream, value)?;
            let mut bytes = [0u8; 32];
            if wide
                .to_le_bytes_checked(&mut bytes[..width], signed)
                .is_none()
            {
                return Err(Reason::Value(format!(
                    "{} is out of range for {ty}",
                    wide_text(&wide, stream.is_none_or(is_signed_wide), 0)
                )));
            }
            out.extend_from_slice(&bytes[..width]);
        }
        ChType::Decimal { precision, scale } => {
            let (Value::Packed(bytes), Some(StreamType::Decimal { scale: from, .. })) =
                (value, stream)
            else {
                return Err(wrong_kind());
            };
            let wide = WideInt::from_le_bytes(bytes, true);
            let too_wide = || {
                Reason::Value(format!(
                    "{} does not fit {ty} ({precision} digits, {scale} after the point)",
                    wide_text(&wide, true, *from)
                ))
            };
            let scaled = wide
                .checked_scale_up(scale.saturating_sub(*from))
                .ok_or_else(too_wide)?;
            if !scaled.fits_precision(*precision) {
                return Err(too_wide());
            }
            out.extend_from_slice(&scaled.to_le_bytes()[..decimal_width(*precision)]);
        }
        ChType::Date32 => {
            let days = narrow::<i32>(ty, value)?;
            check_date32(days.into()).map_err(Reason::Value)?;
            out.extend_from_slice(&days.to_le_bytes());
        }
        ChType::DateTime64(precision) => {
            let ticks = datetime64_ticks(ty, *precision, value)?;
            out.extend_from_slice(&ticks.to_le_bytes());
        }
        ChType::Uuid => {
            let bytes = match value {
                Value::Packed(bytes) => {
                    let mut uuid = [0u8; 16];
                    uuid.copy_from_slice(bytes);
                    uuid
                }
                Value::Bytes(text) => std::str::from_utf8(text)
                    .ok()
                    .and_then(parse_uuid)
                    .ok_or_else(|| {
                        Reason::Value(format!("`{}` is not a UUID", String::from_utf8_lossy(text)))
                    })?,
                _ => return Err(wrong_kind()),
            };
            // ClickHouse keeps a UUID as two little-endian 64-bit halves, high half first.
            for half in bytes.chunks_exact(8) {
                out.extend(half.iter().rev());
            }
        }
        ChType::IPv4 | ChType::IPv6 => {
            let Value::Bytes(text) = value else {
                let ChType::IPv6 = ty else {
                    return Err(wrong_kind());
                };
                match value {
                    Value::Packed(bytes) => out.extend_from_slice(bytes),
                    Value::Uint(v) => {
                        let v4 = std::net::Ipv4Addr::from(u32::try_from(v).map_err(|_| {
                            Reason::IntOutOfRange {
                                value: v.into(),
                                ty,
                            }
                        })?);
                        out.extend_from_slice(&v4.to_ipv6_mapped().octets());
                    }
                    _ => return Err(wrong_kind()),
                }
                return Ok(());
            };
            let text = std::str::from_utf8(text).unwrap_or("");
            let bad = || {
                Reason::Value(format!(
                    "`{}` is not an {ty} address",
                    String::from_utf8_lossy(value_bytes(value))
                ))
            };
            if let ChType::IPv4 = ty {
                let ip: std::net::Ipv4Addr = text.parse().map_err(|_| bad())?;
                out.extend_from_slice(&u32::from(ip).to_le_bytes());
            } else {
                let ip: std::net::Ipv6Addr = text
                    .parse()
                    .or_else(|_| {
                        text.parse::<std::net::Ipv4Addr>()
                            .map(|v4| v4.to_ipv6_mapped())
                    })
                    .map_err(|_| bad())?;
                out.extend_from_slice(&ip.octets());
            }
        }
        ChType::Enum8(items) => {
            let code = enum_code(ty, items, value)?;
            out.extend_from_slice(&code.to_le_bytes());
        }
        ChType::Enum16(items) => {
            let code = enum_code(ty, items, value)?;
            out.extend_from_slice(&code.to_le_bytes());
        }
        ChType::Float32 => {
            let Value::Float(v) = value else {
                return Err(wrong_kind());
            };
            // Rounding to the nearest f32 is the meaning of `float`; turning a finite value
            // into an infinity is not.
            let narrow = v as f32;
            if v.is_finite() && !narrow.is_finite() {
                return Err(Reason::FloatOutOfRange { value: v, ty });
            }
            out.extend_from_slice(&narrow.to_le_bytes());
        }
        ChType::Float64 => {
            let Value::Float(v) = value else {
                return Err(wrong_kind());
            };
            out.extend_from_slice(&v.to_le_bytes());
        }
        ChType::Bool => {
            let Value::Bool(v) = value else {
                return Err(wrong_kind());
            };
            out.push(u8::from(v));
        }
        ChType::String => {
            let Value::Bytes(bytes) = value else {
                return Err(wrong_kind());
            };
            write_leb128(bytes.len() as u64, out);
            out.extend_from_slice(bytes);
        }
        ChType::FixedString(n) => {
            // An IPv6 address or a UUID (text order) as its 16 bytes.
            let bytes = match value {
                Value::Bytes(bytes) => bytes,
                Value::Packed(bytes)
                    if matches!(stream, Some(StreamType::Ipv6 | StreamType::Uuid)) =>
                {
                    bytes
                }
                _ => return Err(wrong_kind()),
            };
            if bytes.len() > *n {
                return Err(Reason::TooLong {
                    len: bytes.len(),
                    ty,
                });
            }
            out.extend_from_slice(bytes);
            out.resize(out.len() + (n - bytes.len()), 0);
        }
        ChType::Json => {
            let Value::Bytes(text) = value else {
                return Err(wrong_kind());
            };
            check_json_object(text)?;
            write_leb128(text.len() as u64, out);
            out.extend_from_slice(text);
        }
        ChType::Time => time::write_time(ty, value, out)?,
        ChType::Time64(precision) => time::write_time64(ty, *precision, value, out)?,
        ChType::UInt32 | ChType::DateTime => return Err(wrong_kind()),
        ChType::Array(_) | ChType::Tuple(_) | ChType::Map(..) => return Err(wrong_kind()),
        // Handled by the callers.
        ChType::Nullable(_)
        | ChType::LowCardinality(_)
        | ChType::Variant(_)
        | ChType::Dynamic
        | ChType::Unsupported(_) => return Err(Reason::Unsupported(ty)),
    }
    Ok(())
}

/// A `JSON` column's value is sent as its text (`input_format_binary_read_json_as_string`): a
/// text that is not one JSON object would fail the whole INSERT, so it is refused here, as the
/// value of its row alone.
fn check_json_object<'t>(text: &[u8]) -> Result<(), Reason<'t>> {
    let object = text.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    match serde_json::from_slice::<serde::de::IgnoredAny>(text) {
        Ok(_) if object => Ok(()),
        Ok(_) => Err(Reason::Value(format!(
            "`{}` is JSON but not an object, which a JSON column holds",
            String::from_utf8_lossy(&text[..text.len().min(64)])
        ))),
        Err(err) => Err(Reason::Value(format!(
            "`{}` is not a JSON object: {err}",
            String::from_utf8_lossy(&text[..text.len().min(64)])
        ))),
    }
}

fn value_bytes<'v>(value: Value<'v>) -> &'v [u8] {
    match value {
        Value::Bytes(bytes) | Value::Packed(bytes) => bytes,
        _ => &[],
    }
}

fn is_signed_wide(stream: &StreamType) -> bool {
    !matches!(stream, StreamType::Uint128 | StreamType::Uint256)
}

fn wide_text(value: &WideInt, signed: bool, scale: u8) -> String {
    let mut text = String::new();
    value.write_decimal(signed, scale, &mut text);
    text
}

/// The integer of a value written to a 128- or 256-bit column.
fn wide_integer<'t>(
    ty: &'t ChType,
    stream: Option<&StreamType>,
    value: Value<'_>,
) -> Result<WideInt, Reason<'t>> {
    Ok(match value {
        Value::Int(v) => WideInt::from_i128(v.into()),
        Value::Uint(v) => WideInt::from_i128(v.into()),
        Value::Packed(bytes)
            if matches!(
                stream,
                Some(
                    StreamType::Int128
                        | StreamType::Uint128
                        | StreamType::Int256
                        | StreamType::Uint256
                )
            ) =>
        {
            WideInt::from_le_bytes(bytes, stream.is_none_or(is_signed_wide))
        }
        other => {
            return Err(Reason::WrongKind {
                kind: other.kind(),
                ty,
            })
        }
    })
}

/// Ticks of 10^-precision s for a `timestamp` (µs) or `datetime` (s) value, within the range of
/// `DateTime64` and without dropping digits.
fn datetime64_ticks<'t>(
    ty: &'t ChType,
    precision: u8,
    value: Value<'_>,
) -> Result<i64, Reason<'t>> {
    // Only `timestamp` (µs, signed) and `datetime` (seconds, unsigned) fit DateTime64.
    let (units, per_second): (i128, i128) = match value {
        Value::Int(v) => (v.into(), 1_000_000),
        Value::Uint(v) => (v.into(), 1),
        other => {
            return Err(Reason::WrongKind {
                kind: other.kind(),
                ty,
            })
        }
    };
    let seconds = units.div_euclid(per_second);
    if seconds < DATETIME64_SECONDS.0.into() || seconds > DATETIME64_SECONDS.1.into() {
        return Err(Reason::Value(format!(
            "{units} ({}) is outside the range of {ty} (1900-01-01 ..= 2299-12-31)",
            if per_second == 1 { "seconds" } else { "µs" }
        )));
    }
    let target = 10i128.pow(precision.into());
    let ticks = if target >= per_second {
        units * (target / per_second)
    } else {
        let step = per_second / target;
        if units % step != 0 {
            return Err(Reason::Value(format!(
                "{units} µs has digits finer than {ty} keeps; use DateTime64(6) or round the \
                 value"
            )));
        }
        units / step
    };
    // Within the range above every precision up to 9 fits 64 bits.
    i64::try_from(ticks).map_err(|_| Reason::IntOutOfRange { value: ticks, ty })
}

/// The code of an enum value given by name or by code; an unknown one is refused.
fn enum_code<'t, T: Copy + Into<i64> + fmt::Display>(
    ty: &'t ChType,
    items: &[(String, T)],
    value: Value<'_>,
) -> Result<T, Reason<'t>> {
    let found = match value {
        Value::Bytes(name) => items.iter().find(|(n, _)| n.as_bytes() == name),
        Value::Int(code) => items.iter().find(|(_, c)| (*c).into() == code),
        Value::Uint(code) => items
            .iter()
            .find(|(_, c)| i64::try_from(code).is_ok_and(|code| (*c).into() == code)),
        other => {
            return Err(Reason::WrongKind {
                kind: other.kind(),
                ty,
            })
        }
    };
    found.map(|(_, code)| *code).ok_or_else(|| {
        let shown = match value {
            Value::Bytes(name) => format!("`{}`", String::from_utf8_lossy(name)),
            Value::Int(code) => code.to_string(),
            Value::Uint(code) => code.to_string(),
            _ => String::new(),
        };
        Reason::Value(format!("{shown} is not a value of {ty}"))
    })
}

/// An integer value converted to the column's width, or the reason it cannot be.
fn narrow<'t, T: TryFrom<i128>>(ty: &'t ChType, value: Value<'_>) -> Result<T, Reason<'t>> {
    let wide: i128 = match value {
        Value::Int(v) => v.into(),
        Value::Uint(v) => v.into(),
        other => {
            return Err(Reason::WrongKind {
                kind: other.kind(),
                ty,
            })
        }
    };
    T::try_from(wide).map_err(|_| Reason::IntOutOfRange { value: wide, ty })
}

#[cfg(test)]
mod tests {
    use flow_core::{Column, MessageBatch, MessageId, StreamSchema, StreamType};

    use super::*;

    fn opt(ty: StreamType) -> StreamType {
        StreamType::Optional(Box::new(ty))
    }

    fn nullable(ty: ChType) -> ChType {
        ChType::Nullable(Box::new(ty))
    }

    fn low(ty: ChType) -> ChType {
        ChType::LowCardinality(Box::new(ty))
    }

    /// A batch with one column per `(stream type, value)`, and one row.
    fn one_row(cells: &[(StreamType, Value<'_>)]) -> MessageBatch {
        let columns = cells
            .iter()
            .enumerate()
            .map(|(i, (ty, _))| Column::new(format!("s{i}"), ty.clone()))
            .collect();
        let mut batch = MessageBatch::new(StreamSchema::new(columns).unwrap());
        let mut writer = batch.start_row(MessageId::new(0, 0));
        for (_, value) in cells {
            writer.push(*value).unwrap();
        }
        writer.finish().unwrap();
        batch
    }

    /// Encodes the single value of a one-column batch as `ty`.
    fn encode_one(
        stream: StreamType,
        value: Value<'_>,
        ty: ChType,
    ) -> Result<Vec<u8>, EncodeError> {
        let batch = one_row(&[(stream, value)]);
        let encoder = RowBinaryEncoder::new(vec![EncodedColumn {
            name: "c".to_owned(),
            stream_index: 0,
            ty,
        }]);
        let mut out = Vec::new();
        encoder.encode_row(&batch.row(0), &mut out)?;
        Ok(out)
    }

    fn reason(err: EncodeError) -> String {
        assert_eq!(err.column, "c");
        err.reason
    }

    #[test]
    fn integers_are_little_endian_at_the_column_width() {
        let cases: Vec<(StreamType, Value<'_>, ChType, Vec<u8>)> = vec![
            (StreamType::Int8, Value::Int(-2), ChType::Int8, vec![0xfe]),
            (
                StreamType::Int16,
                Value::Int(-2),
                ChType::Int16,
                vec![0xfe, 0xff],
            ),
            (
                StreamType::Int32,
                Value::Int(0x0102_0304),
                ChType::Int32,
                vec![4, 3, 2, 1],
            ),
            (
                StreamType::Int64,
                Value::Int(i64::MIN),
                ChType::Int64,
                vec![0, 0, 0, 0, 0, 0, 0, 0x80],
            ),
            (
                StreamType::Uint8,
                Value::Uint(255),
                ChType::UInt8,
                vec![0xff],
            ),
            (
                StreamType::Uint16,
                Value::Uint(0x0102),
                ChType::UInt16,
                vec![2, 1],
            ),
            (
                StreamType::Uint32,
                Value::Uint(u32::MAX.into()),
                ChType::UInt32,
                vec![0xff; 4],
            ),
            (
                StreamType::Uint64,
                Value::Uint(u64::MAX),
                ChType::UInt64,
                vec![0xff; 8],
            ),
        ];
        for (stream, value, ty, bytes) in cases {
            assert_eq!(
                encode_one(stream, value, ty.clone()).unwrap(),
                bytes,
                "{ty}"
            );
        }
    }

    #[test]
    fn floats_bools_dates_and_datetimes() {
        assert_eq!(
            encode_one(StreamType::Boolean, Value::Bool(true), ChType::UInt8).unwrap(),
            vec![1]
        );
        assert_eq!(
            encode_one(StreamType::Boolean, Value::Bool(false), ChType::UInt8).unwrap(),
            vec![0]
        );
        assert_eq!(
            encode_one(StreamType::Float, Value::Float(1.5), ChType::Float32).unwrap(),
            1.5f32.to_le_bytes()
        );
        assert_eq!(
            encode_one(StreamType::Float, Value::Float(1.5), ChType::Float32).unwrap(),
            vec![0, 0, 0xc0, 0x3f]
        );
        assert_eq!(
            encode_one(StreamType::Double, Value::Float(-2.25), ChType::Float64).unwrap(),
            vec![0, 0, 0, 0, 0, 0, 0x02, 0xc0]
        );
        assert_eq!(
            encode_one(StreamType::Boolean, Value::Bool(true), ChType::Bool).unwrap(),
            vec![1]
        );
        assert_eq!(
            encode_one(StreamType::Boolean, Value::Bool(false), ChType::Bool).unwrap(),
            vec![0]
        );
        assert_eq!(
            encode_one(StreamType::Date, Value::Uint(19_000), ChType::Date).unwrap(),
            vec![0x38, 0x4a]
        );
        assert_eq!(
            encode_one(StreamType::Date, Value::Uint(65_535), ChType::Date).unwrap(),
            vec![0xff, 0xff]
        );
        assert_eq!(
            encode_one(
                StreamType::Datetime,
                Value::Uint(1_700_000_000),
                ChType::DateTime
            )
            .unwrap(),
            vec![0x00, 0xf1, 0x53, 0x65]
        );
    }

    #[test]
    fn non_finite_floats_pass_but_finite_overflow_of_float32_is_rejected() {
        let nan = encode_one(StreamType::Double, Value::Float(f64::NAN), ChType::Float32).unwrap();
        assert!(f32::from_le_bytes([nan[0], nan[1], nan[2], nan[3]]).is_nan());
        assert_eq!(
            encode_one(
                StreamType::Double,
                Value::Float(f64::INFINITY),
                ChType::Float32
            )
            .unwrap(),
            f32::INFINITY.to_le_bytes()
        );
        let err = encode_one(StreamType::Double, Value::Float(1e300), ChType::Float32).unwrap_err();
        assert_eq!(
            err.to_string(),
            "column `c`: 1e300 is out of range for Float32"
        );
    }

    #[test]
    fn strings_have_a_leb128_length_prefix() {
        assert_eq!(
            encode_one(StreamType::String, Value::Bytes(b""), ChType::String).unwrap(),
            vec![0]
        );
        assert_eq!(
            encode_one(StreamType::Utf8, Value::Bytes(b"abc"), ChType::String).unwrap(),
            vec![3, b'a', b'b', b'c']
        );
        for (len, prefix) in [
            (127usize, vec![0x7f]),
            (128, vec![0x80, 0x01]),
            (300, vec![0xac, 0x02]),
            (16_383, vec![0xff, 0x7f]),
            (16_384, vec![0x80, 0x80, 0x01]),
        ] {
            let text = vec![b'x'; len];
            let out = encode_one(StreamType::String, Value::Bytes(&text), ChType::String).unwrap();
            assert_eq!(&out[..prefix.len()], prefix.as_slice(), "{len}");
            assert_eq!(&out[prefix.len()..], text.as_slice());
        }
    }

    #[test]
    fn leb128_of_large_values() {
        let mut out = Vec::new();
        write_leb128(u64::MAX, &mut out);
        assert_eq!(
            out,
            vec![0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
        out.clear();
        write_leb128(624_485, &mut out);
        assert_eq!(out, vec![0xe5, 0x8e, 0x26]);
    }

    #[test]
    fn fixed_string_is_zero_padded_to_its_width() {
        assert_eq!(
            encode_one(
                StreamType::String,
                Value::Bytes(b"ab"),
                ChType::FixedString(4)
            )
            .unwrap(),
            vec![b'a', b'b', 0, 0]
        );
        assert_eq!(
            encode_one(
                StreamType::String,
                Value::Bytes(b"abcd"),
                ChType::FixedString(4)
            )
            .unwrap(),
            b"abcd".to_vec()
        );
        assert_eq!(
            encode_one(
                StreamType::String,
                Value::Bytes(b""),
                ChType::FixedString(2)
            )
            .unwrap(),
            vec![0, 0]
        );
    }

    #[test]
    fn too_long_fixed_string_is_rejected_and_out_is_truncated() {
        let batch = one_row(&[
            (StreamType::Uint32, Value::Uint(7)),
            (StreamType::Utf8, Value::Bytes(b"hello")),
        ]);
        let encoder = RowBinaryEncoder::new(vec![
            EncodedColumn {
                name: "id".to_owned(),
                stream_index: 0,
                ty: ChType::UInt32,
            },
            EncodedColumn {
                name: "code".to_owned(),
                stream_index: 1,
                ty: ChType::FixedString(4),
            },
        ]);
        let mut out = vec![0xaa, 0xbb];
        let err = encoder.encode_row(&batch.row(0), &mut out).unwrap_err();
        assert_eq!(
            err,
            EncodeError {
                column: "code".to_owned(),
                reason: "a value of 5 bytes is longer than FixedString(4) allows".to_owned(),
            }
        );
        assert_eq!(
            err.to_string(),
            "column `code`: a value of 5 bytes is longer than FixedString(4) allows"
        );
        assert_eq!(out, vec![0xaa, 0xbb]);
    }

    #[test]
    fn nullable_writes_a_marker_then_the_value() {
        let ty = nullable(ChType::UInt16);
        assert_eq!(
            encode_one(opt(StreamType::Uint16), Value::Null, ty.clone()).unwrap(),
            vec![1]
        );
        assert_eq!(
            encode_one(opt(StreamType::Uint16), Value::Uint(0x0102), ty.clone()).unwrap(),
            vec![0, 2, 1]
        );
        // A non-optional stream column into a Nullable table column.
        assert_eq!(
            encode_one(StreamType::Uint16, Value::Uint(5), ty).unwrap(),
            vec![0, 5, 0]
        );
        assert_eq!(
            encode_one(
                opt(StreamType::String),
                Value::Bytes(b"x"),
                nullable(ChType::FixedString(3))
            )
            .unwrap(),
            vec![0, b'x', 0, 0]
        );
        assert_eq!(
            encode_one(
                opt(StreamType::String),
                Value::Null,
                nullable(ChType::FixedString(3))
            )
            .unwrap(),
            vec![1]
        );
    }

    #[test]
    fn low_cardinality_is_encoded_as_its_inner_type() {
        assert_eq!(
            encode_one(StreamType::String, Value::Bytes(b"ab"), low(ChType::String)).unwrap(),
            vec![2, b'a', b'b']
        );
        let ty = low(nullable(ChType::String));
        assert_eq!(
            encode_one(opt(StreamType::String), Value::Null, ty.clone()).unwrap(),
            vec![1]
        );
        assert_eq!(
            encode_one(opt(StreamType::String), Value::Bytes(b"ab"), ty).unwrap(),
            vec![0, 2, b'a', b'b']
        );
    }

    #[test]
    fn null_into_a_non_nullable_column_is_rejected() {
        let err = encode_one(opt(StreamType::Uint64), Value::Null, ChType::UInt64).unwrap_err();
        assert_eq!(
            reason(err),
            "null, but the column type UInt64 is not Nullable"
        );
        let err =
            encode_one(opt(StreamType::String), Value::Null, low(ChType::String)).unwrap_err();
        assert_eq!(
            reason(err),
            "null, but the column type String is not Nullable"
        );
    }

    #[test]
    fn integers_outside_the_column_width_are_rejected() {
        let cases = [
            (
                StreamType::Int64,
                Value::Int(128),
                ChType::Int8,
                "128 is out of range for Int8",
            ),
            (
                StreamType::Int64,
                Value::Int(-129),
                ChType::Int8,
                "-129 is out of range for Int8",
            ),
            (
                StreamType::Int64,
                Value::Int(40_000),
                ChType::Int16,
                "40000 is out of range for Int16",
            ),
            (
                StreamType::Int64,
                Value::Int(i64::from(i32::MAX) + 1),
                ChType::Int32,
                "2147483648 is out of range for Int32",
            ),
            (
                StreamType::Uint64,
                Value::Uint(u64::MAX),
                ChType::Int64,
                "18446744073709551615 is out of range for Int64",
            ),
            (
                StreamType::Int64,
                Value::Int(-1),
                ChType::UInt8,
                "-1 is out of range for UInt8",
            ),
            (
                StreamType::Uint64,
                Value::Uint(256),
                ChType::UInt8,
                "256 is out of range for UInt8",
            ),
            (
                StreamType::Uint64,
                Value::Uint(65_536),
                ChType::UInt16,
                "65536 is out of range for UInt16",
            ),
            (
                StreamType::Uint64,
                Value::Uint(1 << 32),
                ChType::UInt32,
                "4294967296 is out of range for UInt32",
            ),
            (
                StreamType::Int64,
                Value::Int(-1),
                ChType::UInt64,
                "-1 is out of range for UInt64",
            ),
            (
                StreamType::Uint64,
                Value::Uint(65_536),
                ChType::Date,
                "65536 is out of range for Date",
            ),
            (
                StreamType::Uint64,
                Value::Uint(1 << 32),
                ChType::DateTime,
                "4294967296 is out of range for DateTime",
            ),
            (
                opt(StreamType::Uint64),
                Value::Uint(300),
                nullable(ChType::UInt8),
                "300 is out of range for UInt8",
            ),
        ];
        for (stream, value, ty, expected) in cases {
            let err = encode_one(stream, value, ty).unwrap_err();
            assert_eq!(reason(err), expected);
        }
        // In-range values of the other sign class are written.
        assert_eq!(
            encode_one(StreamType::Uint64, Value::Uint(5), ChType::Int8).unwrap(),
            vec![5]
        );
        assert_eq!(
            encode_one(StreamType::Int64, Value::Int(5), ChType::UInt8).unwrap(),
            vec![5]
        );
    }

    #[test]
    fn values_of_the_wrong_kind_are_rejected() {
        let cases = [
            (
                StreamType::String,
                Value::Bytes(b"1"),
                ChType::UInt8,
                "a string cannot be written to UInt8",
            ),
            (
                StreamType::Double,
                Value::Float(1.0),
                ChType::Int32,
                "a floating-point number cannot be written to Int32",
            ),
            (
                StreamType::Uint8,
                Value::Uint(1),
                ChType::Bool,
                "an unsigned integer cannot be written to Bool",
            ),
            (
                StreamType::Int64,
                Value::Int(1),
                ChType::String,
                "a signed integer cannot be written to String",
            ),
            (
                StreamType::Uint32,
                Value::Uint(1),
                ChType::FixedString(4),
                "an unsigned integer cannot be written to FixedString(4)",
            ),
            (
                StreamType::Boolean,
                Value::Bool(true),
                ChType::Float64,
                "a boolean cannot be written to Float64",
            ),
            (
                StreamType::String,
                Value::Bytes(b"x"),
                ChType::Float32,
                "a string cannot be written to Float32",
            ),
            (
                StreamType::String,
                Value::Bytes(b"x"),
                ChType::Unsupported("UUID".to_owned()),
                "the type UUID cannot be encoded",
            ),
        ];
        for (stream, value, ty, expected) in cases {
            let err = encode_one(stream, value, ty).unwrap_err();
            assert_eq!(reason(err), expected);
        }
    }

    /// Encodes one value given as JSON, of `stream` type, as `column`.
    fn encode_json(stream: &str, column: &str, json: &str) -> Result<Vec<u8>, EncodeError> {
        let schema = StreamSchema::new(vec![Column::new("c", stream.parse().unwrap())]).unwrap();
        let mut batch = MessageBatch::new(schema);
        let mut row = batch.start_row(MessageId::new(0, 0));
        flow_core::push_json_text(&mut row, json).unwrap();
        row.finish().unwrap();
        let encoder = RowBinaryEncoder::new(vec![EncodedColumn {
            name: "c".to_owned(),
            stream_index: 0,
            ty: ChType::parse(column),
        }]);
        let mut out = Vec::new();
        encoder.encode_row(&batch.row(0), &mut out)?;
        Ok(out)
    }

    /// The bytes ClickHouse 26.9.2.1 itself wrote for the same values (`SELECT (v)::Dynamic
    /// FORMAT RowBinary` on a modern node): a type code, its arguments, then the value.
    #[test]
    fn dynamic_values_carry_the_binary_code_of_their_natural_type_as_the_server_writes_it() {
        let cases: [(&str, &str, &str); 13] = [
            ("uint8", "1", "0101"),
            ("boolean", "true", "2d01"),
            ("ipv4", "\"1.2.3.4\"", "2804030201"),
            ("ipv6", "\"::1\"", "2900000000000000000000000000000001"),
            (
                "uuid",
                "\"00000000-0000-0000-0000-000000000001\"",
                "1d00000000000000000100000000000000",
            ),
            ("list<uint8>", "[1,2]", "1e01020102"),
            ("tuple<uint8,string>", "[1,\"a\"]", "1f020115010161"),
            ("dict<string,uint8>", "{\"a\":1}", "27150101016101"),
            ("list<optional<uint8>>", "[null,1]", "1e230102010001"),
            ("decimal(18,2)", "\"1.5\"", "1a12029600000000000000"),
            ("timestamp", "0", "13060000000000000000"),
            ("date32", "\"1970-01-01\"", "1000000000"),
            ("int128", "1", "0b01000000000000000000000000000000"),
        ];
        for (stream, json, expected) in cases {
            let out = encode_json(stream, "Dynamic", json).unwrap();
            let hex: String = out.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(hex, expected, "{stream} {json}");
        }
        // NULL is the type Nothing, with no value after it.
        assert_eq!(
            encode_json("optional<uint8>", "Dynamic", "null").unwrap(),
            [0]
        );
        assert_eq!(
            encode_json("list<optional<string>>", "Array(Dynamic)", "[null,\"a\"]").unwrap(),
            [2, 0, 0x15, 1, b'a']
        );
    }

    #[test]
    fn a_variant_value_is_its_place_in_the_sorted_list_then_its_bytes_and_null_is_255() {
        // As system.columns prints it: variants sorted by name, the discriminator's order.
        let ty = "Variant(Array(UInt8), String, UInt64)";
        assert_eq!(
            encode_json("uint64", ty, "7").unwrap(),
            [2, 7, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            encode_json("string", ty, "\"ab\"").unwrap(),
            [1, 2, b'a', b'b']
        );
        assert_eq!(encode_json("list<uint8>", ty, "[3]").unwrap(), [0, 1, 3]);
        assert_eq!(encode_json("optional<uint64>", ty, "null").unwrap(), [255]);
        // A type without a variant of its own goes to the first it fits: uint8 -> UInt64.
        assert_eq!(
            encode_json("uint8", ty, "5").unwrap(),
            [2, 5, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            encode_json(
                "list<optional<string>>",
                "Array(Variant(String, UInt8))",
                "[null,\"a\"]"
            )
            .unwrap(),
            [2, 255, 0, 1, b'a']
        );
    }

    #[test]
    fn a_json_value_is_sent_as_its_text_and_only_an_object_is_taken() {
        let object = r#"{"a": {"b": 1}, "c": [1, "x"]}"#;
        let text = serde_json::to_string(object).unwrap();
        let out = encode_json("string", "JSON(max_dynamic_paths=8, `a.b` UInt32)", &text).unwrap();
        assert_eq!(out[0] as usize, object.len());
        assert_eq!(&out[1..], object.as_bytes());
        for (value, reason) in [
            (
                "[1, 2]",
                "`[1, 2]` is JSON but not an object, which a JSON column holds",
            ),
            (
                "{\"a\": ",
                "`{\"a\": ` is not a JSON object: EOF while parsing a value at line 1 column 6",
            ),
        ] {
            let text = serde_json::to_string(value).unwrap();
            assert_eq!(
                reason_of(encode_json("string", "JSON", &text).unwrap_err()),
                reason,
                "{value}"
            );
        }
        assert!(
            RowBinaryEncoder::new(vec![EncodedColumn::parsed("j", 0, "Array(JSON)")]).holds_json()
        );
        assert!(!RowBinaryEncoder::new(vec![EncodedColumn::parsed("s", 0, "String")]).holds_json());
    }

    fn reason_of(err: EncodeError) -> String {
        err.reason
    }

    #[test]
    fn values_that_do_not_fit_their_column_are_refused_with_column_and_value() {
        let cases = [
            (
                "decimal(9,2)",
                "Decimal(5, 2)",
                "\"1234.5\"",
                "column `c`: 1234.50 does not fit Decimal(5, 2) (5 digits, 2 after the point)",
            ),
            (
                "decimal(9,2)",
                "Decimal(9, 4)",
                "\"9999999.99\"",
                "column `c`: 9999999.99 does not fit Decimal(9, 4) (9 digits, 4 after the point)",
            ),
            (
                "utf8",
                "Enum8('a' = 1, 'b' = 2)",
                "\"c\"",
                "column `c`: `c` is not a value of Enum8('a' = 1, 'b' = 2)",
            ),
            (
                "int16",
                "Enum16('a' = 1000)",
                "7",
                "column `c`: 7 is not a value of Enum16('a' = 1000)",
            ),
            (
                "utf8",
                "IPv4",
                "\"10.0.0.300\"",
                "column `c`: `10.0.0.300` is not an IPv4 address",
            ),
            (
                "utf8",
                "IPv6",
                "\"fe80::zz\"",
                "column `c`: `fe80::zz` is not an IPv6 address",
            ),
            (
                "utf8",
                "UUID",
                "\"nope\"",
                "column `c`: `nope` is not a UUID",
            ),
            (
                "timestamp",
                "DateTime64(3)",
                "\"2300-01-01T00:00:00Z\"",
                "column `c`: 10413792000000000 (µs) is outside the range of DateTime64(3) \
                 (1900-01-01 ..= 2299-12-31)",
            ),
            (
                "timestamp",
                "DateTime64(3)",
                "1500",
                "column `c`: 1500 µs has digits finer than DateTime64(3) keeps; use \
                 DateTime64(6) or round the value",
            ),
            (
                "list<optional<int8>>",
                "Array(Int8)",
                "[1, null]",
                "column `c`: null, but the column type Int8 is not Nullable",
            ),
            (
                "uint256",
                "UInt128",
                "\"340282366920938463463374607431768211456\"",
                "column `c`: 340282366920938463463374607431768211456 is out of range for UInt128",
            ),
            (
                "date32",
                "Date",
                "\"1969-12-31\"",
                "column `c`: -1 is out of range for Date",
            ),
        ];
        for (stream, column, json, expected) in cases {
            let err = encode_json(stream, column, json).unwrap_err();
            assert_eq!(err.to_string(), expected, "{stream} -> {column}");
        }
    }

    #[test]
    fn columns_follow_the_plan_order_and_pick_their_stream_index() {
        let batch = one_row(&[
            (StreamType::Uint8, Value::Uint(1)),
            (StreamType::Utf8, Value::Bytes(b"z")),
            (StreamType::Int16, Value::Int(-1)),
        ]);
        let encoder = RowBinaryEncoder::new(vec![
            EncodedColumn {
                name: "c".to_owned(),
                stream_index: 2,
                ty: ChType::Int16,
            },
            EncodedColumn {
                name: "a".to_owned(),
                stream_index: 0,
                ty: ChType::UInt8,
            },
            EncodedColumn {
                name: "b".to_owned(),
                stream_index: 1,
                ty: ChType::String,
            },
        ]);
        assert_eq!(encoder.column_names(), vec!["c", "a", "b"]);
        let mut out = Vec::new();
        encoder.encode_row(&batch.row(0), &mut out).unwrap();
        encoder.encode_row(&batch.row(0), &mut out).unwrap();
        let row = vec![0xff, 0xff, 1, 1, b'z'];
        assert_eq!(out, [row.clone(), row].concat());
    }

    #[test]
    fn a_stream_index_outside_the_row_is_an_error_not_a_panic() {
        let batch = one_row(&[(StreamType::Uint8, Value::Uint(1))]);
        let encoder = RowBinaryEncoder::new(vec![
            EncodedColumn {
                name: "a".to_owned(),
                stream_index: 0,
                ty: ChType::UInt8,
            },
            EncodedColumn {
                name: "b".to_owned(),
                stream_index: 3,
                ty: ChType::UInt8,
            },
        ]);
        let mut out = Vec::new();
        let err = encoder.encode_row(&batch.row(0), &mut out).unwrap_err();
        assert_eq!(
            err.to_string(),
            "column `b`: stream column index 3 is outside the row of 1 values"
        );
        assert!(out.is_empty());
    }

    /// Encodes `value` of `stream` as `ty` for the servers of `version`.
    fn encode_for(
        version: &str,
        stream: StreamType,
        value: Value<'_>,
        ty: ChType,
    ) -> Result<Vec<u8>, String> {
        let batch = one_row(&[(stream, value)]);
        let encoder = RowBinaryEncoder::new(vec![EncodedColumn {
            name: "c".to_owned(),
            stream_index: 0,
            ty,
        }])
        .with_ranges(ReadableRanges::of_version(version));
        let mut out = Vec::new();
        match encoder.encode_row(&batch.row(0), &mut out) {
            Ok(()) => Ok(out),
            Err(err) => {
                assert!(out.is_empty());
                Err(err.to_string())
            }
        }
    }

    #[test]
    fn dates_and_times_the_server_would_read_back_as_others_are_refused_by_version() {
        // 18.16 reads Date back only up to 2106-02-07 and shows 2149-06-06 as 1970-01-01.
        assert_eq!(
            encode_for(
                "18.16.1",
                StreamType::Date,
                Value::Uint(49_710),
                ChType::Date
            ),
            Ok(49_710u16.to_le_bytes().to_vec())
        );
        assert_eq!(
            encode_for(
                "18.16.1",
                StreamType::Date,
                Value::Uint(65_535),
                ChType::Date
            ),
            Err(
                "column `c`: 2149-06-06 (day 65535) is outside the Date range ClickHouse 18.16.1 \
                 reads back (1970-01-02 ..= 2106-02-07): it would be stored and read back as \
                 another date. Correct the value at the source, or upgrade the server (21.4 and \
                 later read Date up to 2149-06-06)"
                    .to_owned()
            )
        );
        assert!(encode_for("18.16.1", StreamType::Date, Value::Uint(0), ChType::Date).is_err());
        assert!(encode_for(
            "18.16.1",
            opt(StreamType::Date),
            Value::Uint(49_711),
            nullable(ChType::Date)
        )
        .unwrap_err()
        .starts_with("column `c`: 2106-02-08 (day 49711) is outside the Date range"));
        let max = Value::Uint(u32::MAX.into());
        assert!(
            encode_for("18.16.1", StreamType::Datetime, max, ChType::DateTime)
                .unwrap_err()
                .starts_with(
                    "column `c`: 4294967295 (2106-02-07 06:28:15 UTC) is outside the DateTime \
                     range ClickHouse 18.16.1 reads back in every time zone"
                )
        );
        assert_eq!(
            encode_for(
                "18.16.1",
                StreamType::Datetime,
                Value::Uint(1_700_000_000),
                ChType::DateTime
            ),
            Ok(1_700_000_000u32.to_le_bytes().to_vec())
        );
        // Inside a list, too.
        let mut packed = Vec::new();
        write_leb128(2, &mut packed);
        packed.extend_from_slice(&1u16.to_le_bytes());
        packed.extend_from_slice(&65_535u16.to_le_bytes());
        assert!(encode_for(
            "18.16.1",
            StreamType::List(Box::new(StreamType::Date)),
            Value::Packed(&packed),
            ChType::Array(Box::new(ChType::Date))
        )
        .unwrap_err()
        .contains("2149-06-06 (day 65535) is outside the Date range"));
        // From 21.4 on every u16 and u32 reads back.
        assert_eq!(
            encode_for(
                "23.8.2.7",
                StreamType::Date,
                Value::Uint(65_535),
                ChType::Date
            ),
            Ok(65_535u16.to_le_bytes().to_vec())
        );
        assert_eq!(
            encode_for("23.8.2.7", StreamType::Datetime, max, ChType::DateTime),
            Ok(u32::MAX.to_le_bytes().to_vec())
        );
        // UInt16 / UInt32 columns are not dates.
        assert!(encode_for(
            "18.16.1",
            StreamType::Uint16,
            Value::Uint(65_535),
            ChType::UInt16
        )
        .is_ok());
    }
}

#[cfg(test)]
mod widening_tests {
    use flow_core::{Column, MessageBatch, MessageId, StreamSchema, StreamType, Value};

    use super::*;

    fn encode(stream: StreamType, value: Value<'_>, ty: ChType) -> Vec<u8> {
        let mut batch =
            MessageBatch::new(StreamSchema::new(vec![Column::new("c", stream)]).unwrap());
        let mut writer = batch.start_row(MessageId::new(0, 0));
        writer.push(value).unwrap();
        writer.finish().unwrap();
        let encoder = RowBinaryEncoder::new(vec![EncodedColumn {
            name: "c".to_owned(),
            stream_index: 0,
            ty,
        }]);
        let mut out = Vec::new();
        encoder.encode_row(&batch.row(0), &mut out).unwrap();
        out
    }

    #[test]
    fn a_value_is_written_as_the_wider_column_it_was_widened_to() {
        assert_eq!(
            encode(
                StreamType::Uint32,
                Value::Uint(u32::MAX.into()),
                ChType::UInt64
            ),
            u64::from(u32::MAX).to_le_bytes()
        );
        assert_eq!(
            encode(
                StreamType::Uint32,
                Value::Uint(u32::MAX.into()),
                ChType::Int64
            ),
            i64::from(u32::MAX).to_le_bytes()
        );
        assert_eq!(
            encode(StreamType::Int8, Value::Int(-128), ChType::Int32),
            (-128i32).to_le_bytes()
        );
        assert_eq!(
            encode(StreamType::Uint64, Value::Uint(u64::MAX), ChType::Int128),
            i128::from(u64::MAX).to_le_bytes()
        );
        // A float is the f64 of its f32: Float64 keeps it exactly.
        let third = f32::from_bits(0x3eaa_aaab);
        assert_eq!(
            encode(
                StreamType::Float,
                Value::Float(third.into()),
                ChType::Float64
            ),
            f64::from(third).to_le_bytes()
        );
        let mut packed = Vec::new();
        write_leb128(2, &mut packed);
        packed.extend_from_slice(&7u32.to_le_bytes());
        packed.extend_from_slice(&u32::MAX.to_le_bytes());
        let mut expected = vec![2];
        expected.extend_from_slice(&7u64.to_le_bytes());
        expected.extend_from_slice(&u64::from(u32::MAX).to_le_bytes());
        assert_eq!(
            encode(
                StreamType::List(Box::new(StreamType::Uint32)),
                Value::Packed(&packed),
                ChType::Array(Box::new(ChType::UInt64))
            ),
            expected
        );
    }
}

#[cfg(test)]
mod oracle_tests;

//! The JSON forms of stream values, read by `jsonl_file` and the broker sources
//! ([`push_json`]) and written for dead letters and the debug sink ([`write_json_value`]; a
//! whole row as a JSON object by column name: [`write_row_object`]).
//! A record (a JSON object by column name) is read by [`RecordDecoder`], for every JSON source.
//!
//! Numbers are read from their text (a [`RawValue`]), so decimals and 128/256-bit integers
//! arrive without a trip through `f64`: `decimal(P,S)` and `int128` .. `uint256` take a JSON
//! number or a string of digits; `uuid` and `ipv6`/`ipv4` their text forms (`ipv4` also a
//! number); `date`/`date32` a day number or `YYYY-MM-DD`; `datetime` seconds or
//! `YYYY-MM-DD HH:MM:SS` (UTC); `timestamp` microseconds or RFC 3339 text, which must carry its
//! zone (`Z` or `±HH:MM`: a text without one is refused rather than guessed); `list<T>` and
//! `tuple<...>` arrays; `dict<K,V>` an object (keys read as K) or an array of `[key, value]`.

use std::io::Write;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::ops::Range;

use serde_json::value::RawValue;
use thiserror::Error;

use crate::json_scan::scan_flat;
use crate::message::{check_item, Row, RowWriter, Value};
use crate::packed::{self, check_date32, write_leb128, PackedReader};
use crate::types::{StreamSchema, StreamType};
use crate::wide_int::WideInt;

/// Reads the JSON value of one column (`None`: the key is missing, which is null) and pushes it.
/// `raw` is the value's JSON text, already checked to be JSON. The error names the column and
/// its type.
pub(crate) fn push_json(
    row: &mut RowWriter<'_>,
    name: &str,
    ty: &StreamType,
    raw: Option<&str>,
    escapes: Escapes,
    scratch: &mut Vec<u8>,
) -> Result<(), String> {
    let in_column = |what: String| format!("column `{name}` ({ty}): {what}");
    let raw = raw.unwrap_or("null");
    let pushed = if raw == "null" {
        row.push(Value::Null)
    } else if ty.is_packed() {
        scratch.clear();
        pack(ty.inner(), raw, scratch).map_err(in_column)?;
        row.push(Value::Packed(scratch))
    } else {
        let value = scalar_from_text(raw, ty, escapes, scratch).map_err(in_column)?;
        row.push(value)
    };
    pushed.map(|_| ()).map_err(|err| err.to_string())
}

/// Whether the strings of a record may hold escapes: not in one read by the one-pass scan
/// ([`scan_flat`]), which saves looking for them again in every string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Escapes {
    None,
    Possible,
}

/// The cell value of `raw`, the JSON text of a value of the scalar type `ty` (or an `optional`
/// of one), read from its text: numbers from their digits, a string borrowed from the record
/// unless it has escapes (then unescaped into `scratch`). Nothing is allocated for a value
/// without escapes, and the text is not checked for UTF-8 again. The range of an integer that
/// fits 64 bits is the row's check; one that does not is out of range here.
fn scalar_from_text<'v>(
    raw: &'v str,
    ty: &StreamType,
    escapes: Escapes,
    scratch: &'v mut Vec<u8>,
) -> Result<Value<'v>, String> {
    let scalar = ty.inner();
    Ok(match raw.as_bytes().first() {
        Some(b'"') => return string_value(raw, scalar, escapes, scratch),
        Some(b'-' | b'0'..=b'9') => number_value(raw, ty)?,
        _ => match raw {
            "null" => Value::Null,
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ if raw.starts_with('[') => return Err(format!("expected {scalar}, got an array")),
            _ if raw.starts_with('{') => return Err(format!("expected {scalar}, got an object")),
            _ => return Err(format!("not JSON: {raw}")),
        },
    })
}

/// A JSON number's cell value, as the JSON reader types numbers: an integer is unsigned when it
/// fits 64 bits, else signed when it fits, else (and any fraction or exponent) a float; `-0` is
/// the float -0.0. An integer beyond 64 bits where `ty` is an integer type is out of range
/// rather than a float.
fn number_value(raw: &str, ty: &StreamType) -> Result<Value<'static>, String> {
    let (negative, digits) = match raw.strip_prefix('-') {
        Some(digits) => (true, digits),
        None => (false, raw),
    };
    // The common case in one pass: up to 19 digits always fit a u64.
    if digits.len() <= 19 && digits.bytes().all(|b| b.is_ascii_digit()) {
        let magnitude = digits
            .bytes()
            .fold(0u64, |v, b| v * 10 + u64::from(b - b'0'));
        if !negative || magnitude <= 1 << 63 {
            return Ok(integer_value(negative, magnitude));
        }
    }
    if !raw.contains(['.', 'e', 'E']) {
        if let Ok(magnitude) = digits.parse::<u64>() {
            if !negative || magnitude <= 1 << 63 {
                return Ok(integer_value(negative, magnitude));
            }
        }
        if ty.integer_range().is_some() {
            return Err(ty.out_of_range(&raw));
        }
    }
    raw.parse::<f64>()
        .map(Value::Float)
        .map_err(|_| format!("`{raw}` is not a number"))
}

/// The value of an integer literal of `magnitude` (at most 2^63 when `negative`).
fn integer_value(negative: bool, magnitude: u64) -> Value<'static> {
    match (negative, magnitude) {
        (false, v) => Value::Uint(v),
        (true, 0) => Value::Float(-0.0),
        (true, v) => Value::Int((v as i64).wrapping_neg()),
    }
}

/// The cell value of a JSON string `raw` (quotes included) for the scalar type `ty`.
fn string_value<'v>(
    raw: &'v str,
    ty: &StreamType,
    escapes: Escapes,
    scratch: &'v mut Vec<u8>,
) -> Result<Value<'v>, String> {
    let body = raw
        .strip_prefix('"')
        .and_then(|rest| rest.strip_suffix('"'))
        .unwrap_or(raw);
    if escapes == Escapes::None || !body.contains('\\') {
        return Ok(text_scalar(body, ty)?.unwrap_or(Value::Bytes(body.as_bytes())));
    }
    let text: String = serde_json::from_str(raw).map_err(|err| {
        lone_surrogate(raw.as_bytes()).unwrap_or_else(|| format!("not JSON ({err})"))
    })?;
    if let Some(value) = text_scalar(&text, ty)? {
        return Ok(value);
    }
    scratch.clear();
    scratch.extend_from_slice(text.as_bytes());
    Ok(Value::Bytes(scratch))
}

/// The value a text gives a type that reads text (dates, times, IPv4, a float's `nan`/`inf`);
/// `None` for the types that take the text itself (a string, or a type the row then refuses a
/// string for, with its own message).
fn text_scalar(s: &str, ty: &StreamType) -> Result<Option<Value<'static>>, String> {
    Ok(Some(match ty {
        StreamType::Date => Value::Uint(parse_date(s)?),
        StreamType::Datetime => Value::Uint(parse_datetime(s)?),
        StreamType::Date32 => Value::Int(parse_date32(s)?),
        StreamType::Timestamp => Value::Int(parse_timestamp(s)?),
        StreamType::Ipv4 => Value::Uint(
            s.parse::<Ipv4Addr>()
                .map(|ip| u32::from(ip).into())
                .map_err(|_| format!("`{s}` is not an IPv4 address"))?,
        ),
        StreamType::Float | StreamType::Double => Value::Float(match s {
            "nan" | "NaN" => f64::NAN,
            "inf" | "+inf" | "Infinity" => f64::INFINITY,
            "-inf" | "-Infinity" => f64::NEG_INFINITY,
            _ => return Err(format!("`{s}` is not a number")),
        }),
        _ => return Ok(None),
    }))
}

/// Why [`push_json_text`] refused a value.
#[derive(Error, Debug)]
#[non_exhaustive]
pub enum JsonValueError {
    /// Every column of the row has its value already.
    #[error("the row has all its values")]
    RowComplete,
    /// The text is not JSON.
    #[error("not JSON ({source}): {json}")]
    NotJson {
        /// The text.
        json: String,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// The JSON value is not a form of the column's type; the message names the column and its
    /// type.
    #[error("{0}")]
    Column(String),
}

/// Pushes the next column's value from its JSON text, as `jsonl_file` reads the column's key
/// (for sources that hold one value at a time).
pub fn push_json_text(row: &mut RowWriter<'_>, json: &str) -> Result<(), JsonValueError> {
    let Some(column) = row.next_column().cloned() else {
        return Err(JsonValueError::RowComplete);
    };
    let raw: &RawValue = serde_json::from_str(json).map_err(|source| JsonValueError::NotJson {
        json: json.to_owned(),
        source,
    })?;
    let mut scratch = Vec::new();
    let raw = Some(raw.get());
    push_json(
        row,
        &column.name,
        &column.ty,
        raw,
        Escapes::Possible,
        &mut scratch,
    )
    .map_err(JsonValueError::Column)
}

/// Why a record is not a row's JSON object; the display is the whole message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RecordError {
    /// The text is not one JSON object.
    NotObject(String),
    /// A key that is not a column.
    UnknownKey(String),
    /// A key given twice: which value is meant is a guess, so the record is refused.
    DuplicateKey(String),
}

impl std::fmt::Display for RecordError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordError::NotObject(reason) => write!(f, "not a JSON object: {reason}"),
            RecordError::UnknownKey(key) => {
                write!(f, "`{key}`: not a column of the declared schema")
            }
            RecordError::DuplicateKey(key) => write!(
                f,
                "key `{key}` appears more than once in the record: give each column once"
            ),
        }
    }
}

/// The UTF-8 byte order mark some editors and exporters put first: not part of the JSON, so it
/// is skipped as most JSON tools do.
pub(crate) const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Reads records (a JSON object by column name, a leading byte order mark skipped) into rows,
/// for `jsonl_file`, the broker sources and the push source: the one place a record is parsed.
/// Keys are matched against the schema without being copied; values stay JSON text until their
/// column's type reads them (a decimal or a 128-bit integer must not pass through an f64 on the
/// way). The buffers are kept from record to record, so a record allocates nothing unless a
/// string has escapes.
#[derive(Clone, Debug)]
pub(crate) struct RecordDecoder {
    /// Where each column's value lies in the record last read (`None`: the key is missing).
    slots: Vec<Option<Range<usize>>>,
    /// Unescaped strings and packed values, one at a time.
    scratch: Vec<u8>,
    /// Whether the strings of the record last read may hold escapes.
    escapes: Escapes,
}

impl Default for RecordDecoder {
    fn default() -> Self {
        RecordDecoder {
            slots: Vec::new(),
            scratch: Vec::new(),
            escapes: Escapes::Possible,
        }
    }
}

/// Why [`RecordDecoder::push_values`] refused a record: the column's index and what is wrong
/// (naming the column and its type).
pub(crate) struct ValueError {
    pub(crate) column: usize,
    pub(crate) what: String,
}

impl RecordDecoder {
    /// Reads `text` as a record of `schema`: checks it is one JSON object whose keys are
    /// columns, each once, and notes where each value is. Returns the record's text, which
    /// [`RecordDecoder::push_values`] reads the values from.
    pub(crate) fn read<'t>(
        &mut self,
        text: &'t [u8],
        schema: &StreamSchema,
    ) -> Result<&'t str, RecordError> {
        let text = text.strip_prefix(BOM).unwrap_or(text);
        // The one UTF-8 check of the record; the parser's own error says where it fails.
        let Ok(text) = std::str::from_utf8(text) else {
            let err = serde_json::from_slice::<serde::de::IgnoredAny>(text).err();
            return Err(RecordError::NotObject(
                err.map_or_else(|| "not UTF-8".to_owned(), |err| err.to_string()),
            ));
        };
        self.slots.clear();
        self.slots.resize(schema.columns().len(), None);
        if scan_flat(text, schema, &mut self.slots) {
            self.escapes = Escapes::None;
            return Ok(text);
        }
        // Not a flat record (or not one at all): serde_json reads it, or says what is wrong.
        self.escapes = Escapes::Possible;
        self.slots.fill(None);
        self.read_with_serde(text, schema).map(|()| text)
    }

    /// [`RecordDecoder::read`] of any record through serde_json, into slots all `None`.
    fn read_with_serde(&mut self, text: &str, schema: &StreamSchema) -> Result<(), RecordError> {
        let mut problem = None;
        let mut de = serde_json::Deserializer::from_str(text);
        let seed = ObjectSeed {
            schema,
            base: text.as_ptr() as usize,
            slots: &mut self.slots,
            problem: &mut problem,
        };
        let parsed = serde::de::DeserializeSeed::deserialize(seed, &mut de).and_then(|()| de.end());
        parsed.map_err(|err| {
            problem.unwrap_or_else(|| {
                RecordError::NotObject(
                    lone_surrogate(text.as_bytes()).unwrap_or_else(|| err.to_string()),
                )
            })
        })
    }

    /// Pushes the values of the record [`RecordDecoder::read`] last read from `text`, in
    /// schema order (a missing key is null).
    pub(crate) fn push_values(
        &mut self,
        text: &str,
        schema: &StreamSchema,
        row: &mut RowWriter<'_>,
    ) -> Result<(), ValueError> {
        for (index, (column, slot)) in schema.columns().iter().zip(&self.slots).enumerate() {
            let raw = slot.clone().and_then(|range| text.get(range));
            let (name, ty, escapes) = (&column.name, &column.ty, self.escapes);
            push_json(row, name, ty, raw, escapes, &mut self.scratch).map_err(|what| {
                ValueError {
                    column: index,
                    what,
                }
            })?;
        }
        Ok(())
    }
}

/// What is wrong when `text` has a `\uXXXX` escape of a surrogate without its partner (looked
/// for only once the text failed to parse: the parser calls it "unexpected end of hex escape").
fn lone_surrogate(text: &[u8]) -> Option<String> {
    let escape = first_lone_surrogate(text)?;
    Some(format!(
        "`\\u{escape:04x}` is a lone UTF-16 surrogate, which is not a character: write the \
         character itself, or a high surrogate (\\ud800-\\udbff) followed by a low one \
         (\\udc00-\\udfff)"
    ))
}

fn first_lone_surrogate(text: &[u8]) -> Option<u32> {
    let escape_at = |i: usize| -> Option<u32> {
        let hex = text.get(i..i + 6)?;
        if !hex.starts_with(b"\\u") {
            return None;
        }
        u32::from_str_radix(std::str::from_utf8(&hex[2..]).ok()?, 16).ok()
    };
    let mut i = 0;
    while i < text.len() {
        if text[i] != b'\\' {
            i += 1;
            continue;
        }
        match escape_at(i) {
            Some(high @ 0xD800..=0xDBFF) => {
                if matches!(escape_at(i + 6), Some(0xDC00..=0xDFFF)) {
                    i += 12;
                    continue;
                }
                return Some(high);
            }
            Some(low @ 0xDC00..=0xDFFF) => return Some(low),
            Some(_) => i += 6,
            None => i += 2,
        }
    }
    None
}

struct ObjectSeed<'s> {
    schema: &'s StreamSchema,
    /// The address of the record's text, to turn a value's borrowed text into its range.
    base: usize,
    slots: &'s mut [Option<Range<usize>>],
    problem: &'s mut Option<RecordError>,
}

impl<'a> serde::de::DeserializeSeed<'a> for ObjectSeed<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'a>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'a> serde::de::Visitor<'a> for ObjectSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: serde::de::MapAccess<'a>>(self, mut map: A) -> Result<(), A::Error> {
        use serde::de::Error as _;
        let mut expected = 0;
        while let Some(index) = map.next_key_seed(KeySeed {
            schema: self.schema,
            expected,
            problem: self.problem,
        })? {
            expected = index + 1;
            // Borrowed from the record's text (the parser reads a `str`), so its address is
            // inside it.
            let raw: &'a RawValue = map.next_value()?;
            let start = (raw.get().as_ptr() as usize).wrapping_sub(self.base);
            let slot = &mut self.slots[index];
            if slot.is_some() {
                let name = &self.schema.columns()[index].name;
                *self.problem = Some(RecordError::DuplicateKey(name.clone()));
                return Err(A::Error::custom("duplicate key"));
            }
            *slot = Some(start..start + raw.get().len());
        }
        Ok(())
    }
}

/// A key, read as its column's index; an unknown key is the record's problem. The key is only
/// borrowed (an escaped one is unescaped into the parser's scratch), so reading it allocates
/// nothing.
struct KeySeed<'s> {
    schema: &'s StreamSchema,
    /// The column tried first: the one after the previous key's (records usually list their
    /// keys in the schema's order).
    expected: usize,
    problem: &'s mut Option<RecordError>,
}

impl<'de> serde::de::DeserializeSeed<'de> for KeySeed<'_> {
    type Value = usize;
    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<usize, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl serde::de::Visitor<'_> for KeySeed<'_> {
    type Value = usize;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a column name")
    }
    fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<usize, E> {
        let columns = self.schema.columns();
        if columns.get(self.expected).is_some_and(|c| c.name == key) {
            return Ok(self.expected);
        }
        self.schema.index_of(key).ok_or_else(|| {
            *self.problem = Some(RecordError::UnknownKey(key.to_owned()));
            E::custom("unknown key")
        })
    }
}

/// A JSON string's text, or the error for another JSON value.
fn json_text(raw: &str, what: &str) -> Result<String, String> {
    serde_json::from_str::<String>(raw).map_err(|_| {
        lone_surrogate(raw.as_bytes())
            .unwrap_or_else(|| format!("expected {what} as text, got {raw}"))
    })
}

/// The digits of a JSON number or string; exponents are refused (they hide how many digits the
/// value has).
fn number_text(raw: &str, ty: &StreamType) -> Result<String, String> {
    let text = if raw.starts_with('"') {
        json_text(raw, "a number")?
    } else if raw.starts_with(|c: char| c == '-' || c.is_ascii_digit()) {
        raw.to_owned()
    } else {
        return Err(format!("expected {ty}, got {raw}"));
    };
    if text.contains(['e', 'E']) {
        return Err(format!(
            "{text}: write {ty} values without an exponent (digits, a point, digits)"
        ));
    }
    Ok(text)
}

/// Appends the packed form of the JSON value `raw` of type `ty` (an `optional` here is an item's,
/// with its marker byte).
fn pack(ty: &StreamType, raw: &str, out: &mut Vec<u8>) -> Result<(), String> {
    let is_null = raw == "null";
    match ty {
        StreamType::Optional(inner) => {
            if is_null {
                out.push(1);
                return Ok(());
            }
            out.push(0);
            return pack(inner, raw, out);
        }
        _ if is_null => return Err(format!("null where {ty} is expected")),
        _ => {}
    }
    match ty {
        StreamType::Int128 | StreamType::Uint128 | StreamType::Int256 | StreamType::Uint256 => {
            let (bits, signed) = match ty {
                StreamType::Int128 => (128, true),
                StreamType::Uint128 => (128, false),
                StreamType::Int256 => (256, true),
                _ => (256, false),
            };
            let value = WideInt::parse_integer(&number_text(raw, ty)?, bits, signed)?;
            out.extend_from_slice(&value.to_le_bytes()[..(bits / 8) as usize]);
        }
        StreamType::Decimal { precision, scale } => {
            let value = WideInt::parse_decimal(&number_text(raw, ty)?, *precision, *scale)?;
            out.extend_from_slice(&value.to_le_bytes()[..packed::decimal_width(*precision)]);
        }
        StreamType::Uuid => {
            let text = json_text(raw, "a UUID")?;
            let bytes = packed::parse_uuid(&text).ok_or_else(|| {
                format!("`{text}` is not a UUID (expected 8-4-4-4-12 hex digits)")
            })?;
            out.extend_from_slice(&bytes);
        }
        StreamType::Ipv6 => {
            let text = json_text(raw, "an IPv6 address")?;
            let ip = text
                .parse::<Ipv6Addr>()
                .or_else(|_| text.parse::<Ipv4Addr>().map(|v4| v4.to_ipv6_mapped()))
                .map_err(|_| format!("`{text}` is not an IPv6 address"))?;
            out.extend_from_slice(&ip.octets());
        }
        StreamType::List(item) => {
            let items: Vec<&RawValue> = serde_json::from_str(raw)
                .map_err(|_| format!("expected {ty} as an array, got {raw}"))?;
            write_leb128(items.len() as u64, out);
            for item_raw in items {
                pack(item, item_raw.get(), out)?;
            }
        }
        StreamType::Tuple(items) => {
            let values: Vec<&RawValue> = serde_json::from_str(raw)
                .map_err(|_| format!("expected {ty} as an array, got {raw}"))?;
            if values.len() != items.len() {
                return Err(format!(
                    "expected {ty}, an array of {} items, got {}",
                    items.len(),
                    values.len()
                ));
            }
            for (item, value) in items.iter().zip(values) {
                pack(item, value.get(), out)?;
            }
        }
        StreamType::Dict(key, value) => {
            if raw.starts_with('{') {
                let Entries(entries) = serde_json::from_str(raw).map_err(|err| {
                    lone_surrogate(raw.as_bytes())
                        .unwrap_or_else(|| format!("expected {ty}, got a bad object ({err})"))
                })?;
                write_leb128(entries.len() as u64, out);
                for (k, v) in entries {
                    // An object key is text: numeric key types read it as a number.
                    let numeric = match key.inner() {
                        StreamType::Int8
                        | StreamType::Int16
                        | StreamType::Int32
                        | StreamType::Int64
                        | StreamType::Uint8
                        | StreamType::Uint16
                        | StreamType::Uint32
                        | StreamType::Uint64
                        | StreamType::Float
                        | StreamType::Double => true,
                        StreamType::Date
                        | StreamType::Date32
                        | StreamType::Datetime
                        | StreamType::Timestamp
                        | StreamType::Ipv4 => k.parse::<i64>().is_ok(),
                        _ => false,
                    };
                    let key_json = if numeric {
                        k
                    } else {
                        serde_json::Value::String(k).to_string()
                    };
                    pack(key, &key_json, out)?;
                    pack(value, v.get(), out)?;
                }
            } else {
                let pairs: Vec<(&RawValue, &RawValue)> =
                    serde_json::from_str(raw).map_err(|_| {
                        format!("expected {ty} as an object or an array of [key, value], got {raw}")
                    })?;
                write_leb128(pairs.len() as u64, out);
                for (k, v) in pairs {
                    pack(key, k.get(), out)?;
                    pack(value, v.get(), out)?;
                }
            }
        }
        scalar => {
            let mut unescaped = Vec::new();
            let value = scalar_from_text(raw, scalar, Escapes::Possible, &mut unescaped)?;
            // The same checks as a top-level value of the type.
            check_item(scalar, value)?;
            write_scalar(scalar, value, out)?;
        }
    }
    Ok(())
}

/// An object's entries in the order they were written (a `Map` keeps its order, and may repeat a
/// key).
struct Entries<'a>(Vec<(String, &'a RawValue)>);

impl<'de> serde::Deserialize<'de> for Entries<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Entries<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, &'de RawValue>()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

/// Appends a checked cell value of a scalar type in its packed form.
fn write_scalar(ty: &StreamType, value: Value<'_>, out: &mut Vec<u8>) -> Result<(), String> {
    let int = match value {
        Value::Int(v) => i128::from(v),
        Value::Uint(v) => i128::from(v),
        Value::Bool(v) => i128::from(v),
        Value::Float(v) => {
            if let StreamType::Float = ty {
                // An item is packed as its own width, so a float's range is checked here.
                let narrow = v as f32;
                if v.is_finite() && !narrow.is_finite() {
                    return Err(format!("{v:e} is out of range for float"));
                }
                out.extend_from_slice(&narrow.to_le_bytes());
            } else {
                out.extend_from_slice(&v.to_le_bytes());
            }
            return Ok(());
        }
        Value::Bytes(bytes) => {
            write_leb128(bytes.len() as u64, out);
            out.extend_from_slice(bytes);
            return Ok(());
        }
        Value::Null | Value::Packed(_) => return Ok(()),
    };
    let width = packed::fixed_width(ty).unwrap_or(8);
    out.extend_from_slice(&int.to_le_bytes()[..width]);
    Ok(())
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day number (the inverse of [`days_from_civil`]), to check it.
/// Appends `{"<column>":<value>,...}` for `row`, with `columns` naming its values in order.
/// Non-finite floats are written as strings (JSON has none); bytes that are not UTF-8 are
/// replaced with U+FFFD.
pub fn write_row_object(out: &mut Vec<u8>, columns: &[String], row: &Row<'_>) {
    out.push(b'{');
    for (i, (name, value)) in columns.iter().zip(row.values()).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_json_string(out, name.as_bytes());
        out.push(b':');
        write_json_value(out, row.column_type(i), value);
    }
    out.push(b'}');
}

/// Writes a JSON string; bytes that are not UTF-8 are replaced with U+FFFD.
pub fn write_json_string(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(b'"');
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '"' => out.extend_from_slice(b"\\\""),
                '\\' => out.extend_from_slice(b"\\\\"),
                '\n' => out.extend_from_slice(b"\\n"),
                '\r' => out.extend_from_slice(b"\\r"),
                '\t' => out.extend_from_slice(b"\\t"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c => {
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
        if !chunk.invalid().is_empty() {
            out.extend_from_slice("\u{fffd}".as_bytes());
        }
    }
    out.push(b'"');
}

#[cfg(test)]
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

fn parse_date_parts(text: &str) -> Option<i64> {
    let mut parts = text.splitn(3, '-');
    let year: i64 = parts.next()?.parse().ok()?;
    let month: i64 = parts.next()?.parse().ok()?;
    let day: i64 = parts.next()?.parse().ok()?;
    let max_day = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        _ => return None,
    };
    (1..=max_day)
        .contains(&day)
        .then(|| days_from_civil(year, month, day))
}

pub(crate) fn parse_date(text: &str) -> Result<u64, String> {
    let days = parse_date_parts(text)
        .ok_or_else(|| format!("`{text}` is not a date (expected YYYY-MM-DD)"))?;
    u64::try_from(days).map_err(|_| format!("`{text}` is before 1970-01-01"))
}

fn parse_date32(text: &str) -> Result<i64, String> {
    let days = parse_date_parts(text)
        .ok_or_else(|| format!("`{text}` is not a date (expected YYYY-MM-DD)"))?;
    check_date32(days)
        .map(|()| days)
        .map_err(|_| format!("`{text}` is outside date32 (1900-01-01 ..= 2299-12-31)"))
}

/// `HH:MM:SS` as seconds.
fn parse_clock(time: &str) -> Option<i64> {
    let mut hms = time.splitn(3, ':');
    let mut next = |max: i64| -> Option<i64> {
        let part = hms.next()?;
        if part.len() != 2 {
            return None;
        }
        let v: i64 = part.parse().ok()?;
        (0..=max).contains(&v).then_some(v)
    };
    Some(next(23)? * 3600 + next(59)? * 60 + next(59)?)
}

pub(crate) fn parse_datetime(text: &str) -> Result<u64, String> {
    let bad = || format!("`{text}` is not a datetime (expected YYYY-MM-DD HH:MM:SS, UTC)");
    let trimmed = text.strip_suffix('Z').unwrap_or(text);
    let (date, time) = trimmed
        .split_once(' ')
        .or_else(|| trimmed.split_once('T'))
        .ok_or_else(bad)?;
    let days = parse_date_parts(date).ok_or_else(bad)?;
    let seconds = days * 86_400 + parse_clock(time).ok_or_else(bad)?;
    u64::try_from(seconds).map_err(|_| format!("`{text}` is before 1970-01-01"))
}

/// RFC 3339 (`2023-11-14T22:13:20.123456Z`, `... +02:00`) as microseconds since the epoch; the
/// zone is required and at most six fractional digits that are not zeros are kept.
pub(crate) fn parse_timestamp(text: &str) -> Result<i64, String> {
    let bad = || {
        format!(
            "`{text}` is not an RFC 3339 timestamp (expected YYYY-MM-DDTHH:MM:SS[.ffffff] and \
             Z or ±HH:MM)"
        )
    };
    let (date, rest) = text.split_once(['T', 't', ' ']).ok_or_else(bad)?;
    let days = parse_date_parts(date).ok_or_else(bad)?;
    let (clock_and_fraction, offset_seconds) = if let Some(clock) = rest.strip_suffix(['Z', 'z']) {
        (clock, 0)
    } else if let Some(at) = rest.rfind(['+', '-']).filter(|&at| at >= 8) {
        let (clock, zone) = rest.split_at(at);
        let sign = if zone.starts_with('-') { -1 } else { 1 };
        let (h, m) = zone[1..].split_once(':').ok_or_else(bad)?;
        let (Ok(h), Ok(m)) = (h.parse::<i64>(), m.parse::<i64>()) else {
            return Err(bad());
        };
        if h.abs() > 23 || m > 59 || zone.len() != 6 {
            return Err(bad());
        }
        (clock, sign * (h * 3600 + m * 60))
    } else {
        return Err(format!(
            "`{text}` has no time zone: write Z or ±HH:MM after the time (a timestamp \
                 without one is ambiguous)"
        ));
    };
    let (clock, fraction) = match clock_and_fraction.split_once('.') {
        Some((clock, fraction)) => (clock, fraction),
        None => (clock_and_fraction, ""),
    };
    let seconds = parse_clock(clock).ok_or_else(bad)?;
    if !fraction.bytes().all(|b| b.is_ascii_digit())
        || (clock_and_fraction.contains('.') && fraction.is_empty())
    {
        return Err(bad());
    }
    if fraction.len() > 6 && fraction[6..].bytes().any(|b| b != b'0') {
        return Err(format!(
            "`{text}` is finer than a microsecond, which a timestamp cannot hold"
        ));
    }
    let mut micros = 0i64;
    for i in 0..6 {
        let digit = fraction
            .as_bytes()
            .get(i)
            .map_or(0, |b| i64::from(b - b'0'));
        micros = micros * 10 + digit;
    }
    (days * 86_400 + seconds - offset_seconds)
        .checked_mul(1_000_000)
        .and_then(|s| s.checked_add(micros))
        .ok_or_else(|| format!("`{text}` is outside the range of a timestamp"))
}

/// Writes a value of `ty` as JSON: decimals and 64-bit-plus integers of packed types as strings
/// (a JSON reader's doubles would lose digits), `uuid` and IPs as text, `date32` and `timestamp`
/// as numbers, lists and tuples as arrays, dicts with string keys as objects and others as
/// arrays of pairs.
pub fn write_json_value(out: &mut Vec<u8>, ty: &StreamType, value: Value<'_>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Int(v) => {
            let _ = write!(out, "{v}");
        }
        Value::Uint(v) if matches!(ty.inner(), StreamType::Ipv4) => {
            let ip = Ipv4Addr::from(v as u32);
            let _ = write!(out, "\"{ip}\"");
        }
        Value::Uint(v) => {
            let _ = write!(out, "{v}");
        }
        Value::Float(v) => write_float(out, v),
        Value::Bool(v) => out.extend_from_slice(if v { b"true" } else { b"false" }),
        Value::Bytes(bytes) => write_json_string(out, bytes),
        Value::Packed(bytes) => {
            let mut reader = PackedReader::new(bytes);
            if write_packed(out, ty.inner(), &mut reader).is_err() {
                // Checked when the row was written; not reached.
                out.extend_from_slice(b"null");
            }
        }
    }
}

fn write_float(out: &mut Vec<u8>, v: f64) {
    if v.is_finite() {
        let _ = write!(out, "{v}");
    } else {
        // JSON has no NaN or infinity.
        write_json_string(out, v.to_string().as_bytes());
    }
}

/// Text written to a byte buffer through `fmt::Write`.
struct Utf8Out<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for Utf8Out<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

fn write_packed(
    out: &mut Vec<u8>,
    ty: &StreamType,
    reader: &mut PackedReader<'_>,
) -> Result<(), packed::PackedError> {
    match ty {
        StreamType::Optional(inner) => {
            if reader.byte()? == 1 {
                out.extend_from_slice(b"null");
                Ok(())
            } else {
                write_packed(out, inner, reader)
            }
        }
        StreamType::Int8 => write_num(out, i8::from_le_bytes(reader.array()?)),
        StreamType::Int16 => write_num(out, i16::from_le_bytes(reader.array()?)),
        StreamType::Int32 | StreamType::Date32 => {
            write_num(out, i32::from_le_bytes(reader.array()?))
        }
        StreamType::Int64 | StreamType::Timestamp => {
            write_num(out, i64::from_le_bytes(reader.array()?))
        }
        StreamType::Uint8 => write_num(out, reader.byte()?),
        StreamType::Uint16 | StreamType::Date => {
            write_num(out, u16::from_le_bytes(reader.array()?))
        }
        StreamType::Uint32 | StreamType::Datetime => {
            write_num(out, u32::from_le_bytes(reader.array()?))
        }
        StreamType::Uint64 => write_num(out, u64::from_le_bytes(reader.array()?)),
        StreamType::Ipv4 => {
            let ip = Ipv4Addr::from(u32::from_le_bytes(reader.array()?));
            let _ = write!(out, "\"{ip}\"");
            Ok(())
        }
        StreamType::Float => {
            write_float(out, f32::from_le_bytes(reader.array()?).into());
            Ok(())
        }
        StreamType::Double => {
            write_float(out, f64::from_le_bytes(reader.array()?));
            Ok(())
        }
        StreamType::Boolean => {
            out.extend_from_slice(if reader.byte()? == 1 {
                b"true"
            } else {
                b"false"
            });
            Ok(())
        }
        StreamType::String | StreamType::Utf8 => {
            write_json_string(out, reader.string()?);
            Ok(())
        }
        StreamType::Int128 | StreamType::Uint128 | StreamType::Int256 | StreamType::Uint256 => {
            let width = packed::fixed_width(ty).unwrap_or(16);
            let signed = matches!(ty, StreamType::Int128 | StreamType::Int256);
            let value = WideInt::from_le_bytes(reader.take(width)?, signed);
            out.push(b'"');
            value.write_decimal(signed, 0, &mut Utf8Out(out));
            out.push(b'"');
            Ok(())
        }
        StreamType::Decimal { precision, scale } => {
            let value =
                WideInt::from_le_bytes(reader.take(packed::decimal_width(*precision))?, true);
            out.push(b'"');
            value.write_decimal(true, *scale, &mut Utf8Out(out));
            out.push(b'"');
            Ok(())
        }
        StreamType::Uuid => {
            out.push(b'"');
            packed::write_uuid(&reader.array()?, &mut Utf8Out(out));
            out.push(b'"');
            Ok(())
        }
        StreamType::Ipv6 => {
            let ip = Ipv6Addr::from(reader.array::<16>()?);
            let _ = write!(out, "\"{ip}\"");
            Ok(())
        }
        StreamType::List(item) => {
            let count = reader.leb128()?;
            out.push(b'[');
            for i in 0..count {
                if i > 0 {
                    out.push(b',');
                }
                write_packed(out, item, reader)?;
            }
            out.push(b']');
            Ok(())
        }
        StreamType::Tuple(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_packed(out, item, reader)?;
            }
            out.push(b']');
            Ok(())
        }
        StreamType::Dict(key, value) => {
            let count = reader.leb128()?;
            let as_object = matches!(key.as_ref(), StreamType::String | StreamType::Utf8);
            out.push(if as_object { b'{' } else { b'[' });
            for i in 0..count {
                if i > 0 {
                    out.push(b',');
                }
                if as_object {
                    write_packed(out, key, reader)?;
                    out.push(b':');
                    write_packed(out, value, reader)?;
                } else {
                    out.push(b'[');
                    write_packed(out, key, reader)?;
                    out.push(b',');
                    write_packed(out, value, reader)?;
                    out.push(b']');
                }
            }
            out.push(if as_object { b'}' } else { b']' });
            Ok(())
        }
    }
}

fn write_num(out: &mut Vec<u8>, v: impl std::fmt::Display) -> Result<(), packed::PackedError> {
    let _ = write!(out, "{v}");
    Ok(())
}

/// `YYYY-MM-DD` of a day number.
#[cfg(test)]
fn format_days(days: i64) -> String {
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_need_a_zone_and_keep_microseconds() {
        assert_eq!(parse_timestamp("1970-01-01T00:00:00Z"), Ok(0));
        assert_eq!(
            parse_timestamp("2023-11-14T22:13:20.123456Z"),
            Ok(1_700_000_000_123_456)
        );
        assert_eq!(
            parse_timestamp("2023-11-15T00:13:20.5+02:00"),
            Ok(1_700_000_000_500_000)
        );
        assert_eq!(parse_timestamp("1969-12-31T23:59:59-00:00"), Ok(-1_000_000));
        assert_eq!(
            parse_timestamp("2023-11-14T22:13:20.1234560Z"),
            Ok(1_700_000_000_123_456)
        );
        assert_eq!(
            parse_timestamp("2023-11-14T22:13:20"),
            Err(
                "`2023-11-14T22:13:20` has no time zone: write Z or ±HH:MM after the time \
                 (a timestamp without one is ambiguous)"
                    .to_owned()
            )
        );
        assert!(parse_timestamp("2023-11-14T22:13:20.1234567Z")
            .unwrap_err()
            .contains("finer than a microsecond"));
        for bad in [
            "2023-11-14",
            "2023-11-14T25:00:00Z",
            "2023-11-14T22:13:20+2:00",
        ] {
            assert!(parse_timestamp(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn day_numbers_convert_both_ways() {
        for days in [-25_567, -1, 0, 19_000, 120_529] {
            let text = format_days(days);
            assert_eq!(parse_date_parts(&text), Some(days), "{text}");
        }
        assert_eq!(format_days(-25_567), "1900-01-01");
        assert_eq!(format_days(120_529), "2299-12-31");
    }

    fn pushed(ty: &str, json: &str) -> Result<String, String> {
        let schema = crate::types::StreamSchema::new(vec![crate::types::Column::new(
            "c",
            ty.parse().unwrap(),
        )])
        .unwrap();
        let mut batch = crate::message::MessageBatch::new(schema);
        let mut row = batch.start_row(crate::message::MessageId::new(0, 0));
        push_json_text(&mut row, json).map_err(|err| err.to_string())?;
        row.finish().map_err(|err| err.to_string())?;
        let mut out = Vec::new();
        write_row_object(&mut out, &["c".to_owned()], &batch.row(0));
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn integer_literals_beyond_64_bits_are_out_of_range_with_the_range() {
        let cases = [
            (
                "uint64",
                "18446744073709551616",
                "0 to 18446744073709551615",
            ),
            (
                "uint64",
                "-9223372036854775809",
                "0 to 18446744073709551615",
            ),
            ("uint8", "18446744073709551616", "0 to 255"),
            ("uint16", "18446744073709551616", "0 to 65535"),
            ("uint32", "18446744073709551616", "0 to 4294967295"),
            ("int8", "-9223372036854775809", "-128 to 127"),
            ("int16", "18446744073709551616", "-32768 to 32767"),
            (
                "int32",
                "-99999999999999999999",
                "-2147483648 to 2147483647",
            ),
            (
                "int64",
                "18446744073709551616",
                "-9223372036854775808 to 9223372036854775807",
            ),
            (
                "optional<uint64>",
                "18446744073709551616",
                "0 to 18446744073709551615",
            ),
        ];
        for (ty, json, range) in cases {
            let inner = ty.trim_start_matches("optional<").trim_end_matches('>');
            assert_eq!(
                pushed(ty, json),
                Err(format!(
                    "column `c` ({ty}): {json} is out of range for {inner} ({range})"
                )),
                "{ty} {json}"
            );
        }
        // Wider integers give their range in powers of two (the digits run to 78).
        assert_eq!(
            pushed("uint256", "-1"),
            Err("column `c` (uint256): -1 is out of range for uint256 (0 to 2^256-1)".to_owned())
        );
        assert_eq!(
            pushed("int128", "\"-170141183460469231731687303715884105729\""),
            Err(
                "column `c` (int128): -170141183460469231731687303715884105729 is out of range \
                 for int128 (-2^127 to 2^127-1)"
                    .to_owned()
            )
        );
        // A fraction is still a float where an integer is declared.
        assert_eq!(
            pushed("uint64", "1.5"),
            Err("column `c` (uint64): expected uint64, got a floating-point number".to_owned())
        );
    }

    fn schema_of(names: &[&str]) -> std::sync::Arc<StreamSchema> {
        StreamSchema::new(
            names
                .iter()
                .map(|name| crate::types::Column::new(*name, StreamType::Uint64))
                .collect(),
        )
        .unwrap()
    }

    fn record(json: &[u8]) -> Result<Vec<Option<String>>, String> {
        let mut decoder = RecordDecoder::default();
        let text = decoder
            .read(json, &schema_of(&["id", "n"]))
            .map_err(|err| err.to_string())?;
        Ok(decoder
            .slots
            .iter()
            .map(|slot| slot.clone().map(|range| text[range].to_owned()))
            .collect())
    }

    #[test]
    fn a_record_giving_a_key_twice_is_refused_naming_the_key() {
        assert_eq!(
            record(br#"{"id":1,"id":2}"#),
            Err("key `id` appears more than once in the record: give each column once".to_owned())
        );
        // An escaped spelling of the same key is the same key.
        assert_eq!(
            record(br#"{"n":null,"id":1,"\u006e":3}"#),
            Err("key `n` appears more than once in the record: give each column once".to_owned())
        );
        assert_eq!(
            record(br#"{"n":2,"id":1}"#),
            Ok(vec![Some("1".to_owned()), Some("2".to_owned())])
        );
        assert_eq!(
            record(br#"{"id":1,"x":2}"#),
            Err("`x`: not a column of the declared schema".to_owned())
        );
    }

    #[test]
    fn a_lone_surrogate_is_named_as_such() {
        let lone = |escape: &str| {
            format!(
                "`{escape}` is a lone UTF-16 surrogate, which is not a character: write the \
                 character itself, or a high surrogate (\\ud800-\\udbff) followed by a low one \
                 (\\udc00-\\udfff)"
            )
        };
        assert_eq!(
            pushed("utf8", r#""\ud800""#),
            Err(format!("column `c` (utf8): {}", lone("\\ud800")))
        );
        assert_eq!(
            pushed("string", r#""a\\\udc00""#),
            Err(format!("column `c` (string): {}", lone("\\udc00")))
        );
        assert_eq!(
            pushed("list<utf8>", r#"["ok", "\ud800x"]"#),
            Err(format!("column `c` (list<utf8>): {}", lone("\\ud800")))
        );
        // In a key, the record is refused with the same reason.
        assert_eq!(
            record(br#"{"\udbff":1}"#),
            Err(format!("not a JSON object: {}", lone("\\udbff")))
        );
        // A pair is a character.
        assert_eq!(
            pushed("utf8", r#""\ud83d\ude00""#),
            Ok("{\"c\":\"\u{1f600}\"}".to_owned())
        );
    }

    #[test]
    fn a_leading_byte_order_mark_is_skipped() {
        assert_eq!(
            record(b"\xEF\xBB\xBF{\"id\":7}"),
            Ok(vec![Some("7".to_owned()), None])
        );
    }

    #[test]
    fn items_are_checked_like_columns_and_written_back_in_the_same_forms() {
        assert_eq!(
            pushed("list<float>", "[1e300]"),
            Err("column `c` (list<float>): 1e300 is out of range for float".to_owned())
        );
        assert_eq!(
            pushed(
                "dict<uint16,optional<ipv4>>",
                r#"{"7": "1.2.3.4", "65535": null}"#
            ),
            Ok(r#"{"c":[[7,"1.2.3.4"],[65535,null]]}"#.to_owned())
        );
        assert_eq!(
            pushed("dict<uint16,utf8>", r#"{"65536": "x"}"#),
            Err(
                "column `c` (dict<uint16,utf8>): 65536 is out of range for uint16 (0 to 65535)"
                    .to_owned()
            )
        );
        assert_eq!(
            pushed(
                "tuple<decimal(5,2),uuid>",
                r#"[-1, "00000000-0000-0000-0000-00000000000a"]"#
            ),
            Ok(r#"{"c":["-1.00","00000000-0000-0000-0000-00000000000a"]}"#.to_owned())
        );
        assert_eq!(
            pushed("optional<list<optional<int8>>>", "null"),
            Ok(r#"{"c":null}"#.to_owned())
        );
        assert_eq!(
            pushed("list<int8>", r#"{"a": 1}"#),
            Err(
                r#"column `c` (list<int8>): expected list<int8> as an array, got {"a": 1}"#
                    .to_owned()
            )
        );
    }

    fn decimal_text(units: i128, scale: u32) -> String {
        let sign = if units < 0 { "-" } else { "" };
        let magnitude = units.unsigned_abs();
        let unit = 10u128.pow(scale);
        format!(
            "{sign}{}.{:0width$}",
            magnitude / unit,
            magnitude % unit,
            width = scale as usize
        )
    }

    /// The slots of `text` as the one-pass scan notes them (`None`: it left the record to
    /// serde_json) and as serde_json notes them (`Err`: it refused the record).
    type BothReads = (
        Option<Vec<Option<String>>>,
        Result<Vec<Option<String>>, String>,
    );

    fn both_reads(text: &str, schema: &StreamSchema) -> BothReads {
        let texts = |slots: &[Option<Range<usize>>]| -> Vec<Option<String>> {
            let of = |range: &Range<usize>| text[range.clone()].to_owned();
            slots.iter().map(|slot| slot.as_ref().map(of)).collect()
        };
        let mut slots = vec![None; schema.columns().len()];
        let scanned = scan_flat(text, schema, &mut slots).then(|| texts(&slots));
        let mut decoder = RecordDecoder {
            slots: vec![None; schema.columns().len()],
            ..RecordDecoder::default()
        };
        let serde = decoder.read_with_serde(text, schema);
        (
            scanned,
            serde
                .map(|()| texts(&decoder.slots))
                .map_err(|e| e.to_string()),
        )
    }

    #[test]
    fn a_flat_record_is_scanned_in_one_pass_to_the_slots_serde_json_gives() {
        let schema = schema_of(&["id", "n", "s"]);
        for text in [
            r#"{"id":1,"n":-2.5e+3,"s":"ab c"}"#,
            " {\t\"s\" : \"\" , \"id\":0 }\r\n",
            r#"{"n":null,"id":true}"#,
            r#"{}"#,
        ] {
            let (scanned, serde) = both_reads(text, &schema);
            assert!(scanned.is_some(), "{text}");
            assert_eq!(scanned, serde.ok(), "{text}");
        }
        let (scanned, _) = both_reads(r#"{"id":1,"n":-2.5e+3,"s":"ab c"}"#, &schema);
        let slot = |s: &str| Some(s.to_owned());
        assert_eq!(
            scanned,
            Some(vec![slot("1"), slot("-2.5e+3"), slot("\"ab c\"")])
        );
    }

    #[test]
    fn records_beyond_the_flat_form_are_left_to_serde_json() {
        let schema = schema_of(&["id", "n", "s"]);
        for text in [
            r#"{"id":1,"s":"a\"b"}"#,
            r#"{"id":[1]}"#,
            r#"{"id":{"a":1}}"#,
            r#"{"i\u0064":1}"#,
            r#"{"id":1,"id":2}"#,
            r#"{"other":1}"#,
            r#"{"id":01}"#,
            r#"{"id":1.}"#,
            r#"{"id":1,}"#,
            r#"{"id":1} x"#,
            r#"{"id":tru}"#,
            "{\"s\":\"a\u{1}\"}",
            r#"[1]"#,
        ] {
            let (scanned, _) = both_reads(text, &schema);
            assert_eq!(scanned, None, "{text}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// Wherever the one-pass scan reads a record, serde_json reads it too, to the same
        /// slots; records of the flat form and near it, valid or not, are generated from its
        /// grammar.
        #[test]
        fn the_one_pass_scan_reads_no_record_otherwise_than_serde_json(
            text in proptest::string::string_regex(&format!(
                r#"[ \t]?\{{[ ]?({PAIR}([ ]?,[ ]?{PAIR}){{0,3}})?[ ]?\}}[ \n]?"#
            )).expect("a regular expression"),
        ) {
            let schema = schema_of(&["id", "n", "s"]);
            let (scanned, serde) = both_reads(&text, &schema);
            if let Some(scanned) = scanned {
                proptest::prop_assert_eq!(Ok(scanned), serde, "{}", text);
            }
        }
    }

    /// One key and value of a generated record: mostly well-formed, some not.
    const PAIR: &str = r#""(id|n|s|x|i\\u0064)"[ ]?:[ ]?(-?(0|[1-9][0-9]{0,3}|0[0-9])(\.[0-9]{0,2})?([eE][+-]?[0-9]{0,2})?|"[a-z\\" \u{1}é]{0,4}"|true|false|null|tru|\[1\]|\{\})"#;

    proptest::proptest! {
        /// The decoder reads scalars from their text; the oracle is the values the record was
        /// written from (by serde_json, which escapes strings its own way).
        #[test]
        fn scalars_decode_to_the_values_serde_json_wrote(
            u in proptest::num::u64::ANY,
            i in proptest::num::i64::ANY,
            f in proptest::num::f64::NORMAL | proptest::num::f64::SUBNORMAL | proptest::num::f64::ZERO,
            text in "\\PC*|[\"\\\\\\u{0}-\\u{1f}\\u{7f}\\u{fffd}\\u{1f600}a]{0,8}",
            b in proptest::bool::ANY,
        ) {
            let schema = StreamSchema::new(
                [("u", "uint64"), ("i", "int64"), ("f", "double"), ("s", "string"), ("b", "boolean")]
                    .iter()
                    .map(|(name, ty)| crate::types::Column::new(*name, ty.parse().unwrap()))
                    .collect(),
            )
            .unwrap();
            let json = serde_json::json!({"u": u, "i": i, "f": f, "s": text, "b": b}).to_string();
            let mut decoder = RecordDecoder::default();
            let record = decoder.read(json.as_bytes(), &schema).unwrap();
            let mut batch = crate::message::MessageBatch::new(std::sync::Arc::clone(&schema));
            let mut row = batch.start_row(crate::message::MessageId::new(0, 0));
            decoder.push_values(record, &schema, &mut row).map_err(|err| err.what).unwrap();
            row.finish().unwrap();
            let values: Vec<Value<'_>> = batch.row(0).values().collect();
            proptest::prop_assert_eq!(values[0], Value::Uint(u));
            proptest::prop_assert_eq!(values[1], Value::Int(i));
            match values[2] {
                Value::Float(read) => proptest::prop_assert_eq!(read.to_bits(), f.to_bits()),
                other => proptest::prop_assert!(false, "{other:?} for {f}"),
            }
            proptest::prop_assert_eq!(values[3], Value::Bytes(text.as_bytes()));
            proptest::prop_assert_eq!(values[4], Value::Bool(b));
        }

        #[test]
        fn json_forms_of_wide_and_nested_values_round_trip_exactly(
            units in proptest::collection::vec(
                proptest::option::of(-(10i128.pow(38) - 1)..10i128.pow(38)),
                0..5,
            ),
            wide in proptest::num::i128::ANY,
            pairs in proptest::collection::vec(("[a-z\"\\\\]{0,4}", proptest::num::u64::ANY), 0..4),
        ) {
            let items: Vec<String> = units
                .iter()
                .map(|u| u.map_or("null".to_owned(), |u| format!("\"{}\"", decimal_text(u, 10))))
                .collect();
            let json = format!("[{}]", items.join(","));
            proptest::prop_assert_eq!(
                pushed("list<optional<decimal(38,10)>>", &json),
                Ok(format!("{{\"c\":{json}}}"))
            );
            let json = format!("\"{wide}\"");
            proptest::prop_assert_eq!(pushed("int128", &json), Ok(format!("{{\"c\":{json}}}")));
            let object: Vec<String> = pairs
                .iter()
                .map(|(k, v)| format!("{}:{v}", serde_json::Value::String(k.clone())))
                .collect();
            let json = format!("{{{}}}", object.join(","));
            proptest::prop_assert_eq!(
                pushed("dict<utf8,uint64>", &json),
                Ok(format!("{{\"c\":{json}}}"))
            );
        }
    }
}

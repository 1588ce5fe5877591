//! Stream types and schemas, named after the yson types of the reference (`int8` .. `uint64`,
//! `float`, `double`, `string`, `utf8`, `boolean`, `date`, `datetime`, `date32`, `timestamp`,
//! `decimal(P,S)`, `uuid`, `optional<T>`, `list<T>`, `dict<K,V>`, `tuple<T1,...>`), plus the
//! ClickHouse value types yson has no name for (`int128` .. `uint256`, `ipv4`, `ipv6`).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

use crate::type_expr::TypeExprCursor;

/// A stream type or schema that cannot be used.
#[derive(Error, Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemaError {
    /// A type name this crate does not know.
    #[error("unknown stream type `{text}`")]
    UnknownType {
        /// The text as given.
        text: String,
    },
    /// A column's name is empty.
    #[error("a column has an empty name")]
    EmptyColumnName,
    /// Two columns have the same name.
    #[error("column `{name}` is declared twice")]
    DuplicateColumn {
        /// The name.
        name: String,
    },
}

/// The type of one stream column.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum StreamType {
    /// Signed 8-bit integer.
    Int8,
    /// Signed 16-bit integer.
    Int16,
    /// Signed 32-bit integer.
    Int32,
    /// Signed 64-bit integer.
    Int64,
    /// Unsigned 8-bit integer.
    Uint8,
    /// Unsigned 16-bit integer.
    Uint16,
    /// Unsigned 32-bit integer.
    Uint32,
    /// Unsigned 64-bit integer.
    Uint64,
    /// Signed 128-bit integer.
    Int128,
    /// Unsigned 128-bit integer.
    Uint128,
    /// Signed 256-bit integer.
    Int256,
    /// Unsigned 256-bit integer.
    Uint256,
    /// 32-bit IEEE float.
    Float,
    /// 64-bit IEEE float.
    Double,
    /// Arbitrary bytes.
    String,
    /// Bytes that must be valid UTF-8.
    Utf8,
    /// `true` or `false`.
    Boolean,
    /// Days since 1970-01-01, `0..=65535` (the range ClickHouse's `Date` can hold).
    Date,
    /// Seconds since the Unix epoch, `0..=4294967295`.
    Datetime,
    /// Days since 1970-01-01 as a signed 32-bit number (before the epoch too).
    Date32,
    /// Microseconds since the Unix epoch, signed 64-bit (the yson `timestamp`).
    Timestamp,
    /// A fixed-point number of `precision` significant digits (1..=76), `scale` of them after
    /// the point (0..=precision).
    Decimal {
        /// Significant digits, 1..=[`MAX_DECIMAL_PRECISION`].
        precision: u8,
        /// Digits after the point, 0..=precision.
        scale: u8,
    },
    /// A 128-bit UUID.
    Uuid,
    /// An IPv4 address, carried as its 32-bit number.
    Ipv4,
    /// An IPv6 address (16 bytes).
    Ipv6,
    /// `optional<T>`: a `T` or null.
    Optional(Box<StreamType>),
    /// `list<T>`: any number of `T`.
    List(Box<StreamType>),
    /// `dict<K,V>`: key-value pairs.
    Dict(Box<StreamType>, Box<StreamType>),
    /// `tuple<T1,...>`: a fixed sequence of typed items.
    Tuple(Vec<StreamType>),
}

/// The most digits a `decimal(P,S)` can have: what ClickHouse's `Decimal256` holds.
pub const MAX_DECIMAL_PRECISION: u8 = 76;

impl StreamType {
    /// The type without its `optional<>` wrapper.
    pub fn inner(&self) -> &StreamType {
        match self {
            StreamType::Optional(inner) => inner.inner(),
            other => other,
        }
    }

    /// Whether the type is `optional<T>`.
    pub fn is_optional(&self) -> bool {
        matches!(self, StreamType::Optional(_))
    }

    /// Whether a value of this type (under its `optional`) travels as [`crate::Value::Packed`]:
    /// the types whose values do not fit one 64-bit cell.
    pub fn is_packed(&self) -> bool {
        matches!(
            self.inner(),
            StreamType::Int128
                | StreamType::Uint128
                | StreamType::Int256
                | StreamType::Uint256
                | StreamType::Decimal { .. }
                | StreamType::Uuid
                | StreamType::Ipv6
                | StreamType::List(_)
                | StreamType::Dict(..)
                | StreamType::Tuple(_)
        )
    }

    /// Inclusive integer range of a type carried as a 64-bit integer, as `i128` so that both
    /// signed and unsigned fit.
    pub fn integer_range(&self) -> Option<(i128, i128)> {
        Some(match self.inner() {
            StreamType::Int8 => (i8::MIN.into(), i8::MAX.into()),
            StreamType::Int16 => (i16::MIN.into(), i16::MAX.into()),
            StreamType::Int32 | StreamType::Date32 => (i32::MIN.into(), i32::MAX.into()),
            StreamType::Int64 | StreamType::Timestamp => (i64::MIN.into(), i64::MAX.into()),
            StreamType::Uint8 => (0, u8::MAX.into()),
            StreamType::Uint16 => (0, u16::MAX.into()),
            StreamType::Uint32 | StreamType::Datetime | StreamType::Ipv4 => (0, u32::MAX.into()),
            StreamType::Uint64 => (0, u64::MAX.into()),
            StreamType::Date => (0, u16::MAX.into()),
            _ => return None,
        })
    }

    /// Why `value` does not fit the type (under its `optional`), with the range where the type
    /// is an integer carried in 64 bits: the one wording of every out-of-range value.
    pub(crate) fn out_of_range(&self, value: &dyn fmt::Display) -> String {
        let inner = self.inner();
        match inner.integer_range() {
            Some((min, max)) => format!("{value} is out of range for {inner} ({min} to {max})"),
            None => format!("{value} is out of range for {inner}"),
        }
    }

    /// Whether the type (under its `optional`) is a signed integer: `int8`..`int64`, `date32`,
    /// `timestamp`.
    pub fn is_signed_integer(&self) -> bool {
        matches!(
            self.inner(),
            StreamType::Int8
                | StreamType::Int16
                | StreamType::Int32
                | StreamType::Int64
                | StreamType::Date32
                | StreamType::Timestamp
        )
    }
}

impl fmt::Display for StreamType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            StreamType::Int8 => "int8",
            StreamType::Int16 => "int16",
            StreamType::Int32 => "int32",
            StreamType::Int64 => "int64",
            StreamType::Uint8 => "uint8",
            StreamType::Uint16 => "uint16",
            StreamType::Uint32 => "uint32",
            StreamType::Uint64 => "uint64",
            StreamType::Int128 => "int128",
            StreamType::Uint128 => "uint128",
            StreamType::Int256 => "int256",
            StreamType::Uint256 => "uint256",
            StreamType::Float => "float",
            StreamType::Double => "double",
            StreamType::String => "string",
            StreamType::Utf8 => "utf8",
            StreamType::Boolean => "boolean",
            StreamType::Date => "date",
            StreamType::Datetime => "datetime",
            StreamType::Date32 => "date32",
            StreamType::Timestamp => "timestamp",
            StreamType::Uuid => "uuid",
            StreamType::Ipv4 => "ipv4",
            StreamType::Ipv6 => "ipv6",
            StreamType::Decimal { precision, scale } => {
                return write!(f, "decimal({precision},{scale})")
            }
            StreamType::Optional(inner) => return write!(f, "optional<{inner}>"),
            StreamType::List(inner) => return write!(f, "list<{inner}>"),
            StreamType::Dict(key, value) => return write!(f, "dict<{key},{value}>"),
            StreamType::Tuple(items) => {
                f.write_str("tuple<")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{item}")?;
                }
                return f.write_str(">");
            }
        };
        f.write_str(name)
    }
}

impl FromStr for StreamType {
    type Err = SchemaError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let unknown = || SchemaError::UnknownType {
            text: text.to_owned(),
        };
        let mut parser = TypeParser {
            lex: TypeExprCursor::new(text),
        };
        let ty = parser.parse_type().ok_or_else(unknown)?;
        if !parser.lex.is_done() {
            return Err(unknown());
        }
        Ok(ty)
    }
}

/// Recursive descent over a type text such as `dict<utf8,list<optional<decimal(18,4)>>>`.
struct TypeParser<'a> {
    lex: TypeExprCursor<'a>,
}

impl<'a> TypeParser<'a> {
    fn boxed(&mut self) -> Option<Box<StreamType>> {
        Some(Box::new(self.parse_type()?))
    }

    fn parse_type(&mut self) -> Option<StreamType> {
        let word = self.lex.word();
        Some(match word {
            "int8" => StreamType::Int8,
            "int16" => StreamType::Int16,
            "int32" => StreamType::Int32,
            "int64" => StreamType::Int64,
            "uint8" => StreamType::Uint8,
            "uint16" => StreamType::Uint16,
            "uint32" => StreamType::Uint32,
            "uint64" => StreamType::Uint64,
            "int128" => StreamType::Int128,
            "uint128" => StreamType::Uint128,
            "int256" => StreamType::Int256,
            "uint256" => StreamType::Uint256,
            "float" => StreamType::Float,
            "double" => StreamType::Double,
            "string" => StreamType::String,
            "utf8" => StreamType::Utf8,
            "boolean" | "bool" => StreamType::Boolean,
            "date" => StreamType::Date,
            "datetime" => StreamType::Datetime,
            "date32" => StreamType::Date32,
            "timestamp" => StreamType::Timestamp,
            "uuid" => StreamType::Uuid,
            "ipv4" => StreamType::Ipv4,
            "ipv6" => StreamType::Ipv6,
            "decimal" => {
                if !self.lex.eat('(') {
                    return None;
                }
                let precision = self.lex.number::<u8>()?;
                if !self.lex.eat(',') {
                    return None;
                }
                let scale = self.lex.number::<u8>()?;
                if !self.lex.eat(')') {
                    return None;
                }
                let valid = (1..=MAX_DECIMAL_PRECISION).contains(&precision) && scale <= precision;
                return valid.then_some(StreamType::Decimal { precision, scale });
            }
            "optional" | "list" | "dict" | "tuple" => {
                if !self.lex.eat('<') {
                    return None;
                }
                let ty = match word {
                    "optional" => StreamType::Optional(self.boxed()?),
                    "list" => StreamType::List(self.boxed()?),
                    "dict" => {
                        let key = self.boxed()?;
                        if !self.lex.eat(',') {
                            return None;
                        }
                        StreamType::Dict(key, self.boxed()?)
                    }
                    _ => {
                        let mut items = vec![self.parse_type()?];
                        while self.lex.eat(',') {
                            items.push(self.parse_type()?);
                        }
                        StreamType::Tuple(items)
                    }
                };
                if !self.lex.eat('>') {
                    return None;
                }
                ty
            }
            _ => return None,
        })
    }
}

impl Serialize for StreamType {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for StreamType {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// One named, typed column of a stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Column {
    /// The column's name, unique within its stream.
    pub name: String,
    /// The column's type (`type:` in a spec).
    #[serde(rename = "type")]
    pub ty: StreamType,
}

impl Column {
    /// A column named `name` of type `ty`.
    pub fn new(name: impl Into<String>, ty: StreamType) -> Self {
        Column {
            name: name.into(),
            ty,
        }
    }
}

/// The ordered columns of a stream. Shared behind an `Arc` by every batch of the stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamSchema {
    columns: Vec<Column>,
}

impl StreamSchema {
    /// Builds a schema; column names must be unique and non-empty.
    pub fn new(columns: Vec<Column>) -> Result<Arc<Self>, SchemaError> {
        let mut seen = std::collections::HashSet::new();
        for column in &columns {
            if column.name.is_empty() {
                return Err(SchemaError::EmptyColumnName);
            }
            if !seen.insert(column.name.as_str()) {
                return Err(SchemaError::DuplicateColumn {
                    name: column.name.clone(),
                });
            }
        }
        Ok(Arc::new(StreamSchema { columns }))
    }

    /// For column lists written in code, known to be unique and non-empty.
    pub(crate) fn trusted(columns: Vec<Column>) -> Arc<Self> {
        debug_assert!(StreamSchema::new(columns.clone()).is_ok());
        Arc::new(StreamSchema { columns })
    }

    /// The columns, in order.
    pub fn columns(&self) -> &[Column] {
        &self.columns
    }

    /// How many columns there are.
    pub fn len(&self) -> usize {
        self.columns.len()
    }

    /// Whether there are no columns.
    pub fn is_empty(&self) -> bool {
        self.columns.is_empty()
    }

    /// The position of the column named `name`, if there is one.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_name_round_trips_through_display_and_parse() {
        for name in [
            "int8",
            "int16",
            "int32",
            "int64",
            "uint8",
            "uint16",
            "uint32",
            "uint64",
            "float",
            "double",
            "string",
            "utf8",
            "boolean",
            "date",
            "datetime",
            "optional<uint64>",
            "optional<optional<utf8>>",
            "int128",
            "uint128",
            "int256",
            "uint256",
            "date32",
            "timestamp",
            "uuid",
            "ipv4",
            "ipv6",
            "decimal(18,4)",
            "decimal(76,0)",
            "list<optional<decimal(18,4)>>",
            "dict<string,list<uint32>>",
            "tuple<int8,utf8,list<tuple<uuid,ipv6>>>",
        ] {
            let ty: StreamType = name.parse().unwrap();
            assert_eq!(ty.to_string(), name);
        }
        assert_eq!(
            " dict< utf8 , list<uint32> > "
                .parse::<StreamType>()
                .unwrap(),
            StreamType::Dict(
                Box::new(StreamType::Utf8),
                Box::new(StreamType::List(Box::new(StreamType::Uint32)))
            )
        );
    }

    #[test]
    fn unknown_type_is_rejected_with_its_text() {
        let err = "uint512".parse::<StreamType>().unwrap_err();
        assert_eq!(err.to_string(), "unknown stream type `uint512`");
        for text in [
            "optional<int8",
            "decimal(0,0)",
            "decimal(77,2)",
            "decimal(4,5)",
            "decimal(4)",
            "dict<utf8>",
            "tuple<>",
            "list<int8>>",
            "list<int8> x",
        ] {
            assert!(text.parse::<StreamType>().is_err(), "{text}");
        }
    }

    #[test]
    fn duplicate_column_names_are_rejected() {
        let err = StreamSchema::new(vec![
            Column::new("a", StreamType::Int8),
            Column::new("a", StreamType::Int16),
        ])
        .unwrap_err();
        assert_eq!(err.to_string(), "column `a` is declared twice");
    }
}

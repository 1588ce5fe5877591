//! Stream types and schemas, mirroring the yson types of the reference (`int8` .. `uint64`, `float`,
//! `double`, `string`, `utf8`, `boolean`, `date`, `datetime`, `optional<T>`).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

/// A stream type or schema that cannot be used.
#[derive(Error, Debug, Clone, PartialEq, Eq)]
pub enum SchemaError {
    #[error("unknown stream type `{text}`")]
    UnknownType { text: String },
    #[error("a column has an empty name")]
    EmptyColumnName,
    #[error("column `{name}` is declared twice")]
    DuplicateColumn { name: String },
}

/// The type of one stream column.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum StreamType {
    Int8,
    Int16,
    Int32,
    Int64,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    /// 32-bit IEEE float.
    Float,
    /// 64-bit IEEE float.
    Double,
    /// Arbitrary bytes.
    String,
    /// Bytes that must be valid UTF-8.
    Utf8,
    Boolean,
    /// Days since 1970-01-01, `0..=65535` (the range ClickHouse's `Date` can hold).
    Date,
    /// Seconds since the Unix epoch, `0..=4294967295`.
    Datetime,
    Optional(Box<StreamType>),
}

impl StreamType {
    /// The type without its `optional<>` wrapper.
    pub fn inner(&self) -> &StreamType {
        match self {
            StreamType::Optional(inner) => inner.inner(),
            other => other,
        }
    }

    pub fn is_optional(&self) -> bool {
        matches!(self, StreamType::Optional(_))
    }

    /// Inclusive integer range of an integral type, as `i128` so that both signed and unsigned fit.
    pub fn integer_range(&self) -> Option<(i128, i128)> {
        Some(match self.inner() {
            StreamType::Int8 => (i8::MIN.into(), i8::MAX.into()),
            StreamType::Int16 => (i16::MIN.into(), i16::MAX.into()),
            StreamType::Int32 => (i32::MIN.into(), i32::MAX.into()),
            StreamType::Int64 => (i64::MIN.into(), i64::MAX.into()),
            StreamType::Uint8 => (0, u8::MAX.into()),
            StreamType::Uint16 => (0, u16::MAX.into()),
            StreamType::Uint32 | StreamType::Datetime => (0, u32::MAX.into()),
            StreamType::Uint64 => (0, u64::MAX.into()),
            StreamType::Date => (0, u16::MAX.into()),
            _ => return None,
        })
    }

    pub fn is_signed_integer(&self) -> bool {
        matches!(
            self.inner(),
            StreamType::Int8 | StreamType::Int16 | StreamType::Int32 | StreamType::Int64
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
            StreamType::Float => "float",
            StreamType::Double => "double",
            StreamType::String => "string",
            StreamType::Utf8 => "utf8",
            StreamType::Boolean => "boolean",
            StreamType::Date => "date",
            StreamType::Datetime => "datetime",
            StreamType::Optional(inner) => return write!(f, "optional<{inner}>"),
        };
        f.write_str(name)
    }
}

impl FromStr for StreamType {
    type Err = SchemaError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let trimmed = text.trim();
        if let Some(rest) = trimmed.strip_prefix("optional<") {
            let inner = rest
                .strip_suffix('>')
                .ok_or_else(|| SchemaError::UnknownType {
                    text: text.to_owned(),
                })?;
            return Ok(StreamType::Optional(Box::new(inner.parse()?)));
        }
        Ok(match trimmed {
            "int8" => StreamType::Int8,
            "int16" => StreamType::Int16,
            "int32" => StreamType::Int32,
            "int64" => StreamType::Int64,
            "uint8" => StreamType::Uint8,
            "uint16" => StreamType::Uint16,
            "uint32" => StreamType::Uint32,
            "uint64" => StreamType::Uint64,
            "float" => StreamType::Float,
            "double" => StreamType::Double,
            "string" => StreamType::String,
            "utf8" => StreamType::Utf8,
            "boolean" | "bool" => StreamType::Boolean,
            "date" => StreamType::Date,
            "datetime" => StreamType::Datetime,
            _ => {
                return Err(SchemaError::UnknownType {
                    text: text.to_owned(),
                })
            }
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
    pub name: String,
    #[serde(rename = "type")]
    pub ty: StreamType,
}

impl Column {
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

    pub fn columns(&self) -> &[Column] {
        &self.columns
    }

    pub fn len(&self) -> usize {
        self.columns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.columns.is_empty()
    }

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
        ] {
            let ty: StreamType = name.parse().unwrap();
            assert_eq!(ty.to_string(), name);
        }
    }

    #[test]
    fn unknown_type_is_rejected_with_its_text() {
        let err = "uint128".parse::<StreamType>().unwrap_err();
        assert_eq!(err.to_string(), "unknown stream type `uint128`");
        assert!("optional<int8".parse::<StreamType>().is_err());
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

//! ClickHouse column types as `system.columns.type` prints them, and the check that a stream
//! column may be written to a table column (the "Type mapping" table of the reference).

use std::fmt;

use flow_core::StreamType;

/// A ClickHouse column type as `system.columns.type` prints it.
///
/// Only the types the sink can write are modelled; everything else is kept verbatim as
/// [`ChType::Unsupported`]. `LowCardinality` is modelled only around the string types
/// (`String`, `FixedString(N)`, and their `Nullable`), the one use the reference maps;
/// `LowCardinality(UInt32)` and the like are `Unsupported`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChType {
    Int8,
    Int16,
    Int32,
    Int64,
    UInt8,
    UInt16,
    UInt32,
    UInt64,
    Float32,
    Float64,
    String,
    FixedString(usize),
    LowCardinality(Box<ChType>),
    Bool,
    Date,
    /// `DateTime` with or without a time zone argument. The zone only changes how ClickHouse
    /// prints the value, never the stored seconds, so it is not kept.
    DateTime,
    Nullable(Box<ChType>),
    /// Any other type, with the text it was parsed from.
    Unsupported(String),
}

impl ChType {
    /// Parses e.g. "Nullable(FixedString(16))", "LowCardinality(String)",
    /// "LowCardinality(Nullable(String))", "DateTime('UTC')", "DateTime", "Bool". Anything else
    /// (Decimal(9,2), DateTime64(3), Enum8(...), UUID, IPv4, Array(...), Tuple, Map, ..., and
    /// wrappers ClickHouse itself rejects such as `Nullable(Nullable(T))`) is
    /// `Unsupported(original text)`, including a supported wrapper around an unsupported type:
    /// `Nullable(Decimal(9,2))` is `Unsupported("Nullable(Decimal(9,2))")`. Never fails.
    pub fn parse(text: &str) -> ChType {
        parse_supported(text).unwrap_or_else(|| ChType::Unsupported(text.to_owned()))
    }

    /// Whether the column accepts NULL: `Nullable(T)` or `LowCardinality(Nullable(T))`.
    pub fn is_nullable(&self) -> bool {
        match self {
            ChType::Nullable(_) => true,
            ChType::LowCardinality(inner) => inner.is_nullable(),
            _ => false,
        }
    }

    /// The scalar type under the `Nullable` / `LowCardinality` wrappers, if the whole type is one
    /// the sink supports (`None` for `Unsupported` anywhere or an invalid wrapping).
    pub fn supported_scalar(&self) -> Option<&ChType> {
        match self {
            ChType::Nullable(inner) if inner.is_scalar() => Some(inner),
            ChType::LowCardinality(inner) => match inner.as_ref() {
                ChType::String | ChType::FixedString(_) => Some(inner),
                ChType::Nullable(scalar)
                    if matches!(scalar.as_ref(), ChType::String | ChType::FixedString(_)) =>
                {
                    Some(scalar)
                }
                _ => None,
            },
            scalar if scalar.is_scalar() => Some(scalar),
            _ => None,
        }
    }

    fn is_scalar(&self) -> bool {
        !matches!(
            self,
            ChType::Nullable(_) | ChType::LowCardinality(_) | ChType::Unsupported(_)
        )
    }
}

/// `Some` only when the whole text is a supported type.
fn parse_supported(text: &str) -> Option<ChType> {
    let text = text.trim();
    if let Some((name, args)) = split_call(text) {
        return match name {
            "Nullable" => {
                let inner = parse_supported(args)?;
                inner.is_scalar().then(|| ChType::Nullable(Box::new(inner)))
            }
            "LowCardinality" => {
                let ty = ChType::LowCardinality(Box::new(parse_supported(args)?));
                ty.supported_scalar().is_some().then_some(ty)
            }
            "FixedString" => {
                let digits = args.trim();
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                let n: usize = digits.parse().ok()?;
                (n > 0).then_some(ChType::FixedString(n))
            }
            "DateTime" => {
                let zone = args.trim();
                let quoted = zone.len() >= 2
                    && zone.starts_with('\'')
                    && zone.ends_with('\'')
                    && !zone[1..zone.len() - 1].contains('\'');
                quoted.then_some(ChType::DateTime)
            }
            _ => None,
        };
    }
    Some(match text {
        "Int8" => ChType::Int8,
        "Int16" => ChType::Int16,
        "Int32" => ChType::Int32,
        "Int64" => ChType::Int64,
        "UInt8" => ChType::UInt8,
        "UInt16" => ChType::UInt16,
        "UInt32" => ChType::UInt32,
        "UInt64" => ChType::UInt64,
        "Float32" => ChType::Float32,
        "Float64" => ChType::Float64,
        "String" => ChType::String,
        "Bool" => ChType::Bool,
        "Date" => ChType::Date,
        "DateTime" => ChType::DateTime,
        _ => return None,
    })
}

/// Splits `Name(args)` into `("Name", "args")`; the closing parenthesis must end the text.
fn split_call(text: &str) -> Option<(&str, &str)> {
    let open = text.find('(')?;
    let args = text[open + 1..].strip_suffix(')')?;
    Some((text[..open].trim_end(), args))
}

impl fmt::Display for ChType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            ChType::Int8 => "Int8",
            ChType::Int16 => "Int16",
            ChType::Int32 => "Int32",
            ChType::Int64 => "Int64",
            ChType::UInt8 => "UInt8",
            ChType::UInt16 => "UInt16",
            ChType::UInt32 => "UInt32",
            ChType::UInt64 => "UInt64",
            ChType::Float32 => "Float32",
            ChType::Float64 => "Float64",
            ChType::String => "String",
            ChType::Bool => "Bool",
            ChType::Date => "Date",
            ChType::DateTime => "DateTime",
            ChType::FixedString(n) => return write!(f, "FixedString({n})"),
            ChType::LowCardinality(inner) => return write!(f, "LowCardinality({inner})"),
            ChType::Nullable(inner) => return write!(f, "Nullable({inner})"),
            ChType::Unsupported(text) => text,
        };
        f.write_str(name)
    }
}

/// Checks that a stream column can be written to a table column, per the reference table:
/// Int8..UInt64 ↔ int8..uint64 exactly; Float32 ↔ float; Float64 ↔ double; String /
/// FixedString(N) / LowCardinality(String) ↔ string or utf8; Bool ↔ boolean; Date ↔ date;
/// DateTime ↔ datetime; Nullable(T) ↔ optional<T'> where T ↔ T', and also a non-optional T' into
/// Nullable(T) (never null) and an optional<T'> into a non-Nullable T (allowed; a null is then
/// rejected per message at write time). Unsupported types never match.
///
/// The error explains the fix, e.g. "column `user_id`: the stream has uint32 but the table has
/// UInt64; declare the stream column as uint64 or change the table column to UInt32".
pub fn check_mapping(column: &str, stream: &StreamType, table: &ChType) -> Result<(), String> {
    let Some(scalar) = table.supported_scalar() else {
        return Err(format!(
            "column `{column}`: the table type {table} is not supported by the ClickHouse sink; \
             drop the column from the stream (the table then fills in its DEFAULT) or change the \
             table column to a supported type"
        ));
    };
    let wanted = stream.inner();
    if scalar_matches(wanted, scalar) {
        return Ok(());
    }
    let stream_fix = stream_spelling(scalar, stream.is_optional());
    let table_fix = table_spelling(wanted);
    let table_fix = if table.is_nullable() {
        format!("Nullable({table_fix})")
    } else {
        table_fix.to_owned()
    };
    Err(format!(
        "column `{column}`: the stream has {stream} but the table has {table}; declare the \
         stream column as {stream_fix} or change the table column to {table_fix}"
    ))
}

fn scalar_matches(stream: &StreamType, table: &ChType) -> bool {
    matches!(
        (stream, table),
        (StreamType::Int8, ChType::Int8)
            | (StreamType::Int16, ChType::Int16)
            | (StreamType::Int32, ChType::Int32)
            | (StreamType::Int64, ChType::Int64)
            | (StreamType::Uint8, ChType::UInt8)
            | (StreamType::Uint16, ChType::UInt16)
            | (StreamType::Uint32, ChType::UInt32)
            | (StreamType::Uint64, ChType::UInt64)
            | (StreamType::Float, ChType::Float32)
            | (StreamType::Double, ChType::Float64)
            | (
                StreamType::String | StreamType::Utf8,
                ChType::String | ChType::FixedString(_)
            )
            | (StreamType::Boolean, ChType::Bool)
            // Servers before 21.12 have no Bool; UInt8 is how a boolean is stored there.
            | (StreamType::Boolean, ChType::UInt8)
            | (StreamType::Date, ChType::Date)
            | (StreamType::Datetime, ChType::DateTime)
    )
}

/// The stream type(s) that can be written to the table scalar `table`.
fn stream_spelling(table: &ChType, optional: bool) -> String {
    let names: &[&str] = match table {
        ChType::Int8 => &["int8"],
        ChType::Int16 => &["int16"],
        ChType::Int32 => &["int32"],
        ChType::Int64 => &["int64"],
        ChType::UInt8 => &["uint8"],
        ChType::UInt16 => &["uint16"],
        ChType::UInt32 => &["uint32"],
        ChType::UInt64 => &["uint64"],
        ChType::Float32 => &["float"],
        ChType::Float64 => &["double"],
        ChType::String | ChType::FixedString(_) => &["string", "utf8"],
        ChType::Bool => &["boolean"],
        ChType::Date => &["date"],
        ChType::DateTime => &["datetime"],
        // Not reached: only supported scalars get here.
        ChType::LowCardinality(_) | ChType::Nullable(_) | ChType::Unsupported(_) => &[],
    };
    names
        .iter()
        .map(|name| {
            if optional {
                format!("optional<{name}>")
            } else {
                (*name).to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(" or ")
}

/// The table scalar a stream scalar maps to.
fn table_spelling(stream: &StreamType) -> &'static str {
    match stream {
        StreamType::Int8 => "Int8",
        StreamType::Int16 => "Int16",
        StreamType::Int32 => "Int32",
        StreamType::Int64 => "Int64",
        StreamType::Uint8 => "UInt8",
        StreamType::Uint16 => "UInt16",
        StreamType::Uint32 => "UInt32",
        StreamType::Uint64 => "UInt64",
        StreamType::Float => "Float32",
        StreamType::Double => "Float64",
        StreamType::String | StreamType::Utf8 => "String",
        StreamType::Boolean => "Bool",
        StreamType::Date => "Date",
        StreamType::Datetime => "DateTime",
        // `inner()` strips every optional, so this is not reached.
        StreamType::Optional(inner) => table_spelling(inner),
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn parse_plain_types_and_display_round_trips() {
        let cases = [
            ("Int8", ChType::Int8),
            ("Int16", ChType::Int16),
            ("Int32", ChType::Int32),
            ("Int64", ChType::Int64),
            ("UInt8", ChType::UInt8),
            ("UInt16", ChType::UInt16),
            ("UInt32", ChType::UInt32),
            ("UInt64", ChType::UInt64),
            ("Float32", ChType::Float32),
            ("Float64", ChType::Float64),
            ("String", ChType::String),
            ("FixedString(16)", ChType::FixedString(16)),
            ("Bool", ChType::Bool),
            ("Date", ChType::Date),
            ("DateTime", ChType::DateTime),
        ];
        for (text, ty) in cases {
            assert_eq!(ChType::parse(text), ty, "{text}");
            assert_eq!(ty.to_string(), text);
        }
    }

    #[test]
    fn parse_wrappers_including_nested_ones() {
        let cases = [
            (
                "Nullable(FixedString(16))",
                nullable(ChType::FixedString(16)),
            ),
            ("Nullable(UInt64)", nullable(ChType::UInt64)),
            ("Nullable(DateTime)", nullable(ChType::DateTime)),
            ("LowCardinality(String)", low(ChType::String)),
            (
                "LowCardinality(FixedString(2))",
                low(ChType::FixedString(2)),
            ),
            (
                "LowCardinality(Nullable(String))",
                low(nullable(ChType::String)),
            ),
            (
                "LowCardinality(Nullable(FixedString(3)))",
                low(nullable(ChType::FixedString(3))),
            ),
        ];
        for (text, ty) in cases {
            assert_eq!(ChType::parse(text), ty, "{text}");
            assert_eq!(ty.to_string(), text);
        }
    }

    #[test]
    fn parse_datetime_with_time_zone_and_whitespace() {
        assert_eq!(ChType::parse("DateTime('UTC')"), ChType::DateTime);
        assert_eq!(ChType::parse("DateTime('Europe/Moscow')"), ChType::DateTime);
        assert_eq!(
            ChType::parse("Nullable(DateTime('UTC'))"),
            nullable(ChType::DateTime)
        );
        assert_eq!(ChType::DateTime.to_string(), "DateTime");
        assert_eq!(
            ChType::parse(" Nullable( FixedString( 4 ) ) "),
            nullable(ChType::FixedString(4))
        );
    }

    #[test]
    fn parse_keeps_everything_else_as_unsupported_text() {
        for text in [
            "Decimal(9,2)",
            "Decimal(9, 2)",
            "DateTime64(3)",
            "DateTime64(3, 'UTC')",
            "DateTime(UTC)",
            "DateTime('a'b')",
            "Enum8('a' = 1, 'b' = 2)",
            "UUID",
            "IPv4",
            "IPv6",
            "Array(UInt8)",
            "Tuple(UInt8, String)",
            "Map(String, UInt64)",
            "Nullable(Decimal(9,2))",
            "Nullable(Nullable(UInt8))",
            "Nullable(LowCardinality(String))",
            "LowCardinality(UInt32)",
            "LowCardinality(LowCardinality(String))",
            "FixedString(0)",
            "FixedString(+3)",
            "FixedString()",
            "Nullable(String",
            "string",
            "UInt128",
            "Boolean",
            "",
        ] {
            let ty = ChType::parse(text);
            assert_eq!(ty, ChType::Unsupported(text.to_owned()), "{text}");
            assert_eq!(ty.to_string(), text);
        }
    }

    #[test]
    fn check_mapping_accepts_every_row_of_the_reference_table() {
        let pairs = [
            (StreamType::Int8, ChType::Int8),
            (StreamType::Int16, ChType::Int16),
            (StreamType::Int32, ChType::Int32),
            (StreamType::Int64, ChType::Int64),
            (StreamType::Uint8, ChType::UInt8),
            (StreamType::Uint16, ChType::UInt16),
            (StreamType::Uint32, ChType::UInt32),
            (StreamType::Uint64, ChType::UInt64),
            (StreamType::Float, ChType::Float32),
            (StreamType::Double, ChType::Float64),
            (StreamType::String, ChType::String),
            (StreamType::Utf8, ChType::String),
            (StreamType::String, ChType::FixedString(8)),
            (StreamType::Utf8, ChType::FixedString(8)),
            (StreamType::String, low(ChType::String)),
            (StreamType::Utf8, low(ChType::String)),
            (StreamType::Boolean, ChType::Bool),
            (StreamType::Boolean, ChType::UInt8),
            (StreamType::Date, ChType::Date),
            (StreamType::Datetime, ChType::DateTime),
        ];
        for (stream, table) in pairs {
            // Exact, optional into Nullable, plain into Nullable, optional into plain.
            assert_eq!(check_mapping("c", &stream, &table), Ok(()));
            let null_table = if let ChType::LowCardinality(inner) = &table {
                low(nullable((**inner).clone()))
            } else {
                nullable(table.clone())
            };
            assert_eq!(
                check_mapping("c", &opt(stream.clone()), &null_table),
                Ok(())
            );
            assert_eq!(check_mapping("c", &stream, &null_table), Ok(()));
            assert_eq!(check_mapping("c", &opt(stream.clone()), &table), Ok(()));
        }
    }

    #[test]
    fn check_mapping_rejects_width_mismatch_with_the_fix() {
        assert_eq!(
            check_mapping("user_id", &StreamType::Uint32, &ChType::UInt64),
            Err(
                "column `user_id`: the stream has uint32 but the table has UInt64; declare the \
                 stream column as uint64 or change the table column to UInt32"
                    .to_owned()
            )
        );
        assert_eq!(
            check_mapping("n", &StreamType::Int64, &ChType::UInt64),
            Err(
                "column `n`: the stream has int64 but the table has UInt64; declare the stream \
                 column as uint64 or change the table column to Int64"
                    .to_owned()
            )
        );
    }

    #[test]
    fn check_mapping_rejects_with_optional_and_nullable_in_the_fix() {
        assert_eq!(
            check_mapping(
                "score",
                &opt(StreamType::Double),
                &nullable(ChType::Float32)
            ),
            Err(
                "column `score`: the stream has optional<double> but the table has \
                 Nullable(Float32); declare the stream column as optional<float> or change the \
                 table column to Nullable(Float64)"
                    .to_owned()
            )
        );
        assert_eq!(
            check_mapping("name", &StreamType::Uint8, &low(nullable(ChType::String))),
            Err("column `name`: the stream has uint8 but the table has \
                 LowCardinality(Nullable(String)); declare the stream column as string or utf8 \
                 or change the table column to Nullable(UInt8)"
                .to_owned())
        );
        assert_eq!(
            check_mapping("flag", &StreamType::Boolean, &ChType::UInt16),
            Err(
                "column `flag`: the stream has boolean but the table has UInt16; declare the \
                 stream column as uint16 or change the table column to Bool"
                    .to_owned()
            )
        );
        assert_eq!(
            check_mapping("day", &StreamType::Datetime, &ChType::Date),
            Err(
                "column `day`: the stream has datetime but the table has Date; declare the \
                 stream column as date or change the table column to DateTime"
                    .to_owned()
            )
        );
    }

    #[test]
    fn check_mapping_rejects_unsupported_table_types() {
        let table = ChType::parse("Decimal(9,2)");
        assert_eq!(
            check_mapping("price", &StreamType::Double, &table),
            Err(
                "column `price`: the table type Decimal(9,2) is not supported by the ClickHouse \
                 sink; drop the column from the stream (the table then fills in its DEFAULT) or \
                 change the table column to a supported type"
                    .to_owned()
            )
        );
        for text in ["UUID", "Nullable(Decimal(9,2))", "LowCardinality(UInt32)"] {
            assert!(check_mapping("c", &StreamType::String, &ChType::parse(text)).is_err());
        }
        // Hand-built wrappings ClickHouse would refuse are not supported either.
        assert!(check_mapping("c", &StreamType::Uint32, &low(ChType::UInt32)).is_err());
        assert!(check_mapping(
            "c",
            &StreamType::Uint32,
            &nullable(nullable(ChType::UInt32))
        )
        .is_err());
    }
}

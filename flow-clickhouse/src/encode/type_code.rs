//! ClickHouse's binary encoding of data types: one code byte and the type's arguments (a
//! precision, a count of tuple items, the nested types). A `Dynamic` value starts with the
//! encoding of its own type; flow writes it from a stream type (the value's natural column type),
//! and [`crate::encode::row_spans`] reads it back when a refused part is split into rows.

use flow_core::{decimal_width, write_leb128, StreamType};

/// The type code of `Nothing`: a NULL in a `Dynamic` column, with no value after it.
pub(crate) const NOTHING: u8 = 0x00;
/// The code of `Nullable(T)`, before `T`'s.
pub(crate) const NULLABLE: u8 = 0x23;

/// Appends the binary encoding of `stream`'s natural column type.
pub(crate) fn write_type_code(stream: &StreamType, out: &mut Vec<u8>) {
    let code = match stream {
        StreamType::Uint8 => 0x01,
        StreamType::Uint16 => 0x02,
        StreamType::Uint32 => 0x03,
        StreamType::Uint64 => 0x04,
        StreamType::Uint128 => 0x05,
        StreamType::Uint256 => 0x06,
        StreamType::Int8 => 0x07,
        StreamType::Int16 => 0x08,
        StreamType::Int32 => 0x09,
        StreamType::Int64 => 0x0a,
        StreamType::Int128 => 0x0b,
        StreamType::Int256 => 0x0c,
        StreamType::Float => 0x0d,
        StreamType::Double => 0x0e,
        StreamType::Date => 0x0f,
        StreamType::Date32 => 0x10,
        StreamType::Datetime => 0x11,
        StreamType::Timestamp => return out.extend_from_slice(&[0x13, 6]),
        StreamType::String | StreamType::Utf8 => 0x15,
        StreamType::Decimal { precision, scale } => {
            // Decimal32/64/128/256 by the width the precision needs.
            let code = match decimal_width(*precision) {
                4 => 0x19,
                8 => 0x1a,
                16 => 0x1b,
                _ => 0x1c,
            };
            return out.extend_from_slice(&[code, *precision, *scale]);
        }
        StreamType::Uuid => 0x1d,
        StreamType::List(item) => {
            out.push(0x1e);
            return write_type_code(item, out);
        }
        StreamType::Tuple(items) => {
            out.push(0x1f);
            write_leb128(items.len() as u64, out);
            return items.iter().for_each(|item| write_type_code(item, out));
        }
        StreamType::Optional(item) => {
            out.push(NULLABLE);
            return write_type_code(item, out);
        }
        StreamType::Dict(key, value) => {
            out.push(0x27);
            write_type_code(key, out);
            return write_type_code(value, out);
        }
        StreamType::Ipv4 => 0x28,
        StreamType::Ipv6 => 0x29,
        StreamType::Boolean => 0x2d,
    };
    out.push(code);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::chtype::{column_type_to_add, ChType};
    use crate::encode::row_spans::read_type_code;

    #[test]
    fn every_stream_type_reads_back_as_its_natural_column_type() {
        for stream in [
            "uint8",
            "uint16",
            "uint32",
            "uint64",
            "uint128",
            "uint256",
            "int8",
            "int16",
            "int32",
            "int64",
            "int128",
            "int256",
            "float",
            "double",
            "string",
            "utf8",
            "boolean",
            "date",
            "datetime",
            "date32",
            "timestamp",
            "decimal(9,2)",
            "decimal(18,4)",
            "decimal(38,10)",
            "decimal(76,3)",
            "uuid",
            "ipv4",
            "ipv6",
            "list<optional<uint8>>",
            "dict<string,list<int16>>",
            "tuple<uint8,optional<utf8>,decimal(18,2)>",
        ] {
            let stream: StreamType = stream.parse().unwrap();
            let mut out = Vec::new();
            write_type_code(&stream, &mut out);
            let (read, end) = read_type_code(&out, 0).unwrap();
            assert_eq!(end, out.len(), "{stream}");
            assert_eq!(
                read,
                Some(ChType::parse(&column_type_to_add(&stream))),
                "{stream}"
            );
        }
    }

    /// Codes as ClickHouse 26.9.2.1 wrote them for `toDateTime('...', 'UTC')::Dynamic`,
    /// `toFixedString('ab', 2)::Dynamic` and `NULL::Dynamic`.
    #[test]
    fn codes_flow_does_not_write_are_read_or_named() {
        let utc = [0x12, 3, b'U', b'T', b'C'];
        assert_eq!(read_type_code(&utc, 0), Ok((Some(ChType::DateTime), 5)));
        assert_eq!(
            read_type_code(&[0x16, 2], 0),
            Ok((Some(ChType::FixedString(2)), 2))
        );
        assert_eq!(read_type_code(&[0x00], 0), Ok((None, 1)));
        assert_eq!(
            read_type_code(&[0x2a, 0], 0),
            Err("the binary type code 0x2a cannot be read".to_owned())
        );
        assert!(read_type_code(&[0x1e], 0).is_err());
    }
}

//! `Dynamic` values: each one carries its own type, in ClickHouse's binary type encoding (one
//! code byte and the type's arguments), then its bytes as that type; NULL is the type `Nothing`
//! (code 0) with no value. A value's type is its stream type's natural column type
//! ([`natural_scalar`]), so the server stores a `uint32` as `UInt32`, a `list<utf8>` as
//! `Array(String)`.

use flow_core::{write_leb128, PackedReader, StreamType, Value};

use super::{encode_scalar, malformed, read_item, Reason};
use crate::encode::chtype::natural_scalar;
use crate::encode::readable::ReadableRanges;
use crate::encode::type_code::{write_type_code, NOTHING};

/// Writes one cell of `stream` into a `Dynamic` column.
pub(super) fn encode_cell<'t>(
    ranges: &'t ReadableRanges,
    stream: &StreamType,
    value: Value<'_>,
    out: &mut Vec<u8>,
) -> Result<(), Reason<'t>> {
    let stream = stream.inner();
    match value {
        Value::Null => {
            out.push(NOTHING);
            Ok(())
        }
        Value::Packed(bytes) if is_nested(stream) => {
            write_type_code(stream, out);
            write_natural(ranges, stream, &mut PackedReader::new(bytes), out)
        }
        value => {
            write_type_code(stream, out);
            write_scalar(ranges, stream, value, out)
        }
    }
}

/// Writes one packed item of `stream` (an array's element, a map's value...) into `Dynamic`.
pub(super) fn encode_packed<'t>(
    ranges: &'t ReadableRanges,
    stream: &StreamType,
    reader: &mut PackedReader<'_>,
    out: &mut Vec<u8>,
) -> Result<(), Reason<'t>> {
    let stream = match stream {
        StreamType::Optional(item) => {
            if reader.byte().map_err(malformed)? == 1 {
                out.push(NOTHING);
                return Ok(());
            }
            item.as_ref()
        }
        other => other,
    };
    write_type_code(stream, out);
    write_natural(ranges, stream, reader, out)
}

fn is_nested(stream: &StreamType) -> bool {
    matches!(
        stream,
        StreamType::List(_) | StreamType::Dict(..) | StreamType::Tuple(_)
    )
}

/// Writes a packed value of `stream` as its natural column type, walking nested types.
fn write_natural<'t>(
    ranges: &'t ReadableRanges,
    stream: &StreamType,
    reader: &mut PackedReader<'_>,
    out: &mut Vec<u8>,
) -> Result<(), Reason<'t>> {
    match stream {
        StreamType::Optional(item) => {
            let null = reader.byte().map_err(malformed)?;
            out.push(null);
            if null == 1 {
                return Ok(());
            }
            write_natural(ranges, item, reader, out)
        }
        StreamType::List(item) => {
            let count = reader.leb128().map_err(malformed)?;
            write_leb128(count, out);
            (0..count).try_for_each(|_| write_natural(ranges, item, reader, out))
        }
        StreamType::Dict(key, value) => {
            let count = reader.leb128().map_err(malformed)?;
            write_leb128(count, out);
            (0..count).try_for_each(|_| {
                write_natural(ranges, key, reader, out)?;
                write_natural(ranges, value, reader, out)
            })
        }
        StreamType::Tuple(items) => items
            .iter()
            .try_for_each(|item| write_natural(ranges, item, reader, out)),
        scalar => {
            let value = read_item(scalar, reader).map_err(malformed)?;
            write_scalar(ranges, scalar, value, out)
        }
    }
}

/// Writes a value of a stream type that is not nested as its natural column type.
fn write_scalar<'t>(
    ranges: &'t ReadableRanges,
    stream: &StreamType,
    value: Value<'_>,
    out: &mut Vec<u8>,
) -> Result<(), Reason<'t>> {
    let Some(natural) = natural_scalar(stream) else {
        return Err(Reason::Value(format!(
            "{} has no column type of its own",
            value.kind()
        )));
    };
    // The type is a local: the reason is turned into its text before it goes.
    encode_scalar(&natural, ranges, Some(stream), value, out)
        .map_err(|reason| Reason::Value(reason.describe()))
}

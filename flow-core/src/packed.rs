//! The packed form: how a value of a type that does not fit a 64-bit cell travels
//! ([`crate::Value::Packed`]) — `int128` .. `uint256`, `decimal(P,S)`, `uuid`, `ipv6`, `list<T>`,
//! `dict<K,V>` and `tuple<...>`.
//!
//! It is ClickHouse's RowBinary layout of the type's natural column type, so a sink can often
//! copy it and always walk it without a lookup table: integers, floats, `date` (u16),
//! `datetime` (u32), `date32` (i32), `timestamp` (i64 µs) and `ipv4` (u32) little-endian at their
//! width; `boolean` one byte; `string`/`utf8` an unsigned LEB128 length and the bytes;
//! `decimal(P,S)` the integer value × 10^S in 4, 8, 16 or 32 bytes (P ≤ 9, 18, 38, 76);
//! `int128`/`uint128` 16 bytes, `int256`/`uint256` 32 bytes; `uuid` its 16 bytes in text order
//! (not ClickHouse's two swapped halves); `ipv6` its 16 bytes in network order; `optional<T>` a
//! byte 1 (null) or 0 followed by T; `list<T>` a LEB128 count and the items; `dict<K,V>` a LEB128
//! count and the key, value pairs; `tuple<...>` the items one after the other.
//!
//! A top-level value carries the form of the column's type under its `optional` (a null column
//! value is [`crate::Value::Null`], not a marker byte).

use std::fmt;

use crate::types::StreamType;
use crate::wide_int::WideInt;

/// Bytes of a `decimal(P,S)` value.
pub fn decimal_width(precision: u8) -> usize {
    match precision {
        0..=9 => 4,
        10..=18 => 8,
        19..=38 => 16,
        _ => 32,
    }
}

/// The width of a type whose packed form has a fixed size (for arrays of them and for checks).
pub fn fixed_width(ty: &StreamType) -> Option<usize> {
    Some(match ty {
        StreamType::Int8 | StreamType::Uint8 | StreamType::Boolean => 1,
        StreamType::Int16 | StreamType::Uint16 | StreamType::Date => 2,
        StreamType::Int32
        | StreamType::Uint32
        | StreamType::Float
        | StreamType::Datetime
        | StreamType::Date32
        | StreamType::Ipv4 => 4,
        StreamType::Int64 | StreamType::Uint64 | StreamType::Double | StreamType::Timestamp => 8,
        StreamType::Int128 | StreamType::Uint128 | StreamType::Uuid | StreamType::Ipv6 => 16,
        StreamType::Int256 | StreamType::Uint256 => 32,
        StreamType::Decimal { precision, .. } => decimal_width(*precision),
        _ => return None,
    })
}

/// Why packed bytes do not hold a value of their type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedError(pub String);

impl fmt::Display for PackedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A cursor over packed bytes.
#[derive(Clone, Copy, Debug)]
pub struct PackedReader<'a> {
    bytes: &'a [u8],
}

impl<'a> PackedReader<'a> {
    /// A cursor at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        PackedReader { bytes }
    }

    /// Whether every byte has been read.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The next `n` bytes; an error when fewer are left.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], PackedError> {
        if self.bytes.len() < n {
            return Err(PackedError(format!(
                "packed value ends early ({n} bytes wanted, {} left)",
                self.bytes.len()
            )));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    /// The next byte.
    pub fn byte(&mut self) -> Result<u8, PackedError> {
        Ok(self.take(1)?[0])
    }

    /// The next `N` bytes, as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], PackedError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// The next LEB128-encoded unsigned number (RowBinary's length prefix).
    pub fn leb128(&mut self) -> Result<u64, PackedError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.byte()?;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(PackedError(
            "a length prefix longer than 10 bytes".to_owned(),
        ))
    }

    /// A LEB128 length and that many bytes.
    pub fn string(&mut self) -> Result<&'a [u8], PackedError> {
        let len = self.leb128()?;
        let len =
            usize::try_from(len).map_err(|_| PackedError(format!("a length of {len} bytes")))?;
        self.take(len)
    }

    /// The bytes of one value of `ty`, skipped over and checked.
    pub fn value(&mut self, ty: &StreamType) -> Result<&'a [u8], PackedError> {
        let start = self.bytes;
        check(ty, self)?;
        Ok(&start[..start.len() - self.bytes.len()])
    }
}

/// Appends an unsigned LEB128 number.
#[inline]
pub fn write_leb128(mut value: u64, out: &mut Vec<u8>) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// Checks that `bytes` are exactly one packed value of `ty` (the type under its `optional`).
pub fn validate(ty: &StreamType, bytes: &[u8]) -> Result<(), PackedError> {
    let mut reader = PackedReader::new(bytes);
    check(ty.inner(), &mut reader)?;
    if reader.is_empty() {
        Ok(())
    } else {
        Err(PackedError(format!(
            "{} bytes after the {ty} value",
            reader.bytes.len()
        )))
    }
}

fn check(ty: &StreamType, reader: &mut PackedReader<'_>) -> Result<(), PackedError> {
    match ty {
        StreamType::Optional(inner) => match reader.byte()? {
            1 => Ok(()),
            0 => check(inner, reader),
            other => Err(PackedError(format!("null marker {other}"))),
        },
        StreamType::Boolean => match reader.byte()? {
            0 | 1 => Ok(()),
            other => Err(PackedError(format!("boolean byte {other}"))),
        },
        StreamType::String => reader.string().map(|_| ()),
        StreamType::Utf8 => {
            let bytes = reader.string()?;
            std::str::from_utf8(bytes)
                .map(|_| ())
                .map_err(|err| PackedError(format!("not valid UTF-8 ({err})")))
        }
        StreamType::Date32 => {
            let days = i32::from_le_bytes(reader.array()?);
            check_date32(days.into()).map_err(PackedError)
        }
        StreamType::Decimal { precision, scale } => {
            let bytes = reader.take(decimal_width(*precision))?;
            let value = WideInt::from_le_bytes(bytes, true);
            if value.fits_precision(*precision) {
                Ok(())
            } else {
                let mut text = String::new();
                value.write_decimal(true, *scale, &mut text);
                Err(PackedError(format!(
                    "{text} has more than {precision} digits"
                )))
            }
        }
        StreamType::List(item) => {
            let count = reader.leb128()?;
            for _ in 0..count {
                check(item, reader)?;
            }
            Ok(())
        }
        StreamType::Dict(key, value) => {
            let count = reader.leb128()?;
            for _ in 0..count {
                check(key, reader)?;
                check(value, reader)?;
            }
            Ok(())
        }
        StreamType::Tuple(items) => items.iter().try_for_each(|item| check(item, reader)),
        other => {
            // Every other type has a fixed width and no invalid bit pattern.
            let width = fixed_width(other).unwrap_or(0);
            reader.take(width).map(|_| ())
        }
    }
}

/// The range ClickHouse's `Date32` holds: 1900-01-01 ..= 2299-12-31.
pub const DATE32_RANGE: (i64, i64) = (-25_567, 120_529);

/// Checks that `days` since 1970-01-01 is within the range ClickHouse's `Date32` holds
/// (1900-01-01 ..= 2299-12-31); the error says why not.
pub fn check_date32(days: i64) -> Result<(), String> {
    if (DATE32_RANGE.0..=DATE32_RANGE.1).contains(&days) {
        Ok(())
    } else {
        Err(format!(
            "{days} days is outside date32 (1900-01-01 ..= 2299-12-31)"
        ))
    }
}

/// Formats a UUID's 16 bytes (text order) as `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn write_uuid(bytes: &[u8; 16], out: &mut impl fmt::Write) {
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            let _ = out.write_char('-');
        }
        let _ = write!(out, "{b:02x}");
    }
}

/// Parses `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (either case; braces and other forms are not
/// accepted).
pub fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let bytes = text.as_bytes();
    if bytes.len() != 36 {
        return None;
    }
    let mut out = [0u8; 16];
    let mut nibbles = 0;
    for (i, &c) in bytes.iter().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            if c != b'-' {
                return None;
            }
            continue;
        }
        let v = char::from(c).to_digit(16)? as u8;
        out[nibbles / 2] |= if nibbles % 2 == 0 { v << 4 } else { v };
        nibbles += 1;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_text_round_trips_and_other_forms_are_refused() {
        let text = "01234567-89ab-cdef-0123-456789abcdef";
        let bytes = parse_uuid(text).unwrap();
        assert_eq!(bytes[0], 0x01);
        assert_eq!(bytes[15], 0xef);
        let mut back = String::new();
        write_uuid(&bytes, &mut back);
        assert_eq!(back, text);
        assert_eq!(
            parse_uuid("01234567-89AB-CDEF-0123-456789ABCDEF"),
            Some(bytes)
        );
        for bad in [
            "0123456789abcdef0123456789abcdef",
            "{01234567-89ab-cdef-0123-456789abcdef}",
            "01234567-89ab-cdef-0123-456789abcdeg",
            "01234567+89ab-cdef-0123-456789abcdef",
        ] {
            assert_eq!(parse_uuid(bad), None, "{bad}");
        }
    }

    #[test]
    fn validation_walks_nesting_and_refuses_trailing_or_missing_bytes() {
        let ty: StreamType = "list<optional<tuple<uint16,utf8>>>".parse().unwrap();
        // Two items: a null, then (7, "ab").
        let good = [2, 1, 0, 7, 0, 2, b'a', b'b'];
        assert_eq!(validate(&ty, &good), Ok(()));
        assert!(validate(&ty, &good[..7]).is_err());
        let mut longer = good.to_vec();
        longer.push(0);
        assert_eq!(
            validate(&ty, &longer).unwrap_err().0,
            "1 bytes after the list<optional<tuple<uint16,utf8>>> value"
        );
        assert!(validate(&ty, &[1, 2]).is_err());
        let bad_utf8 = [1, 0, 7, 0, 1, 0xff];
        assert!(validate(&ty, &bad_utf8).unwrap_err().0.contains("UTF-8"));
        let dec: StreamType = "decimal(3,1)".parse().unwrap();
        assert_eq!(validate(&dec, &999i32.to_le_bytes()), Ok(()));
        assert_eq!(
            validate(&dec, &1000i32.to_le_bytes()).unwrap_err().0,
            "100.0 has more than 3 digits"
        );
    }
}

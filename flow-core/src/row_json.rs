//! Rows as JSON objects by column name ([`write_row_object`]), written straight into a byte
//! buffer: the debug sink's output lines and the `row` of a sink's dead letters. Values take the
//! JSON forms of [`crate::json_form`].

use std::io::Write;

use crate::json_form::write_json_value;
use crate::message::Row;

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

//! A row a sink could not write ([`DeadRow`]): the JSON payload of a sink's dead letter, written
//! when the row is rejected and read back by `flow-worker dead-letters`.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use std::sync::Arc;

use crate::json_form::{push_json_text, write_json_string, write_row_object};
use crate::message::{MessageBatch, MessageId, Row, Value};

/// A sink's dead row as stored (the dead letter's `reason` holds the why).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadRow {
    /// The row's message id, `<partition>-<offset>`.
    pub message_id: String,
    /// The shard the row was routed to (sharded sinks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<String>,
    /// The column whose value failed a check before sealing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub column: Option<String>,
    /// The server's error code, when the server refused the row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i64>,
    /// The row by column name. A string value that is not UTF-8 shows here with U+FFFD in
    /// place of its bad bytes; its exact bytes are in `row_base64`.
    pub row: serde_json::Value,
    /// The exact bytes, in base64, of the row's string values that are not UTF-8, by column: a
    /// dead letter may be the only copy of a message whose broker retention has expired.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub row_base64: BTreeMap<String, String>,
    /// What the sink needs to send the row again as it was (rows the server refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resend: Option<ResendRow>,
    /// The table the row named when that table did not exist (a sink with a table template):
    /// the row was not encoded, and a requeue has the sink encode it for the table then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub for_table: Option<TableRow>,
}

/// Where a row set aside for a missing table goes once requeued ([`DeadRow::for_table`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableRow {
    /// e.g. `default.events_click`.
    pub target: String,
    /// The deduplication token the row is sent under, fixed when it was set aside so that a
    /// requeue repeated after a crash is deduplicated.
    pub token: String,
}

/// A refused row as its sink encoded it, so that `dead-letters requeue` can put it back into the
/// sink's outbox byte for byte, under a token of its own.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResendRow {
    /// e.g. `default.events`.
    pub target: String,
    /// The columns the bytes are encoded for.
    pub columns: Vec<String>,
    /// The stored format of the batch the row came from (its framing).
    pub format: String,
    /// The fingerprint of the encoding plan.
    pub plan: String,
    /// The deduplication token the row is sent under.
    pub token: String,
    /// The message-id bounds the row is known to lie within (equal when its offset is known).
    pub first_offset: u64,
    /// Message id of the last row the row may be (the upper bound).
    pub last_offset: u64,
    /// The row's encoded bytes, in hexadecimal.
    pub encoded_hex: String,
}

impl ResendRow {
    /// `bytes` in lowercase hexadecimal, two digits per byte (the form of `encoded_hex`).
    pub fn hex(bytes: &[u8]) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(bytes.len() * 2);
        for byte in bytes {
            out.push(char::from(DIGITS[usize::from(byte >> 4)]));
            out.push(char::from(DIGITS[usize::from(byte & 15)]));
        }
        out
    }

    /// The encoded bytes; `None` when `encoded_hex` is not hexadecimal.
    pub fn encoded(&self) -> Option<Vec<u8>> {
        let digits = self.encoded_hex.as_bytes();
        if !digits.len().is_multiple_of(2) {
            return None;
        }
        let value = |d: u8| char::from(d).to_digit(16).map(|v| v as u8);
        digits
            .chunks(2)
            .map(|pair| Some(value(pair[0])? << 4 | value(pair[1])?))
            .collect()
    }
}

impl DeadRow {
    /// Encodes a dead row straight from the rejected `row` (the JSON of its values is written
    /// once, not built as a tree).
    pub fn encode(
        row: &Row<'_>,
        columns: &[String],
        shard: Option<&str>,
        column: Option<&str>,
        code: Option<i64>,
    ) -> Vec<u8> {
        let mut out = Vec::with_capacity(128);
        out.extend_from_slice(b"{\"message_id\":");
        write_json_string(&mut out, row.id().to_string().as_bytes());
        if let Some(shard) = shard {
            out.extend_from_slice(b",\"shard\":");
            write_json_string(&mut out, shard.as_bytes());
        }
        if let Some(column) = column {
            out.extend_from_slice(b",\"column\":");
            write_json_string(&mut out, column.as_bytes());
        }
        if let Some(code) = code {
            out.extend_from_slice(format!(",\"code\":{code}").as_bytes());
        }
        out.extend_from_slice(b",\"row\":");
        write_row_object(&mut out, columns, row);
        write_row_base64(&mut out, columns, row);
        out.push(b'}');
        out
    }

    /// [`DeadRow::encode`] of a row whose table `for_table.target` did not exist.
    pub fn encode_for_table(row: &Row<'_>, columns: &[String], for_table: &TableRow) -> Vec<u8> {
        let mut out = DeadRow::encode(row, columns, None, None, None);
        out.pop();
        out.extend_from_slice(b",\"for_table\":{\"target\":");
        write_json_string(&mut out, for_table.target.as_bytes());
        out.extend_from_slice(b",\"token\":");
        write_json_string(&mut out, for_table.token.as_bytes());
        out.extend_from_slice(b"}}");
        out
    }

    /// Reads a stored dead row.
    pub fn decode(payload: &[u8]) -> Result<DeadRow, serde_json::Error> {
        serde_json::from_slice(payload)
    }

    /// Appends the row back to `batch` (of the stream it was read from): the values by column
    /// name, strings that were not UTF-8 from `row_base64`. The error names the column.
    pub fn push_into(&self, batch: &mut MessageBatch) -> Result<(), String> {
        let id: MessageId = self
            .message_id
            .parse()
            .map_err(|err: crate::ValueError| err.to_string())?;
        let schema = Arc::clone(batch.schema());
        let mut writer = batch.start_row(id);
        for column in schema.columns() {
            if let Some(encoded) = self.row_base64.get(&column.name) {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .map_err(|err| {
                        format!("column `{}`: row_base64 is not base64: {err}", column.name)
                    })?;
                writer
                    .push(Value::Bytes(&bytes))
                    .map_err(|err| format!("column `{}`: {err}", column.name))?;
                continue;
            }
            let json = self
                .row
                .get(&column.name)
                .map_or_else(|| "null".to_owned(), serde_json::Value::to_string);
            push_json_text(&mut writer, &json).map_err(|err| err.to_string())?;
        }
        writer.finish().map_err(|err| err.to_string())
    }
}

/// Writes `,"row_base64":{...}` for the row's string values that are not UTF-8 (nothing when
/// every value is UTF-8, the usual case, so a dead row costs no more than before).
fn write_row_base64(out: &mut Vec<u8>, columns: &[String], row: &Row<'_>) {
    let mut first = true;
    for (name, value) in columns.iter().zip(row.values()) {
        let Value::Bytes(bytes) = value else { continue };
        if std::str::from_utf8(bytes).is_ok() {
            continue;
        }
        out.extend_from_slice(if first { b",\"row_base64\":{" } else { b"," });
        first = false;
        write_json_string(out, name.as_bytes());
        out.push(b':');
        write_json_string(out, base64_of(bytes).as_bytes());
    }
    if !first {
        out.push(b'}');
    }
}

/// `bytes` in standard base64 with padding (RFC 4648), as dead-letter exports carry bytes that
/// are not UTF-8.
pub fn base64_of(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Bytes as a JSON export keeps them exactly: as text when they are UTF-8, else in base64.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExactBytes<'a> {
    /// The bytes are UTF-8.
    Text(&'a str),
    /// The bytes in base64 ([`base64_of`]).
    Base64(String),
}

impl<'a> ExactBytes<'a> {
    /// How `bytes` are exported.
    pub fn of(bytes: &'a [u8]) -> ExactBytes<'a> {
        match std::str::from_utf8(bytes) {
            Ok(text) => ExactBytes::Text(text),
            Err(_) => ExactBytes::Base64(base64_of(bytes)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::message::{MessageBatch, MessageId, Value};
    use crate::types::{Column, StreamSchema, StreamType};

    #[test]
    fn resend_bytes_round_trip_through_hex_and_bad_hex_is_none() {
        let bytes = [0u8, 1, 0x7f, 0x80, 0xff];
        let resend = ResendRow {
            target: "default.t".to_owned(),
            columns: vec!["id".to_owned()],
            format: "RowBinary;lz4".to_owned(),
            plan: "p".to_owned(),
            token: "t#3-3".to_owned(),
            first_offset: 3,
            last_offset: 3,
            encoded_hex: ResendRow::hex(&bytes),
        };
        assert_eq!(resend.encoded_hex, "00017f80ff");
        assert_eq!(resend.encoded().as_deref(), Some(&bytes[..]));
        let odd = ResendRow {
            encoded_hex: "abc".to_owned(),
            ..resend.clone()
        };
        assert_eq!(odd.encoded(), None);
        let not_hex = ResendRow {
            encoded_hex: "zz".to_owned(),
            ..resend
        };
        assert_eq!(not_hex.encoded(), None);
    }

    #[test]
    fn a_dead_row_round_trips_through_its_json_payload() {
        let schema = StreamSchema::new(vec![
            Column::new("id", StreamType::Uint64),
            Column::new("name", StreamType::String),
        ])
        .unwrap();
        let mut batch = MessageBatch::new(Arc::clone(&schema));
        let mut writer = batch.start_row(MessageId::new(3, 17));
        writer.push(Value::Uint(5)).unwrap();
        writer.push(Value::Bytes(b"a \"quoted\"\n name")).unwrap();
        writer.finish().unwrap();
        let columns = vec!["id".to_owned(), "name".to_owned()];
        let payload = DeadRow::encode(&batch.row(0), &columns, Some("b"), Some("name"), None);
        let dead = DeadRow::decode(&payload).unwrap();
        assert_eq!(
            dead,
            DeadRow {
                message_id: "3-17".to_owned(),
                shard: Some("b".to_owned()),
                column: Some("name".to_owned()),
                code: None,
                row: serde_json::json!({"id": 5, "name": "a \"quoted\"\n name"}),
                row_base64: BTreeMap::new(),
                resend: None,
                for_table: None,
            }
        );
    }

    #[test]
    fn a_row_set_aside_for_a_missing_table_comes_back_whole() {
        let schema = StreamSchema::new(vec![
            Column::new("id", StreamType::Uint64),
            Column::new("raw", StreamType::String),
            Column::new("kind", StreamType::Optional(Box::new(StreamType::Utf8))),
        ])
        .unwrap();
        let mut batch = MessageBatch::new(Arc::clone(&schema));
        let mut writer = batch.start_row(MessageId::new(2, 9));
        writer.push(Value::Uint(u64::MAX)).unwrap();
        writer.push(Value::Bytes(b"\xff\x00ok")).unwrap();
        writer.push(Value::Null).unwrap();
        writer.finish().unwrap();
        let columns: Vec<String> = ["id", "raw", "kind"].map(String::from).to_vec();
        let table = TableRow {
            target: "default.events_x".to_owned(),
            token: "p.s/events_x/requeued/2-9".to_owned(),
        };
        let payload = DeadRow::encode_for_table(&batch.row(0), &columns, &table);
        let dead = DeadRow::decode(&payload).unwrap();
        assert_eq!(dead.for_table, Some(table));
        let mut back = MessageBatch::new(schema);
        dead.push_into(&mut back).unwrap();
        let row = back.row(0);
        assert_eq!(row.id(), MessageId::new(2, 9));
        assert_eq!(row.get(0), Value::Uint(u64::MAX));
        assert_eq!(row.get(1), Value::Bytes(b"\xff\x00ok"));
        assert_eq!(row.get(2), Value::Null);
    }

    #[test]
    fn a_dead_row_keeps_the_exact_bytes_of_a_value_that_is_not_utf8() {
        let schema = StreamSchema::new(vec![
            Column::new("id", StreamType::Uint64),
            Column::new("raw", StreamType::String),
            Column::new("name", StreamType::String),
        ])
        .unwrap();
        let mut batch = MessageBatch::new(Arc::clone(&schema));
        let mut writer = batch.start_row(MessageId::new(0, 4));
        writer.push(Value::Uint(4)).unwrap();
        writer.push(Value::Bytes(&[0xff, 0xfe, b'a'])).unwrap();
        writer.push(Value::Bytes(b"ok")).unwrap();
        writer.finish().unwrap();
        let columns = vec!["id".to_owned(), "raw".to_owned(), "name".to_owned()];
        let payload = DeadRow::encode(&batch.row(0), &columns, None, Some("raw"), None);
        let dead = DeadRow::decode(&payload).unwrap();
        assert_eq!(dead.row["raw"], serde_json::json!("\u{fffd}\u{fffd}a"));
        assert_eq!(
            dead.row_base64,
            BTreeMap::from([("raw".to_owned(), "//5h".to_owned())])
        );
    }

    #[test]
    fn exact_bytes_are_text_when_utf8_and_base64_otherwise() {
        assert_eq!(
            ExactBytes::of(b"{\"id\":1}"),
            ExactBytes::Text("{\"id\":1}")
        );
        assert_eq!(
            ExactBytes::of(&[0xff, 0xfe]),
            ExactBytes::Base64("//4=".to_owned())
        );
    }
}

//! A row a sink could not write ([`DeadRow`]): the JSON payload of a sink's dead letter, written
//! when the row is rejected and read back by `flow-worker dead-letters`.

use serde::{Deserialize, Serialize};

use crate::json_form::{write_json_string, write_row_object};
use crate::message::Row;

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
    /// The row by column name.
    pub row: serde_json::Value,
    /// What the sink needs to send the row again as it was (rows the server refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resend: Option<ResendRow>,
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
        out.push(b'}');
        out
    }

    /// Reads a stored dead row.
    pub fn decode(payload: &[u8]) -> Result<DeadRow, serde_json::Error> {
        serde_json::from_slice(payload)
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
                resend: None,
            }
        );
    }
}

//! What every broker source shares (NATS JetStream, Kafka): the position is the broker's own
//! (a stream sequence, an offset), committed in the outbox with the epoch and never acknowledged
//! to the broker as the source of truth; a message's id is `<partition>-<broker position>`, so ids
//! grow but need not be contiguous. A message's payload becomes a row by [`BrokerFormat`]: `json`
//! decodes one object against the declared schema exactly as `jsonl_file` decodes a line, `raw`
//! keeps the payload whole next to the broker's metadata columns.

use std::sync::Arc;

use flow_state::DeadLetter;
use serde::{Deserialize, Serialize};

use crate::error::{SourceError, Violation};
use crate::message::{MessageId, Value};
use crate::plugin::SourceOutput;
use crate::types::{Column, SchemaError, StreamSchema, StreamType};

use super::jsonl::{parse_line, OnBadRecord};
use crate::json_form::RecordDecoder;

/// How a broker message's payload becomes a row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BrokerFormat {
    /// One JSON object per message, checked against the declared `schema`.
    #[default]
    Json,
    /// The payload as a `string` column, with the broker's metadata (see [`BrokerDecoder::raw_schema`]).
    Raw,
}

/// What a broker source knows of one message.
#[derive(Clone, Copy, Debug)]
pub struct BrokerRecord<'a> {
    /// The broker's position of the message (stream sequence, offset); the message's id offset.
    pub position: u64,
    /// The message's bytes.
    pub payload: &'a [u8],
    /// The subject (NATS) or topic (Kafka) the message was published to.
    pub origin: &'a str,
    /// When the broker stored the message, in seconds since the Unix epoch.
    pub timestamp_seconds: u64,
    /// The message key, for brokers that have one.
    pub key: Option<&'a [u8]>,
}

/// Turns broker messages into rows of one partition's batch, or into dead letters.
#[derive(Clone, Debug)]
pub struct BrokerDecoder {
    partition: u32,
    schema: Arc<StreamSchema>,
    format: BrokerFormat,
    on_bad_record: OnBadRecord,
    with_key: bool,
    json: RecordDecoder,
}

impl BrokerDecoder {
    /// The columns of the `raw` format: `<origin>` (the subject or topic), `position`,
    /// `timestamp`, `key` where the broker has keys, and `payload`.
    pub fn raw_schema(
        origin_column: &str,
        with_key: bool,
    ) -> Result<Arc<StreamSchema>, SchemaError> {
        let mut columns = vec![
            Column::new(origin_column, StreamType::Utf8),
            Column::new("position", StreamType::Uint64),
            Column::new("timestamp", StreamType::Datetime),
        ];
        if with_key {
            columns.push(Column::new(
                "key",
                StreamType::Optional(Box::new(StreamType::String)),
            ));
        }
        columns.push(Column::new("payload", StreamType::String));
        StreamSchema::new(columns)
    }

    /// The stream schema of a broker source's spec: the declared `schema` with `json`, the raw
    /// columns with `raw`. Violations name `parameters.schema`.
    pub fn schema_of(
        format: BrokerFormat,
        declared: Option<&[Column]>,
        origin_column: &str,
        with_key: bool,
    ) -> Result<Arc<StreamSchema>, Violation> {
        match (format, declared) {
            (BrokerFormat::Raw, None) => Self::raw_schema(origin_column, with_key)
                .map_err(|err| Violation::new("parameters.format", err.to_string())),
            (BrokerFormat::Raw, Some(_)) => Err(Violation::new(
                "parameters.schema",
                "`format: raw` has fixed columns; remove `schema` or use `format: json`",
            )),
            (BrokerFormat::Json, None) => Err(Violation::new(
                "parameters.schema",
                "`format: json` needs the declared columns: add `schema: [{name: ..., type: ...}]`",
            )),
            (BrokerFormat::Json, Some(columns)) => match StreamSchema::new(columns.to_vec()) {
                Ok(schema) if !schema.is_empty() => Ok(schema),
                Ok(_) => Err(Violation::new(
                    "parameters.schema",
                    "declare at least one column",
                )),
                Err(err) => Err(Violation::new("parameters.schema", err.to_string())),
            },
        }
    }

    /// A decoder of `partition`'s records into `schema`; `with_key`: the raw schema has the `key`
    /// column (brokers with keys).
    pub fn new(
        partition: u32,
        schema: Arc<StreamSchema>,
        format: BrokerFormat,
        on_bad_record: OnBadRecord,
        with_key: bool,
    ) -> Self {
        BrokerDecoder {
            partition,
            schema,
            format,
            on_bad_record,
            with_key,
            json: RecordDecoder::default(),
        }
    }

    /// Whether rows take the record's `timestamp_seconds` (the `timestamp` column of `format:
    /// raw`): a reader that must work to get the time skips it otherwise.
    pub fn uses_timestamp(&self) -> bool {
        matches!(self.format, BrokerFormat::Raw)
    }

    /// Appends the record's row, or its dead letter with `on_bad_record: dead_letter`. A bad
    /// record under `stop` fails with `<partition>/<position>: column: what is wrong`.
    pub fn append(
        &mut self,
        record: &BrokerRecord<'_>,
        out: &mut SourceOutput<'_>,
    ) -> Result<(), SourceError> {
        let id = MessageId::new(self.partition, record.position);
        let result = match self.format {
            BrokerFormat::Json => {
                parse_line(&mut self.json, record.payload, &self.schema, out.batch, id)
            }
            BrokerFormat::Raw => self.append_raw(record, out, id),
        };
        match result {
            Ok(_) => Ok(()),
            Err(what) => {
                let location = format!("{}/{}", self.partition, record.position);
                match self.on_bad_record {
                    OnBadRecord::Stop => Err(SourceError::BadRecord { location, what }),
                    OnBadRecord::DeadLetter => {
                        out.dead_letters.push(DeadLetter {
                            partition: self.partition,
                            offset: Some(record.position),
                            reason: format!("{location}: {what}"),
                            payload: record.payload.to_vec(),
                        });
                        Ok(())
                    }
                }
            }
        }
    }

    fn append_raw(
        &self,
        record: &BrokerRecord<'_>,
        out: &mut SourceOutput<'_>,
        id: MessageId,
    ) -> Result<bool, String> {
        let mut row = out.batch.start_row(id);
        row.push(Value::Bytes(record.origin.as_bytes()))
            .and_then(|row| row.push(Value::Uint(record.position)))
            .and_then(|row| row.push(Value::Uint(record.timestamp_seconds)))
            .map_err(|err| err.to_string())?;
        if self.with_key {
            let key = record.key.map_or(Value::Null, Value::Bytes);
            row.push(key).map_err(|err| err.to_string())?;
        }
        row.push(Value::Bytes(record.payload))
            .map_err(|err| err.to_string())?;
        row.finish().map_err(|err| err.to_string())?;
        Ok(true)
    }
}

/// A broker position as committed: the big-endian `u64` of the last message read (or of the
/// broker's head when the partition was found caught up); 0 before any.
pub fn encode_broker_position(position: u64) -> Vec<u8> {
    position.to_be_bytes().to_vec()
}

/// The position committed by [`encode_broker_position`].
pub fn decode_broker_position(bytes: &[u8]) -> Result<u64, SourceError> {
    super::position::decode_words::<1>(bytes)
        .map(|[word]| word)
        .ok_or_else(|| SourceError::BadPosition {
            position: bytes.to_vec(),
            what: format!(
                "a broker position is 8 bytes, not {}: was the state directory written by another source class?",
                bytes.len()
            ),
        })
}

/// A broker position followed by words that identify what the broker's positions count in (a
/// stream's creation time, a topic's identity), as committed: big-endian `u64` words.
pub fn encode_broker_words(words: &[u64]) -> Vec<u8> {
    super::position::encode_words(words)
}

/// The words of a position committed by [`encode_broker_words`] or [`encode_broker_position`]
/// (one word), accepted when it is one of `lengths` words long: a source that added identity
/// words still reads the positions its older versions committed.
pub fn decode_broker_words(bytes: &[u8], lengths: &[usize]) -> Result<Vec<u64>, SourceError> {
    super::position::decode_word_list(bytes, lengths).ok_or_else(|| {
        let accepted: Vec<String> = lengths.iter().map(|words| (words * 8).to_string()).collect();
        SourceError::BadPosition {
            position: bytes.to_vec(),
            what: format!(
                "a position of this broker source is {} bytes, not {}: was the state directory written by another source class?",
                accepted.join(" or "),
                bytes.len()
            ),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::MessageBatch;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn record(position: u64, payload: &[u8]) -> BrokerRecord<'_> {
        BrokerRecord {
            position,
            payload,
            origin: "events.0",
            timestamp_seconds: 1_700_000_000,
            key: None,
        }
    }

    fn json_decoder(on_bad_record: OnBadRecord) -> BrokerDecoder {
        let columns = vec![
            Column::new("id", StreamType::Uint64),
            Column::new("name", StreamType::Utf8),
        ];
        let schema = BrokerDecoder::schema_of(BrokerFormat::Json, Some(&columns), "subject", false)
            .unwrap_or_else(|v| panic!("{v}"));
        BrokerDecoder::new(3, schema, BrokerFormat::Json, on_bad_record, false)
    }

    #[test]
    fn json_messages_become_rows_with_the_broker_position_as_id() -> TestResult {
        let mut decoder = json_decoder(OnBadRecord::Stop);
        let mut batch = MessageBatch::new(Arc::clone(&decoder.schema));
        let mut dead = Vec::new();
        let mut out = SourceOutput {
            batch: &mut batch,
            dead_letters: &mut dead,
        };
        decoder.append(&record(17, br#"{"id": 5, "name": "x"}"#), &mut out)?;
        decoder.append(&record(40, br#"{"id": 6, "name": "y"}"#), &mut out)?;
        assert_eq!(batch.ids(), &[MessageId::new(3, 17), MessageId::new(3, 40)]);
        assert_eq!(batch.row(1).get(0), Value::Uint(6));
        Ok(())
    }

    #[test]
    fn a_bad_json_message_names_partition_position_and_column() {
        let mut decoder = json_decoder(OnBadRecord::Stop);
        let mut batch = MessageBatch::new(Arc::clone(&decoder.schema));
        let mut dead = Vec::new();
        let mut out = SourceOutput {
            batch: &mut batch,
            dead_letters: &mut dead,
        };
        let err = decoder
            .append(&record(9, br#"{"id": -5, "name": "x"}"#), &mut out)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("3/9: column `id` (uint64): -5 is out of range for uint64 (0 to 18446744073709551615)")
        );
        assert!(batch.is_empty());
    }

    #[test]
    fn a_bad_json_message_becomes_a_dead_letter_when_configured() -> TestResult {
        let mut decoder = json_decoder(OnBadRecord::DeadLetter);
        let mut batch = MessageBatch::new(Arc::clone(&decoder.schema));
        let mut dead = Vec::new();
        let mut out = SourceOutput {
            batch: &mut batch,
            dead_letters: &mut dead,
        };
        decoder.append(&record(9, b"not json"), &mut out)?;
        decoder.append(&record(10, br#"{"id": 1, "name": "ok"}"#), &mut out)?;
        assert_eq!(batch.len(), 1);
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].offset, Some(9));
        assert_eq!(dead[0].payload, b"not json");
        assert!(dead[0].reason.starts_with("3/9: not a JSON object"));
        Ok(())
    }

    #[test]
    fn raw_messages_keep_payload_and_metadata() -> TestResult {
        let schema = BrokerDecoder::raw_schema("topic", true)?;
        let names: Vec<&str> = schema.columns().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["topic", "position", "timestamp", "key", "payload"]);
        let mut decoder = BrokerDecoder::new(
            0,
            Arc::clone(&schema),
            BrokerFormat::Raw,
            OnBadRecord::Stop,
            true,
        );
        let mut batch = MessageBatch::new(schema);
        let mut dead = Vec::new();
        let mut out = SourceOutput {
            batch: &mut batch,
            dead_letters: &mut dead,
        };
        let mut rec = record(5, b"\xff binary");
        rec.key = Some(b"k1");
        decoder.append(&rec, &mut out)?;
        let row = batch.row(0);
        assert_eq!(row.get(0), Value::Bytes(b"events.0"));
        assert_eq!(row.get(1), Value::Uint(5));
        assert_eq!(row.get(2), Value::Uint(1_700_000_000));
        assert_eq!(row.get(3), Value::Bytes(b"k1"));
        assert_eq!(row.get(4), Value::Bytes(b"\xff binary"));
        Ok(())
    }

    #[test]
    fn positions_round_trip_and_a_foreign_one_is_refused() {
        assert_eq!(
            decode_broker_position(&encode_broker_position(42)).ok(),
            Some(42)
        );
        let err = decode_broker_position(&[0; 16])
            .err()
            .map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("8 bytes, not 16")));
    }

    #[test]
    fn word_positions_of_each_accepted_length_round_trip_and_others_are_refused() {
        let words = [150, 1_764_000_000_000_000_000, 1];
        assert_eq!(
            decode_broker_words(&encode_broker_words(&words), &[1, 3]).ok(),
            Some(words.to_vec())
        );
        assert_eq!(
            decode_broker_words(&encode_broker_position(42), &[1, 3]).ok(),
            Some(vec![42])
        );
        let err = decode_broker_words(&[0; 16], &[1, 3])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("is 8 or 24 bytes, not 16"), "{err}");
        assert!(decode_broker_words(&[0; 7], &[1, 3]).is_err());
    }

    #[test]
    fn schema_rules_of_the_two_formats() {
        let columns = vec![Column::new("id", StreamType::Uint64)];
        assert!(
            BrokerDecoder::schema_of(BrokerFormat::Raw, Some(&columns), "subject", false).is_err()
        );
        assert!(BrokerDecoder::schema_of(BrokerFormat::Json, None, "subject", false).is_err());
        assert!(BrokerDecoder::schema_of(BrokerFormat::Raw, None, "subject", false).is_ok());
    }
}

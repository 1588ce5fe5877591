//! `jsonl_file`: one partition per file of JSON objects, one per line, checked against a declared
//! schema. The position is `(byte offset, line number)` of the next line, with the file's device,
//! inode and the hash of the bytes before the offset (see `line_reader`); a message's
//! offset is its 0-based line number. A bad line stops the partition with
//! `file:line: column: what is wrong`, or is committed as a dead letter with
//! `on_bad_record: dead_letter`. A last line without its newline is not read until the newline
//! arrives: a finite run that ends on one reports it instead of parsing half a record.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use flow_state::DeadLetter;
use serde::{Deserialize, Serialize};
use tokio::io::BufReader;

use crate::error::{SourceError, Violation};
use crate::json_form::{RecordDecoder, BOM};
use crate::message::{MessageBatch, MessageId};
use crate::plugin::{ReadLimits, Source, SourceFactory, SourceOutput, SourceRead};
use crate::registry::{parse_parameters, BuildResult, SourceBuildContext};
use crate::spec::is_valid_name;
use crate::types::{Column, StreamSchema};

use super::line_reader::{self, CheckError, LineEnd, Recorded, Tail};

/// The default of `max_record_bytes`: far above any sane JSON record, far below what hurts.
pub const DEFAULT_MAX_RECORD_BYTES: u64 = 16 * 1024 * 1024;
/// The largest `max_record_bytes` accepted.
pub const MAX_RECORD_BYTES_LIMIT: u64 = 1024 * 1024 * 1024;
/// How long a last line without its newline may stay unchanged before a finite run reports it.
const INCOMPLETE_LINE_GRACE: std::time::Duration = std::time::Duration::from_secs(1);
/// How long a read waits for an incomplete last line to grow before returning.
const INCOMPLETE_LINE_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// What a source does with a record that does not fit its schema (`on_bad_record`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnBadRecord {
    /// Stop the partition with the line's error.
    #[default]
    Stop,
    /// Store the line and its error as a dead letter, committed with the epoch, and go on.
    DeadLetter,
}

/// Parameters of the `jsonl_file` source, as a spec's `parameters:` map gives them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonlFileParams {
    /// One file per partition, in partition order.
    pub files: Vec<PathBuf>,
    /// The id of the stream the source emits (default `rows`).
    #[serde(default = "default_stream_id")]
    pub stream_id: String,
    /// The declared columns; every line must be an object with exactly these keys (a missing key is
    /// null, which only an `optional<T>` column accepts).
    pub schema: Vec<Column>,
    /// What a line that does not fit the schema does (default `stop`).
    #[serde(default)]
    pub on_bad_record: OnBadRecord,
    /// A longer line is a bad record: it stops the partition or is kept as a dead letter of its
    /// first `max_record_bytes` bytes; no line is held in memory beyond that.
    #[serde(default = "default_max_record_bytes")]
    pub max_record_bytes: u64,
}

pub(crate) fn default_max_record_bytes() -> u64 {
    DEFAULT_MAX_RECORD_BYTES
}

pub(crate) fn default_stream_id() -> String {
    "rows".to_owned()
}

pub(crate) fn build(
    ctx: &SourceBuildContext<'_>,
    parameters: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SourceFactory>> {
    let mut params: JsonlFileParams = parse_parameters(parameters, "parameters")?;
    for file in &mut params.files {
        *file = ctx.paths.resolve(file);
    }
    let mut violations = Vec::new();
    if params.files.len() != ctx.partitions as usize {
        violations.push(Violation::new(
            "parameters.files",
            format!(
                "{} file(s) for {} partition(s): jsonl_file reads one file per partition, so set `partitions: {}`",
                params.files.len(),
                ctx.partitions,
                params.files.len().max(1)
            ),
        ));
    }
    if params.max_record_bytes == 0 || params.max_record_bytes > MAX_RECORD_BYTES_LIMIT {
        violations.push(Violation::new(
            "parameters.max_record_bytes",
            format!(
                "{} is out of range 1..={MAX_RECORD_BYTES_LIMIT}",
                params.max_record_bytes
            ),
        ));
    }
    if !is_valid_name(&params.stream_id) {
        violations.push(Violation::new(
            "parameters.stream_id",
            format!("`{}` is not a valid stream id", params.stream_id),
        ));
    }
    let schema = match StreamSchema::new(params.schema.clone()) {
        Ok(schema) if !schema.is_empty() => Some(schema),
        Ok(_) => {
            violations.push(Violation::new(
                "parameters.schema",
                "declare at least one column",
            ));
            None
        }
        Err(err) => {
            violations.push(Violation::new("parameters.schema", err.to_string()));
            None
        }
    };
    match schema {
        Some(schema) if violations.is_empty() => Ok(Arc::new(JsonlFileFactory { params, schema })),
        _ => Err(violations),
    }
}

struct JsonlFileFactory {
    params: JsonlFileParams,
    schema: Arc<StreamSchema>,
}

impl SourceFactory for JsonlFileFactory {
    fn stream_id(&self) -> &str {
        &self.params.stream_id
    }

    fn schema(&self) -> Arc<StreamSchema> {
        Arc::clone(&self.schema)
    }

    /// A position is a line number and byte offset in a file that is only appended to; a file edited under a pending batch is caught by the batch's row count and content hash.
    fn replayable(&self) -> bool {
        true
    }

    fn open_partition(
        &self,
        partition: u32,
        position: Option<&[u8]>,
    ) -> Result<Box<dyn Source>, SourceError> {
        let path = self
            .params
            .files
            .get(partition as usize)
            .cloned()
            .ok_or_else(|| SourceError::BadPosition {
                position: Vec::new(),
                what: format!("no file is configured for partition {partition}"),
            })?;
        let (byte_offset, line, recorded) = match position {
            None => (0, 0, None),
            Some(bytes) => decode_position(bytes)?,
        };
        Ok(Box::new(JsonlFileSource {
            path,
            partition,
            schema: Arc::clone(&self.schema),
            on_bad_record: self.params.on_bad_record,
            max_record_bytes: usize::try_from(self.params.max_record_bytes).unwrap_or(usize::MAX),
            reader: None,
            byte_offset,
            line,
            recorded,
            identity: (0, 0),
            tail: Tail::default(),
            incomplete: None,
            buffer: Vec::new(),
            decoder: RecordDecoder::default(),
        }))
    }
}

/// `(byte offset, line)` and, unless the position predates file identities (two words), what it
/// recorded about the file.
fn decode_position(bytes: &[u8]) -> Result<(u64, u64, Option<Recorded>), SourceError> {
    if let Some([offset, line, device, inode, hash]) = super::position::decode_words::<5>(bytes) {
        let recorded = Recorded {
            offset,
            device,
            inode,
            hash,
        };
        return Ok((offset, line, Some(recorded)));
    }
    // Written before positions carried the file's identity: nothing to check against.
    super::position::decode_words::<2>(bytes)
        .map(|[offset, line]| (offset, line, None))
        .ok_or_else(|| SourceError::BadPosition {
            position: bytes.to_vec(),
            what: "a jsonl_file position is five big-endian u64 (byte offset, line, device, inode, hash of the bytes before the offset)".to_owned(),
        })
}

struct JsonlFileSource {
    path: PathBuf,
    partition: u32,
    schema: Arc<StreamSchema>,
    on_bad_record: OnBadRecord,
    max_record_bytes: usize,
    reader: Option<BufReader<tokio::fs::File>>,
    byte_offset: u64,
    /// 0-based number of the next line.
    line: u64,
    /// What the position this reader opened at (or last reopened at) says about the file.
    recorded: Option<Recorded>,
    /// Device and inode of the open file.
    identity: (u64, u64),
    /// The bytes before `byte_offset`, for the position's hash.
    tail: Tail,
    /// Since when the file has ended inside the line at `byte_offset`, and how long that line was.
    incomplete: Option<(tokio::time::Instant, u64)>,
    buffer: Vec<u8>,
    decoder: RecordDecoder,
}

impl JsonlFileSource {
    fn io_error(&self, what: &'static str, source: std::io::Error) -> SourceError {
        SourceError::Io {
            what,
            path: self.path.clone(),
            source,
        }
    }

    fn position(&self) -> Vec<u8> {
        let (device, inode) = self.identity;
        super::position::encode_words(&[
            self.byte_offset,
            self.line,
            device,
            inode,
            self.tail.hash(),
        ])
    }

    /// Opens the file at `byte_offset`, checking that it is still the file the position was
    /// taken in.
    async fn open(&mut self) -> Result<(), SourceError> {
        // The type is checked before the open: opening a FIFO blocks until a writer appears,
        // and a task blocked there ignores a stop. A path that cannot be looked up is left to
        // the open, whose error says why.
        if let Ok(metadata) = tokio::fs::metadata(&self.path).await {
            line_reader::identity(&metadata).map_err(|what| SourceError::InputFile {
                path: self.path.clone(),
                what,
            })?;
        }
        let mut file = tokio::fs::File::open(&self.path)
            .await
            .map_err(|e| self.io_error("cannot open input file", e))?;
        let tail =
            line_reader::check_and_load(&mut file, &self.path, self.byte_offset, self.recorded)
                .await
                .map_err(|err| match err {
                    CheckError::Io(e) => self.io_error("cannot read input file", e),
                    CheckError::Changed(what) => SourceError::InputFile {
                        path: self.path.clone(),
                        what,
                    },
                })?;
        let metadata = file
            .metadata()
            .await
            .map_err(|e| self.io_error("cannot read input file", e))?;
        self.identity =
            line_reader::identity(&metadata).map_err(|what| SourceError::InputFile {
                path: self.path.clone(),
                what,
            })?;
        self.tail = tail;
        self.reader = Some(BufReader::new(file));
        Ok(())
    }

    /// The file ends inside a line: nothing of it is a record yet. The reader is dropped so the
    /// line is read again from its start; a line that stays incomplete past the grace period
    /// ends a finite run with an error instead of being parsed half-written.
    async fn incomplete_line(&mut self, consumed: u64, appended: bool) -> Result<(), SourceError> {
        self.reader = None;
        self.recorded = Some(Recorded {
            offset: self.byte_offset,
            device: self.identity.0,
            inode: self.identity.1,
            hash: self.tail.hash(),
        });
        let now = tokio::time::Instant::now();
        let since = match self.incomplete {
            Some((since, len)) if len == consumed => since,
            _ => now,
        };
        self.incomplete = Some((since, consumed));
        if now.duration_since(since) >= INCOMPLETE_LINE_GRACE {
            return Err(SourceError::BadRecord {
                location: format!("{}:{}", self.path.display(), self.line + 1),
                what: format!(
                    "the last line is incomplete: {consumed} byte(s) without a newline at the end of the file. A line is read once its newline is written; end it with a newline and run again"
                ),
            });
        }
        if !appended {
            tokio::time::sleep(INCOMPLETE_LINE_POLL).await;
        }
        Ok(())
    }
}

#[async_trait]
impl Source for JsonlFileSource {
    async fn read(
        &mut self,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
    ) -> Result<SourceRead, SourceError> {
        if self.reader.is_none() {
            self.open().await?;
        }
        let mut appended = 0usize;
        let mut handled = 0usize;
        while appended < limits.max_messages {
            let Some(reader) = self.reader.as_mut() else {
                break;
            };
            let end = line_reader::read_line(
                reader,
                &mut self.buffer,
                self.max_record_bytes,
                &mut self.tail,
            )
            .await
            .map_err(|e| self.io_error("cannot read input file", e))?;
            let (consumed, truncated) = match end {
                LineEnd::Eof => {
                    return Ok(SourceRead {
                        position: self.position(),
                        exhausted: true,
                        lag: None,
                    });
                }
                LineEnd::Incomplete { consumed } => {
                    self.incomplete_line(consumed, handled > 0).await?;
                    break;
                }
                LineEnd::Complete {
                    consumed,
                    truncated,
                } => (consumed, truncated),
            };
            self.incomplete = None;
            handled += 1;
            let line_index = self.line;
            let result = if truncated {
                Err(format!(
                    "the line is {consumed} bytes long, more than max_record_bytes ({})",
                    self.max_record_bytes
                ))
            } else {
                parse_line(
                    &mut self.decoder,
                    &self.buffer,
                    &self.schema,
                    out.batch,
                    MessageId::new(self.partition, line_index),
                )
            };
            self.byte_offset += consumed;
            self.line += 1;
            match result {
                Ok(true) => appended += 1,
                Ok(false) => {}
                Err(what) => {
                    let location = format!("{}:{}", self.path.display(), line_index + 1);
                    match self.on_bad_record {
                        OnBadRecord::Stop => {
                            return Err(SourceError::BadRecord { location, what });
                        }
                        OnBadRecord::DeadLetter => out.dead_letters.push(DeadLetter {
                            partition: self.partition,
                            offset: Some(line_index),
                            reason: format!("{location}: {what}"),
                            // At most `max_record_bytes`: the buffer holds no more.
                            payload: trim_newline(&self.buffer).to_vec(),
                        }),
                    }
                }
            }
            if appended % 1024 == 1023 && tokio::time::Instant::now() >= limits.deadline {
                break;
            }
        }
        Ok(SourceRead {
            position: self.position(),
            exhausted: false,
            lag: None,
        })
    }
}

fn trim_newline(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// Appends the line's message; `Ok(false)` for a blank line. The error says what is wrong.
pub(super) fn parse_line(
    decoder: &mut RecordDecoder,
    raw: &[u8],
    schema: &StreamSchema,
    batch: &mut MessageBatch,
    id: MessageId,
) -> Result<bool, String> {
    let line = trim_newline(raw);
    let body = line.strip_prefix(BOM).unwrap_or(line);
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(false);
    }
    let text = decoder.read(line, schema).map_err(|err| err.to_string())?;
    let mut row = batch.start_row(id);
    decoder
        .push_values(text, schema, &mut row)
        .map_err(|err| err.what)?;
    row.finish().map_err(|err| err.to_string())?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json_form::{parse_date, parse_datetime};
    use crate::message::Value;
    use crate::types::StreamType;
    use std::io::Write;
    use std::time::Duration;

    fn factory(file: PathBuf, on_bad_record: OnBadRecord) -> JsonlFileFactory {
        let params = JsonlFileParams {
            files: vec![file],
            stream_id: "rows".to_owned(),
            schema: vec![
                Column::new("id", StreamType::Uint64),
                Column::new("name", StreamType::Optional(Box::new(StreamType::Utf8))),
                Column::new("day", StreamType::Date),
            ],
            on_bad_record,
            max_record_bytes: 64,
        };
        let schema = StreamSchema::new(params.schema.clone()).unwrap();
        JsonlFileFactory { params, schema }
    }

    async fn read(
        source: &mut Box<dyn Source>,
        batch: &mut MessageBatch,
        dead: &mut Vec<DeadLetter>,
        max: usize,
    ) -> Result<SourceRead, SourceError> {
        source
            .read(
                &mut SourceOutput {
                    batch,
                    dead_letters: dead,
                },
                ReadLimits {
                    max_messages: max,
                    deadline: tokio::time::Instant::now() + Duration::from_secs(5),
                },
            )
            .await
    }

    fn write_file(lines: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(lines.as_bytes()).unwrap();
        file
    }

    #[tokio::test]
    async fn reads_lines_and_resumes_from_the_committed_position() {
        let file = write_file("{\"id\":1,\"name\":\"a\",\"day\":\"1970-01-02\"}\n\n{\"id\":2,\"day\":3}\n{\"id\":3,\"day\":0}\n");
        let factory = factory(file.path().to_path_buf(), OnBadRecord::Stop);
        let mut source = factory.open_partition(0, None).unwrap();
        let mut batch = MessageBatch::new(factory.schema());
        let mut dead = Vec::new();
        let first = read(&mut source, &mut batch, &mut dead, 2).await.unwrap();
        assert!(!first.exhausted);
        assert_eq!(batch.len(), 2);
        assert_eq!(batch.row(0).get(2), Value::Uint(1));
        assert_eq!(batch.row(1).get(1), Value::Null);
        assert_eq!(batch.row(1).id(), MessageId::new(0, 2));

        let mut resumed = factory.open_partition(0, Some(&first.position)).unwrap();
        let mut rest = MessageBatch::new(factory.schema());
        let end = read(&mut resumed, &mut rest, &mut dead, 10).await.unwrap();
        assert!(end.exhausted);
        assert_eq!(rest.ids(), &[MessageId::new(0, 3)]);
    }

    #[tokio::test]
    async fn bad_line_stops_with_file_line_column_and_reason() {
        let file = write_file("{\"id\":1,\"day\":0}\n{\"id\":-4,\"day\":0}\n");
        let factory = factory(file.path().to_path_buf(), OnBadRecord::Stop);
        let mut source = factory.open_partition(0, None).unwrap();
        let mut batch = MessageBatch::new(factory.schema());
        let mut dead = Vec::new();
        let err = read(&mut source, &mut batch, &mut dead, 10)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}:2: column `id` (uint64): -4 is out of range for uint64 (0 to 18446744073709551615)",
                file.path().display()
            )
        );
    }

    #[tokio::test]
    async fn bad_lines_become_dead_letters_when_configured() {
        let file = write_file("{\"id\":1,\"day\":0}\nnot json\n{\"id\":2,\"day\":0,\"extra\":1}\n{\"id\":3,\"day\":\"2020-02-30\"}\n{\"id\":4,\"day\":0}\n");
        let factory = factory(file.path().to_path_buf(), OnBadRecord::DeadLetter);
        let mut source = factory.open_partition(0, None).unwrap();
        let mut batch = MessageBatch::new(factory.schema());
        let mut dead = Vec::new();
        let end = read(&mut source, &mut batch, &mut dead, 10).await.unwrap();
        assert!(end.exhausted);
        assert_eq!(batch.ids(), &[MessageId::new(0, 0), MessageId::new(0, 4)]);
        assert_eq!(dead.len(), 3);
        assert_eq!(dead[0].offset, Some(1));
        assert_eq!(dead[0].payload, b"not json");
        assert!(
            dead[1]
                .reason
                .ends_with(":3: `extra`: not a column of the declared schema"),
            "{}",
            dead[1].reason
        );
        assert!(
            dead[2].reason.contains("`2020-02-30` is not a date"),
            "{}",
            dead[2].reason
        );
    }

    #[tokio::test]
    async fn a_leading_byte_order_mark_is_skipped_and_duplicate_keys_are_bad_records() {
        let file = write_file(
            "\u{feff}{\"id\":1,\"day\":0}\n{\"id\":2,\"id\":3,\"day\":0}\n\u{feff}\n{\"id\":4,\"day\":0}\n",
        );
        let factory = factory(file.path().to_path_buf(), OnBadRecord::DeadLetter);
        let mut source = factory.open_partition(0, None).unwrap();
        let mut batch = MessageBatch::new(factory.schema());
        let mut dead = Vec::new();
        let end = read(&mut source, &mut batch, &mut dead, 10).await.unwrap();
        assert!(end.exhausted);
        assert_eq!(batch.ids(), &[MessageId::new(0, 0), MessageId::new(0, 3)]);
        assert_eq!(batch.row(0).get(0), Value::Uint(1));
        assert_eq!(dead.len(), 1);
        assert_eq!(
            dead[0].reason,
            format!(
                "{}:2: key `id` appears more than once in the record: give each column once",
                file.path().display()
            )
        );
        assert_eq!(dead[0].payload, b"{\"id\":2,\"id\":3,\"day\":0}");

        let stop = factory_stop_on(&file);
        let mut source = stop.open_partition(0, None).unwrap();
        let mut batch = MessageBatch::new(stop.schema());
        let err = read(&mut source, &mut batch, &mut dead, 10)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}:2: key `id` appears more than once in the record: give each column once",
                file.path().display()
            )
        );
    }

    fn factory_stop_on(file: &tempfile::NamedTempFile) -> JsonlFileFactory {
        factory(file.path().to_path_buf(), OnBadRecord::Stop)
    }

    fn wide_factory(file: PathBuf) -> JsonlFileFactory {
        let types = [
            ("i128", "int128"),
            ("u128", "uint128"),
            ("i256", "int256"),
            ("u256", "uint256"),
            ("price", "decimal(9,2)"),
            ("id", "uuid"),
            ("v4", "ipv4"),
            ("v6", "ipv6"),
            ("born", "date32"),
            ("at", "timestamp"),
            ("tags", "list<int8>"),
            ("counts", "dict<utf8,uint8>"),
            ("pair", "tuple<uint8,optional<utf8>>"),
        ];
        let params = JsonlFileParams {
            files: vec![file],
            stream_id: "rows".to_owned(),
            schema: types
                .iter()
                .map(|(name, ty)| Column::new(*name, ty.parse().unwrap()))
                .collect(),
            on_bad_record: OnBadRecord::DeadLetter,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
        };
        let schema = StreamSchema::new(params.schema.clone()).unwrap();
        JsonlFileFactory { params, schema }
    }

    const GOOD_WIDE_LINE: &str = r#"{"i128":"-170141183460469231731687303715884105728","u128":340282366920938463463374607431768211455,"i256":-5,"u256":"115792089237316195423570985008687907853269984665640564039457584007913129639935","price":1234567.89,"id":"01234567-89ab-cdef-0123-456789abcdef","v4":"10.0.0.1","v6":"2001:db8::1","born":"1900-01-01","at":"2023-11-14T22:13:20.5+00:00","tags":[-128,0,127],"counts":{"a":1,"b":255},"pair":[7,null]}"#;

    #[tokio::test]
    async fn every_new_type_reads_its_json_form_without_loss() {
        let file = write_file(&format!("{GOOD_WIDE_LINE}\n"));
        let factory = wide_factory(file.path().to_path_buf());
        let mut source = factory.open_partition(0, None).unwrap();
        let mut batch = MessageBatch::new(factory.schema());
        let mut dead = Vec::new();
        read(&mut source, &mut batch, &mut dead, 10).await.unwrap();
        assert!(dead.is_empty(), "{:?}", dead[0].reason);
        let names: Vec<String> = factory
            .schema()
            .columns()
            .iter()
            .map(|c| c.name.clone())
            .collect();
        let mut out = Vec::new();
        crate::json_form::write_row_object(&mut out, &names, &batch.row(0));
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"i128":"-170141183460469231731687303715884105728","u128":"340282366920938463463374607431768211455","i256":"-5","u256":"115792089237316195423570985008687907853269984665640564039457584007913129639935","price":"1234567.89","id":"01234567-89ab-cdef-0123-456789abcdef","v4":"10.0.0.1","v6":"2001:db8::1","born":-25567,"at":1700000000500000,"tags":[-128,0,127],"counts":{"a":1,"b":255},"pair":[7,null]}"#
        );
    }

    #[tokio::test]
    async fn one_bad_value_per_new_type_gives_one_error_naming_file_line_and_column() {
        let bad: [(&str, &str); 13] = [
            ("i128", r#""170141183460469231731687303715884105728""#),
            ("u128", "-1"),
            ("i256", r#""12x""#),
            ("u256", "1e3"),
            ("price", "12345678.9"),
            ("id", r#""01234567-89ab-cdef-0123-456789abcde""#),
            ("v4", r#""10.0.0.256""#),
            ("v6", r#""2001:db8:::1""#),
            ("born", r#""2300-01-01""#),
            ("at", r#""2023-11-14T22:13:20""#),
            ("tags", "[1,128]"),
            ("counts", r#"{"a":"x"}"#),
            ("pair", "[7]"),
        ];
        // The good line's fields as raw JSON text (a JSON library would round its numbers).
        let fields: std::collections::BTreeMap<String, Box<serde_json::value::RawValue>> =
            serde_json::from_str(GOOD_WIDE_LINE).unwrap();
        let mut lines = String::new();
        for (column, value) in &bad {
            // The good line with this one column's value replaced (a record gives a key once).
            let others: Vec<String> = fields
                .iter()
                .filter(|(key, _)| key != column)
                .map(|(key, raw)| format!("\"{key}\":{}", raw.get()))
                .collect();
            lines.push_str(&format!("{{{},\"{column}\":{value}}}\n", others.join(",")));
        }
        let file = write_file(&lines);
        let factory = wide_factory(file.path().to_path_buf());
        let mut source = factory.open_partition(0, None).unwrap();
        let mut batch = MessageBatch::new(factory.schema());
        let mut dead = Vec::new();
        read(&mut source, &mut batch, &mut dead, 100).await.unwrap();
        assert!(batch.is_empty());
        let path = file.path().display();
        let reasons: Vec<String> = dead.iter().map(|d| d.reason.clone()).collect();
        let expected: Vec<String> = [
            "1: column `i128` (int128): 170141183460469231731687303715884105728 is out of range for int128 (-2^127 to 2^127-1)",
            "2: column `u128` (uint128): -1 is out of range for uint128 (0 to 2^128-1)",
            "3: column `i256` (int256): `12x` is not an integer",
            "4: column `u256` (uint256): 1e3: write uint256 values without an exponent (digits, a point, digits)",
            "5: column `price` (decimal(9,2)): 12345678.9 has more than 7 digits before the point (decimal(9,2))",
            "6: column `id` (uuid): `01234567-89ab-cdef-0123-456789abcde` is not a UUID (expected 8-4-4-4-12 hex digits)",
            "7: column `v4` (ipv4): `10.0.0.256` is not an IPv4 address",
            "8: column `v6` (ipv6): `2001:db8:::1` is not an IPv6 address",
            "9: column `born` (date32): `2300-01-01` is outside date32 (1900-01-01 ..= 2299-12-31)",
            "10: column `at` (timestamp): `2023-11-14T22:13:20` has no time zone: write Z or ±HH:MM after the time (a timestamp without one is ambiguous)",
            "11: column `tags` (list<int8>): 128 is out of range for int8 (-128 to 127)",
            "12: column `counts` (dict<utf8,uint8>): expected uint8, got a string",
            "13: column `pair` (tuple<uint8,optional<utf8>>): expected tuple<uint8,optional<utf8>>, an array of 2 items, got 1",
        ]
        .iter()
        .map(|tail| format!("{path}:{tail}"))
        .collect();
        assert_eq!(reasons, expected);
    }

    #[test]
    fn dates_and_datetimes_convert_to_days_and_seconds() {
        assert_eq!(parse_date("1970-01-01").unwrap(), 0);
        assert_eq!(parse_date("2000-03-01").unwrap(), 11_017);
        assert_eq!(
            parse_datetime("2023-11-14 22:13:20").unwrap(),
            1_700_000_000
        );
        assert_eq!(
            parse_datetime("2023-11-14T22:13:20Z").unwrap(),
            1_700_000_000
        );
        assert!(parse_datetime("2023-11-14 24:00:00").is_err());
        assert!(parse_date("1969-12-31").is_err());
    }

    async fn read_all(
        factory: &JsonlFileFactory,
        position: Option<&[u8]>,
    ) -> Result<(MessageBatch, Vec<DeadLetter>, SourceRead), SourceError> {
        let mut source = factory.open_partition(0, position)?;
        let mut batch = MessageBatch::new(factory.schema());
        let mut dead = Vec::new();
        let read = read(&mut source, &mut batch, &mut dead, 100).await?;
        Ok((batch, dead, read))
    }

    #[tokio::test]
    async fn a_file_replaced_between_runs_is_refused_not_read_from_a_stale_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        std::fs::write(&path, "{\"id\":1,\"day\":0}\n{\"id\":2,\"day\":0}\n").unwrap();
        let factory = factory(path.clone(), OnBadRecord::DeadLetter);
        let (batch, _, first) = read_all(&factory, None).await.unwrap();
        assert_eq!(batch.len(), 2);
        // `mv` of a new, longer file over the input.
        let replacement = dir.path().join("new.jsonl");
        std::fs::write(
            &replacement,
            "{\"id\":7,\"day\":0}\n{\"id\":8,\"day\":0}\n{\"id\":9,\"day\":0}\n",
        )
        .unwrap();
        std::fs::rename(&replacement, &path).unwrap();
        let err = read_all(&factory, Some(&first.position))
            .await
            .err()
            .unwrap();
        assert_eq!(
            err.to_string(),
            format!(
                "input file `{}`: the bytes before the committed position (byte 34) are not the ones read before: the file was replaced or rewritten since the last run (a file read by jsonl_file may only be appended to). Restore the file, or start over with a new state directory (everything is then read and sent again)",
                path.display()
            )
        );
    }

    #[tokio::test]
    async fn a_copy_with_the_same_bytes_under_a_new_inode_resumes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        std::fs::write(&path, "{\"id\":1,\"day\":0}\n").unwrap();
        let factory = factory(path.clone(), OnBadRecord::Stop);
        let (_, _, first) = read_all(&factory, None).await.unwrap();
        // An atomic rewrite that kept what was read and appended a line (or a restore).
        let rewritten = dir.path().join("rewritten.jsonl");
        std::fs::write(&rewritten, "{\"id\":1,\"day\":0}\n{\"id\":2,\"day\":0}\n").unwrap();
        std::fs::rename(&rewritten, &path).unwrap();
        let (batch, _, end) = read_all(&factory, Some(&first.position)).await.unwrap();
        assert_eq!(batch.ids(), &[MessageId::new(0, 1)]);
        assert!(end.exhausted);
    }

    #[tokio::test]
    async fn a_truncated_file_is_refused_with_its_length_and_the_position() {
        let file = write_file("{\"id\":1,\"day\":0}\n{\"id\":2,\"day\":0}\n");
        let factory = factory(file.path().to_path_buf(), OnBadRecord::Stop);
        let (_, _, first) = read_all(&factory, None).await.unwrap();
        std::fs::write(file.path(), "{\"id\":1}\n").unwrap();
        let err = read_all(&factory, Some(&first.position))
            .await
            .err()
            .unwrap();
        assert!(
            err.to_string().contains(
                "9 bytes long, shorter than the committed position (byte 34): it was truncated or replaced"
            ),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_file_only_appended_to_resumes_and_positions_are_deterministic() {
        let file = write_file("{\"id\":1,\"day\":0}\n");
        let factory = factory(file.path().to_path_buf(), OnBadRecord::Stop);
        let (_, _, first) = read_all(&factory, None).await.unwrap();
        let (_, _, again) = read_all(&factory, None).await.unwrap();
        assert_eq!(first.position, again.position);
        std::fs::OpenOptions::new()
            .append(true)
            .open(file.path())
            .unwrap()
            .write_all(b"{\"id\":2,\"day\":0}\n")
            .unwrap();
        let (batch, _, end) = read_all(&factory, Some(&first.position)).await.unwrap();
        assert_eq!(batch.ids(), &[MessageId::new(0, 1)]);
        assert!(end.exhausted);
        // Two-word positions (written before file identities) are still accepted.
        let legacy = super::super::position::encode_words(&[17, 1]);
        let (batch, _, _) = read_all(&factory, Some(&legacy)).await.unwrap();
        assert_eq!(batch.ids(), &[MessageId::new(0, 1)]);
    }

    #[tokio::test]
    async fn an_incomplete_last_line_is_not_a_record_and_is_read_once_its_newline_arrives() {
        let file = write_file("{\"id\":1,\"day\":0}\n{\"id\":2,");
        let factory = factory(file.path().to_path_buf(), OnBadRecord::DeadLetter);
        let mut source = factory.open_partition(0, None).unwrap();
        let mut batch = MessageBatch::new(factory.schema());
        let mut dead = Vec::new();
        let first = read(&mut source, &mut batch, &mut dead, 10).await.unwrap();
        assert!(!first.exhausted);
        assert_eq!(batch.ids(), &[MessageId::new(0, 0)]);
        assert!(dead.is_empty());
        std::fs::OpenOptions::new()
            .append(true)
            .open(file.path())
            .unwrap()
            .write_all(b"\"day\":0}\n")
            .unwrap();
        let end = read(&mut source, &mut batch, &mut dead, 10).await.unwrap();
        assert!(end.exhausted);
        assert_eq!(batch.ids(), &[MessageId::new(0, 0), MessageId::new(0, 1)]);
        assert!(dead.is_empty(), "{dead:?}");
        // The position after the completed line is the one a fresh read of the whole file gives.
        let (_, _, fresh) = read_all(&factory, None).await.unwrap();
        assert_eq!(end.position, fresh.position);
    }

    #[tokio::test]
    async fn an_incomplete_last_line_that_stays_so_is_reported_with_file_and_line() {
        let file = write_file("{\"id\":1,\"day\":0}\n{\"id\":2,");
        let factory = factory(file.path().to_path_buf(), OnBadRecord::DeadLetter);
        let mut source = factory.open_partition(0, None).unwrap();
        let mut batch = MessageBatch::new(factory.schema());
        let mut dead = Vec::new();
        let started = std::time::Instant::now();
        let err = loop {
            match read(&mut source, &mut batch, &mut dead, 10).await {
                Ok(read) => assert!(!read.exhausted),
                Err(err) => break err,
            }
            assert!(started.elapsed() < Duration::from_secs(10));
        };
        assert_eq!(
            err.to_string(),
            format!(
                "{}:2: the last line is incomplete: 8 byte(s) without a newline at the end of the file. A line is read once its newline is written; end it with a newline and run again",
                file.path().display()
            )
        );
        assert!(dead.is_empty());
        assert_eq!(batch.len(), 1);
    }

    #[tokio::test]
    async fn a_line_over_max_record_bytes_is_refused_and_its_dead_letter_is_bounded() {
        let long = format!(
            "{{\"id\":1,\"day\":0,\"name\":\"{}\"}}\n",
            "x".repeat(10_000)
        );
        let file = write_file(&format!("{long}{{\"id\":2,\"day\":0}}\n"));
        let stop = factory(file.path().to_path_buf(), OnBadRecord::Stop);
        let err = read_all(&stop, None).await.err().unwrap();
        assert_eq!(
            err.to_string(),
            format!(
                "{}:1: the line is 10027 bytes long, more than max_record_bytes (64)",
                file.path().display()
            )
        );
        let dead_letter = factory(file.path().to_path_buf(), OnBadRecord::DeadLetter);
        let (batch, dead, end) = read_all(&dead_letter, None).await.unwrap();
        assert!(end.exhausted);
        assert_eq!(batch.ids(), &[MessageId::new(0, 1)]);
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].payload, long.as_bytes()[..64].to_vec());
    }

    #[tokio::test]
    async fn a_device_that_is_not_a_regular_file_is_refused() {
        let factory = factory(PathBuf::from("/dev/zero"), OnBadRecord::DeadLetter);
        let err = read_all(&factory, None).await.err().unwrap();
        assert_eq!(
            err.to_string(),
            "input file `/dev/zero`: not a regular file but a character device: jsonl_file resumes at a byte offset, so it reads regular files only (copy the data into a file)"
        );
    }

    /// Opening a FIFO blocks until a writer appears (and a stop was ignored meanwhile): it is
    /// refused by its type, at once, without being opened.
    #[test]
    fn a_fifo_is_refused_before_it_is_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("events.jsonl");
        let status = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(status.success());
        let factory = factory(fifo.clone(), OnBadRecord::Stop);
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let read = runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), read_all(&factory, None)).await
        });
        // An open blocked on the FIFO would hold a normal shutdown: leave it behind.
        runtime.shutdown_background();
        let read = read.expect("opening a FIFO without a writer must not block");
        assert_eq!(
            read.err().unwrap().to_string(),
            format!(
                "input file `{}`: not a regular file but a FIFO (named pipe): jsonl_file resumes at a byte offset, so it reads regular files only (copy the data into a file)",
                fifo.display()
            )
        );
    }

    #[tokio::test]
    async fn a_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let factory = factory(dir.path().to_path_buf(), OnBadRecord::Stop);
        let err = read_all(&factory, None).await.err().unwrap();
        assert_eq!(
            err.to_string(),
            format!(
                "input file `{}`: not a regular file but a directory: jsonl_file resumes at a byte offset, so it reads regular files only (copy the data into a file)",
                dir.path().display()
            )
        );
    }

    #[test]
    fn max_record_bytes_has_a_default_and_a_range() {
        let ctx = SourceBuildContext {
            pipeline: "p",
            partitions: 1,
            paths: crate::SpecPaths::working_directory(),
        };
        let params: serde_yaml::Value =
            serde_yaml::from_str("{files: [a.jsonl], schema: [{name: id, type: uint64}]}").unwrap();
        assert!(build(&ctx, &params).is_ok());
        let params: serde_yaml::Value = serde_yaml::from_str(
            "{files: [a.jsonl], schema: [{name: id, type: uint64}], max_record_bytes: 0}",
        )
        .unwrap();
        let err = build(&ctx, &params).err().unwrap();
        assert_eq!(err[0].path, "parameters.max_record_bytes");
        assert_eq!(err[0].message, "0 is out of range 1..=1073741824");
    }

    #[test]
    fn file_count_must_match_partitions() {
        let params: serde_yaml::Value =
            serde_yaml::from_str("{files: [a.jsonl], schema: [{name: id, type: uint64}]}").unwrap();
        let err = build(
            &SourceBuildContext {
                pipeline: "p",
                partitions: 2,
                paths: crate::SpecPaths::working_directory(),
            },
            &params,
        )
        .err()
        .unwrap();
        assert_eq!(err[0].path, "parameters.files");
    }
}

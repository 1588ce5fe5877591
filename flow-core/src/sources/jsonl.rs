//! `jsonl_file`: one partition per file of JSON objects, one per line, checked against a declared
//! schema. The position is `(byte offset, line number)` of the next line; a message's offset is its
//! 0-based line number. A bad line stops the partition with `file:line: column: what is wrong`, or is
//! committed as a dead letter with `on_bad_record: dead_letter`.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use flow_state::DeadLetter;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncSeekExt, BufReader};

use crate::error::{SourceError, Violation};
use crate::message::{MessageBatch, MessageId, Value};
use crate::plugin::{ReadLimits, Source, SourceFactory, SourceOutput, SourceRead};
use crate::registry::{parse_parameters, BuildResult, SourceBuildContext};
use crate::spec::is_valid_name;
use crate::types::{Column, StreamSchema, StreamType};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnBadRecord {
    /// Stop the partition with the line's error.
    #[default]
    Stop,
    /// Store the line and its error as a dead letter, committed with the epoch, and go on.
    DeadLetter,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonlFileParams {
    /// One file per partition, in partition order.
    pub files: Vec<PathBuf>,
    #[serde(default = "default_stream_id")]
    pub stream_id: String,
    /// The declared columns; every line must be an object with exactly these keys (a missing key is
    /// null, which only an `optional<T>` column accepts).
    pub schema: Vec<Column>,
    #[serde(default)]
    pub on_bad_record: OnBadRecord,
}

fn default_stream_id() -> String {
    "rows".to_owned()
}

pub(crate) fn build(
    ctx: &SourceBuildContext<'_>,
    parameters: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SourceFactory>> {
    let params: JsonlFileParams =
        parse_parameters(parameters, "parameters").map_err(|v| vec![v])?;
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
        let [byte_offset, line] = match position {
            None => [0, 0],
            Some(bytes) => {
                super::decode_words::<2>(bytes).ok_or_else(|| SourceError::BadPosition {
                    position: bytes.to_vec(),
                    what: "a jsonl_file position is two big-endian u64 (byte offset, line)"
                        .to_owned(),
                })?
            }
        };
        Ok(Box::new(JsonlFileSource {
            path,
            partition,
            schema: Arc::clone(&self.schema),
            on_bad_record: self.params.on_bad_record,
            reader: None,
            byte_offset,
            line,
            buffer: Vec::new(),
        }))
    }
}

struct JsonlFileSource {
    path: PathBuf,
    partition: u32,
    schema: Arc<StreamSchema>,
    on_bad_record: OnBadRecord,
    reader: Option<BufReader<tokio::fs::File>>,
    byte_offset: u64,
    /// 0-based number of the next line.
    line: u64,
    buffer: Vec<u8>,
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
        super::encode_words(&[self.byte_offset, self.line])
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
            let mut file = tokio::fs::File::open(&self.path)
                .await
                .map_err(|e| self.io_error("cannot open input file", e))?;
            file.seek(std::io::SeekFrom::Start(self.byte_offset))
                .await
                .map_err(|e| self.io_error("cannot seek in input file", e))?;
            self.reader = Some(BufReader::new(file));
        }
        let mut appended = 0usize;
        while appended < limits.max_messages {
            let Some(reader) = self.reader.as_mut() else {
                break;
            };
            self.buffer.clear();
            let n = reader.read_until(b'\n', &mut self.buffer).await;
            let n = n.map_err(|e| self.io_error("cannot read input file", e))?;
            if n == 0 {
                return Ok(SourceRead {
                    position: self.position(),
                    exhausted: true,
                });
            }
            let line_index = self.line;
            let result = parse_line(
                &self.buffer,
                &self.schema,
                out.batch,
                MessageId::new(self.partition, line_index),
            );
            self.byte_offset += n as u64;
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
        })
    }
}

fn trim_newline(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// Appends the line's message; `Ok(false)` for a blank line. The error says what is wrong.
fn parse_line(
    raw: &[u8],
    schema: &StreamSchema,
    batch: &mut MessageBatch,
    id: MessageId,
) -> Result<bool, String> {
    let line = trim_newline(raw);
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(false);
    }
    let object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(line).map_err(|err| format!("not a JSON object: {err}"))?;
    if let Some(unknown) = object.keys().find(|key| schema.index_of(key).is_none()) {
        return Err(format!("`{unknown}`: not a column of the declared schema"));
    }
    let mut row = batch.start_row(id);
    for column in schema.columns() {
        let json = object.get(&column.name).unwrap_or(&serde_json::Value::Null);
        let value = json_value(json, &column.ty)
            .map_err(|what| format!("column `{}` ({}): {what}", column.name, column.ty))?;
        row.push(value).map_err(|err| err.to_string())?;
    }
    row.finish().map_err(|err| err.to_string())?;
    Ok(true)
}

fn json_value<'a>(json: &'a serde_json::Value, ty: &StreamType) -> Result<Value<'a>, String> {
    Ok(match json {
        serde_json::Value::Null => Value::Null,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                Value::Uint(u)
            } else if let Some(i) = n.as_i64() {
                Value::Int(i)
            } else {
                Value::Float(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => match ty.inner() {
            StreamType::Date => Value::Uint(parse_date(s)?),
            StreamType::Datetime => Value::Uint(parse_datetime(s)?),
            _ => Value::Bytes(s.as_bytes()),
        },
        serde_json::Value::Array(_) => return Err(format!("expected {ty}, got an array")),
        serde_json::Value::Object(_) => return Err(format!("expected {ty}, got an object")),
    })
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn parse_date_parts(text: &str) -> Option<i64> {
    let mut parts = text.splitn(3, '-');
    let year: i64 = parts.next()?.parse().ok()?;
    let month: i64 = parts.next()?.parse().ok()?;
    let day: i64 = parts.next()?.parse().ok()?;
    let max_day = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        _ => return None,
    };
    (1..=max_day)
        .contains(&day)
        .then(|| days_from_civil(year, month, day))
}

fn parse_date(text: &str) -> Result<u64, String> {
    let days = parse_date_parts(text)
        .ok_or_else(|| format!("`{text}` is not a date (expected YYYY-MM-DD)"))?;
    u64::try_from(days).map_err(|_| format!("`{text}` is before 1970-01-01"))
}

fn parse_datetime(text: &str) -> Result<u64, String> {
    let bad = || format!("`{text}` is not a datetime (expected YYYY-MM-DD HH:MM:SS, UTC)");
    let trimmed = text.strip_suffix('Z').unwrap_or(text);
    let (date, time) = trimmed
        .split_once(' ')
        .or_else(|| trimmed.split_once('T'))
        .ok_or_else(bad)?;
    let days = parse_date_parts(date).ok_or_else(bad)?;
    let mut hms = time.splitn(3, ':');
    let mut next = |max: i64| -> Option<i64> {
        let v: i64 = hms.next()?.parse().ok()?;
        (0..=max).contains(&v).then_some(v)
    };
    let (h, m, s) = (next(23), next(59), next(59));
    let (Some(h), Some(m), Some(s)) = (h, m, s) else {
        return Err(bad());
    };
    let seconds = days * 86_400 + h * 3600 + m * 60 + s;
    u64::try_from(seconds).map_err(|_| format!("`{text}` is before 1970-01-01"))
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let file = write_file("{\"id\":1,\"name\":\"a\",\"day\":\"1970-01-02\"}\n\n{\"id\":2,\"day\":3}\n{\"id\":3,\"day\":0}");
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
                "{}:2: column `id` (uint64): -4 is out of range for uint64",
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

    #[test]
    fn file_count_must_match_partitions() {
        let params: serde_yaml::Value =
            serde_yaml::from_str("{files: [a.jsonl], schema: [{name: id, type: uint64}]}").unwrap();
        let err = build(
            &SourceBuildContext {
                pipeline: "p",
                partitions: 2,
            },
            &params,
        )
        .err()
        .unwrap();
        assert_eq!(err[0].path, "parameters.files");
    }
}

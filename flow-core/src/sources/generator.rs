//! `generator`: a deterministic source for tests, demos and benchmarks. Every message is a pure
//! function of (partition, offset, partitions), so a replay produces identical rows.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::error::{SourceError, Violation};
use crate::message::{MessageId, Value};
use crate::plugin::{ReadLimits, Source, SourceFactory, SourceOutput, SourceRead};
use crate::registry::{parse_parameters, BuildResult, SourceBuildContext};
use crate::types::{Column, StreamSchema, StreamType};

/// Largest `payload_bytes`: a generated row must stay far below any batch limit.
pub const MAX_PAYLOAD_BYTES: usize = 1 << 20;
/// `ts` of message id 0; it advances one second every 1000 ids.
pub(crate) const TS_BASE: u64 = 1_700_000_000;

/// Parameters of the `generator` source, as a spec's `parameters:` map gives them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GeneratorParams {
    /// Messages per partition; 0 means endless.
    pub count: u64,
    /// Per partition; 0 means unlimited.
    #[serde(default)]
    pub rate_per_second: u64,
    /// Bytes of each row's `payload` column, 0..=[`MAX_PAYLOAD_BYTES`] (default 16).
    #[serde(default = "default_payload_bytes")]
    pub payload_bytes: usize,
}

pub(crate) fn default_payload_bytes() -> usize {
    16
}

impl GeneratorParams {
    /// Every violation of these parameters, with paths under `parameters`.
    pub fn validate(&self) -> Vec<Violation> {
        let mut violations = Vec::new();
        if self.payload_bytes > MAX_PAYLOAD_BYTES {
            violations.push(Violation::new(
                "parameters.payload_bytes",
                format!(
                    "{} is out of range 0..={MAX_PAYLOAD_BYTES}",
                    self.payload_bytes
                ),
            ));
        }
        violations
    }
}

/// The schema of stream `rows`.
pub fn schema() -> Arc<StreamSchema> {
    StreamSchema::trusted(vec![
        Column::new("id", StreamType::Uint64),
        Column::new("partition", StreamType::Uint32),
        Column::new("offset", StreamType::Uint64),
        Column::new("user_id", StreamType::Uint64),
        Column::new("ts", StreamType::Datetime),
        Column::new("payload", StreamType::String),
    ])
}

/// The value of message `offset` of `partition`: `(id, user_id, ts)`.
pub fn row_values(partition: u32, offset: u64, partitions: u32) -> (u64, u64, u64) {
    let id = offset * u64::from(partitions) + u64::from(partition);
    (id, id % 1000, TS_BASE + id / 1000)
}

/// Writes the `len` payload bytes of message `id` into `out` (lowercase letters and digits).
pub fn fill_payload(id: u64, len: usize, out: &mut Vec<u8>) {
    out.clear();
    append_payload(id, len, out);
}

/// Appends the `len` payload bytes of message `id` to `out`.
fn append_payload(id: u64, len: usize, out: &mut Vec<u8>) {
    const ALPHABET: &[u8; 36] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let end = out.len() + len;
    let mut state = id ^ 0x9e37_79b9_7f4a_7c15;
    while out.len() < end {
        // splitmix64: a cheap, well-mixed, reproducible stream.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        for byte in z.to_le_bytes() {
            if out.len() == end {
                break;
            }
            out.push(ALPHABET[usize::from(byte) % ALPHABET.len()]);
        }
    }
}

pub(crate) fn build(
    ctx: &SourceBuildContext<'_>,
    parameters: &serde_yaml::Value,
) -> BuildResult<Arc<dyn SourceFactory>> {
    let params: GeneratorParams = parse_parameters(parameters, "parameters")?;
    let violations = params.validate();
    if !violations.is_empty() {
        return Err(violations);
    }
    Ok(Arc::new(GeneratorFactory {
        params,
        partitions: ctx.partitions,
        schema: schema(),
    }))
}

struct GeneratorFactory {
    params: GeneratorParams,
    partitions: u32,
    schema: Arc<StreamSchema>,
}

impl SourceFactory for GeneratorFactory {
    fn stream_id(&self) -> &str {
        "rows"
    }

    fn schema(&self) -> Arc<StreamSchema> {
        Arc::clone(&self.schema)
    }

    /// Every message is a pure function of (partition, offset).
    fn replayable(&self) -> bool {
        true
    }

    fn open_partition(
        &self,
        partition: u32,
        position: Option<&[u8]>,
    ) -> Result<Box<dyn Source>, SourceError> {
        let next = match position {
            None => 0,
            Some(bytes) => super::position::decode_words::<1>(bytes).ok_or_else(|| {
                SourceError::BadPosition {
                    position: bytes.to_vec(),
                    what: "a generator position is one big-endian u64".to_owned(),
                }
            })?[0],
        };
        Ok(Box::new(GeneratorSource {
            params: self.params.clone(),
            partition,
            partitions: self.partitions,
            next,
            started: Instant::now(),
            emitted_since_start: 0,
        }))
    }
}

/// One partition of the generator.
pub struct GeneratorSource {
    params: GeneratorParams,
    partition: u32,
    partitions: u32,
    next: u64,
    started: Instant,
    emitted_since_start: u64,
}

impl GeneratorSource {
    fn exhausted(&self) -> bool {
        self.params.count != 0 && self.next >= self.params.count
    }

    /// How many messages the rate limit allows now, or when the next one is allowed.
    fn allowance(&self, now: Instant) -> Result<u64, Instant> {
        let rate = self.params.rate_per_second;
        if rate == 0 {
            return Ok(u64::MAX);
        }
        // Integer arithmetic: at the due instant the next message must be allowed exactly, or a
        // reader would wake up, find nothing allowed and spin.
        let elapsed = now.duration_since(self.started).as_nanos();
        let allowed = (elapsed * u128::from(rate) / 1_000_000_000) as u64 + 1;
        if allowed > self.emitted_since_start {
            Ok(allowed - self.emitted_since_start)
        } else {
            let due_nanos =
                (u128::from(self.emitted_since_start) * 1_000_000_000).div_ceil(u128::from(rate));
            Err(self.started + Duration::from_nanos(u64::try_from(due_nanos).unwrap_or(u64::MAX)))
        }
    }
}

impl GeneratorSource {
    fn generate(&mut self, out: &mut SourceOutput<'_>, n: u64) -> Result<(), SourceError> {
        for _ in 0..n {
            let offset = self.next;
            let (id, user_id, ts) = row_values(self.partition, offset, self.partitions);
            let payload_bytes = self.params.payload_bytes;
            let mut row = out.batch.start_row(MessageId::new(self.partition, offset));
            row.push(Value::Uint(id))
                .and_then(|r| r.push(Value::Uint(u64::from(self.partition))))
                .and_then(|r| r.push(Value::Uint(offset)))
                .and_then(|r| r.push(Value::Uint(user_id)))
                .and_then(|r| r.push(Value::Uint(ts)))
                .and_then(|r| r.push_bytes_with(|arena| append_payload(id, payload_bytes, arena)))
                .map_err(|err| SourceError::Plugin(Box::new(err)))?;
            row.finish()
                .map_err(|err| SourceError::Plugin(Box::new(err)))?;
            self.next += 1;
            self.emitted_since_start += 1;
        }
        Ok(())
    }
}

#[async_trait]
impl Source for GeneratorSource {
    async fn read(
        &mut self,
        out: &mut SourceOutput<'_>,
        limits: ReadLimits,
    ) -> Result<SourceRead, SourceError> {
        let mut budget = limits.max_messages as u64;
        if self.params.count != 0 {
            budget = budget.min(self.params.count.saturating_sub(self.next));
        }
        let allowed = match self.allowance(Instant::now()) {
            Ok(allowed) => allowed,
            Err(due) => {
                tokio::time::sleep_until(due.min(limits.deadline)).await;
                self.allowance(Instant::now()).unwrap_or(0)
            }
        };
        let n = budget.min(allowed);
        self.generate(out, n)?;
        Ok(SourceRead {
            position: super::position::encode_words(&[self.next]),
            exhausted: self.exhausted(),
            lag: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::MessageBatch;

    async fn read_all(partition: u32, partitions: u32, count: u64) -> MessageBatch {
        let factory = GeneratorFactory {
            params: GeneratorParams {
                count,
                rate_per_second: 0,
                payload_bytes: 8,
            },
            partitions,
            schema: schema(),
        };
        let mut source = factory.open_partition(partition, None).unwrap();
        let mut batch = MessageBatch::new(schema());
        let mut dead = Vec::new();
        let mut out = SourceOutput {
            batch: &mut batch,
            dead_letters: &mut dead,
        };
        let read = source
            .read(
                &mut out,
                ReadLimits {
                    max_messages: 1000,
                    deadline: Instant::now() + Duration::from_secs(5),
                },
            )
            .await
            .unwrap();
        assert!(read.exhausted);
        assert_eq!(read.position, 3u64.to_be_bytes().to_vec());
        batch
    }

    #[tokio::test]
    async fn rows_follow_the_contract_formulas() {
        let batch = read_all(2, 4, 3).await;
        assert_eq!(batch.len(), 3);
        let row = batch.row(2);
        assert_eq!(row.id(), MessageId::new(2, 2));
        assert_eq!(row.get(0), Value::Uint(10)); // id = 2 * 4 + 2
        assert_eq!(row.get(1), Value::Uint(2));
        assert_eq!(row.get(2), Value::Uint(2));
        assert_eq!(row.get(3), Value::Uint(10));
        assert_eq!(row.get(4), Value::Uint(TS_BASE));
        let Value::Bytes(payload) = row.get(5) else {
            panic!("payload is not bytes")
        };
        // Written in place, the payload is what the hand-written baselines make for the id.
        let mut expected = Vec::new();
        fill_payload(10, 8, &mut expected);
        assert_eq!(payload, &expected[..]);
    }

    #[tokio::test]
    async fn replay_is_identical() {
        let a = read_all(1, 2, 3).await;
        let b = read_all(1, 2, 3).await;
        for i in 0..3 {
            assert_eq!(
                a.row(i).values().collect::<Vec<_>>(),
                b.row(i).values().collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn payload_is_deterministic_and_printable() {
        let mut a = Vec::new();
        let mut b = Vec::new();
        fill_payload(42, 40, &mut a);
        fill_payload(42, 40, &mut b);
        assert_eq!(a, b);
        assert_eq!(a.len(), 40);
        assert!(a.iter().all(|c| c.is_ascii_alphanumeric()));
        fill_payload(43, 40, &mut b);
        assert_ne!(a, b);
    }

    #[tokio::test]
    async fn resume_from_position_continues_at_the_next_offset() {
        let factory = GeneratorFactory {
            params: GeneratorParams {
                count: 5,
                rate_per_second: 0,
                payload_bytes: 0,
            },
            partitions: 1,
            schema: schema(),
        };
        let mut source = factory
            .open_partition(0, Some(&3u64.to_be_bytes()))
            .unwrap();
        let mut batch = MessageBatch::new(schema());
        let mut dead = Vec::new();
        let read = source
            .read(
                &mut SourceOutput {
                    batch: &mut batch,
                    dead_letters: &mut dead,
                },
                ReadLimits {
                    max_messages: 100,
                    deadline: Instant::now() + Duration::from_secs(1),
                },
            )
            .await
            .unwrap();
        assert_eq!(batch.ids(), &[MessageId::new(0, 3), MessageId::new(0, 4)]);
        assert!(read.exhausted);
        assert!(factory.open_partition(0, Some(b"xyz")).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn rate_limit_bounds_messages_per_second() {
        let factory = GeneratorFactory {
            params: GeneratorParams {
                count: 0,
                rate_per_second: 100,
                payload_bytes: 0,
            },
            partitions: 1,
            schema: schema(),
        };
        let mut source = factory.open_partition(0, None).unwrap();
        let mut batch = MessageBatch::new(schema());
        let mut dead = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let read = source
                .read(
                    &mut SourceOutput {
                        batch: &mut batch,
                        dead_letters: &mut dead,
                    },
                    ReadLimits {
                        max_messages: 100_000,
                        deadline,
                    },
                )
                .await
                .unwrap();
            assert!(!read.exhausted);
            if Instant::now() >= deadline {
                break;
            }
        }
        // 2 s at 100/s, plus the first message allowed at t = 0.
        assert!((200..=202).contains(&batch.len()), "{}", batch.len());
    }
}

//! The `kafka` source: flow partition `i` reads one partition of a Kafka topic (partition `i`, or
//! the `i`-th entry of `topic_partitions`), in offset order. The position is the offset of the next
//! message to read, committed in the outbox with the epoch. Each reader assigns its partition to
//! its own consumer at that offset (manual assignment: no consumer group, no rebalancing), so a
//! restart or the rebuild of a pending batch re-reads exactly what was read before.
//!
//! `auto.offset.reset` is `error`: when the broker no longer holds the position (retention deleted
//! it), librdkafka reports it instead of jumping elsewhere, and the partition stops naming the
//! offsets lost. A `group_id`, when given, receives the read position now and then, for monitoring
//! tools only; flow never reads it back.
//!
//! `params`: the parameters and their validation; `reader`: one partition's reader; `position`:
//! the committed position and the topic's identity in it; `error`:
//! [`KafkaSourceError`].

mod error;
mod params;
mod position;
mod reader;

pub use error::KafkaSourceError;
pub(crate) use params::build;
pub use params::KafkaParams;

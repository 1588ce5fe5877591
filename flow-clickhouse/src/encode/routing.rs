//! Row routing for the sharded ClickHouse sink: rendezvous (highest-random-weight) hashing of a
//! canonical routing key over the shard names.
//!
//! Both the key encoding and the score are persisted behaviour in effect: a batch replayed after a
//! restart must reach the same shard it reached the first time, so neither may change.
//!
//! * **Score**: `score(key, shard) = xxh64(key, seed = xxh64(shard_name_bytes, 0))`. The shard with
//!   the maximum score wins; equal scores are won by the smaller name. Adding or removing a shard
//!   therefore moves only the keys that the added shard wins or the removed shard held.
//! * **Routing key** (see [`routing_key`]): with no `sharding_key_columns`, the message id
//!   (`partition` as `u32` LE, then `offset` as `u64` LE); otherwise the key columns' values in the
//!   configured order, each as a tag byte (`0` null, `1` int, `2` uint, `3` float, `4` bool,
//!   `5` bytes) followed by `Int` as `i64` LE, `Uint` as `u64` LE, `Float` as the `f64` bits LE
//!   (`-0.0` normalised to `0.0`), `Bool` as one byte (`0`/`1`), `Bytes` as a `u32` LE length and
//!   the bytes. Null has no payload.

use flow_core::{Row, Value};
use xxhash_rust::xxh64::xxh64;

const TAG_NULL: u8 = 0;
const TAG_INT: u8 = 1;
const TAG_UINT: u8 = 2;
const TAG_FLOAT: u8 = 3;
const TAG_BOOL: u8 = 4;
const TAG_BYTES: u8 = 5;
const TAG_PACKED: u8 = 6;

/// Rendezvous (highest-random-weight) routing over shard names.
#[derive(Clone, Debug)]
pub struct RendezvousRouter {
    /// Shard names, sorted.
    shards: Vec<String>,
    /// `seeds[i] = xxh64(shards[i], 0)`.
    seeds: Vec<u64>,
}

impl RendezvousRouter {
    /// `shards`: names (any order, unique); stored sorted by name. The sharded sink validates that
    /// the list is non-empty and the names unique before building a router.
    pub fn new(shards: &[String]) -> RendezvousRouter {
        let mut shards = shards.to_vec();
        shards.sort_unstable();
        debug_assert!(
            shards.windows(2).all(|pair| pair[0] != pair[1]),
            "shard names must be unique"
        );
        let seeds = shards
            .iter()
            .map(|name| xxh64(name.as_bytes(), 0))
            .collect();
        RendezvousRouter { shards, seeds }
    }

    /// The shard names, sorted; [`route`](Self::route) returns indexes into this slice.
    pub fn shards(&self) -> &[String] {
        &self.shards
    }

    /// Index into [`shards`](Self::shards) of the winner for `key`: the shard with the maximum
    /// `xxh64(key, seed = xxh64(shard_name, 0))`; ties go to the smaller name. Does not allocate.
    /// A router without shards returns 0.
    pub fn route(&self, key: &[u8]) -> usize {
        let mut best = 0;
        let mut best_score = 0u64;
        for (index, &seed) in self.seeds.iter().enumerate() {
            let score = xxh64(key, seed);
            // Names are sorted, so keeping the first maximum breaks ties by the smaller name.
            if index == 0 || score > best_score {
                best = index;
                best_score = score;
            }
        }
        best
    }
}

/// Builds the routing key of a row without allocating (the caller reuses `buf`, which is cleared
/// first).
///
/// `key_columns` = indexes of `sharding_key_columns` in the row's schema, in order; empty => the
/// message id is the key (partition as `u32` LE then offset as `u64` LE). Each value is encoded
/// canonically: a tag byte (0 null, 1 int, 2 uint, 3 float, 4 bool, 5 bytes) then `Int` as `i64`
/// LE, `Uint` as `u64` LE, `Float` as `f64` bits LE (with `-0.0` normalised to `0.0`), `Bool` as
/// one byte, `Bytes` as `u32` LE length + bytes.
///
/// Panics if an index is outside the row's schema (a programming error: the indexes are resolved
/// against the schema when the sink is built). A string longer than `u32::MAX` bytes has its length
/// saturated, which cannot occur for a message the runtime accepted.
pub fn routing_key(row: &Row<'_>, key_columns: &[usize], buf: &mut Vec<u8>) {
    buf.clear();
    if key_columns.is_empty() {
        let id = row.id();
        buf.extend_from_slice(&id.partition.to_le_bytes());
        buf.extend_from_slice(&id.offset.to_le_bytes());
        return;
    }
    for &column in key_columns {
        encode_value(row.get(column), buf);
    }
}

fn encode_value(value: Value<'_>, buf: &mut Vec<u8>) {
    match value {
        Value::Null => buf.push(TAG_NULL),
        Value::Int(v) => {
            buf.push(TAG_INT);
            buf.extend_from_slice(&v.to_le_bytes());
        }
        Value::Uint(v) => {
            buf.push(TAG_UINT);
            buf.extend_from_slice(&v.to_le_bytes());
        }
        Value::Float(v) => {
            buf.push(TAG_FLOAT);
            // -0.0 == 0.0, so this maps both zeros to the bits of +0.0.
            let v = if v == 0.0 { 0.0 } else { v };
            buf.extend_from_slice(&v.to_bits().to_le_bytes());
        }
        Value::Bool(v) => {
            buf.push(TAG_BOOL);
            buf.push(u8::from(v));
        }
        Value::Bytes(bytes) => {
            buf.push(TAG_BYTES);
            let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
            buf.extend_from_slice(&len.to_le_bytes());
            buf.extend_from_slice(bytes);
        }
        // A packed value's bytes are canonical for its type (decimals, UUIDs, lists, ...).
        Value::Packed(bytes) => {
            buf.push(TAG_PACKED);
            let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
            buf.extend_from_slice(&len.to_le_bytes());
            buf.extend_from_slice(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use flow_core::{Column, MessageBatch, MessageId, StreamSchema, StreamType};

    use super::*;

    const KEYS: u64 = 100_000;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|name| (*name).to_owned()).collect()
    }

    /// The default key form: a message id (partition u32 LE, offset u64 LE).
    fn id_key(i: u64) -> [u8; 12] {
        let mut key = [0u8; 12];
        key[..4].copy_from_slice(&((i % 7) as u32).to_le_bytes());
        key[4..].copy_from_slice(&(i / 7).to_le_bytes());
        key
    }

    fn winner<'r>(router: &'r RendezvousRouter, key: &[u8]) -> &'r str {
        &router.shards()[router.route(key)]
    }

    #[test]
    fn shards_are_sorted_by_name() {
        let router = RendezvousRouter::new(&names(&["c", "a", "b"]));
        assert_eq!(router.shards(), names(&["a", "b", "c"]).as_slice());
    }

    #[test]
    fn routing_is_deterministic_across_instances_and_orderings() {
        let first = RendezvousRouter::new(&names(&["a", "b", "c", "d"]));
        let second = RendezvousRouter::new(&names(&["d", "b", "a", "c"]));
        let third = RendezvousRouter::new(&names(&["c", "d", "a", "b"]));
        for i in 0..10_000 {
            let key = id_key(i);
            let expected = winner(&first, &key);
            assert_eq!(winner(&first, &key), expected);
            assert_eq!(winner(&second, &key), expected);
            assert_eq!(winner(&third, &key), expected);
        }
    }

    #[test]
    fn score_is_xxh64_of_the_key_seeded_by_the_shard_name_hash() {
        let router = RendezvousRouter::new(&names(&["a", "b", "c"]));
        for i in 0..1_000 {
            let key = id_key(i);
            let expected = ["a", "b", "c"]
                .iter()
                .map(|name| (xxh64(&key, xxh64(name.as_bytes(), 0)), *name))
                // Max score, then the smaller name.
                .max_by(|x, y| x.0.cmp(&y.0).then(y.1.cmp(x.1)))
                .map(|(_, name)| name);
            assert_eq!(Some(winner(&router, &key)), expected);
        }
    }

    #[test]
    fn single_shard_gets_every_key_and_empty_router_returns_zero() {
        let router = RendezvousRouter::new(&names(&["only"]));
        assert!((0..1_000).all(|i| router.route(&id_key(i)) == 0));
        assert_eq!(RendezvousRouter::new(&[]).route(b"key"), 0);
    }

    #[test]
    fn keys_spread_uniformly_over_two_three_and_four_shards() {
        for list in [
            &["a", "b"][..],
            &["a", "b", "c"][..],
            &["shard-1", "shard-2", "shard-3", "shard-4"][..],
        ] {
            let router = RendezvousRouter::new(&names(list));
            let mut counts = vec![0u64; list.len()];
            for i in 0..KEYS {
                counts[router.route(&id_key(i))] += 1;
            }
            let share = KEYS as f64 / list.len() as f64;
            for (shard, &count) in router.shards().iter().zip(&counts) {
                let deviation = (count as f64 - share).abs() / share;
                assert!(
                    deviation <= 0.05,
                    "shard {shard} got {count} of {KEYS} keys over {} shards ({counts:?})",
                    list.len()
                );
            }
        }
    }

    #[test]
    fn adding_a_shard_moves_only_keys_to_the_new_shard() {
        let before = RendezvousRouter::new(&names(&["a", "b", "c"]));
        let after = RendezvousRouter::new(&names(&["a", "b", "c", "d"]));
        let mut moved = 0u64;
        for i in 0..KEYS {
            let key = id_key(i);
            let (old, new) = (winner(&before, &key), winner(&after, &key));
            if old != new {
                assert_eq!(new, "d", "key {i} moved from {old} to {new}");
                moved += 1;
            }
        }
        let fraction = moved as f64 / KEYS as f64;
        assert!((fraction - 0.25).abs() <= 0.03, "moved fraction {fraction}");
    }

    #[test]
    fn removing_a_shard_moves_only_its_own_keys() {
        let before = RendezvousRouter::new(&names(&["a", "b", "c"]));
        let after = RendezvousRouter::new(&names(&["a", "b"]));
        let mut moved = 0u64;
        for i in 0..KEYS {
            let key = id_key(i);
            let (old, new) = (winner(&before, &key), winner(&after, &key));
            if old == "c" {
                moved += 1;
            } else {
                assert_eq!(old, new, "key {i} was on {old}, not on the removed shard");
            }
        }
        let fraction = moved as f64 / KEYS as f64;
        assert!(
            (fraction - 1.0 / 3.0).abs() <= 0.03,
            "moved fraction {fraction}"
        );
    }

    fn schema() -> Arc<StreamSchema> {
        StreamSchema::new(vec![
            Column::new("user", StreamType::Optional(Box::new(StreamType::Int64))),
            Column::new("region", StreamType::Utf8),
            Column::new("count", StreamType::Uint32),
            Column::new("score", StreamType::Double),
            Column::new("flag", StreamType::Boolean),
        ])
        .unwrap()
    }

    fn batch(rows: &[(MessageId, [Value<'_>; 5])]) -> MessageBatch {
        let mut batch = MessageBatch::new(schema());
        for (id, values) in rows {
            let mut row = batch.start_row(*id);
            for value in values {
                row.push(*value).unwrap();
            }
            row.finish().unwrap();
        }
        batch
    }

    #[test]
    fn routing_key_encodes_each_column_canonically() {
        let batch = batch(&[(
            MessageId::new(1, 2),
            [
                Value::Int(-2),
                Value::Bytes(b"eu"),
                Value::Uint(7),
                Value::Float(1.5),
                Value::Bool(true),
            ],
        )]);
        let mut buf = vec![0xff; 3];
        routing_key(&batch.row(0), &[0, 1, 2, 3, 4], &mut buf);
        let mut expected = vec![1u8];
        expected.extend_from_slice(&[0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        expected.extend_from_slice(&[5, 2, 0, 0, 0, b'e', b'u']);
        expected.extend_from_slice(&[2, 7, 0, 0, 0, 0, 0, 0, 0]);
        expected.extend_from_slice(&[3, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f]);
        expected.extend_from_slice(&[4, 1]);
        assert_eq!(buf, expected);

        // Column order matters; a subset encodes only the chosen columns.
        routing_key(&batch.row(0), &[4, 1], &mut buf);
        assert_eq!(buf, vec![4, 1, 5, 2, 0, 0, 0, b'e', b'u']);
    }

    #[test]
    fn routing_key_tells_null_from_zero_and_normalises_negative_zero() {
        let batch = batch(&[
            (
                MessageId::new(0, 0),
                [
                    Value::Null,
                    Value::Bytes(b""),
                    Value::Uint(0),
                    Value::Float(-0.0),
                    Value::Bool(false),
                ],
            ),
            (
                MessageId::new(0, 1),
                [
                    Value::Int(0),
                    Value::Bytes(b""),
                    Value::Uint(0),
                    Value::Float(0.0),
                    Value::Bool(false),
                ],
            ),
        ]);
        let (mut null_key, mut zero_key) = (Vec::new(), Vec::new());
        routing_key(&batch.row(0), &[0], &mut null_key);
        routing_key(&batch.row(1), &[0], &mut zero_key);
        assert_eq!(null_key, vec![0]);
        assert_eq!(zero_key, vec![1, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_ne!(null_key, zero_key);

        routing_key(&batch.row(0), &[3], &mut null_key);
        routing_key(&batch.row(1), &[3], &mut zero_key);
        assert_eq!(null_key, vec![3, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(null_key, zero_key);

        // An empty string still carries its length, so it differs from null too.
        routing_key(&batch.row(0), &[1], &mut null_key);
        assert_eq!(null_key, vec![5, 0, 0, 0, 0]);
    }

    #[test]
    fn routing_key_is_the_message_id_without_key_columns() {
        let values = [
            Value::Int(9),
            Value::Bytes(b"x"),
            Value::Uint(1),
            Value::Float(2.0),
            Value::Bool(true),
        ];
        let batch = batch(&[(MessageId::new(3, 0x0102_0304_0506), values)]);
        let mut buf = vec![1, 2, 3];
        routing_key(&batch.row(0), &[], &mut buf);
        assert_eq!(buf, vec![3, 0, 0, 0, 6, 5, 4, 3, 2, 1, 0, 0]);
        assert_eq!(buf.as_slice(), id_key(3 + 7 * 0x0102_0304_0506).as_slice());
    }
}

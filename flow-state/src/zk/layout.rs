//! Where a partition's state lives in ZooKeeper: `<root>/<pipeline>/partitions/<p>/state/`, one
//! flat level of children named `<kind>.<escaped name>[.<seq>]`, so that one listing finds all.
//!
//! | child                    | data                                                        |
//! |--------------------------|-------------------------------------------------------------|
//! | `position`               | the committed source position (opaque bytes)                |
//! | `counters`               | every counter of the partition (bincode list)               |
//! | `queue.<sink>`           | the queue bounds `head..next` (2 x be64), as in sled        |
//! | `batch.<sink>.<seq>`     | one pending batch: bounds + hash, the sled value (no payload) |
//! | `fp.<sink>`              | the sink's fingerprints (bincode map), as in sled           |
//! | `dlseq.<owner>`          | the owner's next dead-letter seq (be64)                     |
//! | `dead.<owner>.<seq>`     | a dead-letter reference: the dead letter without its payload |
//! | `value.<sink>.<name>`    | a partition-scoped sink value (`<kind>/<partition>[/...]`)  |
//!
//! Names are escaped (`%XX` for every byte outside `[A-Za-z0-9_-]`): a sink or value name may
//! hold `.` or `/`, which ZooKeeper names cannot. Seqs are 20 decimal digits, so a listing sorts
//! in seq order.

use std::fmt::Write as _;

/// The most bytes flow puts in one node: ZooKeeper refuses a request above its `jute.maxbuffer`
/// (1 MiB by default), and a multi carries several nodes.
pub(crate) const NODE_LIMIT: usize = 512 * 1024;

/// The node holding every state child of `partition`: a sibling of the `owner` and `lease` nodes
/// of cluster membership (the pipeline's name as it is, like theirs).
pub(crate) fn state_path(root: &str, pipeline: &str, partition: u32) -> String {
    format!(
        "{}/{pipeline}/partitions/{partition}/state",
        root.trim_end_matches('/')
    )
}

/// One child of a partition's `state` node, parsed from its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Child {
    Position,
    Counters,
    Queue { sink: String },
    Batch { sink: String, seq: u64 },
    Fingerprints { sink: String },
    DeadLetterSeq { owner: String },
    DeadLetter { owner: String, seq: u64 },
    Value { sink: String, name: String },
}

impl Child {
    /// The child's node name.
    pub(crate) fn name(&self) -> String {
        match self {
            Child::Position => "position".to_owned(),
            Child::Counters => "counters".to_owned(),
            Child::Queue { sink } => format!("queue.{}", escape(sink)),
            Child::Batch { sink, seq } => format!("batch.{}.{seq:020}", escape(sink)),
            Child::Fingerprints { sink } => format!("fp.{}", escape(sink)),
            Child::DeadLetterSeq { owner } => format!("dlseq.{}", escape(owner)),
            Child::DeadLetter { owner, seq } => format!("dead.{}.{seq:020}", escape(owner)),
            Child::Value { sink, name } => format!("value.{}.{}", escape(sink), escape(name)),
        }
    }

    /// Parses a child's node name; `None` for a name this layout does not have.
    pub(crate) fn parse(name: &str) -> Option<Child> {
        let mut parts = name.split('.');
        let kind = parts.next()?;
        let a = parts.next();
        let b = parts.next();
        if parts.next().is_some() {
            return None;
        }
        let seq = |s: Option<&str>| s.filter(|s| s.len() == 20)?.parse::<u64>().ok();
        Some(match (kind, a, b) {
            ("position", None, None) => Child::Position,
            ("counters", None, None) => Child::Counters,
            ("queue", Some(sink), None) => Child::Queue {
                sink: unescape(sink)?,
            },
            ("batch", Some(sink), b) => Child::Batch {
                sink: unescape(sink)?,
                seq: seq(b)?,
            },
            ("fp", Some(sink), None) => Child::Fingerprints {
                sink: unescape(sink)?,
            },
            ("dlseq", Some(owner), None) => Child::DeadLetterSeq {
                owner: unescape(owner)?,
            },
            ("dead", Some(owner), b) => Child::DeadLetter {
                owner: unescape(owner)?,
                seq: seq(b)?,
            },
            ("value", Some(sink), Some(name)) => Child::Value {
                sink: unescape(sink)?,
                name: unescape(name)?,
            },
            _ => return None,
        })
    }
}

/// The partition a sink value belongs to, when its name is partition-scoped:
/// `<kind>/<partition>` or `<kind>/<partition>/<more>` (`gave_up/3`, `changed/3/17`, ...). Other
/// names (`file_len:<path>`) are sink-wide.
pub(crate) fn value_partition(name: &str) -> Option<u32> {
    let mut parts = name.split('/');
    let kind = parts.next()?;
    let partition = parts.next()?;
    if kind.is_empty() || partition.is_empty() || !partition.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    partition.parse().ok()
}

fn escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

fn unescape(name: &str) -> Option<String> {
    let bytes = name.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_child_name_parses_back_and_escapes_dots_and_slashes() {
        let children = [
            Child::Position,
            Child::Counters,
            Child::Queue {
                sink: "ch.a".into(),
            },
            Child::Batch {
                sink: "ch".into(),
                seq: 42,
            },
            Child::Fingerprints { sink: "ch".into() },
            Child::DeadLetterSeq {
                owner: "source".into(),
            },
            Child::DeadLetter {
                owner: "ch".into(),
                seq: u64::MAX,
            },
            Child::Value {
                sink: "ch".into(),
                name: "changed/3/17".into(),
            },
        ];
        for child in children {
            let name = child.name();
            assert!(!name.contains('/'), "{name}");
            assert_eq!(Child::parse(&name), Some(child), "{name}");
        }
        assert_eq!(
            Child::Batch {
                sink: "ch".into(),
                seq: 7
            }
            .name(),
            "batch.ch.00000000000000000007"
        );
        assert_eq!(Child::parse("batch.ch.7"), None);
        assert_eq!(Child::parse("lease"), None);
        assert_eq!(
            state_path("/flow/", "events", 3),
            "/flow/events/partitions/3/state"
        );
    }

    #[test]
    fn only_kind_slash_partition_names_are_partition_scoped() {
        assert_eq!(value_partition("gave_up/3"), Some(3));
        assert_eq!(value_partition("changed/12/99"), Some(12));
        assert_eq!(value_partition("file_len:/tmp/x"), None);
        assert_eq!(value_partition("columns"), None);
        assert_eq!(value_partition("/3"), None);
        assert_eq!(value_partition("x/-3"), None);
    }
}

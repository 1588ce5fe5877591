//! Topology and target fingerprints of the exactly-once ClickHouse sinks, and the topology change
//! guard that compares them at startup.
//!
//! The sink stores fingerprints in its own state and compares them with the current spec and the
//! ClickHouse metadata when a partition starts; while undelivered batches remain, any mismatch
//! refuses the start (see [`check_topology`]). **These formats are persisted**: changing any of
//! them makes every partition with undelivered batches refuse to start.
//!
//! Every hash is xxh64 with seed 0 of a UTF-8 pre-hash string, printed as 16 lowercase hex digits
//! (zero-padded). Lists inside a pre-hash string are *length-prefixed*: each item is written as
//! `<len>:<item>,` where `<len>` is the item's byte length in decimal, so `["user_id"]` becomes
//! `7:user_id,` and no item can be confused with a separator.
//!
//! * **Routing (topology) fingerprint**, [`topology_fingerprint`]:
//!   - unsharded forms (`host`, `hosts`): the constant [`UNSHARDED`] (`unsharded`), not a hash;
//!   - `shard_hosts`: `hex(xxh64(lp(sharding_key_columns in the configured order) + "|" +
//!     lp(shard names sorted)))`. Host lists are not part of it.
//! * **Target fingerprint** of a shard (the unsharded table is shard `""`):
//!   - `Replicated*MergeTree`, [`replicated_target_fingerprint`]:
//!     `hex(xxh64("replicated|" + lp([zookeeper_name, zookeeper_path])))`. Servers without
//!     `system.replicas.zookeeper_name` use Keeper `default`, which the caller passes;
//!   - plain `MergeTree` / single-host `SharedMergeTree`, [`endpoint_target_fingerprint`]:
//!     `hex(xxh64("endpoint|" + lp([database, table, port in decimal]) + "|" + lp(hosts sorted)))`,
//!     hosts as written (`host:port`).
//! * **State keys**: the routing fingerprint is stored under [`ROUTING_KEY`] (`routing`), the target
//!   fingerprint of shard `s` under [`target_key`]`(s)` = `target:<s>` (`target:` when unsharded).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use xxhash_rust::xxh64::xxh64;

use crate::config::topology::Endpoint;

/// The routing fingerprint of the unsharded forms (`host` and `hosts`).
pub const UNSHARDED: &str = "unsharded";

/// State key of the routing fingerprint.
pub const ROUTING_KEY: &str = "routing";

/// Prefix of the state keys of target fingerprints.
const TARGET_PREFIX: &str = "target:";

/// Rendered in error texts for a fingerprint or bound that is absent.
const ABSENT: &str = "<absent>";

/// State key of the target fingerprint of `shard` (`""` for the unsharded forms): `target:<shard>`.
pub fn target_key(shard: &str) -> String {
    format!("{TARGET_PREFIX}{shard}")
}

/// `<len>:<item>,` for each item, `len` being the item's byte length.
fn length_prefixed<I, S>(items: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let mut out = String::new();
    for item in items {
        let item = item.as_ref();
        // Writing into a String cannot fail.
        let _ = write!(out, "{}:{item},", item.len());
    }
    out
}

fn hex_xxh64(text: &str) -> String {
    format!("{:016x}", xxh64(text.as_bytes(), 0))
}

fn sorted(items: &[String]) -> Vec<&str> {
    let mut items: Vec<&str> = items.iter().map(String::as_str).collect();
    items.sort_unstable();
    items
}

fn topology_preimage(key_columns: &[String], shard_names: &[String]) -> String {
    format!(
        "{}|{}",
        length_prefixed(key_columns),
        length_prefixed(sorted(shard_names))
    )
}

fn replicated_preimage(zookeeper_name: &str, zookeeper_path: &str) -> String {
    format!(
        "replicated|{}",
        length_prefixed([zookeeper_name, zookeeper_path])
    )
}

fn endpoint_preimage(database: &str, table: &str, port: u16, hosts: &[String]) -> String {
    let port = port.to_string();
    format!(
        "endpoint|{}|{}",
        length_prefixed([database, table, port.as_str()]),
        length_prefixed(sorted(hosts))
    )
}

/// The routing fingerprint. `shard_names`: `None` for the unsharded forms (`host`, `hosts`), which
/// share the constant `"unsharded"`; otherwise the hex xxh64 of
/// `length_prefixed(key_columns) + "|" + length_prefixed(shard names sorted)`. The key column order
/// matters; the shard order does not.
pub fn topology_fingerprint(key_columns: &[String], shard_names: Option<&[String]>) -> String {
    match shard_names {
        None => UNSHARDED.to_owned(),
        Some(shard_names) => hex_xxh64(&topology_preimage(key_columns, shard_names)),
    }
}

/// The target fingerprint of a `Replicated*MergeTree` shard: the Keeper identity of the table,
/// whatever the hosts. Pass `"default"` as `zookeeper_name` for servers without
/// `system.replicas.zookeeper_name`.
pub fn replicated_target_fingerprint(zookeeper_name: &str, zookeeper_path: &str) -> String {
    hex_xxh64(&replicated_preimage(zookeeper_name, zookeeper_path))
}

/// The target fingerprint of a shard whose identity cannot be proven from metadata (plain
/// `MergeTree`, single-host `SharedMergeTree`): database, table, port and the hosts (`host:port`,
/// as written; order does not matter).
pub fn endpoint_target_fingerprint(
    database: &str,
    table: &str,
    port: u16,
    endpoints: &[Endpoint],
) -> String {
    // The one place an endpoint becomes fingerprint bytes: as it displays (`[v6]:port`).
    let hosts: Vec<String> = endpoints.iter().map(Endpoint::to_string).collect();
    hex_xxh64(&endpoint_preimage(database, table, port, &hosts))
}

/// What the sink does with its fingerprints after a successful check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopologyDecision {
    /// Nothing undelivered depends on the persisted fingerprints (or there are none): persist the
    /// current ones.
    Adopt,
    /// Undelivered batches remain and every persisted fingerprint matches: keep the state as is.
    Keep,
}

/// A topology or target change while batches are undelivered; the partition refuses to start.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error(
        "Refusing to start the ClickHouse sink: the shard topology changed while {undelivered} \
         batch(es) are still undelivered; replaying them under the new topology would duplicate \
         or drop rows. Restore the previous shard_hosts / sharding_key_columns, deliver the \
         pending batches with `flow-worker drain SPEC` (docs/operations.md, runbook \
         \"Topology change\"), then apply the change\n    \
         persisted_topology_fingerprint = {persisted}\n    \
         spec_topology_fingerprint      = {spec}\n    \
         oldest_undelivered_batch_bound = {bound}",
        bound = .oldest_bound.as_deref().unwrap_or(ABSENT)
    )]
    RoutingChanged {
        undelivered: u64,
        persisted: String,
        spec: String,
        oldest_bound: Option<String>,
    },
    #[error(
        "Refusing to start the ClickHouse sink: {subject} changed while {undelivered} batch(es) \
         are still undelivered; replaying them into a target that cannot be proven to be the same \
         table would duplicate or drop rows. Restore the previous endpoints/table, deliver the \
         pending batches with `flow-worker drain SPEC` (docs/operations.md, runbook \
         \"Topology change\"), then apply the change\n    \
         persisted_target_fingerprint = {persisted}\n    \
         current_target_fingerprint   = {current}",
        subject = target_subject(.shard)
    )]
    TargetChanged {
        /// `""` for the unsharded forms.
        shard: String,
        persisted: String,
        current: String,
        undelivered: u64,
    },
}

/// The topology change guard, run when a partition starts.
///
/// `persisted` and `current` map state keys ([`ROUTING_KEY`], [`target_key`]) to fingerprints;
/// other keys are ignored. With no undelivered batches, or with an empty (fresh) persisted map, the
/// result is [`TopologyDecision::Adopt`] and the caller persists `current`. Otherwise the routing
/// fingerprints must be equal ([`TopologyError::RoutingChanged`]), and so must the target
/// fingerprints of every shard on either side ([`TopologyError::TargetChanged`], the first
/// mismatching shard by name; a side without the key shows `<absent>`); then the result is
/// [`TopologyDecision::Keep`]. `oldest_undelivered_bound` only feeds the error text.
pub fn check_topology(
    persisted: &BTreeMap<String, String>,
    current: &BTreeMap<String, String>,
    undelivered_batches: u64,
    oldest_undelivered_bound: Option<&str>,
) -> Result<TopologyDecision, TopologyError> {
    if undelivered_batches == 0 || persisted.is_empty() {
        return Ok(TopologyDecision::Adopt);
    }
    let persisted_routing = persisted.get(ROUTING_KEY);
    let current_routing = current.get(ROUTING_KEY);
    if persisted_routing != current_routing {
        return Err(TopologyError::RoutingChanged {
            undelivered: undelivered_batches,
            persisted: or_absent(persisted_routing),
            spec: or_absent(current_routing),
            oldest_bound: oldest_undelivered_bound.map(str::to_owned),
        });
    }
    let targets = |map: &'_ BTreeMap<String, String>| {
        map.keys()
            .filter_map(|key| key.strip_prefix(TARGET_PREFIX))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let mut shards = targets(persisted);
    shards.extend(targets(current));
    shards.sort_unstable();
    shards.dedup();
    for shard in shards {
        let key = target_key(&shard);
        let (old, new) = (persisted.get(&key), current.get(&key));
        if old != new {
            return Err(TopologyError::TargetChanged {
                shard,
                persisted: or_absent(old),
                current: or_absent(new),
                undelivered: undelivered_batches,
            });
        }
    }
    Ok(TopologyDecision::Keep)
}

/// "the target of shard `<shard>`", or "the target" for the unsharded forms (shard `""`).
fn target_subject(shard: &str) -> String {
    if shard.is_empty() {
        "the target".to_owned()
    } else {
        format!("the target of shard `{shard}`")
    }
}

fn or_absent(value: Option<&String>) -> String {
    value.map_or_else(|| ABSENT.to_owned(), String::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(hosts: &[String]) -> Vec<Endpoint> {
        hosts
            .iter()
            .map(|h| Endpoint::parse(h, 8123).unwrap())
            .collect()
    }

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|item| (*item).to_owned()).collect()
    }

    fn map(entries: &[(&str, &str)]) -> BTreeMap<String, String> {
        entries
            .iter()
            .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
            .collect()
    }

    #[test]
    fn length_prefixed_writes_byte_length_colon_item_comma() {
        assert_eq!(length_prefixed(["user_id"]), "7:user_id,");
        assert_eq!(length_prefixed(["a", "", "bc"]), "1:a,0:,2:bc,");
        assert_eq!(length_prefixed(Vec::<String>::new()), "");
        // Byte length, not characters.
        assert_eq!(length_prefixed(["é"]), "2:é,");
    }

    #[test]
    fn hash_is_xxh64_seed_zero_as_sixteen_lowercase_hex_digits() {
        // Published XXH64 test vectors: a change of hash implementation must fail here.
        assert_eq!(hex_xxh64(""), "ef46db3751d8e999");
        assert_eq!(hex_xxh64("abc"), "44bc2cf5ad770999");
    }

    #[test]
    fn topology_fingerprint_is_pinned() {
        let columns = strings(&["user_id", "region"]);
        let shards = strings(&["b", "a"]);
        assert_eq!(
            topology_preimage(&columns, &shards),
            "7:user_id,6:region,|1:a,1:b,"
        );
        assert_eq!(
            topology_fingerprint(&columns, Some(&shards)),
            "59023ffbccb45fe1"
        );
        // No key columns (routing by message id).
        assert_eq!(topology_preimage(&[], &shards), "|1:a,1:b,");
        assert_eq!(topology_fingerprint(&[], Some(&shards)), "d76d4a4ed2e8ffbb");
    }

    #[test]
    fn topology_fingerprint_ignores_shard_order_but_not_key_column_order() {
        let columns = strings(&["user_id", "region"]);
        let forward = topology_fingerprint(&columns, Some(&strings(&["a", "b", "c"])));
        let shuffled = topology_fingerprint(&columns, Some(&strings(&["c", "a", "b"])));
        assert_eq!(forward, shuffled);
        let swapped = topology_fingerprint(
            &strings(&["region", "user_id"]),
            Some(&strings(&["a", "b", "c"])),
        );
        assert_ne!(forward, swapped);
        let fewer = topology_fingerprint(&columns, Some(&strings(&["a", "b"])));
        assert_ne!(forward, fewer);
        assert_eq!(forward.len(), 16);
        assert!(forward
            .chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)));
    }

    #[test]
    fn unsharded_forms_share_the_constant_fingerprint() {
        assert_eq!(UNSHARDED, "unsharded");
        assert_eq!(topology_fingerprint(&[], None), "unsharded");
        assert_eq!(
            topology_fingerprint(&strings(&["user_id"]), None),
            "unsharded"
        );
        assert_ne!(topology_fingerprint(&[], Some(&strings(&["a"]))), UNSHARDED);
    }

    #[test]
    fn replicated_target_fingerprint_is_pinned() {
        assert_eq!(
            replicated_preimage("default", "/clickhouse/tables/01/events"),
            "replicated|7:default,28:/clickhouse/tables/01/events,"
        );
        assert_eq!(
            replicated_target_fingerprint("default", "/clickhouse/tables/01/events"),
            "ff5a316087095cca"
        );
        assert_ne!(
            replicated_target_fingerprint("aux", "/clickhouse/tables/01/events"),
            replicated_target_fingerprint("default", "/clickhouse/tables/01/events")
        );
    }

    #[test]
    fn endpoint_target_fingerprint_formats_ipv6_in_brackets_pinned() {
        let endpoints = [
            Endpoint::parse("[::1]", 8123).unwrap(),
            Endpoint::parse("127.0.0.1", 8123).unwrap(),
        ];
        // Stored fingerprints depend on these bytes: the endpoint as `Endpoint` displays it.
        assert_eq!(
            endpoint_target_fingerprint("db", "events", 8123, &endpoints),
            "811282dc233ccd31"
        );
        let hosts = strings(&["[::1]:8123", "127.0.0.1:8123"]);
        assert_eq!(
            endpoint_preimage("db", "events", 8123, &hosts),
            "endpoint|2:db,6:events,4:8123,|14:127.0.0.1:8123,10:[::1]:8123,"
        );
    }

    #[test]
    fn endpoint_target_fingerprint_is_pinned_and_ignores_host_order() {
        let hosts = strings(&["ch-b:9000", "ch-a:9000"]);
        assert_eq!(
            endpoint_preimage("db", "events", 9000, &hosts),
            "endpoint|2:db,6:events,4:9000,|9:ch-a:9000,9:ch-b:9000,"
        );
        assert_eq!(
            endpoint_target_fingerprint("db", "events", 9000, &endpoints(&hosts)),
            "0cdbeddcab821bc8"
        );
        assert_eq!(
            endpoint_target_fingerprint(
                "db",
                "events",
                9000,
                &endpoints(&strings(&["ch-a:9000", "ch-b:9000"]))
            ),
            endpoint_target_fingerprint("db", "events", 9000, &endpoints(&hosts))
        );
        assert_ne!(
            endpoint_target_fingerprint("db", "events", 9440, &endpoints(&hosts)),
            endpoint_target_fingerprint("db", "events", 9000, &endpoints(&hosts))
        );
    }

    #[test]
    fn state_keys() {
        assert_eq!(ROUTING_KEY, "routing");
        assert_eq!(target_key("a"), "target:a");
        assert_eq!(target_key(""), "target:");
    }

    fn sharded_state(routing: &str, a: &str, b: &str) -> BTreeMap<String, String> {
        map(&[("routing", routing), ("target:a", a), ("target:b", b)])
    }

    #[test]
    fn drained_or_fresh_state_adopts_the_current_fingerprints() {
        let persisted = sharded_state("1111", "aaaa", "bbbb");
        let current = map(&[("routing", "unsharded"), ("target:", "cccc")]);
        assert_eq!(
            check_topology(&persisted, &current, 0, None),
            Ok(TopologyDecision::Adopt)
        );
        assert_eq!(
            check_topology(&BTreeMap::new(), &current, 5, Some("0-9")),
            Ok(TopologyDecision::Adopt)
        );
    }

    #[test]
    fn matching_fingerprints_keep_the_state() {
        let state = sharded_state("1111", "aaaa", "bbbb");
        assert_eq!(
            check_topology(&state, &state.clone(), 2, Some("0-1")),
            Ok(TopologyDecision::Keep)
        );
        let mut with_other_keys = state.clone();
        with_other_keys.insert("version".to_owned(), "1".to_owned());
        assert_eq!(
            check_topology(&with_other_keys, &state, 2, None),
            Ok(TopologyDecision::Keep)
        );
    }

    #[test]
    fn routing_change_with_undelivered_batches_is_refused_with_the_reference_text() {
        let persisted = map(&[("routing", "unsharded"), ("target:", "cccc")]);
        let current = sharded_state("3f2a17c9b4e05d81", "aaaa", "bbbb");
        let err = check_topology(&persisted, &current, 3, Some("1-4-17")).unwrap_err();
        assert_eq!(
            err,
            TopologyError::RoutingChanged {
                undelivered: 3,
                persisted: "unsharded".to_owned(),
                spec: "3f2a17c9b4e05d81".to_owned(),
                oldest_bound: Some("1-4-17".to_owned()),
            }
        );
        assert_eq!(
            err.to_string(),
            "Refusing to start the ClickHouse sink: the shard topology changed while 3 batch(es) \
             are still undelivered; replaying them under the new topology would duplicate or drop \
             rows. Restore the previous shard_hosts / sharding_key_columns, deliver the pending \
             batches with `flow-worker drain SPEC` (docs/operations.md, runbook \"Topology \
             change\"), then apply the change\n\
             \x20   persisted_topology_fingerprint = unsharded\n\
             \x20   spec_topology_fingerprint      = 3f2a17c9b4e05d81\n\
             \x20   oldest_undelivered_batch_bound = 1-4-17"
        );
        let without_bound = TopologyError::RoutingChanged {
            undelivered: 1,
            persisted: "a".to_owned(),
            spec: "b".to_owned(),
            oldest_bound: None,
        };
        assert!(without_bound
            .to_string()
            .ends_with("\n    oldest_undelivered_batch_bound = <absent>"));
    }

    #[test]
    fn target_change_with_undelivered_batches_is_refused_with_its_text() {
        let persisted = sharded_state("1111", "aaaa", "bbbb");
        let current = sharded_state("1111", "aaaa", "dddd");
        let err = check_topology(&persisted, &current, 2, Some("0-5")).unwrap_err();
        assert_eq!(
            err,
            TopologyError::TargetChanged {
                shard: "b".to_owned(),
                persisted: "bbbb".to_owned(),
                current: "dddd".to_owned(),
                undelivered: 2,
            }
        );
        assert_eq!(
            err.to_string(),
            "Refusing to start the ClickHouse sink: the target of shard `b` changed while 2 \
             batch(es) are still undelivered; replaying them into a target that cannot be proven \
             to be the same table would duplicate or drop rows. Restore the previous \
             endpoints/table, deliver the pending batches with `flow-worker drain SPEC` \
             (docs/operations.md, runbook \"Topology change\"), then apply the change\n\
             \x20   persisted_target_fingerprint = bbbb\n\
             \x20   current_target_fingerprint   = dddd"
        );
    }

    #[test]
    fn missing_target_fingerprint_with_undelivered_batches_is_refused() {
        let persisted = sharded_state("1111", "aaaa", "bbbb");
        let current = map(&[("routing", "1111"), ("target:a", "aaaa")]);
        let err = check_topology(&persisted, &current, 1, None).unwrap_err();
        assert_eq!(
            err,
            TopologyError::TargetChanged {
                shard: "b".to_owned(),
                persisted: "bbbb".to_owned(),
                current: "<absent>".to_owned(),
                undelivered: 1,
            }
        );
        // The unsharded target is shard "" and is named without a shard.
        let persisted = map(&[("routing", "unsharded"), ("target:", "cccc")]);
        let current = map(&[("routing", "unsharded"), ("target:", "eeee")]);
        let err = check_topology(&persisted, &current, 4, None).unwrap_err();
        assert!(err.to_string().starts_with(
            "Refusing to start the ClickHouse sink: the target changed while 4 batch(es)"
        ));
    }
}

//! Where a sink writes, parsed once from the host forms of its parameters: a [`Topology`] of
//! [`Endpoint`]s (`host` → one host, `hosts` → replicas of one table, `shard_hosts` → named
//! shards of replicas).

use std::fmt;
use std::net::Ipv6Addr;

/// One ClickHouse server: host (an IPv6 address without brackets) and HTTP port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    /// Parses a host entry: `host`, `host:port`, `[v6]`, `[v6]:port` or a bare IPv6 address
    /// (which cannot carry a port). Entries without a port get `default_port`.
    pub fn parse(entry: &str, default_port: u16) -> Result<Endpoint, String> {
        const HINT: &str = "write `host` or `host:port` (IPv6 as `[addr]:port`), without scheme, \
                            path or spaces";
        if entry.is_empty() {
            return Err(
                "the host is empty: give a host name or address, or remove the entry".to_owned(),
            );
        }
        if entry.contains("://") {
            return Err(format!("`{entry}` has a URL scheme; {HINT}"));
        }
        let (host, port) = if let Some(rest) = entry.strip_prefix('[') {
            let Some((addr, after)) = rest.split_once(']') else {
                return Err(format!("`{entry}` has no closing `]`; {HINT}"));
            };
            if addr.parse::<Ipv6Addr>().is_err() {
                return Err(format!(
                    "`{addr}` in `{entry}` is not an IPv6 address; {HINT}"
                ));
            }
            let port = match after {
                "" => None,
                _ => match after.strip_prefix(':') {
                    Some(port) => Some(port),
                    None => {
                        return Err(format!("`{entry}`: unexpected `{after}` after `]`; {HINT}"))
                    }
                },
            };
            (addr, port)
        } else if entry.parse::<Ipv6Addr>().is_ok() {
            (entry, None)
        } else {
            match entry.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (entry, None),
            }
        };
        let is_ipv6 = host.contains(':');
        if !is_ipv6 {
            if host.is_empty() {
                return Err(format!("`{entry}` has no host before the port; {HINT}"));
            }
            if !host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
            {
                return Err(format!("`{entry}` is not a valid host; {HINT}"));
            }
        }
        let port = match port {
            None => default_port,
            Some(text) => match text.parse::<u16>() {
                Ok(port) if port > 0 => port,
                _ => {
                    return Err(format!(
                        "`{entry}` has port `{text}`, which is not a number in 1..=65535; fix \
                         the port or drop it to use `port`"
                    ))
                }
            },
        };
        Ok(Endpoint {
            host: host.to_owned(),
            port,
        })
    }
}

impl fmt::Display for Endpoint {
    /// `host:port`, with IPv6 addresses in brackets (`[::1]:8123`), ready for a URL.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// The servers a sink writes to.
/// A shard's position among the sink's shards: the same in the router's shards and the
/// session's shard clients (both in shard-name order; the unsharded forms have one shard, 0).
/// Carried in a part from routing to its INSERT; the shard's name is looked up by it only where
/// it is shown (logs, status, dead letters) or stored (deduplication tokens, outbox batches).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardIndex(pub usize);

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Topology {
    /// `host`: one server.
    SingleHost(Endpoint),
    /// `hosts`: replicas of one unsharded table, in failover order.
    Replicas(Vec<Endpoint>),
    /// `shard_hosts`: shards sorted by name.
    Shards(Vec<Shard>),
}

/// One shard of `shard_hosts`: its name and its replicas in failover order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    pub name: String,
    pub replicas: Vec<Endpoint>,
}

impl Topology {
    pub fn is_sharded(&self) -> bool {
        matches!(self, Topology::Shards(_))
    }

    /// The shard names in name order; empty for the unsharded forms.
    pub fn shard_names(&self) -> Vec<String> {
        match self {
            Topology::Shards(shards) => shards.iter().map(|s| s.name.clone()).collect(),
            Topology::SingleHost(_) | Topology::Replicas(_) => Vec::new(),
        }
    }

    /// The shards to write to with their endpoints: `None` names the one shard of the unsharded
    /// forms.
    pub fn shards(&self) -> Vec<(Option<&str>, &[Endpoint])> {
        match self {
            Topology::SingleHost(endpoint) => vec![(None, std::slice::from_ref(endpoint))],
            Topology::Replicas(endpoints) => vec![(None, endpoints.as_slice())],
            Topology::Shards(shards) => shards
                .iter()
                .map(|s| (Some(s.name.as_str()), s.replicas.as_slice()))
                .collect(),
        }
    }
}

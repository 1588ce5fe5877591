//! The cluster URL `zk://HOST:PORT[,HOST:PORT]/PATH`: the ZooKeeper ensemble and the node under
//! which flow keeps its cluster state.

use std::fmt;
use std::str::FromStr;

/// The form every error message repeats, so that the user sees what to write.
const FORM: &str = "zk://HOST:PORT[,HOST:PORT]/PATH";

/// A parsed cluster URL: at least one ZooKeeper server and an absolute root path that is not
/// ZooKeeper's own root. [`Display`](fmt::Display) writes it back in the form it was parsed from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterUrl {
    hosts: Vec<ClusterHost>,
    root: String,
}

/// One ZooKeeper server of a [`ClusterUrl`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterHost {
    /// Host name or address; an IPv6 address without its brackets.
    pub host: String,
    /// Client port.
    pub port: u16,
}

impl ClusterUrl {
    /// The servers, in the order written.
    pub fn hosts(&self) -> &[ClusterHost] {
        &self.hosts
    }

    /// The root node (absolute, no trailing slash), e.g. `/flow`.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// The servers as a ZooKeeper connect string (`host:port,host:port`), without the root: the
    /// session is opened on ZooKeeper's root so that the root node can be created if missing.
    pub(crate) fn connect_string(&self) -> String {
        self.hosts
            .iter()
            .map(ClusterHost::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl fmt::Display for ClusterHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for ClusterUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "zk://{}{}", self.connect_string(), self.root)
    }
}

/// Why a cluster URL cannot be used; every message quotes the URL and names the part at fault.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClusterUrlError {
    /// The URL does not start with `zk://`.
    #[error("bad cluster URL \"{url}\": it must start with zk:// ({FORM})")]
    Scheme {
        /// The URL as given.
        url: String,
    },
    /// Nothing between `zk://` and the path.
    #[error("bad cluster URL \"{url}\": no ZooKeeper host before the path ({FORM})")]
    NoHosts {
        /// The URL as given.
        url: String,
    },
    /// An empty entry in the host list (`zk://a:1,,b:2/x`, `zk://:2181/x`).
    #[error("bad cluster URL \"{url}\": host {position} is empty ({FORM})")]
    EmptyHost {
        /// The URL as given.
        url: String,
        /// 1-based position in the host list.
        position: usize,
    },
    /// A host that cannot be a host name or address.
    #[error("bad cluster URL \"{url}\": host \"{host}\" {reason}")]
    BadHost {
        /// The URL as given.
        url: String,
        /// The host entry as written.
        host: String,
        /// What is wrong with it and what to write.
        reason: &'static str,
    },
    /// A host without `:PORT`.
    #[error("bad cluster URL \"{url}\": host \"{host}\" has no port: write {host}:PORT (ZooKeeper's client port is usually 2181)")]
    MissingPort {
        /// The URL as given.
        url: String,
        /// The host entry as written.
        host: String,
    },
    /// A port that is not a number from 1 to 65535.
    #[error("bad cluster URL \"{url}\": the port \"{port}\" of host \"{host}\" is not a number from 1 to 65535")]
    BadPort {
        /// The URL as given.
        url: String,
        /// The host, without the port.
        host: String,
        /// The port as written.
        port: String,
    },
    /// No path after the hosts.
    #[error("bad cluster URL \"{url}\": no path after the hosts: name the ZooKeeper node under which flow keeps its cluster state, e.g. zk://127.0.0.1:2181/flow")]
    MissingPath {
        /// The URL as given.
        url: String,
    },
    /// The path is ZooKeeper's root, which holds ZooKeeper's own nodes (and ClickHouse's).
    #[error("bad cluster URL \"{url}\": the path is ZooKeeper's root \"/\": name a node under it, e.g. /flow")]
    RootPath {
        /// The URL as given.
        url: String,
    },
    /// The path ends with `/`, which ZooKeeper refuses.
    #[error("bad cluster URL \"{url}\": the path \"{path}\" ends with \"/\": write it without, e.g. \"{trimmed}\"")]
    TrailingSlash {
        /// The URL as given.
        url: String,
        /// The path as written.
        path: String,
        /// The path without its trailing slashes.
        trimmed: String,
    },
    /// The path has an empty segment (`//`), which ZooKeeper refuses.
    #[error("bad cluster URL \"{url}\": the path \"{path}\" has an empty segment (\"//\")")]
    EmptySegment {
        /// The URL as given.
        url: String,
        /// The path as written.
        path: String,
    },
    /// The path has a `.` or `..` segment: ZooKeeper paths are absolute and refuse them.
    #[error("bad cluster URL \"{url}\": the path \"{path}\" has the relative segment \"{segment}\": ZooKeeper paths are absolute, without \".\" or \"..\"")]
    RelativeSegment {
        /// The URL as given.
        url: String,
        /// The path as written.
        path: String,
        /// The segment, `.` or `..`.
        segment: String,
    },
    /// The path has a character ZooKeeper refuses in node names.
    #[error("bad cluster URL \"{url}\": the path \"{path}\" has the character {character:?}, which ZooKeeper refuses in a path")]
    BadPathCharacter {
        /// The URL as given.
        url: String,
        /// The path as written.
        path: String,
        /// The refused character.
        character: char,
    },
}

impl FromStr for ClusterUrl {
    type Err = ClusterUrlError;

    fn from_str(url: &str) -> Result<ClusterUrl, ClusterUrlError> {
        let owned = || url.to_owned();
        let rest = url
            .strip_prefix("zk://")
            .ok_or_else(|| ClusterUrlError::Scheme { url: owned() })?;
        let (host_list, path) = match rest.find('/') {
            Some(slash) => rest.split_at(slash),
            None => (rest, ""),
        };
        if host_list.is_empty() {
            return Err(ClusterUrlError::NoHosts { url: owned() });
        }
        let hosts = host_list
            .split(',')
            .enumerate()
            .map(|(index, entry)| parse_host(url, index + 1, entry))
            .collect::<Result<Vec<_>, _>>()?;
        check_path(url, path)?;
        Ok(ClusterUrl {
            hosts,
            root: path.to_owned(),
        })
    }
}

/// One `HOST:PORT` or `[IPV6]:PORT` entry.
fn parse_host(url: &str, position: usize, entry: &str) -> Result<ClusterHost, ClusterUrlError> {
    if entry.is_empty() {
        return Err(ClusterUrlError::EmptyHost {
            url: url.to_owned(),
            position,
        });
    }
    if entry.chars().any(char::is_whitespace) {
        return Err(ClusterUrlError::BadHost {
            url: url.to_owned(),
            host: entry.to_owned(),
            reason: "contains whitespace: write hosts as HOST:PORT separated by commas only",
        });
    }
    // `host` as it is written before `:PORT` (an IPv6 address in its brackets).
    let missing_port = |host: &str| ClusterUrlError::MissingPort {
        url: url.to_owned(),
        host: host.to_owned(),
    };
    let (host, port) = if let Some(bracketed) = entry.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or_else(|| ClusterUrlError::BadHost {
                url: url.to_owned(),
                host: entry.to_owned(),
                reason: "has no closing \"]\": write an IPv6 address as [ADDRESS]:PORT",
            })?;
        let written = &entry[..host.len() + 2];
        match after.strip_prefix(':') {
            Some(port) if !port.is_empty() => (host, port),
            _ => return Err(missing_port(written)),
        }
    } else {
        let Some((host, port)) = entry.rsplit_once(':') else {
            return Err(missing_port(entry));
        };
        if host.contains(':') {
            return Err(ClusterUrlError::BadHost {
                url: url.to_owned(),
                host: entry.to_owned(),
                reason: "is an IPv6 address without brackets: write [ADDRESS]:PORT",
            });
        }
        if host.is_empty() {
            return Err(ClusterUrlError::EmptyHost {
                url: url.to_owned(),
                position,
            });
        }
        if port.is_empty() {
            return Err(missing_port(host));
        }
        (host, port)
    };
    if host.is_empty() {
        return Err(ClusterUrlError::EmptyHost {
            url: url.to_owned(),
            position,
        });
    }
    let port = match port.parse::<u16>() {
        // A leading sign is accepted by `parse` but is no way to write a port.
        Ok(number) if number > 0 && port.bytes().all(|b| b.is_ascii_digit()) => number,
        _ => {
            return Err(ClusterUrlError::BadPort {
                url: url.to_owned(),
                host: host.to_owned(),
                port: port.to_owned(),
            })
        }
    };
    Ok(ClusterHost {
        host: host.to_owned(),
        port,
    })
}

/// The root path: absolute (it starts at the `/` that ends the host list), below ZooKeeper's
/// root, and made only of segments ZooKeeper accepts.
fn check_path(url: &str, path: &str) -> Result<(), ClusterUrlError> {
    if path.is_empty() {
        return Err(ClusterUrlError::MissingPath {
            url: url.to_owned(),
        });
    }
    if path == "/" {
        return Err(ClusterUrlError::RootPath {
            url: url.to_owned(),
        });
    }
    if path.ends_with('/') {
        return Err(ClusterUrlError::TrailingSlash {
            url: url.to_owned(),
            path: path.to_owned(),
            trimmed: path.trim_end_matches('/').to_owned(),
        });
    }
    for segment in path[1..].split('/') {
        if segment.is_empty() {
            return Err(ClusterUrlError::EmptySegment {
                url: url.to_owned(),
                path: path.to_owned(),
            });
        }
        if segment == "." || segment == ".." {
            return Err(ClusterUrlError::RelativeSegment {
                url: url.to_owned(),
                path: path.to_owned(),
                segment: segment.to_owned(),
            });
        }
    }
    if let Some(character) = path.chars().find(|&c| refused_by_zookeeper(c)) {
        return Err(ClusterUrlError::BadPathCharacter {
            url: url.to_owned(),
            path: path.to_owned(),
            character,
        });
    }
    Ok(())
}

/// The characters ZooKeeper's `PathUtils.validatePath` refuses: controls, the C1 range, the
/// private-use range after the surrogates (which a `char` cannot hold), and the specials block.
pub(crate) fn refused_by_zookeeper(c: char) -> bool {
    matches!(c, '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..='\u{ffff}')
}

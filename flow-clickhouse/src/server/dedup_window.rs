//! The deduplication window of a target table, and the checks that compare it with what the sink
//! can replay.
//!
//! ClickHouse remembers the hashes (or tokens) of recent blocks in a window bounded by count and by
//! time. A replay that arrives after its block left the window is inserted again, so an
//! exactly-once sink must warn when the window is smaller than its worst replay. The server-wide
//! defaults come from `system.merge_tree_settings`; a table's own `SETTINGS` clause overrides them,
//! and the override is what the table actually uses. The clause is read from `SHOW CREATE TABLE`,
//! which reads only that table's metadata: `system.tables.engine_full` reads every table's, and
//! ClickHouse 18.16 fails the whole query (code 60, naming the other table) when any table of the
//! database is dropped meanwhile.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use tracing::warn;

use crate::config::dynamic::ClickHouseDynamicParams;
use crate::config::params::SinkParams;

/// The settings that bound a deduplication window.
pub const DEDUP_WINDOW_SETTINGS: &[&str] = &[
    "replicated_deduplication_window",
    "replicated_deduplication_window_seconds",
    "replicated_deduplication_window_for_async_inserts",
    "replicated_deduplication_window_seconds_for_async_inserts",
    "non_replicated_deduplication_window",
];

/// Where a window's value comes from; the warning says which one to change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowSource {
    /// The table's own `SETTINGS` clause.
    Table,
    /// The server's default (`system.merge_tree_settings`), which the table does not override.
    ServerDefault,
}

impl fmt::Display for WindowSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WindowSource::Table => "table",
            WindowSource::ServerDefault => "server default",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowValue {
    pub value: u64,
    pub source: WindowSource,
}

/// How many blocks a sink can insert into one shard before a copy of an earlier batch reaches it
/// again: the copy is dropped only while its block is still in the window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayExposure {
    /// Batches in delivery at once (every partition's queue and the batch being sent): what a
    /// replay after a crash can follow.
    pub blocks_in_flight: u64,
    /// In cluster mode, what a zombie's late INSERT can follow.
    pub takeover: Option<Takeover>,
}

/// In cluster mode a worker frozen past its session timeout may have an INSERT on its way that
/// reaches the table after the partition's new owner replayed the batch. That late copy is
/// dropped only while its block is among the shard's last window of blocks, so the window must
/// cover what the pipeline inserts meanwhile; one session timeout is the least such a delay is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Takeover {
    pub session_timeout: Duration,
    pub epoch: Duration,
    /// Blocks the pipeline's partitions insert into one shard in one session timeout, at one
    /// block per partition and epoch.
    pub blocks: u64,
}

impl ReplayExposure {
    /// The exposure of a sink over `partitions` partitions whose batches may wait in a delivery
    /// queue of `queue` each, cut every `epoch`, run in a cluster whose ZooKeeper sessions end
    /// after `session_timeout` (`None`: one process, no takeover).
    pub fn new(
        partitions: u32,
        queue: usize,
        epoch: Duration,
        session_timeout: Option<Duration>,
    ) -> ReplayExposure {
        let partitions = u64::from(partitions);
        let takeover = session_timeout.map(|session_timeout| {
            let epoch_ms = epoch.as_millis().max(1);
            let epochs = session_timeout.as_millis().div_ceil(epoch_ms).max(1);
            Takeover {
                session_timeout,
                epoch,
                blocks: partitions.saturating_mul(u64::try_from(epochs).unwrap_or(u64::MAX)),
            }
        });
        ReplayExposure {
            blocks_in_flight: partitions.saturating_mul(queue as u64 + 1),
            takeover,
        }
    }
}

/// The effective dedup-window settings of one table on one endpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DedupWindows {
    values: BTreeMap<String, WindowValue>,
}

impl DedupWindows {
    /// Server defaults, overridden by the numeric dedup-window settings of the `SETTINGS` clause
    /// in the table's engine clause (see [`engine_clause`]).
    pub fn new(server_defaults: BTreeMap<String, u64>, engine_clause: &str) -> DedupWindows {
        let mut values: BTreeMap<String, WindowValue> = server_defaults
            .into_iter()
            .filter(|(name, _)| DEDUP_WINDOW_SETTINGS.contains(&name.as_str()))
            .map(|(name, value)| {
                let source = WindowSource::ServerDefault;
                (name, WindowValue { value, source })
            })
            .collect();
        for (name, text) in table_settings(engine_clause) {
            if !DEDUP_WINDOW_SETTINGS.contains(&name.as_str()) {
                continue;
            }
            if let Ok(value) = text.parse::<u64>() {
                let source = WindowSource::Table;
                values.insert(name, WindowValue { value, source });
            }
        }
        DedupWindows { values }
    }

    pub fn get(&self, setting: &str) -> Option<WindowValue> {
        self.values.get(setting).copied()
    }

    /// Does a non-replicated MergeTree deduplicate inserted blocks at all?
    pub fn non_replicated_dedup_enabled(&self) -> bool {
        self.get("non_replicated_deduplication_window")
            .is_some_and(|w| w.value > 0)
    }

    /// Every way this window can let a replay through twice.
    ///
    /// `exposure` is how many blocks this sink can insert into the table between a batch's
    /// first attempt and a copy of it; `replay_horizon_secs` is the configured bound on the
    /// replay lag. For a non-replicated table only the block count applies (it has no time bound).
    pub fn check(
        &self,
        replicated: bool,
        async_insert: bool,
        exposure: &ReplayExposure,
        replay_horizon_secs: u64,
    ) -> Vec<DedupWindowWarning> {
        let blocks_in_flight = exposure.blocks_in_flight;
        let mut warnings = Vec::new();
        let blocks_setting = match (replicated, async_insert) {
            (false, _) => "non_replicated_deduplication_window",
            (true, false) => "replicated_deduplication_window",
            (true, true) => "replicated_deduplication_window_for_async_inserts",
        };
        if let Some(window) = self.get(blocks_setting) {
            if window.value < blocks_in_flight {
                warnings.push(DedupWindowWarning::Blocks {
                    setting: blocks_setting,
                    window,
                    blocks_in_flight,
                });
            }
            if let Some(takeover) = exposure.takeover.filter(|t| window.value < t.blocks) {
                warnings.push(DedupWindowWarning::Takeover {
                    setting: blocks_setting,
                    window,
                    takeover,
                });
            }
        }
        if replicated {
            let seconds_setting = if async_insert {
                "replicated_deduplication_window_seconds_for_async_inserts"
            } else {
                "replicated_deduplication_window_seconds"
            };
            if let Some(window) = self.get(seconds_setting) {
                if window.value < replay_horizon_secs {
                    warnings.push(DedupWindowWarning::Seconds {
                        setting: seconds_setting,
                        window,
                        replay_horizon_secs,
                    });
                }
            }
        }
        warnings
    }
}

/// The dedup window of one shard's table, kept by the session for the checks on a reload.
#[derive(Clone, Debug)]
pub(crate) struct ShardDedupWindow {
    pub(crate) shard: String,
    pub(crate) replicated: bool,
    pub(crate) windows: DedupWindows,
}

impl ShardDedupWindow {
    /// Warns when the window cannot cover a replay: shorter in time than `replay_horizon`, or
    /// shorter in blocks than what the sink can insert into the shard between a batch's first
    /// attempt and a copy of it (see [`ReplayExposure`]).
    pub(crate) fn warn_if_short(
        &self,
        params: &SinkParams,
        dynamic: &ClickHouseDynamicParams,
        exposure: &ReplayExposure,
    ) {
        let warnings = self.windows.check(
            self.replicated,
            dynamic.async_insert,
            exposure,
            dynamic.replay_horizon.as_secs(),
        );
        for warning in warnings {
            warning.log(&params.database, &params.table, &self.shard);
        }
    }
}

/// A dedup window too small for the replays this sink can make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DedupWindowWarning {
    /// Fewer blocks remembered than can be inserted before a replay.
    Blocks {
        setting: &'static str,
        window: WindowValue,
        blocks_in_flight: u64,
    },
    /// Fewer blocks remembered than the pipeline inserts while a zombie's INSERT is late.
    Takeover {
        setting: &'static str,
        window: WindowValue,
        takeover: Takeover,
    },
    /// A shorter time remembered than `replay_horizon`.
    Seconds {
        setting: &'static str,
        window: WindowValue,
        replay_horizon_secs: u64,
    },
}

impl DedupWindowWarning {
    /// Writes the warning with the structured attributes the reference names (`Database`, `Table`,
    /// `DedupWindowSetting`, `DedupWindow`, and `ReplayHorizon` or `BlocksInFlight`), and
    /// `BlocksPerTakeover` for the cluster-mode kind.
    pub fn log(&self, database: &str, table: &str, shard: &str) {
        // One event shape for every kind; the attributes that do not apply are left out.
        let (setting, window, blocks_in_flight, replay_horizon, blocks_per_takeover) = match self {
            DedupWindowWarning::Blocks {
                setting,
                window,
                blocks_in_flight,
            } => (setting, window, Some(*blocks_in_flight), None, None),
            DedupWindowWarning::Takeover {
                setting,
                window,
                takeover,
            } => (setting, window, None, None, Some(takeover.blocks)),
            DedupWindowWarning::Seconds {
                setting,
                window,
                replay_horizon_secs,
            } => (setting, window, None, Some(*replay_horizon_secs), None),
        };
        warn!(
            Database = %database,
            Table = %table,
            Shard = %shard,
            DedupWindowSetting = %setting,
            DedupWindow = window.value,
            DedupWindowSource = %window.source,
            BlocksInFlight = blocks_in_flight,
            BlocksPerTakeover = blocks_per_takeover,
            ReplayHorizon = replay_horizon,
            "{self}"
        );
    }
}

impl fmt::Display for DedupWindowWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DedupWindowWarning::Blocks {
                setting,
                window,
                blocks_in_flight,
            } => write!(
                f,
                "the table remembers only {} blocks for deduplication ({setting}, {}), but this sink can have up to {blocks_in_flight} batches in delivery to it: a replay after a crash could fall out of the window and be inserted twice. Raise {setting} on the table to at least {blocks_in_flight} (ALTER TABLE ... MODIFY SETTING, or SETTINGS at CREATE), or use fewer partitions",
                window.value, window.source
            ),
            DedupWindowWarning::Takeover {
                setting,
                window,
                takeover,
            } => write!(
                f,
                "the table remembers only {} blocks for deduplication ({setting}, {}), but in cluster mode this pipeline can insert about {} blocks into it in one session timeout ({:?}; one block per partition and epoch of {:?}): a worker frozen past its session timeout may have an INSERT on its way that arrives after another worker replayed that batch, and it is dropped as a copy only while its block is in the window. Raise {setting} on the table to at least {} (several times that if an INSERT can be delayed longer), or use longer epochs",
                window.value, window.source, takeover.blocks, takeover.session_timeout, takeover.epoch, takeover.blocks
            ),
            DedupWindowWarning::Seconds {
                setting,
                window,
                replay_horizon_secs,
            } => write!(
                f,
                "the table's deduplication window ({setting} = {} s, {}) is shorter than replay_horizon ({replay_horizon_secs} s): a batch replayed later than {} s after its first attempt would be inserted twice. Raise {setting} on the table (with a margin) or lower replay_horizon",
                window.value, window.source, window.value
            ),
        }
    }
}

/// The `name = value` pairs of the trailing `SETTINGS` clause of an `engine_full` text, values
/// as written (quotes kept). Quoted strings, back-quoted identifiers and parentheses are skipped,
/// so a `SETTINGS` inside an expression or literal is not mistaken for the clause.
pub fn table_settings(engine_full: &str) -> Vec<(String, String)> {
    let Some(start) = settings_clause_start(engine_full) else {
        return Vec::new();
    };
    split_top_level(&engine_full[start..], b',')
        .into_iter()
        .filter_map(|item| {
            let (name, value) = item.split_once('=')?;
            let name = name.trim();
            let value = value.trim();
            (!name.is_empty() && !value.is_empty()).then(|| (name.to_owned(), value.to_owned()))
        })
        .collect()
}

/// The engine clause of a `CREATE TABLE` statement as `SHOW CREATE TABLE` prints it: what follows
/// the top-level `ENGINE =`, up to a top-level `COMMENT` (which newer servers print after the
/// settings). The same text `system.tables.engine_full` holds; empty when there is no `ENGINE`.
pub fn engine_clause(create_statement: &str) -> &str {
    let Some(engine_end) = top_level_keywords(create_statement, "ENGINE")
        .first()
        .copied()
    else {
        return "";
    };
    let rest = &create_statement[engine_end..];
    let rest = rest.trim_start().strip_prefix('=').unwrap_or(rest);
    let end = top_level_keywords(rest, "COMMENT")
        .first()
        .map_or(rest.len(), |after| after - "COMMENT".len());
    rest[..end].trim()
}

/// The byte offset right after the last top-level `SETTINGS` keyword, if any.
fn settings_clause_start(text: &str) -> Option<usize> {
    top_level_keywords(text, "SETTINGS").last().copied()
}

/// The byte offsets right after each top-level occurrence of `keyword` as a whole word.
fn top_level_keywords(text: &str, keyword: &str) -> Vec<usize> {
    let keyword = keyword.as_bytes();
    let bytes = text.as_bytes();
    let mut found = Vec::new();
    scan_top_level(bytes, |i| {
        let end = i + keyword.len();
        let is_word_start = i == 0 || !is_ident_byte(bytes[i - 1]);
        if is_word_start
            && bytes.get(i..end) == Some(keyword)
            && bytes.get(end).is_none_or(|b| !is_ident_byte(*b))
        {
            found.push(end);
        }
    });
    found
}

fn split_top_level(text: &str, separator: u8) -> Vec<&str> {
    let bytes = text.as_bytes();
    let mut parts = Vec::new();
    let mut from = 0;
    scan_top_level(bytes, |i| {
        if bytes[i] == separator {
            parts.push(&text[from..i]);
            from = i + 1;
        }
    });
    parts.push(&text[from..]);
    parts
}

/// Calls `at` with the index of every byte outside quotes, back-quotes and parentheses.
fn scan_top_level(bytes: &[u8], mut at: impl FnMut(usize)) {
    let mut depth = 0usize;
    let mut quote: Option<u8> = None;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if let Some(q) = quote {
            if b == b'\\' {
                i += 1;
            } else if b == q {
                quote = None;
            }
        } else {
            match b {
                b'\'' | b'`' | b'"' => quote = Some(b),
                b'(' => depth += 1,
                b')' => depth = depth.saturating_sub(1),
                _ if depth == 0 => at(i),
                _ => {}
            }
        }
        i += 1;
    }
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENGINE_FULL: &str = "ReplicatedMergeTree('/clickhouse/tables/t', 'r1') ORDER BY id \
         SETTINGS replicated_deduplication_window = 7, index_granularity = 4096";

    fn server() -> BTreeMap<String, u64> {
        [
            ("replicated_deduplication_window", 100),
            ("replicated_deduplication_window_seconds", 604_800),
            ("index_granularity", 8192),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_owned(), v))
        .collect()
    }

    #[test]
    fn engine_clause_of_an_old_server_statement_is_its_engine_full() {
        let statement = "CREATE TABLE default.t ( x UInt64,  s String DEFAULT 'ENGINE = x') \
             ENGINE = ReplicatedMergeTree('/clickhouse/tables/t', 'r1') ORDER BY id \
             SETTINGS replicated_deduplication_window = 7, index_granularity = 4096";
        assert_eq!(engine_clause(statement), ENGINE_FULL);
    }

    #[test]
    fn engine_clause_of_a_new_server_statement_stops_at_its_comment() {
        let statement = "CREATE TABLE default.t\n(\n    `x` UInt64 COMMENT 'ENGINE = y'\n)\n\
             ENGINE = ReplicatedMergeTree('/clickhouse/tables/t', 'r1')\nORDER BY id\n\
             SETTINGS replicated_deduplication_window = 7, index_granularity = 4096\n\
             COMMENT 'SETTINGS replicated_deduplication_window = 1'";
        assert_eq!(
            table_settings(engine_clause(statement)),
            vec![
                ("replicated_deduplication_window".to_owned(), "7".to_owned()),
                ("index_granularity".to_owned(), "4096".to_owned()),
            ]
        );
        assert_eq!(engine_clause("CREATE VIEW v AS SELECT 1"), "");
    }

    #[test]
    fn settings_clause_is_parsed_from_engine_full() {
        assert_eq!(
            table_settings(ENGINE_FULL),
            vec![
                ("replicated_deduplication_window".to_owned(), "7".to_owned()),
                ("index_granularity".to_owned(), "4096".to_owned()),
            ]
        );
        assert!(table_settings("MergeTree ORDER BY id").is_empty());
        assert!(table_settings("").is_empty());
    }

    #[test]
    fn settings_inside_literals_identifiers_and_parentheses_are_not_the_clause() {
        let text = "ReplicatedMergeTree('/p/SETTINGS x = 1', 'r') PARTITION BY f(`SETTINGS`, 'a, SETTINGS b = 2') \
             ORDER BY (a, b) SETTINGS storage_policy = 'x, y = 3', replicated_deduplication_window_seconds = 60";
        assert_eq!(
            table_settings(text),
            vec![
                ("storage_policy".to_owned(), "'x, y = 3'".to_owned()),
                (
                    "replicated_deduplication_window_seconds".to_owned(),
                    "60".to_owned()
                ),
            ]
        );
        // A column or setting merely containing the word is not the keyword.
        assert!(table_settings("MergeTree ORDER BY MYSETTINGS").is_empty());
    }

    #[test]
    fn a_table_setting_overrides_the_server_default_and_says_so() {
        let windows = DedupWindows::new(server(), ENGINE_FULL);
        assert_eq!(
            windows.get("replicated_deduplication_window"),
            Some(WindowValue {
                value: 7,
                source: WindowSource::Table
            })
        );
        assert_eq!(
            windows.get("replicated_deduplication_window_seconds"),
            Some(WindowValue {
                value: 604_800,
                source: WindowSource::ServerDefault
            })
        );
        // Not a dedup-window setting: not kept.
        assert_eq!(windows.get("index_granularity"), None);
    }

    #[test]
    fn block_window_smaller_than_the_batches_in_delivery_warns_with_the_table_value() {
        let windows = DedupWindows::new(server(), ENGINE_FULL);
        let warnings = windows.check(true, false, &in_flight(18), 86_400);
        assert_eq!(
            warnings,
            vec![DedupWindowWarning::Blocks {
                setting: "replicated_deduplication_window",
                window: WindowValue {
                    value: 7,
                    source: WindowSource::Table
                },
                blocks_in_flight: 18,
            }]
        );
        assert!(warnings[0]
            .to_string()
            .contains("Raise replicated_deduplication_window on the table to at least 18"));
        assert!(windows.check(true, false, &in_flight(7), 86_400).is_empty());
    }

    fn in_flight(blocks_in_flight: u64) -> ReplayExposure {
        ReplayExposure {
            blocks_in_flight,
            takeover: None,
        }
    }

    #[test]
    fn in_cluster_mode_a_window_smaller_than_one_session_timeout_of_epochs_warns() {
        let windows = DedupWindows::new(server(), "");
        // 8 partitions, epochs of 300 ms, sessions of 4 s: 14 epochs each, 112 blocks.
        let exposure = ReplayExposure::new(
            8,
            8,
            Duration::from_millis(300),
            Some(Duration::from_secs(4)),
        );
        assert_eq!(exposure.blocks_in_flight, 72);
        let warnings = windows.check(true, false, &exposure, 86_400);
        let [DedupWindowWarning::Takeover {
            takeover, window, ..
        }] = warnings.as_slice()
        else {
            panic!("one takeover warning: {warnings:?}");
        };
        assert_eq!((takeover.blocks, window.value), (112, 100));
        assert!(warnings[0]
            .to_string()
            .contains("Raise replicated_deduplication_window on the table to at least 112"));
        // One process: no takeover. Longer epochs: 8 partitions x 4 epochs fit the window.
        let alone = ReplayExposure::new(8, 8, Duration::from_millis(300), None);
        assert!(windows.check(true, false, &alone, 86_400).is_empty());
        let longer =
            ReplayExposure::new(8, 8, Duration::from_secs(1), Some(Duration::from_secs(4)));
        assert_eq!(longer.takeover.map(|t| t.blocks), Some(32));
        assert!(windows.check(true, false, &longer, 86_400).is_empty());
    }

    #[test]
    fn time_window_shorter_than_replay_horizon_warns_and_async_inserts_use_their_own_setting() {
        let windows = DedupWindows::new(
            server(),
            "ReplicatedMergeTree('/p', 'r') ORDER BY id SETTINGS replicated_deduplication_window_seconds = 60, \
             replicated_deduplication_window_seconds_for_async_inserts = 1",
        );
        assert_eq!(
            windows.check(true, false, &in_flight(1), 3_600),
            vec![DedupWindowWarning::Seconds {
                setting: "replicated_deduplication_window_seconds",
                window: WindowValue {
                    value: 60,
                    source: WindowSource::Table
                },
                replay_horizon_secs: 3_600,
            }]
        );
        assert!(windows.check(true, false, &in_flight(1), 60).is_empty());
        // With async inserts only the async window counts (the block-count one is unknown here).
        assert_eq!(
            windows.check(true, true, &in_flight(1), 2),
            vec![DedupWindowWarning::Seconds {
                setting: "replicated_deduplication_window_seconds_for_async_inserts",
                window: WindowValue {
                    value: 1,
                    source: WindowSource::Table
                },
                replay_horizon_secs: 2,
            }]
        );
    }

    #[test]
    fn non_replicated_dedup_is_enabled_only_by_a_positive_window() {
        let off = DedupWindows::new(BTreeMap::new(), "MergeTree ORDER BY id");
        assert!(!off.non_replicated_dedup_enabled());
        assert!(off.check(false, false, &in_flight(18), 86_400).is_empty());
        let zero = DedupWindows::new(
            [("non_replicated_deduplication_window".to_owned(), 0)].into(),
            "MergeTree ORDER BY id",
        );
        assert!(!zero.non_replicated_dedup_enabled());
        let on = DedupWindows::new(
            [("non_replicated_deduplication_window".to_owned(), 0)].into(),
            "MergeTree ORDER BY id SETTINGS non_replicated_deduplication_window = 10",
        );
        assert!(on.non_replicated_dedup_enabled());
        // No time bound applies to a non-replicated table; the block count does.
        assert_eq!(
            on.check(false, false, &in_flight(18), 86_400),
            vec![DedupWindowWarning::Blocks {
                setting: "non_replicated_deduplication_window",
                window: WindowValue {
                    value: 10,
                    source: WindowSource::Table
                },
                blocks_in_flight: 18,
            }]
        );
    }
}

//! `flow-worker status`: what the state directory holds, per pipeline, sink and partition.

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;

use std::collections::BTreeMap;

use anyhow::Context;
use flow::{snapshot_path, SOURCE_UNAVAILABLE};
use flow_core::{SinkCount, SinkCounter};
use flow_state::{SinkPartitionSummary, StateError, StateStore, StateSummary};

use crate::stdout::one_line;

/// Per pipeline and partition, what keeps a running worker's source from reading while it waits
/// (a broker stream that disappeared), as its snapshot names it under [`SOURCE_UNAVAILABLE`].
type Unavailable = BTreeMap<String, BTreeMap<u32, String>>;

/// What a running worker's snapshot holds beside the store's summary.
#[derive(Default, serde::Deserialize)]
struct SnapshotExtra {
    #[serde(default)]
    source_unavailable: Unavailable,
}

pub fn status(state_dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let (summary, unavailable) = live_summary(state_dir)?;
    if json {
        let mut value = serde_json::to_value(&summary)?;
        if let (false, Some(object)) = (unavailable.is_empty(), value.as_object_mut()) {
            object.insert(
                SOURCE_UNAVAILABLE.to_owned(),
                serde_json::to_value(&unavailable)?,
            );
        }
        crate::stdout::write_all(&format!("{}\n", serde_json::to_string_pretty(&value)?))?;
    } else {
        crate::stdout::write_all(&render_live(
            &summary,
            &unavailable,
            flow_core::delivery::now_ms(),
        ))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The state summary (from the store itself, or from the running worker's snapshot while it
/// holds the store) and what keeps a running worker's sources from reading (nothing when no
/// worker runs); says on stderr when it is read from a copy of the directory.
fn live_summary(state_dir: &Path) -> anyhow::Result<(StateSummary, Unavailable)> {
    let (summary, unavailable, copy_note) = read_state(state_dir)?;
    if let Some(note) = copy_note {
        eprintln!("{note}");
    }
    Ok((summary, unavailable))
}

/// The state summary, and the note to show when it was read from a copy of the directory (one
/// this process cannot write): `--watch` shows that note in its header, which a redraw would
/// otherwise wipe from the terminal.
pub(crate) fn read_summary(state_dir: &Path) -> anyhow::Result<(StateSummary, Option<String>)> {
    read_state(state_dir).map(|(summary, _, copy_note)| (summary, copy_note))
}

/// The summary, what keeps sources from reading, and the copy note ([`read_summary`]).
fn read_state(state_dir: &Path) -> anyhow::Result<(StateSummary, Unavailable, Option<String>)> {
    let mut copy_note = None;
    if !crate::run::is_state_dir(state_dir) {
        anyhow::bail!("`{}` is not a flow state directory", state_dir.display());
    }
    let snapshot = snapshot_path(state_dir);
    let (summary, unavailable) = match StateStore::open_to_read(state_dir) {
        Ok(read) => {
            if read.copy().is_some() {
                // sled opens only for writing: what is shown is a copy, not the directory.
                copy_note = Some(format!(
                    "`{}` cannot be written (a read-only file system, or no write permission); showing a copy of it taken just now",
                    state_dir.display()
                ));
            }
            let store = read.store();
            if snapshot.exists() {
                // We hold the store's lock, so the worker that wrote the snapshot is gone.
                eprintln!(
                    "`{}` is left over from a worker that is gone (it did not stop cleanly); showing the state store itself",
                    snapshot.display()
                );
            }
            let summary = store.summary().with_context(|| {
                format!(
                    "reading the state store in `{}` (it may be corrupt)",
                    state_dir.display()
                )
            })?;
            read.close().context("closing the state store")?;
            (summary, Unavailable::new())
        }
        // A running worker holds the lock and keeps a snapshot up to date.
        Err(StateError::Locked { .. }) => read_snapshot(state_dir).with_context(|| {
            format!(
                "a running worker holds `{}`, and its status snapshot is not readable",
                state_dir.display()
            )
        })?,
        Err(open_error) => {
            let stale = if snapshot.exists() {
                format!(
                    ". The status snapshot `{}` there is stale: the worker that wrote it is gone, so it is not shown",
                    snapshot.display()
                )
            } else {
                String::new()
            };
            anyhow::bail!(
                "cannot open the state directory `{}`: {open_error}{stale}",
                state_dir.display()
            );
        }
    };
    Ok((summary, unavailable, copy_note))
}

fn read_snapshot(state_dir: &Path) -> anyhow::Result<(StateSummary, Unavailable)> {
    let path = snapshot_path(state_dir);
    let bytes = std::fs::read(&path).with_context(|| format!("reading `{}`", path.display()))?;
    let age = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .map_or_else(
            || "unknown".to_owned(),
            |d| format!("{:.1} s", d.as_secs_f64()),
        );
    eprintln!(
        "a running worker holds `{}`; showing its snapshot (age {age}, refreshed every 2 s)",
        state_dir.display()
    );
    let summary =
        serde_json::from_slice(&bytes).with_context(|| format!("parsing `{}`", path.display()))?;
    let extra: SnapshotExtra =
        serde_json::from_slice(&bytes).with_context(|| format!("parsing `{}`", path.display()))?;
    Ok((summary, extra.source_unavailable))
}

/// Built-in sources encode positions as big-endian u64 words; show those as numbers.
fn position_text(hex: &str) -> String {
    if !hex.len().is_multiple_of(16) || hex.is_empty() {
        return format!("0x{hex}");
    }
    let words: Option<Vec<String>> = (0..hex.len())
        .step_by(16)
        .map(|i| {
            u64::from_str_radix(&hex[i..i + 16], 16)
                .ok()
                .map(|w| w.to_string())
        })
        .collect();
    words.map_or_else(|| format!("0x{hex}"), |w| w.join("/"))
}

/// The status table; ages are measured at `now_ms` (ms since the Unix epoch).
pub fn render(summary: &StateSummary, now_ms: u64) -> String {
    render_live(summary, &Unavailable::new(), now_ms)
}

/// The status table with a line per partition whose source cannot read and waits.
fn render_live(summary: &StateSummary, unavailable: &Unavailable, now_ms: u64) -> String {
    let mut out = String::new();
    if summary.pipelines.is_empty() {
        out.push_str("no pipeline has committed anything in this state directory\n");
        return out;
    }
    for (name, pipeline) in &summary.pipelines {
        let _ = writeln!(out, "pipeline {name}");
        // A running worker of a broker source knows its lag; other sources have none to show.
        let with_lag = pipeline.positions.values().any(|p| p.lag.is_some());
        let lag_header = if with_lag { "  lag (messages)" } else { "" };
        let _ = writeln!(out, "  {:<10} {:>20}{lag_header}", "partition", "position");
        for (partition, position) in &pipeline.positions {
            let lag = match (with_lag, position.lag) {
                (false, _) => String::new(),
                (true, Some(lag)) => format!("  {lag:>14}"),
                (true, None) => format!("  {:>14}", "-"),
            };
            let _ = writeln!(
                out,
                "  {:<10} {:>20}{lag}",
                partition,
                position_text(&position.hex)
            );
        }
        for (partition, what) in unavailable.get(name).into_iter().flatten() {
            let _ = writeln!(out, "  partition {partition}: source unavailable: {what}");
        }
        for group in &pipeline.source_dead_letters {
            let _ = writeln!(
                out,
                "  source dead letters, partition {}: {}",
                group.partition, group.count
            );
            for dl in &group.recent {
                let _ = writeln!(out, "    #{} {}", dl.seq, one_line(&dl.reason));
            }
        }
        if pipeline.sinks.is_empty() {
            continue;
        }
        let _ = writeln!(
            out,
            "  {:<16} {:>9} {:>11} {:>10} {:>12} {:>14} {:>10} {:>12}",
            "sink",
            "partition",
            "undelivered",
            "rows",
            "bytes",
            "oldest bound",
            "oldest age",
            "dead letters"
        );
        for sink in &pipeline.sinks {
            let oldest = sink
                .oldest
                .as_ref()
                .map(|b| format!("{}-{}", sink.partition, b.last_offset))
                .unwrap_or_else(|| "-".to_owned());
            let age = sink.oldest.as_ref().map_or_else(
                || "-".to_owned(),
                |b| show_age(now_ms.saturating_sub(b.sealed_at_ms)),
            );
            let _ = writeln!(
                out,
                "  {:<16} {:>9} {:>11} {:>10} {:>12} {:>14} {:>10} {:>12}",
                sink.sink,
                sink.partition,
                sink.undelivered,
                sink.rows,
                sink.bytes,
                oldest,
                age,
                sink.dead_letter_count
            );
            // Per shard of a sharded sink: a shard that is down shows its own growing backlog.
            for (shard, backlog) in sink.shards.iter().filter(|(name, _)| !name.is_empty()) {
                let _ = writeln!(
                    out,
                    "    shard {shard}: {} undelivered, {} rows, oldest age {}",
                    backlog.undelivered,
                    backlog.rows,
                    show_age(now_ms.saturating_sub(backlog.oldest_sealed_at_ms))
                );
            }
            if sink.unanswered > 0 {
                let _ = writeln!(
                    out,
                    "    {} pending batch(es) had an INSERT without an answer: they may have landed; past the shard's deduplication window they are set aside (on_expired_backlog)",
                    sink.unanswered
                );
            }
            render_counters(&mut out, sink);
            render_tables(&mut out, sink);
            render_run(&mut out, sink, now_ms);
            for (name, value) in &sink.fingerprints {
                let _ = writeln!(out, "    fingerprint {name} = {value}");
            }
            for dl in &sink.recent_dead_letters {
                let _ = writeln!(out, "    dead letter #{}: {}", dl.seq, one_line(&dl.reason));
            }
        }
    }
    out
}

/// The persisted totals of a sink partition (over every run), summed over shards.
fn render_counters(out: &mut String, sink: &SinkPartitionSummary) {
    if sink.counters.is_empty() {
        return;
    }
    let mut totals: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for (name, value) in &sink.counters {
        let Some(counter) = SinkCounter::parse(name) else {
            continue;
        };
        let what = match counter.count {
            SinkCount::RowsDelivered => "rows",
            SinkCount::BatchesDelivered => "batches",
            SinkCount::Retries => "retries",
            SinkCount::DroppedRows => "dropped",
            SinkCount::LostRows => "lost",
            SinkCount::DeadLetterRows => "dead letter rows",
            SinkCount::GaveUp => "gave up",
            SinkCount::UnansweredInserts => "unanswered inserts",
            SinkCount::InsertErrors { class, code } => {
                let code = code.map_or_else(|| "no code".to_owned(), |c| format!("code {c}"));
                *errors.entry(format!("{class} {code}")).or_default() += value;
                "insert errors"
            }
        };
        *totals.entry(what).or_default() += value;
    }
    let get = |what: &str| totals.get(what).copied().unwrap_or(0);
    let errors = errors
        .iter()
        .map(|(what, n)| format!("{what}: {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    let errors = if errors.is_empty() {
        String::new()
    } else {
        format!(" ({errors})")
    };
    let _ = writeln!(
        out,
        "    totals: {} rows in {} batches delivered, {} insert errors{errors}, {} unanswered, {} retries, {} dead letter rows, gave up {} time(s)",
        get("rows"),
        get("batches"),
        get("insert errors"),
        get("unanswered inserts"),
        get("retries"),
        get("dead letter rows"),
        get("gave up"),
    );
    if totals.contains_key("dropped") || totals.contains_key("lost") {
        let _ = writeln!(
            out,
            "    at-most-once: {} rows dropped (queue full), {} rows lost (failed, not retried)",
            get("dropped"),
            get("lost")
        );
    }
}

/// One line per table of a sink writing many (a table template), from its counters' `table`
/// label: what landed in each table.
fn render_tables(out: &mut String, sink: &SinkPartitionSummary) {
    let mut tables: BTreeMap<String, [u64; 3]> = BTreeMap::new();
    for (name, value) in &sink.counters {
        let Some(SinkCounter {
            count,
            table: Some(table),
            ..
        }) = SinkCounter::parse(name)
        else {
            continue;
        };
        let slot = match count {
            SinkCount::RowsDelivered => 0,
            SinkCount::BatchesDelivered => 1,
            SinkCount::InsertErrors { .. } => 2,
            _ => continue,
        };
        tables.entry(table).or_default()[slot] += value;
    }
    for (table, [rows, batches, errors]) in tables {
        let _ = writeln!(
            out,
            "    table {table}: {rows} rows in {batches} batches delivered, {errors} insert errors"
        );
    }
}

/// What a running worker saw since it started, and a give-up with its reason.
fn render_run(out: &mut String, sink: &SinkPartitionSummary, now_ms: u64) {
    let ago = |at_ms: u64| show_age(now_ms.saturating_sub(at_ms));
    if let Some(run) = &sink.run {
        for (shard, seen) in &run.shards {
            let shard = if shard.is_empty() {
                String::new()
            } else {
                format!("shard {shard} ")
            };
            let last = seen.last_error.as_ref().map_or_else(String::new, |e| {
                let code = e.code.map_or_else(String::new, |c| format!("code {c}, "));
                format!(
                    "; last error {} ago ({code}{}): {}",
                    ago(e.at_ms),
                    e.class,
                    one_line(&e.text)
                )
            });
            let _ = writeln!(
                out,
                "    {shard}since start ({} ago): {} insert errors, {} retries{last}",
                ago(run.since_ms),
                seen.errors,
                seen.retries
            );
        }
    }
    let gave_up = sink.run.as_ref().and_then(|r| r.gave_up.as_ref());
    if let Some(reason) = gave_up.or(sink.gave_up.as_ref()) {
        let _ = writeln!(
            out,
            "    GAVE UP {} ago: {} (the sink fails every write until the worker restarts; fix the cause, then restart)",
            ago(reason.at_ms),
            one_line(&reason.text)
        );
    }
}

/// `45s`, `3m05s`, `2h04m`.
fn show_age(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flow_state::{BatchInfo, ErrorRecord, ShardBacklog, ShardRunStatus, SinkRunStatus};

    #[test]
    fn a_sink_writing_many_tables_shows_one_line_per_table() {
        let mut sink = SinkPartitionSummary::default();
        for (name, value) in [
            ("rows_delivered;shard=a;table=events_buy", 10),
            ("rows_delivered;shard=b;table=events_buy", 5),
            ("batches_delivered;shard=a;table=events_buy", 2),
            ("rows_delivered;table=events_view", 7),
            (
                "insert_errors;table=events_view;class=retryable;code=210",
                1,
            ),
            ("rows_delivered", 3),
        ] {
            sink.counters.insert(name.to_owned(), value);
        }
        let mut out = String::new();
        render_tables(&mut out, &sink);
        assert_eq!(
            out,
            "    table events_buy: 15 rows in 2 batches delivered, 0 insert errors\n    table events_view: 7 rows in 0 batches delivered, 1 insert errors\n"
        );
        // One table: no table line.
        sink.counters.retain(|name, _| !name.contains("table="));
        let mut out = String::new();
        render_tables(&mut out, &sink);
        assert_eq!(out, "");
    }

    #[test]
    fn positions_of_builtin_sources_print_as_numbers() {
        assert_eq!(position_text("000000000000c350"), "50000");
        assert_eq!(position_text("00000000000000100000000000000002"), "16/2");
        assert_eq!(position_text("abcd"), "0xabcd");
    }

    #[test]
    fn the_lag_column_appears_when_a_running_broker_source_reported_lag() {
        let mut summary = StateSummary::default();
        let pipeline = summary.pipelines.entry("p".to_owned()).or_default();
        pipeline
            .positions
            .insert(0, flow_state::PositionInfo::of(&50_000u64.to_be_bytes()));
        assert_eq!(
            render(&summary, 0),
            "pipeline p\n  partition              position\n  0                         50000\n"
        );
        let pipeline = summary.pipelines.entry("p".to_owned()).or_default();
        pipeline
            .positions
            .insert(1, flow_state::PositionInfo::of(&7u64.to_be_bytes()));
        if let Some(position) = pipeline.positions.get_mut(&0) {
            position.lag = Some(12);
        }
        assert_eq!(
            render(&summary, 0),
            "pipeline p\n  partition              position  lag (messages)\n  0                         50000              12\n  1                             7               -\n"
        );
    }

    #[test]
    fn a_partition_whose_source_waits_is_named_with_the_reason() {
        let mut summary = StateSummary::default();
        let pipeline = summary.pipelines.entry("p".to_owned()).or_default();
        for partition in [0, 1] {
            pipeline
                .positions
                .insert(partition, flow_state::PositionInfo::of(&7u64.to_be_bytes()));
        }
        let unavailable = Unavailable::from([(
            "p".to_owned(),
            BTreeMap::from([(1, "stream `S` no longer exists".to_owned())]),
        )]);
        assert_eq!(
            render_live(&summary, &unavailable, 0),
            "pipeline p\n  partition              position\n  0                             7\n  1                             7\n  partition 1: source unavailable: stream `S` no longer exists\n"
        );
        // A snapshot without the key (nothing waits, or an older worker) reads as nothing.
        let extra: Result<SnapshotExtra, _> = serde_json::from_str(r#"{"pipelines": {}}"#);
        assert!(extra.is_ok_and(|e| e.source_unavailable.is_empty()));
    }

    #[test]
    fn the_oldest_pending_age_is_shown_per_sink_partition_and_per_shard() {
        assert_eq!(
            [0, 45_999, 185_000, 7_440_000].map(show_age),
            ["0s", "45s", "3m05s", "2h04m"]
        );
        let mut summary = StateSummary::default();
        let pipeline = summary.pipelines.entry("p".to_owned()).or_default();
        let shard = |undelivered, oldest_sealed_at_ms| ShardBacklog {
            undelivered,
            rows: undelivered * 10,
            oldest_sealed_at_ms,
        };
        pipeline.sinks.push(SinkPartitionSummary {
            sink: "ch".to_owned(),
            partition: 1,
            undelivered: 3,
            rows: 30,
            oldest: Some(BatchInfo {
                last_offset: 99,
                sealed_at_ms: 1_000_000,
                ..BatchInfo::default()
            }),
            shards: [
                ("a".to_owned(), shard(1, 1_060_000)),
                ("b".to_owned(), shard(2, 1_000_000)),
            ]
            .into_iter()
            .collect(),
            ..SinkPartitionSummary::default()
        });
        let text = render(&summary, 1_125_000);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[3].contains("1-99") && lines[3].contains("2m05s"),
            "{text}"
        );
        assert_eq!(
            lines[4],
            "    shard a: 1 undelivered, 10 rows, oldest age 1m05s"
        );
        assert_eq!(
            lines[5],
            "    shard b: 2 undelivered, 20 rows, oldest age 2m05s"
        );
    }

    #[test]
    fn totals_failures_since_start_and_a_give_up_are_shown_per_sink_partition() {
        let mut summary = StateSummary::default();
        let pipeline = summary.pipelines.entry("p".to_owned()).or_default();
        let counters = [
            ("rows_delivered;shard=a", 700),
            ("rows_delivered;shard=b", 300),
            ("batches_delivered;shard=a", 7),
            ("batches_delivered;shard=b", 3),
            ("insert_errors;shard=b;class=retryable;code=210", 4),
            ("retries;shard=b", 3),
            ("gave_up;shard=b", 1),
            ("lost_rows", 5),
        ];
        let error = ErrorRecord {
            code: Some(210),
            class: "retryable".to_owned(),
            text: "connection refused".to_owned(),
            at_ms: 1_050_000,
        };
        let shard_b = ShardRunStatus {
            errors: 4,
            retries: 3,
            last_error: Some(error.clone()),
        };
        pipeline.sinks.push(SinkPartitionSummary {
            sink: "ch".to_owned(),
            counters: counters
                .map(|(n, v)| (n.to_owned(), v))
                .into_iter()
                .collect(),
            run: Some(SinkRunStatus {
                since_ms: 1_000_000,
                shards: [("b".to_owned(), shard_b)].into_iter().collect(),
                gave_up: Some(ErrorRecord {
                    text: "Giving up insert into ClickHouse: ...".to_owned(),
                    ..error
                }),
            }),
            ..SinkPartitionSummary::default()
        });
        let text = render(&summary, 1_060_000);
        let lines: Vec<&str> = text.lines().skip(4).collect();
        assert_eq!(
            lines,
            [
                "    totals: 1000 rows in 10 batches delivered, 4 insert errors (retryable code 210: 4), 0 unanswered, 3 retries, 0 dead letter rows, gave up 1 time(s)",
                "    at-most-once: 0 rows dropped (queue full), 5 rows lost (failed, not retried)",
                "    shard b since start (1m00s ago): 4 insert errors, 3 retries; last error 10s ago (code 210, retryable): connection refused",
                "    GAVE UP 10s ago: Giving up insert into ClickHouse: ... (the sink fails every write until the worker restarts; fix the cause, then restart)",
            ],
            "{text}"
        );
    }
}

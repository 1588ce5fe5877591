//! `flow-worker dead-letters list|export|requeue|purge`: what sources and sinks set aside, read from a
//! state directory (the worker must be stopped: the store is locked while it runs).
//!
//! A sink's dead letter carries a [`DeadRow`] (message id, shard, column, server code, the row by
//! column name); a source's carries the record as read. `export` prints one JSON object per line
//! for both, so the rows can be fixed and fed back by any tool. Bytes are exported exactly: a
//! record that is not UTF-8 as `record_base64`, a row's string values that are not UTF-8 also
//! in `row_base64`.

use std::fmt::Write as _;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use flow_core::{DeadRow, ExactBytes};
use flow_state::{ReadStore, StateError, StateStore, StoredDeadLetter, SOURCE_OWNER};
use serde_json::{json, Value as Json};

/// What `dead-letters` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Action {
    /// One line per dead letter: owner, message id, code or column, reason.
    List,
    /// JSON lines on stdout: pipeline, sink, message_id, code, column, shard, reason, row.
    Export,
    /// Put the rows the server refused back into their sinks' outboxes; the next `run` or
    /// `drain` sends them, exactly once for the exactly-once classes.
    Requeue,
    /// Remove them (needs --yes).
    Purge,
}

pub fn dead_letters(
    state_dir: &Path,
    action: Action,
    sink: Option<&str>,
    yes: bool,
) -> anyhow::Result<ExitCode> {
    if !crate::run::is_state_dir(state_dir) {
        anyhow::bail!("`{}` is not a flow state directory", state_dir.display());
    }
    let read = open(state_dir, action)?;
    let store = read.store();
    if let Some(sink) = sink {
        // A misspelt name would otherwise select nothing and answer "0 dead letter(s)" or
        // "removed 0", as if that sink had nothing set aside.
        if let Err(err) = check_sink_known(store, state_dir, sink) {
            read.close().context("closing the state store")?;
            return Err(err);
        }
    }
    let letters = store
        .all_dead_letters(sink)
        .context("reading the dead letters")?;
    let code = match action {
        Action::List => list(&letters)?,
        Action::Export => export(&letters)?,
        Action::Requeue => requeue(store, letters)?,
        Action::Purge => purge(store, &letters, yes)?,
    };
    read.close().context("closing the state store")?;
    Ok(code)
}

/// Opens the store for `action`: `list` and `export` read a directory they cannot write through a
/// copy of it (said on stderr); `requeue` and `purge` change it, so they need it writable.
fn open(state_dir: &Path, action: Action) -> anyhow::Result<ReadStore> {
    let opened = match action {
        Action::List | Action::Export => StateStore::open_to_read(state_dir),
        Action::Requeue | Action::Purge => StateStore::open(state_dir).map(ReadStore::from),
    };
    match opened {
        Ok(read) => {
            if read.copy().is_some() {
                eprintln!(
                    "`{}` cannot be written (a read-only file system, or no write permission); reading a copy of it taken just now",
                    state_dir.display()
                );
            }
            Ok(read)
        }
        // The store's message names the directory, the reason and what to do.
        Err(err @ StateError::NotWritable { .. }) => {
            let verb = if action == Action::Purge {
                "purge"
            } else {
                "requeue"
            };
            Err(anyhow::anyhow!(
                "dead-letters {verb} changes the state directory, and {err}"
            ))
        }
        Err(err) => Err(anyhow::Error::new(err).context(format!(
            "opening the state directory `{}` (stop the worker that runs on it first)",
            state_dir.display()
        ))),
    }
}

/// Refuses a `--sink` the store does not know, naming the sinks it does know; the source's owner
/// name ([`SOURCE_OWNER`]) selects the source's dead letters and is always accepted.
fn check_sink_known(store: &StateStore, state_dir: &Path, sink: &str) -> anyhow::Result<()> {
    if sink == SOURCE_OWNER {
        return Ok(());
    }
    let known = store
        .sink_names()
        .context("reading the sink names of the state directory")?;
    if known.contains(sink) {
        return Ok(());
    }
    let known = if known.is_empty() {
        "it knows no sink".to_owned()
    } else {
        let names: Vec<String> = known.iter().map(|name| format!("`{name}`")).collect();
        format!("its sinks are {}", names.join(", "))
    };
    anyhow::bail!(
        "the state directory `{}` knows no sink `{sink}`: {known}; pass one of them to --sink (`{SOURCE_OWNER}` for the source's dead letters), or leave --sink out for every dead letter",
        state_dir.display()
    )
}

fn list(letters: &[StoredDeadLetter]) -> anyhow::Result<ExitCode> {
    let mut text = format!("{} dead letter(s)\n", letters.len());
    for d in letters {
        let detail = match decode(d) {
            Some(row) => match (row.code, row.column) {
                (Some(code), _) => format!("code {code}"),
                (None, Some(column)) => format!("column `{column}`"),
                (None, None) => String::new(),
            },
            None => String::new(),
        };
        let _ = writeln!(
            text,
            "{}/{} {}-{} {detail:<16} {}",
            d.pipeline,
            d.owner,
            d.letter.partition,
            d.letter
                .offset
                .map_or_else(|| "?".to_owned(), |o| o.to_string()),
            crate::stdout::one_line(&d.letter.reason)
        );
    }
    crate::stdout::write_all(&text)?;
    Ok(ExitCode::SUCCESS)
}

/// The stored row of a sink's dead letter; `None` for a source's (its payload is the record).
fn decode(d: &StoredDeadLetter) -> Option<DeadRow> {
    if d.owner == SOURCE_OWNER {
        return None;
    }
    DeadRow::decode(&d.letter.payload).ok()
}

fn export_line(d: &StoredDeadLetter) -> Json {
    let message_id = d
        .letter
        .offset
        .map(|offset| format!("{}-{offset}", d.letter.partition));
    match decode(d) {
        Some(row) => {
            let mut line = json!({
                "pipeline": d.pipeline,
                "sink": d.owner,
                "message_id": row.message_id,
                "shard": row.shard,
                "column": row.column,
                "code": row.code,
                "reason": d.letter.reason,
                "row": row.row,
            });
            if !row.row_base64.is_empty() {
                line["row_base64"] = json!(row.row_base64);
            }
            if let Some(for_table) = &row.for_table {
                // Set aside because this table did not exist; a requeue sends it there.
                line["table"] = json!(for_table.target);
            }
            line
        }
        None => {
            let mut line = json!({
                "pipeline": d.pipeline,
                "sink": Json::Null,
                "source": d.owner == SOURCE_OWNER,
                "message_id": message_id,
                "code": Json::Null,
                "reason": d.letter.reason,
            });
            // The record's exact bytes: it may be the only copy left (a broker's retention).
            match ExactBytes::of(&d.letter.payload) {
                ExactBytes::Text(text) => line["record"] = json!(text),
                ExactBytes::Base64(base64) => {
                    line["record"] = Json::Null;
                    line["record_base64"] = json!(base64);
                }
            }
            line
        }
    }
}

fn export(letters: &[StoredDeadLetter]) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    for d in letters {
        serde_json::to_writer(&mut out, &export_line(d)).context("writing to stdout")?;
        out.write_all(b"\n").context("writing to stdout")?;
    }
    out.flush().context("writing to stdout")?;
    Ok(ExitCode::SUCCESS)
}

/// Moves every dead row that carries its encoded bytes back into its sink's outbox; the
/// others (rows set aside before they were encoded, a source's records) stay, and are listed.
fn requeue(store: &StateStore, letters: Vec<StoredDeadLetter>) -> anyhow::Result<ExitCode> {
    let sealed_at_ms = flow_core::delivery::now_ms();
    let mut moved = Vec::new();
    let mut kept = 0usize;
    for letter in letters {
        let batch = match decode(&letter) {
            Some(dead) => flow_clickhouse::requeued_batch(&dead, sealed_at_ms),
            None if letter.owner == SOURCE_OWNER => {
                Err("it is a source's record: fix the input and read it again".to_owned())
            }
            None => Err("its stored row cannot be read".to_owned()),
        };
        match batch {
            Ok(batch) => moved.push((letter, batch)),
            Err(why) => {
                kept += 1;
                eprintln!(
                    "not requeued: {}/{} {}-{}: {why}",
                    letter.pipeline,
                    letter.owner,
                    letter.letter.partition,
                    letter
                        .letter
                        .offset
                        .map_or_else(|| "?".to_owned(), |o| o.to_string()),
                );
            }
        }
    }
    let requeued = store
        .requeue_dead_letters_blocking(moved)
        .context("moving the dead letters into the outbox")?;
    println!(
        "requeued {requeued} dead letter(s) into the outbox; `flow-worker run` or `flow-worker drain` with the pipeline's spec sends them"
    );
    if kept > 0 {
        println!("{kept} dead letter(s) cannot be requeued and were kept (see above); `export` them to fix and feed them back");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn purge(store: &StateStore, letters: &[StoredDeadLetter], yes: bool) -> anyhow::Result<ExitCode> {
    if !yes {
        eprintln!(
            "purge would remove {} dead letter(s) for good; run it again with --yes (export them first to keep a copy)",
            letters.len()
        );
        return Ok(ExitCode::FAILURE);
    }
    let removed = store
        .remove_dead_letters_blocking(letters)
        .context("removing the dead letters")?;
    println!("removed {removed} dead letter(s)");
    Ok(ExitCode::SUCCESS)
}

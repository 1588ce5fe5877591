//! `flow-worker dead-letters list|export|purge`: what sources and sinks set aside, read from a
//! state directory (the worker must be stopped: the store is locked while it runs).
//!
//! A sink's dead letter carries a [`DeadRow`] (message id, shard, column, server code, the row by
//! column name); a source's carries the record as read. `export` prints one JSON object per line
//! for both, so the rows can be fixed and fed back by any tool.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use flow_core::DeadRow;
use flow_state::{StateStore, StoredDeadLetter, SOURCE_OWNER};
use serde_json::{json, Value as Json};

/// What `dead-letters` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Action {
    /// One line per dead letter: owner, message id, code or column, reason.
    List,
    /// JSON lines on stdout: pipeline, sink, message_id, code, column, shard, reason, row.
    Export,
    /// Remove them (needs --yes).
    Purge,
}

pub fn dead_letters(
    state_dir: &Path,
    action: Action,
    sink: Option<&str>,
    yes: bool,
) -> anyhow::Result<ExitCode> {
    if !state_dir.join("db").exists() && !state_dir.join("conf").exists() {
        anyhow::bail!("`{}` is not a flow state directory", state_dir.display());
    }
    let store = StateStore::open(state_dir).with_context(|| {
        format!(
            "opening the state directory `{}` (stop the worker that runs on it first)",
            state_dir.display()
        )
    })?;
    let letters = store
        .all_dead_letters(sink)
        .context("reading the dead letters")?;
    let code = match action {
        Action::List => list(&letters),
        Action::Export => export(&letters)?,
        Action::Purge => purge(&store, &letters, yes)?,
    };
    store.close().context("closing the state store")?;
    Ok(code)
}

fn list(letters: &[StoredDeadLetter]) -> ExitCode {
    println!("{} dead letter(s)", letters.len());
    for d in letters {
        let detail = match decode(d) {
            Some(row) => match (row.code, row.column) {
                (Some(code), _) => format!("code {code}"),
                (None, Some(column)) => format!("column `{column}`"),
                (None, None) => String::new(),
            },
            None => String::new(),
        };
        println!(
            "{}/{} {}-{} {detail:<16} {}",
            d.pipeline,
            d.owner,
            d.letter.partition,
            d.letter
                .offset
                .map_or_else(|| "?".to_owned(), |o| o.to_string()),
            d.letter.reason
        );
    }
    ExitCode::SUCCESS
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
        Some(row) => json!({
            "pipeline": d.pipeline,
            "sink": d.owner,
            "message_id": row.message_id,
            "shard": row.shard,
            "column": row.column,
            "code": row.code,
            "reason": d.letter.reason,
            "row": row.row,
        }),
        None => json!({
            "pipeline": d.pipeline,
            "sink": Json::Null,
            "source": d.owner == SOURCE_OWNER,
            "message_id": message_id,
            "code": Json::Null,
            "reason": d.letter.reason,
            "record": String::from_utf8_lossy(&d.letter.payload),
        }),
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

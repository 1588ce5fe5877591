//! `flow-worker status --watch`: the status, refreshed every `--interval` seconds until Ctrl-C.
//!
//! On a terminal each refresh clears the screen and redraws the table (or the pretty JSON) under
//! a header with the time. Without a terminal (a pipe, a file) nothing is cleared: each refresh
//! is appended, the table under a `--- <time> ---` header line, the JSON as one compact object per
//! line (JSON lines), so that the output can be logged or processed. The first read must
//! succeed (a wrong directory fails at once); a later failed read is shown and retried, since
//! a worker starting or stopping replaces the snapshot under the reader.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::Context;

use crate::error_text::error_text;
use crate::status::{read_summary, render};

/// Clears the screen and moves the cursor home.
const CLEAR_SCREEN: &str = "\x1b[H\x1b[2J";

pub fn watch(state_dir: &Path, json: bool, interval: Duration) -> anyhow::Result<ExitCode> {
    let terminal = std::io::stdout().is_terminal();
    // A wrong directory is reported once, not redrawn forever.
    let mut frame = Some(read_summary(state_dir)?);
    // Off a terminal the copy note goes to stderr once; on one it is part of every header.
    let mut noted = false;
    loop {
        let now = humantime::format_rfc3339_seconds(SystemTime::now());
        let (text, copy_note) = match frame.take() {
            Some((summary, note)) if json && terminal => {
                (serde_json::to_string_pretty(&summary)? + "\n", note)
            }
            Some((summary, note)) if json => (serde_json::to_string(&summary)? + "\n", note),
            Some((summary, note)) => (render(&summary, flow_core::delivery::now_ms()), note),
            None => match read_summary(state_dir) {
                Ok(read) => {
                    frame = Some(read);
                    continue;
                }
                Err(err) => (format!("error: {} (retrying)\n", error_text(&err)), None),
            },
        };
        if let Some(note) = copy_note.as_ref().filter(|_| !terminal && !noted) {
            eprintln!("{note}");
            noted = true;
        }
        let mut stdout = std::io::stdout().lock();
        let header = if terminal {
            let note = copy_note.map_or_else(String::new, |note| format!("{note}\n"));
            format!(
                "{CLEAR_SCREEN}{} every {} s, {now} (Ctrl-C to stop)\n{note}\n",
                state_dir.display(),
                interval.as_secs()
            )
        } else if json {
            String::new()
        } else {
            format!("--- {now} ---\n")
        };
        let written = stdout
            .write_all(header.as_bytes())
            .and_then(|()| stdout.write_all(text.as_bytes()))
            .and_then(|()| stdout.flush());
        match written {
            // A closed pipe (`| head`) is the reader's way to end the watch.
            Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => {
                return Ok(ExitCode::SUCCESS)
            }
            written => written.context("writing the status")?,
        }
        drop(stdout);
        std::thread::sleep(interval);
    }
}

//! Writing a command's answer to stdout: a reader that closed the pipe early (`status | head`)
//! has what it wanted, so that is not an error (`print!` would panic on it).

use std::io::Write;

use anyhow::Context;

/// Writes `text` to stdout and flushes it; a closed pipe counts as written.
pub(crate) fn write_all(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        written => written.context("writing to stdout"),
    }
}

//! Writing a command's answer to stdout: a reader that closed the pipe early (`status | head`)
//! has what it wanted, so that is not an error (`print!` would panic on it); text from outside
//! (a server's error, a row's value in a reason) is shown on one line, its control characters
//! escaped ([`one_line`]).

use std::borrow::Cow;
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

/// `text` with its control characters escaped as Rust writes them (`\n`, `\t`, `\u{0}`), so that
/// a reason holding a newline stays one record of a line-per-record listing and a NUL or an
/// escape sequence never reaches the terminal; other characters are kept as they are.
pub(crate) fn one_line(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_is_kept() {
        assert_eq!(
            one_line("line one\nline two\0\u{1b}[31m é"),
            "line one\\nline two\\u{0}\\u{1b}[31m é"
        );
        assert!(matches!(one_line("plain «text»"), Cow::Borrowed(_)));
    }
}

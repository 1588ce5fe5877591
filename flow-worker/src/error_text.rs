//! How the commands print an error: once, with each cause only when it adds something.

use anyhow::Error;

/// The error and its causes, `: `-separated, each cause only when its text is not already part
/// of what precedes it: our error types name their cause in their own message and expose it as
/// `source` too, so anyhow's `{:#}` would print the same reason two or three times.
pub(crate) fn error_text(err: &Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// A store's error names its cause and exposes it as `source`; with the caller's context on
    /// top, `{:#}` printed the operating system's reason twice.
    #[test]
    fn a_cause_already_in_the_message_is_printed_once() {
        let io = std::io::Error::from(std::io::ErrorKind::ReadOnlyFilesystem);
        let reason = io.to_string();
        let err = anyhow::Error::new(flow_state::StateError::NotWritable {
            dir: PathBuf::from("/srv/state"),
            source: io,
        })
        .context("opening `/srv/state`");
        assert_eq!(format!("{err:#}").matches(&reason).count(), 2);
        let text = error_text(&err);
        assert_eq!(text.matches(&reason).count(), 1, "{text}");
        assert!(
            text.starts_with(&format!(
                "opening `/srv/state`: the state directory /srv/state cannot be opened for writing ({reason}): "
            )),
            "{text}"
        );
    }
}

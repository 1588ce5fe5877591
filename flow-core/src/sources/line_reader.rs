//! Reading a growing file line by line, as `jsonl_file` does: a line is only a line once its
//! newline is there (a writer may be in the middle of it), no line is held in memory beyond
//! `max_record_bytes`, and the file's identity travels with the position so that a file replaced
//! or truncated between runs is noticed instead of being read from a stale byte offset.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncSeekExt};

/// How many bytes before a position its hash covers. Together with the file's device and inode
/// this tells a file that was only appended to from one that was replaced or rewritten, at the
/// cost of one small read when a partition opens.
pub const IDENTITY_WINDOW: usize = 4096;

/// What one call of [`read_line`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum LineEnd {
    /// A line with its newline: `consumed` bytes of the file, of which the first
    /// `max_record_bytes` at most are in the buffer (`truncated` when some were left out).
    Complete { consumed: u64, truncated: bool },
    /// The file ends inside a line (no newline yet): nothing of it is a record.
    Incomplete { consumed: u64 },
    /// The file ends exactly at a line boundary.
    Eof,
}

/// The bytes of a file just before a position, kept while reading so the position's hash costs
/// nothing more than the read itself.
#[derive(Debug, Default)]
pub struct Tail {
    bytes: Vec<u8>,
}

impl Tail {
    /// Adds bytes of the line that started when the tail was `mark` bytes long, keeping that
    /// line's last `IDENTITY_WINDOW` bytes at most, so an incomplete line can be taken back.
    fn push(&mut self, chunk: &[u8], mark: usize) {
        let chunk = &chunk[chunk.len().saturating_sub(IDENTITY_WINDOW)..];
        self.bytes.extend_from_slice(chunk);
        if self.bytes.len() > mark + 2 * IDENTITY_WINDOW {
            let keep_from = self.bytes.len() - IDENTITY_WINDOW;
            self.bytes.drain(mark..keep_from);
        }
    }

    /// The line is complete; trimmed in amortised steps, not per line.
    fn finish_line(&mut self) {
        if self.bytes.len() > 4 * IDENTITY_WINDOW {
            let excess = self.bytes.len() - IDENTITY_WINDOW;
            self.bytes.drain(..excess);
        }
    }

    /// The hash of the (at most) `IDENTITY_WINDOW` bytes before the position.
    pub fn hash(&self) -> u64 {
        let start = self.bytes.len().saturating_sub(IDENTITY_WINDOW);
        xxhash_rust::xxh64::xxh64(&self.bytes[start..], 0)
    }
}

/// Reads one line into `buffer` (cleared first), keeping at most `max_record_bytes` of it; the
/// rest of a longer line is read and skipped without being held.
pub async fn read_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    buffer: &mut Vec<u8>,
    max_record_bytes: usize,
    tail: &mut Tail,
) -> std::io::Result<LineEnd> {
    buffer.clear();
    let mark = tail.bytes.len();
    let mut consumed = 0u64;
    let mut truncated = false;
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            // Not part of the position: the line will be read again once complete.
            tail.bytes.truncate(mark);
            return Ok(if consumed == 0 {
                LineEnd::Eof
            } else {
                LineEnd::Incomplete { consumed }
            });
        }
        let (take, complete) = match available.iter().position(|&b| b == b'\n') {
            Some(newline) => (newline + 1, true),
            None => (available.len(), false),
        };
        let room = max_record_bytes.saturating_sub(buffer.len());
        if room < take {
            truncated = true;
        }
        buffer.extend_from_slice(&available[..take.min(room)]);
        tail.push(&available[..take], mark);
        reader.consume(take);
        consumed += take as u64;
        if complete {
            tail.finish_line();
            return Ok(LineEnd::Complete {
                consumed,
                truncated,
            });
        }
    }
}

/// Device, inode and length of an open input file; refuses what is not a regular file, because a
/// position is a byte offset to seek to on the next run.
pub fn identity(metadata: &std::fs::Metadata) -> Result<(u64, u64), String> {
    if !metadata.is_file() {
        return Err(format!(
            "not a regular file but {}: jsonl_file resumes at a byte offset, so it reads regular files only (copy the data into a file)",
            file_kind(&metadata.file_type())
        ));
    }
    Ok((metadata.dev(), metadata.ino()))
}

/// What a file that is not a regular one is, for the message that refuses it.
fn file_kind(file_type: &std::fs::FileType) -> &'static str {
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_fifo() {
        "a FIFO (named pipe)"
    } else if file_type.is_socket() {
        "a socket"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_symlink() {
        "a symbolic link"
    } else {
        "a special file"
    }
}

/// What a committed position says about its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recorded {
    pub offset: u64,
    pub device: u64,
    pub inode: u64,
    pub hash: u64,
}

/// Reads the window before `offset` into a fresh [`Tail`] and checks it (and the file's identity)
/// against `recorded`, when the position recorded one. The error says what changed.
pub async fn check_and_load(
    file: &mut tokio::fs::File,
    path: &Path,
    offset: u64,
    recorded: Option<Recorded>,
) -> Result<Tail, CheckError> {
    let metadata = file.metadata().await.map_err(CheckError::Io)?;
    let (device, inode) = identity(&metadata).map_err(CheckError::Changed)?;
    let len = metadata.len();
    if len < offset {
        return Err(CheckError::Changed(format!(
            "{len} bytes long, shorter than the committed position (byte {offset}): it was truncated or replaced since the last run. Restore the file, or start over with a new state directory (everything is then read and sent again)"
        )));
    }
    let window = offset.min(IDENTITY_WINDOW as u64);
    file.seek(std::io::SeekFrom::Start(offset - window))
        .await
        .map_err(CheckError::Io)?;
    let mut bytes = vec![0u8; usize::try_from(window).unwrap_or(IDENTITY_WINDOW)];
    file.read_exact(&mut bytes).await.map_err(CheckError::Io)?;
    let tail = Tail { bytes };
    if let Some(recorded) = recorded {
        let same_bytes = tail.hash() == recorded.hash;
        if !same_bytes {
            return Err(CheckError::Changed(format!(
                "the bytes before the committed position (byte {offset}) are not the ones read before: the file was replaced or rewritten since the last run (a file read by jsonl_file may only be appended to). Restore the file, or start over with a new state directory (everything is then read and sent again)"
            )));
        }
        if (device, inode) != (recorded.device, recorded.inode) {
            // The same bytes under a new inode: a copy, a restore or an atomic rewrite that kept
            // the content read so far. Continuing is right; say so.
            tracing::warn!(path = %path.display(), "the input file is a different file (device/inode) than at the committed position, with the same bytes before it; continuing from there");
        }
    }
    Ok(tail)
}

/// Why [`check_and_load`] refused.
#[derive(Debug)]
pub enum CheckError {
    Io(std::io::Error),
    Changed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn lines(text: &[u8], max: usize) -> Vec<(LineEnd, Vec<u8>)> {
        let mut reader = tokio::io::BufReader::with_capacity(4, text);
        let mut tail = Tail::default();
        let mut out = Vec::new();
        loop {
            let mut buffer = Vec::new();
            let end = read_line(&mut reader, &mut buffer, max, &mut tail)
                .await
                .unwrap();
            let last = !matches!(end, LineEnd::Complete { .. });
            out.push((end, buffer));
            if last {
                return out;
            }
        }
    }

    #[tokio::test]
    async fn a_line_without_its_newline_is_incomplete_not_a_line() {
        let got = lines(b"{\"a\":1}\n{\"a\":", 100).await;
        assert_eq!(
            got,
            vec![
                (
                    LineEnd::Complete {
                        consumed: 8,
                        truncated: false
                    },
                    b"{\"a\":1}\n".to_vec()
                ),
                (LineEnd::Incomplete { consumed: 5 }, b"{\"a\":".to_vec()),
            ]
        );
    }

    #[tokio::test]
    async fn a_long_line_is_held_only_up_to_the_cap_and_skipped_whole() {
        let mut text = vec![b'x'; 10_000];
        text.extend_from_slice(b"\nok\n");
        let got = lines(&text, 16).await;
        assert_eq!(
            got[0],
            (
                LineEnd::Complete {
                    consumed: 10_001,
                    truncated: true
                },
                vec![b'x'; 16]
            )
        );
        assert_eq!(got[1].1, b"ok\n");
        assert_eq!(got[2].0, LineEnd::Eof);
    }

    #[test]
    fn the_tail_hash_covers_the_window_before_the_position() {
        let mut streamed = Tail::default();
        for chunk in [&[1u8; 3000][..], &[2u8; 3000][..], &[3u8; 50][..]] {
            streamed.push(chunk, streamed.bytes.len());
            streamed.finish_line();
        }
        let mut whole = vec![1u8; 3000];
        whole.extend_from_slice(&[2u8; 3000]);
        whole.extend_from_slice(&[3u8; 50]);
        let loaded = Tail {
            bytes: whole[whole.len() - IDENTITY_WINDOW..].to_vec(),
        };
        assert_eq!(streamed.hash(), loaded.hash());
    }
}

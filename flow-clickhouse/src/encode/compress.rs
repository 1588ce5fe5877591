//! ClickHouse's native compression framing, applied once when a batch is sealed.
//!
//! The outbox stores framed bytes, which are exactly what is sent (`decompress=1`). Every batch
//! is **one frame**, with or without compression, because ClickHouse 18.16 commits the rows it has
//! parsed when a client's connection closes cleanly in the middle of an INSERT body: a plain
//! RowBinary body cut at a row boundary would land as a partial block, which a replay could not
//! deduplicate. A cut frame fails its size and checksum checks, so nothing lands. With LZ4 the
//! outbox also writes and fsyncs several times fewer bytes.
//!
//! A frame is `checksum (16 B, CityHash128 v1.0.2 of the rest) | method (0x82 LZ4, 0x02 none) |
//! frame size incl. this 9-byte header (u32 LE) | data size (u32 LE) | data`.

use bytes::Bytes;

use crate::config::params::Codec;

const CHECKSUM_SIZE: usize = 16;
const HEADER_SIZE: usize = 9;
const METHOD_LZ4: u8 = 0x82;
const METHOD_NONE: u8 = 0x02;

/// The suffix of `SealedBatch::format` for LZ4-compressed frames.
pub const LZ4_FORMAT_SUFFIX: &str = ";lz4";
/// The suffix of `SealedBatch::format` for uncompressed frames.
pub const NONE_FORMAT_SUFFIX: &str = ";framed";

/// How a sealed part's payload is laid out: always one frame of ClickHouse's compression
/// framing (sent with `decompress=1`), its data LZ4-compressed or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartFormat {
    /// `RowBinary;lz4`.
    Lz4Frame,
    /// `RowBinary;framed`.
    PlainFrame,
}

impl PartFormat {
    /// The name stored as `SealedBatch::format` (stored batches keep it as text).
    pub fn as_str(self) -> &'static str {
        match self {
            PartFormat::Lz4Frame => "RowBinary;lz4",
            PartFormat::PlainFrame => "RowBinary;framed",
        }
    }
}

/// Whether a stored format is framed (sent with `decompress=1`).
pub fn is_framed(format: &str) -> bool {
    format.ends_with(LZ4_FORMAT_SUFFIX) || format.ends_with(NONE_FORMAT_SUFFIX)
}

/// Frames encoded RowBinary rows for the outbox: returns the stored format and the bytes to send.
/// The frame is built in its own allocation, of the worst-case size, and shrunk in place to its
/// length: a payload waiting for delivery holds only its own bytes, and no per-thread scratch of
/// the largest frame ever built stays resident beside it (one per runtime thread, 10 MB each
/// for the benchmark's 100k-row batches).
pub fn seal(codec: Codec, rows: &[u8]) -> (PartFormat, Bytes) {
    let mut frame = Vec::new();
    let (format, len) = match codec {
        Codec::Lz4 => (PartFormat::Lz4Frame, frame_lz4(rows, &mut frame)),
        Codec::None => (PartFormat::PlainFrame, frame_none(rows, &mut frame)),
    };
    frame.truncate(len);
    frame.shrink_to_fit();
    (format, Bytes::from(frame))
}

/// Writes `data` as one LZ4 frame at the start of `buffer` and returns the frame's length.
/// Bytes past the frame are left as they were.
fn frame_lz4(data: &[u8], buffer: &mut Vec<u8>) -> usize {
    let body = CHECKSUM_SIZE + HEADER_SIZE;
    grow_to(
        buffer,
        body + lz4_flex::block::get_maximum_output_size(data.len()),
    );
    // The buffer holds the maximum output size, so compression cannot run out of room.
    let written = lz4_flex::block::compress_into(data, &mut buffer[body..]).unwrap_or(0);
    finish_frame(&mut buffer[..body + written], METHOD_LZ4, data.len());
    body + written
}

/// Writes `data` as one uncompressed frame at the start of `buffer`; see [`frame_lz4`].
fn frame_none(data: &[u8], buffer: &mut Vec<u8>) -> usize {
    let body = CHECKSUM_SIZE + HEADER_SIZE;
    grow_to(buffer, body + data.len());
    buffer[body..body + data.len()].copy_from_slice(data);
    finish_frame(&mut buffer[..body + data.len()], METHOD_NONE, data.len());
    body + data.len()
}

fn grow_to(buffer: &mut Vec<u8>, len: usize) {
    if buffer.is_empty() {
        // Zeroed by the allocator: fresh pages need no writing.
        *buffer = vec![0; len];
    } else if buffer.len() < len {
        buffer.resize(len, 0);
    }
}

/// Fills in the checksum and header of the frame that is all of `frame`.
fn finish_frame(frame: &mut [u8], method: u8, data_len: usize) {
    let header = CHECKSUM_SIZE;
    let frame_len = (frame.len() - header) as u32;
    frame[header] = method;
    frame[header + 1..header + 5].copy_from_slice(&frame_len.to_le_bytes());
    frame[header + 5..header + 9].copy_from_slice(&(data_len as u32).to_le_bytes());
    let checksum = cityhash_rs::cityhash_102_128(&frame[header..]).rotate_right(64);
    frame[..header].copy_from_slice(&checksum.to_le_bytes());
}

/// Why a stored payload does not unframe.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UnframeError {
    /// The payload is shorter than a frame header.
    #[error("a frame of {0} bytes has no header")]
    NoHeader(usize),
    /// The header's length and the payload's disagree.
    #[error("the frame says {said} bytes, the payload holds {held}")]
    Length {
        /// The length the header gives.
        said: usize,
        /// The bytes the payload holds after the checksum.
        held: usize,
    },
    /// The LZ4 block does not decompress.
    #[error("the LZ4 frame does not decompress: {0}")]
    Lz4(#[source] lz4_flex::block::DecompressError),
    /// The header names a method this sink does not write.
    #[error("unknown frame method {0:#x}")]
    Method(u8),
}

/// The encoded rows inside a stored payload of `format`: the payload itself when it is not
/// framed, else the data of its one frame (LZ4 decompressed). Errors name what is wrong.
pub fn unframe(format: &str, payload: &[u8]) -> Result<Vec<u8>, UnframeError> {
    if !is_framed(format) {
        return Ok(payload.to_vec());
    }
    let header = payload
        .get(CHECKSUM_SIZE..CHECKSUM_SIZE + HEADER_SIZE)
        .ok_or(UnframeError::NoHeader(payload.len()))?;
    let word = |at: usize| {
        u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]]) as usize
    };
    let (frame_len, raw_len) = (word(1), word(5));
    let frame = &payload[CHECKSUM_SIZE..];
    if frame.len() != frame_len || frame_len < HEADER_SIZE {
        return Err(UnframeError::Length {
            said: frame_len,
            held: frame.len(),
        });
    }
    let data = &frame[HEADER_SIZE..];
    match header[0] {
        METHOD_LZ4 => lz4_flex::block::decompress(data, raw_len).map_err(UnframeError::Lz4),
        METHOD_NONE => Ok(data.to_vec()),
        other => Err(UnframeError::Method(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes one frame, checking everything ClickHouse checks.
    fn unframe_checked(framed: &[u8]) -> Vec<u8> {
        let header = &framed[CHECKSUM_SIZE..CHECKSUM_SIZE + HEADER_SIZE];
        let frame_len = u32::from_le_bytes(header[1..5].try_into().unwrap()) as usize;
        let raw_len = u32::from_le_bytes(header[5..9].try_into().unwrap()) as usize;
        assert_eq!(
            framed.len(),
            CHECKSUM_SIZE + frame_len,
            "one frame, nothing after"
        );
        let checksum = u128::from_le_bytes(framed[..CHECKSUM_SIZE].try_into().unwrap());
        let frame = &framed[CHECKSUM_SIZE..];
        assert_eq!(
            checksum,
            cityhash_rs::cityhash_102_128(frame).rotate_right(64)
        );
        match header[0] {
            METHOD_LZ4 => lz4_flex::block::decompress(&frame[HEADER_SIZE..], raw_len).unwrap(),
            METHOD_NONE => frame[HEADER_SIZE..].to_vec(),
            other => panic!("unknown method {other:#x}"),
        }
    }

    #[test]
    fn a_batch_is_one_lz4_frame_that_round_trips() {
        let data: Vec<u8> = (0..(3 << 20) + 123).map(|i| (i % 251) as u8).collect();
        let mut framed = Vec::new();
        let len = frame_lz4(&data, &mut framed);
        framed.truncate(len);
        assert!(framed.len() < data.len() / 4);
        assert_eq!(framed[16], METHOD_LZ4);
        assert_eq!(unframe_checked(&framed), data);
    }

    #[test]
    fn unframe_reads_back_what_seal_stored_and_names_a_cut_frame() {
        let data: Vec<u8> = (0..100_000).map(|i| (i % 7) as u8).collect();
        for codec in [Codec::Lz4, Codec::None] {
            let (format, payload) = seal(codec, &data);
            assert_eq!(unframe(format.as_str(), &payload).unwrap(), data);
            assert_eq!(unframe_checked(&payload), data);
            let cut = unframe(format.as_str(), &payload[..payload.len() - 1])
                .unwrap_err()
                .to_string();
            assert!(cut.contains("the payload holds"), "{cut}");
        }
        assert_eq!(unframe("RowBinary", b"raw").unwrap(), b"raw");
        let short = unframe("RowBinary;lz4", &[0; 10]).unwrap_err().to_string();
        assert!(short.contains("no header"), "{short}");
    }

    #[test]
    fn uncompressed_frame_carries_the_bytes_verbatim() {
        let data = b"rowbinary bytes".to_vec();
        let mut framed = Vec::new();
        assert_eq!(frame_none(&data, &mut framed), 25 + data.len());
        assert_eq!(framed[16], METHOD_NONE);
        assert_eq!(&framed[25..], &data[..]);
        assert_eq!(unframe_checked(&framed), data);
    }

    #[test]
    fn framing_is_deterministic_and_ignores_what_a_reused_scratch_held() {
        let data = b"the same bytes give the same frames".repeat(1000);
        let (mut a, mut b) = (Vec::new(), vec![0xAB; 1 << 20]);
        let a_len = frame_lz4(&data, &mut a);
        let b_len = frame_lz4(&data, &mut b);
        assert_eq!(a[..a_len], b[..b_len]);
        // A larger frame first, then a smaller one in the same buffer: the same frame as alone.
        let alone = seal(Codec::None, b"small").1;
        let mut scratch = Vec::new();
        frame_lz4(&data, &mut scratch);
        let len = frame_none(b"small", &mut scratch);
        assert_eq!(scratch[..len], alone[..]);
        assert_eq!(unframe_checked(&alone), b"small");
        // A sealed payload holds only its own bytes.
        let (_, sealed) = seal(Codec::Lz4, &data);
        assert_eq!(sealed[..], a[..a_len]);
    }
}

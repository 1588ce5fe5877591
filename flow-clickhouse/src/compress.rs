//! ClickHouse's native compression framing (LZ4), applied once when a batch is sealed.
//!
//! The outbox stores the compressed bytes, which are exactly what is sent (`decompress=1`): the
//! outbox writes and fsyncs several times fewer bytes, and a delivery or replay only copies a
//! reference. Each frame is `checksum (16 B, CityHash128 v1.0.2 of the rest) | 0x82 | compressed
//! size incl. this 9-byte header (u32 LE) | uncompressed size (u32 LE) | LZ4 block`.

/// Uncompressed bytes per frame, as ClickHouse's own clients use.
pub const FRAME_BYTES: usize = 1 << 20;

const CHECKSUM_SIZE: usize = 16;
const HEADER_SIZE: usize = 9;
const LZ4_METHOD: u8 = 0x82;

/// The suffix of `SealedBatch::format` for payloads in this framing.
pub const LZ4_FORMAT_SUFFIX: &str = ";lz4";

/// Appends `data` compressed as a sequence of LZ4 frames to `out`.
pub fn compress_lz4(data: &[u8], out: &mut Vec<u8>) {
    for chunk in data.chunks(FRAME_BYTES) {
        let start = out.len();
        let bound = lz4_flex::block::get_maximum_output_size(chunk.len());
        out.resize(start + CHECKSUM_SIZE + HEADER_SIZE + bound, 0);
        let body = start + CHECKSUM_SIZE + HEADER_SIZE;
        // The buffer holds the maximum output size, so compression cannot run out of room.
        let written = lz4_flex::block::compress_into(chunk, &mut out[body..]).unwrap_or(0);
        out.truncate(body + written);
        let frame_len = (HEADER_SIZE + written) as u32;
        let header = start + CHECKSUM_SIZE;
        out[header] = LZ4_METHOD;
        out[header + 1..header + 5].copy_from_slice(&frame_len.to_le_bytes());
        out[header + 5..header + 9].copy_from_slice(&(chunk.len() as u32).to_le_bytes());
        let checksum = cityhash_rs::cityhash_102_128(&out[header..]).rotate_right(64);
        out[start..header].copy_from_slice(&checksum.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decompress(mut framed: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        while !framed.is_empty() {
            let header = &framed[CHECKSUM_SIZE..CHECKSUM_SIZE + HEADER_SIZE];
            assert_eq!(header[0], LZ4_METHOD);
            let frame_len = u32::from_le_bytes(header[1..5].try_into().unwrap()) as usize;
            let raw_len = u32::from_le_bytes(header[5..9].try_into().unwrap()) as usize;
            let checksum = u128::from_le_bytes(framed[..CHECKSUM_SIZE].try_into().unwrap());
            let frame = &framed[CHECKSUM_SIZE..CHECKSUM_SIZE + frame_len];
            assert_eq!(
                checksum,
                cityhash_rs::cityhash_102_128(frame).rotate_right(64)
            );
            out.extend(lz4_flex::block::decompress(&frame[HEADER_SIZE..], raw_len).unwrap());
            framed = &framed[CHECKSUM_SIZE + frame_len..];
        }
        out
    }

    #[test]
    fn frames_round_trip_and_split_at_one_mebibyte() {
        let data: Vec<u8> = (0..(FRAME_BYTES * 2 + 123))
            .map(|i| (i % 251) as u8)
            .collect();
        let mut framed = Vec::new();
        compress_lz4(&data, &mut framed);
        assert!(framed.len() < data.len() / 4);
        assert_eq!(decompress(&framed), data);
    }

    #[test]
    fn compression_is_deterministic() {
        let data = b"the same bytes give the same frames".repeat(1000);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        compress_lz4(&data, &mut a);
        compress_lz4(&data, &mut b);
        assert_eq!(a, b);
    }
}

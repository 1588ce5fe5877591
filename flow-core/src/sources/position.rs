//! The positions of the built-in sources: big-endian `u64` words.

/// The `N` words of `position`; `None` unless it is exactly `N` words long.
pub(crate) fn decode_words<const N: usize>(position: &[u8]) -> Option<[u64; N]> {
    if position.len() != N * 8 {
        return None;
    }
    let mut words = [0u64; N];
    for (word, chunk) in words.iter_mut().zip(position.chunks_exact(8)) {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(chunk);
        *word = u64::from_be_bytes(bytes);
    }
    Some(words)
}

/// The position made of `words`.
pub(crate) fn encode_words(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_be_bytes()).collect()
}

/// The words of `position` when it is one of `lengths` words long; `None` otherwise.
pub(crate) fn decode_word_list(position: &[u8], lengths: &[usize]) -> Option<Vec<u64>> {
    if !position.len().is_multiple_of(8) || !lengths.contains(&(position.len() / 8)) {
        return None;
    }
    Some(
        position
            .chunks_exact(8)
            .map(|chunk| {
                let mut bytes = [0u8; 8];
                bytes.copy_from_slice(chunk);
                u64::from_be_bytes(bytes)
            })
            .collect(),
    )
}

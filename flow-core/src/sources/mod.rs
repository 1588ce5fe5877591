//! Built-in sources.

pub mod broker;
pub mod generator;
pub mod jsonl;
mod line_reader;
pub mod push;

pub use broker::{
    decode_broker_position, encode_broker_position, BrokerDecoder, BrokerFormat, BrokerRecord,
};
pub use generator::{GeneratorParams, GeneratorSource};
pub use jsonl::{JsonlFileParams, OnBadRecord};
pub use push::{PushError, PushHandle, PushOptions, PushSource, Receipt, Route};

use crate::registry::Registry;

pub(crate) fn register(registry: &mut Registry) {
    registry.register_source("generator", std::sync::Arc::new(generator::build));
    registry.register_source("jsonl_file", std::sync::Arc::new(jsonl::build));
}

/// Positions of the built-in sources are big-endian `u64` words.
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

pub(crate) fn encode_words(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_be_bytes()).collect()
}

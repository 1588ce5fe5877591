//! Built-in sources and what broker sources share.
//!
//! Layout: `generator` (public: its rows' recipe, which tests and benchmarks predict), `jsonl`
//! (`jsonl_file`), `broker` (the decoding and positions broker sources share), `push/` (the
//! source an application feeds from its own code), `line_reader` and `position` (what the
//! sources above read files and positions with).

mod broker;
pub mod generator;
pub(crate) mod jsonl;
mod line_reader;
mod position;
mod push;

pub use broker::{
    decode_broker_position, decode_broker_words, encode_broker_position, encode_broker_words,
    BrokerDecoder, BrokerFormat, BrokerRecord,
};
pub use generator::{GeneratorParams, GeneratorSource};
pub use jsonl::{JsonlFileParams, OnBadRecord};
pub use push::{PushError, PushHandle, PushOptions, PushSource, Receipt, Route};

use crate::registry::Registry;

pub(crate) fn register(registry: &mut Registry) {
    registry.register_source("generator", std::sync::Arc::new(generator::build));
    registry.register_source("jsonl_file", std::sync::Arc::new(jsonl::build));
}

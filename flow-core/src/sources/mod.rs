//! Built-in sources.

pub mod broker;
pub mod generator;
pub mod jsonl;
mod line_reader;
mod position;
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

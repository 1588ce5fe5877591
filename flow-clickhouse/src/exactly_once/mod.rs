//! The exactly-once sink classes: outbox, tokens, topology fingerprints, rebuilt batches.

pub(crate) mod deliverer;
pub(crate) mod fingerprint;
pub(crate) mod landed;
pub(crate) mod rebuild;
pub(crate) mod sink;
pub(crate) mod state;

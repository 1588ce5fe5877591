//! Internals this crate's own integration tests read (`features = ["testing"]`); not API.

/// `ts` of the generator's message id 0; it advances one second every 1000 ids.
pub const TS_BASE: u64 = crate::sources::generator::TS_BASE;

//! What every sink class shares: the per-sink state, cutting epochs into parts, the INSERT with
//! its retries and backoff, the backlog age, splitting refused parts.

pub(crate) mod backlog_age;
pub(crate) mod backoff;
pub(crate) mod cutter;
pub(crate) mod insert;
pub(crate) mod sink_state;
pub(crate) mod split;

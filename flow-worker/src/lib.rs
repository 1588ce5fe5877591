//! `flow-worker`: runs, validates and inspects flow pipelines described by a YAML spec.
//!
//! Layout:
//! - `cli`: argument parsing, logging set-up and dispatch to one module per command.
//! - the commands: `run` (with `progress`, its live progress line), `drain`, `status` (with
//!   `status_watch`, `--watch`), `dead_letters`, `verify`.
//! - `error_text`: how an error is printed (each cause once); `stdout`: a command's answer
//!   written so that a reader closing the pipe early is no error; `memory`: the jemalloc settings and
//!   memory reports of the worker's processes.
//!
//! `run` executes the pipeline until its finite sources are drained (or a signal stops it),
//! `validate` reports every violation of a spec without connecting anywhere, `drain` delivers
//! what the outbox holds without reading the source, `status` reads a state directory and shows
//! positions, undelivered batches, fingerprints and dead letters, `dead-letters` lists, exports or
//! purges what sources and sinks set aside, and `verify` checks that the replicas of every
//! ClickHouse shard hold the same rows. `run` serves Prometheus metrics at `/metrics` when asked
//! to (the `flow` facade's `MetricsEndpoint`) and keeps the status snapshot current (its
//! `LiveStatus`). The CLI lives in this library so that test harnesses can ship the same binary
//! under their own name.

#![warn(missing_docs)]

mod cli;
mod dead_letters;
mod drain;
mod error_text;
mod memory;
mod progress;
mod run;
mod status;
mod status_cluster;
mod status_watch;
mod stdout;
mod verify;

pub use cli::main;
/// For programs that run pipelines on jemalloc as the worker does (the benchmark's processes).
pub use memory::{configure_allocator, report_memory};

/// The unit tests read jemalloc's statistics, so they run on it like the binary.
#[cfg(test)]
#[global_allocator]
static TEST_ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Every plugin class the worker knows: flow-core's built-ins, the broker sources and the
/// ClickHouse sinks (the `flow` facade's registry).
pub use flow::registry;

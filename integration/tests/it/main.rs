//! The cluster tests, in one test binary: one link and one copy of the generic code they share,
//! instead of one per file (with seventeen files, building them took minutes of a CI run).
//! Several tests stop and restart nodes, so `scripts/test.sh` runs tests one at a time
//! (`RUST_TEST_THREADS=1`); run a file's tests with `cargo test --release -p flow-integration
//! --test it <module>::`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod clickhouse_session;
mod cluster;
mod dead_letters;
mod disk_full;
mod exactly_once_faults;
mod fault_suite;
mod guarantee_cases;
mod nats_source;
mod outbox_bounds;
mod partial_body;
mod protocol_mismatch;
mod proxy;
mod refused_rows;
mod rowbinary_live;
mod schema_change;
mod tls_live;
mod token_double;

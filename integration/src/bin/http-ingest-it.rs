//! The `http_ingest` example (`examples/http_ingest.rs`), built with this package for
//! `tests/http_ingest.rs` (see Cargo.toml).

#[path = "../../../examples/http_ingest.rs"]
mod example;

fn main() -> anyhow::Result<()> {
    example::main()
}

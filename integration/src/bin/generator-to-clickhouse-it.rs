//! The `generator_to_clickhouse` example (`examples/generator_to_clickhouse.rs`), built with this package for
//! `tests/examples.rs` (see Cargo.toml).

#[path = "../../../examples/generator_to_clickhouse.rs"]
mod example;

fn main() -> anyhow::Result<()> {
    example::main()
}

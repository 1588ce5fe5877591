//! The `custom_plugins` example (`examples/custom_plugins.rs`), built with this package for
//! `tests/examples.rs` (see Cargo.toml).

#[path = "../../../examples/custom_plugins.rs"]
mod example;

fn main() -> anyhow::Result<()> {
    example::main()
}

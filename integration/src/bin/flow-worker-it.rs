//! `flow-worker` for the integration tests (see Cargo.toml).
fn main() -> std::process::ExitCode {
    flow_worker::main()
}

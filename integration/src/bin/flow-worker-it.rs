//! `flow-worker` for the integration tests (see Cargo.toml), on the same allocator.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    flow_worker::main()
}

fn main() -> std::process::ExitCode {
    flow_worker::main()
}

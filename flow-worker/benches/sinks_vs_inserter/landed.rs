//! A stream has no end: a flow case reading a broker is stopped (SIGTERM, a graceful stop) once
//! every row is in its table, and timed to that stop.

/// Watches the table from a thread and sends SIGTERM to the worker running `spec` once it
/// holds `rows` rows.
pub struct StopWhenLanded {
    thread: std::thread::JoinHandle<()>,
}

impl StopWhenLanded {
    pub fn start(table: String, rows: u64, spec: std::path::PathBuf) -> StopWhenLanded {
        let first = super::Server::get().map_or("127.0.0.1:18123", super::Server::first);
        let thread = std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
            while std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(100));
                if count(first, &table).is_some_and(|n| n >= rows) {
                    break;
                }
            }
            if let Some(pid) = worker_pid(&spec) {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            }
        });
        StopWhenLanded { thread }
    }

    pub fn join(self) {
        let _ = self.thread.join();
    }
}

/// `count()` of `default.<table>` on `node` (`host:port` of its HTTP interface); `None` while the
/// node does not answer or the table does not exist.
pub fn count(node: &str, table: &str) -> Option<u64> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(node).ok()?;
    let query = format!("SELECT%20count()%20FROM%20default.{table}");
    let request = format!("GET /?query={query} HTTP/1.0\r\nHost: {node}\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).ok()?;
    reply.split("\r\n\r\n").nth(1)?.trim().parse().ok()
}

/// The pid of the `flow-worker run` whose command line names `spec`.
fn worker_pid(spec: &std::path::Path) -> Option<nix::unistd::Pid> {
    let spec = spec.to_string_lossy();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.first().is_some_and(|a| a == super::WORKER) && args.iter().any(|a| *a == spec) {
            return Some(nix::unistd::Pid::from_raw(pid));
        }
    }
    None
}

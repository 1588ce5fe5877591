//! CPU-bound work inside async code: generating, encoding and compressing an epoch take tens of
//! milliseconds, during which a tokio worker polls nothing else. On a machine with few cores
//! that starves the delivery tasks (a half-sent INSERT body waits while the server idles), so on
//! a multi-threaded runtime such work runs under `block_in_place`: the worker's other tasks move
//! to another thread and the operating system shares the cores between both.

use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs `work` so that the runtime's other tasks keep running meanwhile (multi-threaded
/// runtime), or inline (current-thread runtime, where `block_in_place` is not allowed).
pub fn cpu_bound<T>(work: impl FnOnce() -> T) -> T {
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

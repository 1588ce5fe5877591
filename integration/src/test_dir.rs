//! A test's working directory ([`TestDir`]): removed when the test passes, kept when it fails,
//! with what its workers logged shown in the test's output, so that a failure on a CI machine
//! (where only the output survives) leaves its evidence behind.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// How many of a log's warning and error lines a failed test shows, and how many of its last
/// lines.
const WARNINGS_SHOWN: usize = 150;
const TAIL_SHOWN: usize = 40;

/// A temporary directory kept (and its `*.log` files excerpted on stderr) when the thread that
/// owns it panics, i.e. when the test fails.
#[derive(Debug)]
pub struct TestDir {
    path: PathBuf,
    /// Taken by the drop, which removes or keeps the directory.
    dir: Option<tempfile::TempDir>,
}

impl TestDir {
    pub fn new() -> Result<TestDir> {
        let dir = tempfile::tempdir().context("creating the test's directory")?;
        Ok(TestDir {
            path: dir.path().to_path_buf(),
            dir: Some(dir),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `path()/name`.
    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path().join(name)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let Some(dir) = self.dir.take() else {
            return;
        };
        let kept = dir.keep();
        eprintln!("the failed test's directory is kept: {}", kept.display());
        for log in logs_under(&kept) {
            eprintln!("{}", excerpt(&log));
        }
    }
}

/// The `*.log` files in `dir` and its subdirectories, by path.
fn logs_under(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for path in entries.filter_map(|e| e.ok()).map(|e| e.path()) {
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "log") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// A log's warnings and errors (the first [`WARNINGS_SHOWN`]) and its last [`TAIL_SHOWN`] lines.
fn excerpt(log: &Path) -> String {
    let text = match std::fs::read(log) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(err) => return format!("--- {}: cannot be read: {err}", log.display()),
    };
    let lines: Vec<&str> = text.lines().collect();
    let warnings: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|line| line.contains(" WARN ") || line.contains(" ERROR "))
        .collect();
    let shown = warnings.len().min(WARNINGS_SHOWN);
    let tail = &lines[lines.len().saturating_sub(TAIL_SHOWN)..];
    format!(
        "--- {}: {} lines, {} warnings or errors (the first {shown}):\n{}\n--- its last {} lines:\n{}",
        log.display(),
        lines.len(),
        warnings.len(),
        warnings[..shown].join("\n"),
        tail.len(),
        tail.join("\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_passing_test_removes_its_directory() -> Result<()> {
        let dir = TestDir::new()?;
        let path = dir.path().to_path_buf();
        assert!(path.is_dir());
        drop(dir);
        assert!(!path.exists());
        Ok(())
    }

    #[test]
    fn a_failing_test_keeps_its_directory_with_its_logs() -> Result<()> {
        let kept = std::thread::spawn(|| {
            let dir = TestDir::new().unwrap_or_else(|err| panic!("{err:#}"));
            let path = dir.path().to_path_buf();
            std::fs::write(dir.join("worker-1.log"), "a WARN b\nplain\n")
                .unwrap_or_else(|err| panic!("{err:#}"));
            std::panic::panic_any(path);
        })
        .join()
        .err()
        .and_then(|payload| payload.downcast::<PathBuf>().ok())
        .context("the thread did not panic with its directory")?;
        assert_eq!(
            std::fs::read_to_string(kept.join("worker-1.log"))?,
            "a WARN b\nplain\n"
        );
        let excerpt = excerpt(&kept.join("worker-1.log"));
        assert!(
            excerpt.contains("2 lines, 1 warnings or errors"),
            "{excerpt}"
        );
        std::fs::remove_dir_all(kept.as_path())?;
        Ok(())
    }
}

//! Where a spec's relative paths point ([`SpecPaths`]): one rule for every path a spec names
//! (`state_dir`, a source's `files`, a sink's `path` or `password_file`, TLS and credential
//! files): a spec read from a file resolves them against that file's directory, so that the
//! worker finds the same files whichever directory it is started from; a spec parsed from text
//! or built in code leaves them to the process's working directory.

use std::path::{Path, PathBuf};

/// The base a spec's relative paths are resolved against, handed to every plugin builder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecPaths<'a> {
    /// The canonical directory of the spec file; `None`: the working directory.
    dir: Option<&'a Path>,
}

impl<'a> SpecPaths<'a> {
    /// Relative paths stay relative to the process's working directory.
    pub fn working_directory() -> SpecPaths<'static> {
        SpecPaths { dir: None }
    }

    /// Relative paths are joined to `dir` (the directory of the spec file).
    pub fn under(dir: &'a Path) -> SpecPaths<'a> {
        SpecPaths { dir: Some(dir) }
    }

    /// `path` as the spec means it: a relative one joined to the spec file's directory (and
    /// logged with the absolute path it became); an absolute or empty one as written (an empty
    /// one is for the plugin to refuse).
    pub fn resolve(&self, path: &Path) -> PathBuf {
        let Some(dir) = self.dir else {
            return path.to_path_buf();
        };
        if path.as_os_str().is_empty() || path.is_absolute() {
            return path.to_path_buf();
        }
        // Collecting the components drops the `.` ones (`./data`), never a `..`.
        let resolved: PathBuf = dir.join(path).components().collect();
        tracing::info!(
            path = %path.display(),
            resolved = %resolved.display(),
            "a relative path of the spec is taken from the spec file's directory"
        );
        resolved
    }
}

/// The canonical directory holding the spec file at `spec_path` (so that every working
/// directory logs the same paths); should it vanish after the file was read, the directory as
/// named, made absolute, still names the same place for this process.
pub(super) fn spec_file_dir(spec_path: &Path) -> PathBuf {
    let dir = match spec_path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    std::fs::canonicalize(dir)
        .or_else(|_| std::path::absolute(dir))
        .unwrap_or_else(|_| dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_join_the_spec_directory_and_others_stay_as_written() {
        let paths = SpecPaths::under(Path::new("/etc/flow"));
        assert_eq!(
            paths.resolve(Path::new("./data/in.jsonl")),
            Path::new("/etc/flow/data/in.jsonl")
        );
        assert_eq!(
            paths.resolve(Path::new("../secrets/pw")),
            Path::new("/etc/flow/../secrets/pw")
        );
        assert_eq!(paths.resolve(Path::new("/abs/pw")), Path::new("/abs/pw"));
        assert_eq!(paths.resolve(Path::new("")), Path::new(""));
        let cwd = SpecPaths::working_directory();
        assert_eq!(cwd.resolve(Path::new("in.jsonl")), Path::new("in.jsonl"));
    }
}

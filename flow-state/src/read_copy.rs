//! Reading a state directory this process cannot write. sled opens a store only for writing, so
//! a directory on a read-only file system (or one this user may not write) is copied to a
//! temporary directory and the copy is opened instead: what it shows is the directory as of the
//! copy, which the caller must say.

use std::path::Path;

use crate::error::StateError;
use crate::store::StateStore;

/// A store opened for reading by [`StateStore::open_to_read`]: the directory itself, or a
/// temporary copy of it when the directory cannot be written. The copy is removed when this is
/// closed or dropped.
pub struct ReadStore {
    // Declared before `copy`: the store closes before its temporary directory is removed.
    store: StateStore,
    copy: Option<tempfile::TempDir>,
}

impl ReadStore {
    /// The open store (of the directory, or of its copy).
    pub fn store(&self) -> &StateStore {
        &self.store
    }

    /// The temporary copy that was opened because the directory cannot be written; `None` when
    /// the directory itself is open.
    pub fn copy(&self) -> Option<&Path> {
        self.copy.as_ref().map(tempfile::TempDir::path)
    }

    /// Closes the store, then removes the copy, if any.
    pub fn close(self) -> Result<(), StateError> {
        let ReadStore { store, copy } = self;
        store.close()?;
        drop(copy);
        Ok(())
    }
}

impl From<StateStore> for ReadStore {
    /// A store opened in place (by [`StateStore::open`]).
    fn from(store: StateStore) -> ReadStore {
        ReadStore { store, copy: None }
    }
}

impl StateStore {
    /// Opens the store in `dir` to read it. When `dir` cannot be written
    /// ([`StateError::NotWritable`]: a read-only file system, no write permission), the
    /// directory is copied to a temporary directory and the copy is opened
    /// ([`ReadStore::copy`]); every other failure (a worker holding the directory:
    /// [`StateError::Locked`]) is returned as [`StateStore::open`] returns it. Writes made
    /// through a copy are lost with it: use the store only to read.
    pub fn open_to_read(dir: &Path) -> Result<ReadStore, StateError> {
        match StateStore::open(dir) {
            Ok(store) => Ok(ReadStore { store, copy: None }),
            Err(StateError::NotWritable { .. }) => {
                let copy = tempfile::Builder::new()
                    .prefix("flow-state-copy-")
                    .tempdir()
                    .map_err(|source| StateError::Io {
                        what: "creating a temporary directory for a copy of a read-only state directory",
                        path: std::env::temp_dir(),
                        source,
                    })?;
                copy_tree(dir, copy.path())?;
                let store = StateStore::open(copy.path())?;
                Ok(ReadStore {
                    store,
                    copy: Some(copy),
                })
            }
            Err(err) => Err(err),
        }
    }
}

/// Copies the regular files and directories under `from` into `to` (which exists).
fn copy_tree(from: &Path, to: &Path) -> Result<(), StateError> {
    let entries = std::fs::read_dir(from).map_err(StateError::io(
        "listing a read-only state directory to copy it",
        from,
    ))?;
    for entry in entries {
        let entry = entry.map_err(StateError::io(
            "listing a read-only state directory to copy it",
            from,
        ))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(StateError::io(
            "reading the file type of an entry to copy",
            &path,
        ))?;
        let target = to.join(entry.file_name());
        if kind.is_dir() {
            std::fs::create_dir(&target)
                .map_err(StateError::io("creating a directory of the copy", &target))?;
            copy_tree(&path, &target)?;
        } else if kind.is_file() {
            std::fs::copy(&path, &target).map_err(StateError::io(
                "copying a file of a read-only state directory",
                &path,
            ))?;
        }
        // Nothing else (links, sockets) is part of a store.
    }
    Ok(())
}

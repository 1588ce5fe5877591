//! sled's unfinished snapshots. sled 0.34 writes a snapshot of its page table at every open that
//! recovered something: to `snap.<lsn>.generating`, synced, then renamed to `snap.<lsn>`. Its
//! reader (`read_snapshot` in sled's `pagecache/snapshot.rs`) takes the last `snap.*` file by
//! name without skipping `.generating` ones, so a process killed between that write and the
//! rename leaves a store that every later open refuses as `Corruption { at: None }`
//! (`a_store_killed_while_sled_wrote_its_recovery_snapshot_opens_with_everything_committed`
//! reproduces it). Such a file is never needed: the finished snapshot it was to replace is only
//! removed after the rename, and sled rebuilds what it held from that one and the log. Each open
//! therefore removes them first, holding the lock sled takes on `db`, so that a snapshot another
//! process is writing at that moment is left alone.

use std::fs::{File, TryLockError};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use crate::error::{is_not_writable, StateError};

/// Name of sled's data file, the one sled locks for as long as a process has the store open.
const SLED_DATA_FILE: &str = "db";
const SNAPSHOT_PREFIX: &str = "snap.";
const UNFINISHED_SUFFIX: &str = ".generating";

/// Removes the unfinished snapshots in `dir` unless another process holds the store. A directory this process cannot write is left as it is: sled's open then
/// reports it as such, and a read-only copy is cleaned when the copy is opened.
pub(crate) fn remove_unfinished_snapshots(dir: &Path) -> Result<(), StateError> {
    let unfinished = unfinished_snapshots(dir)?;
    if unfinished.is_empty() {
        return Ok(());
    }
    let data_file = dir.join(SLED_DATA_FILE);
    // Without a data file no sled has the store open, so no snapshot is being written.
    let _lock = match File::open(&data_file) {
        Ok(file) => match file.try_lock() {
            Ok(()) => Some(file),
            Err(TryLockError::WouldBlock) => return Ok(()),
            Err(TryLockError::Error(source)) => {
                return Err(StateError::io("locking sled's data file", &data_file)(
                    source,
                ))
            }
        },
        Err(err) if err.kind() == ErrorKind::NotFound => None,
        Err(source) => {
            return Err(StateError::io("opening sled's data file", &data_file)(
                source,
            ))
        }
    };
    for path in unfinished {
        match std::fs::remove_file(&path) {
            Ok(()) => {
                tracing::info!(
                    file = %path.display(),
                    "removed an unfinished sled snapshot left by a process killed while it opened this store"
                );
            }
            Err(err) if is_not_writable(&err) => return Ok(()),
            Err(err) if err.kind() == ErrorKind::NotFound => {}
            Err(source) => {
                return Err(StateError::io(
                    "removing an unfinished sled snapshot",
                    &path,
                )(source))
            }
        }
    }
    Ok(())
}

/// The `snap.*.generating` files directly in `dir`; none when `dir` does not exist yet or is no
/// directory (sled's open then says what is wrong with it).
fn unfinished_snapshots(dir: &Path) -> Result<Vec<PathBuf>, StateError> {
    let what = "listing the state directory for unfinished sled snapshots";
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if matches!(err.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
            return Ok(Vec::new())
        }
        Err(source) => return Err(StateError::io(what, dir)(source)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(StateError::io(what, dir))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(SNAPSHOT_PREFIX) && name.ends_with(UNFINISHED_SUFFIX) {
            out.push(entry.path());
        }
    }
    Ok(out)
}

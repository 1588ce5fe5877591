//! What a state directory says when it cannot be used: held by another process, not a store at
//! all, or belonging to another pipeline (issue 13, items 4 and 14).

use std::time::{Duration, Instant};

use flow_state::{EpochCommit, PipelineIdentity, StateError, StateStore, StoreOptions};

fn commit(store: &StateStore, pipeline: &str, partition: u32) -> anyhow::Result<()> {
    store.commit_blocking(EpochCommit {
        pipeline: pipeline.to_owned(),
        partition,
        position: b"p".to_vec(),
        source_dead_letters: Vec::new(),
        sinks: Vec::new(),
        counters: Vec::new(),
    })?;
    Ok(())
}

#[test]
fn a_store_held_by_another_handle_is_reported_as_locked() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let held = StateStore::open(dir.path())?;
    let err = StateStore::open(dir.path()).err();
    assert!(matches!(err, Some(StateError::Locked { .. })), "{err:?}");
    assert_eq!(
        err.map(|e| e.to_string()),
        Some(format!(
            "the state directory {} is in use by another process (is another worker running on it?)",
            dir.path().display()
        ))
    );
    held.close()?;
    // Released: opens again.
    StateStore::open(dir.path())?.close()?;
    Ok(())
}

#[test]
fn an_open_with_a_lock_wait_takes_a_store_let_go_within_it_and_refuses_one_held_past_it(
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let waiting = StoreOptions {
        lock_wait: Duration::from_secs(3),
        ..StoreOptions::default()
    };
    // Let go 400 ms after the second open starts: as a killed worker's lock is.
    let held = StateStore::open(dir.path())?;
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(400));
        held.close()
    });
    let started = Instant::now();
    let store = StateStore::open_with(dir.path(), waiting.clone())?;
    let waited = started.elapsed();
    releaser
        .join()
        .map_err(|_| anyhow::anyhow!("the releasing thread panicked"))??;
    assert!(
        waited >= Duration::from_millis(400),
        "opened after {waited:?}"
    );
    // Held for longer than the wait: refused once the wait is over, not before.
    let started = Instant::now();
    let err = StateStore::open_with(dir.path(), waiting).err();
    let waited = started.elapsed();
    assert!(matches!(err, Some(StateError::Locked { .. })), "{err:?}");
    assert!(waited >= Duration::from_secs(3), "refused after {waited:?}");
    store.close()?;
    Ok(())
}

#[test]
fn a_path_that_is_not_a_directory_is_not_blamed_on_another_worker() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("plain-file");
    std::fs::write(&file, b"not a store")?;
    let err = StateStore::open(&file).err();
    assert!(matches!(err, Some(StateError::Open { .. })), "{err:?}");
    let text = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(!text.contains("another worker"), "{text}");
    Ok(())
}

#[test]
fn a_store_claimed_by_one_pipeline_refuses_another_name_or_partition_count() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = StateStore::open(dir.path())?;
    store.claim("orders", 4)?;
    store.claim("orders", 4)?;
    assert_eq!(
        store.identity()?,
        Some(PipelineIdentity {
            pipeline: "orders".to_owned(),
            partitions: 4
        })
    );
    let renamed = store.claim("orders-v2", 4).err().map(|e| e.to_string());
    assert_eq!(
        renamed,
        Some(format!(
            "the state directory {} belongs to pipeline `orders` with 4 partition(s), but the spec says pipeline `orders-v2` with 4 partition(s). Starting would send everything again under a new name, or strand the undelivered batches of dropped partitions. To go on, either restore the pipeline name and partition count in the spec, or deliver what is pending with the old spec (`flow-worker drain`) and start the new spec with a new state directory",
            dir.path().display()
        ))
    );
    let fewer = store.claim("orders", 2).err();
    assert!(
        matches!(&fewer, Some(StateError::OtherPipeline { found, wanted, .. }) if found.partitions == 4 && wanted.partitions == 2),
        "{fewer:?}"
    );
    store.close()?;
    Ok(())
}

#[test]
fn a_store_written_before_identities_is_judged_by_its_keys() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = StateStore::open(dir.path())?;
    commit(&store, "orders", 0)?;
    commit(&store, "orders", 3)?;
    let fewer = store.claim("orders", 2).err();
    assert!(
        matches!(&fewer, Some(StateError::OtherPipeline { found, .. }) if found.partitions == 4),
        "{fewer:?}"
    );
    let renamed = store.claim("billing", 4).err();
    assert!(
        matches!(&renamed, Some(StateError::OtherPipeline { found, .. }) if found.pipeline == "orders"),
        "{renamed:?}"
    );
    store.claim("orders", 4)?;
    assert_eq!(
        store.identity()?.map(|i| i.partitions),
        Some(4),
        "recorded once accepted"
    );
    store.close()?;
    Ok(())
}

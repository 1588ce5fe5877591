//! The identity of an outbox (issue 24 item 4): drawn when the store is created, kept when it is
//! reopened, different for two directories of the same pipeline, and absent from a store created
//! before identities existed (whose pending batches carry tokens derived without one).

use flow_state::{EpochCommit, StateStore};

#[test]
fn a_new_store_gets_an_identity_that_reopening_keeps() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = StateStore::open(dir.path())?;
    store.claim("orders", 1)?;
    let first = store.outbox_id()?;
    assert!(first.is_some(), "a store created now has an identity");
    store.close()?;
    let store = StateStore::open(dir.path())?;
    assert_eq!(store.outbox_id()?, first);
    store.close()?;
    Ok(())
}

#[test]
fn two_directories_of_the_same_pipeline_have_different_identities() -> anyhow::Result<()> {
    let (a, b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let ids = [a.path(), b.path()].map(|dir| {
        let store = StateStore::open(dir)?;
        store.claim("orders", 1)?;
        let id = store.outbox_id()?;
        store.close()?;
        Ok::<_, flow_state::StateError>(id)
    });
    let [Ok(Some(a)), Ok(Some(b))] = ids else {
        panic!("both stores have an identity: {ids:?}");
    };
    assert_ne!(a, b);
    assert_eq!(a.to_string().len(), 16, "{a}");
    Ok(())
}

#[test]
fn a_store_created_before_identities_existed_gets_none() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // What an older version left: a sled database it created, with a committed position.
    {
        let db = sled::open(dir.path())?;
        db.flush()?;
    }
    let store = StateStore::open(dir.path())?;
    store.claim("orders", 1)?;
    store.commit_blocking(EpochCommit {
        pipeline: "orders".to_owned(),
        partition: 0,
        position: b"p".to_vec(),
        ..EpochCommit::default()
    })?;
    assert_eq!(store.outbox_id()?, None);
    store.close()?;
    let store = StateStore::open(dir.path())?;
    assert_eq!(store.outbox_id()?, None, "reopening does not invent one");
    store.close()?;
    Ok(())
}

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};

use super::*;

fn batch(partition: u32, n: u64, len: usize) -> SealedBatch {
    SealedBatch {
        target: "default.events".to_owned(),
        columns: vec!["id".to_owned(), "body".to_owned()],
        format: "RowBinary".to_owned(),
        token: format!("tok-{partition}-{n}"),
        shard: if n.is_multiple_of(2) {
            String::new()
        } else {
            "s1".to_owned()
        },
        first_offset: n * 10,
        last_offset: n * 10 + 9,
        rows: 10,
        payload: (0..len)
            .map(|i| (i as u64 * 31 + n * 7 + u64::from(partition)) as u8)
            .collect(),
    }
}

fn dead_letter(partition: u32, offset: u64, reason: &str) -> DeadLetter {
    DeadLetter {
        partition,
        offset: Some(offset),
        reason: reason.to_owned(),
        payload: vec![0, 255, offset as u8, b'x'],
    }
}

fn key(sink: &str, partition: u32) -> SinkPartition {
    SinkPartition::new("pipe", sink, partition)
}

fn epoch(partition: u32, position: &str, sinks: Vec<SinkEpochCommit>) -> EpochCommit {
    EpochCommit {
        pipeline: "pipe".to_owned(),
        partition,
        position: position.as_bytes().to_vec(),
        source_dead_letters: Vec::new(),
        sinks,
    }
}

fn sink(name: &str, batches: Vec<SealedBatch>) -> SinkEpochCommit {
    SinkEpochCommit {
        sink: name.to_owned(),
        batches,
        dead_letters: Vec::new(),
    }
}

#[test]
fn commit_then_reopen_restores_position_batches_fingerprints_and_dead_letters() {
    let dir = tempfile::tempdir().unwrap();
    let b1 = batch(3, 1, 1000);
    let b2 = batch(3, 2, 200_000); // above sled's blob threshold
    let b3 = batch(3, 3, 0);
    let other = batch(3, 4, 17);
    {
        let store = StateStore::open(dir.path()).unwrap();
        let mut c = epoch(
            3,
            "offset-42",
            vec![sink("ch", vec![b1.clone(), b2.clone()])],
        );
        c.source_dead_letters = vec![dead_letter(3, 40, "bad json")];
        c.sinks[0].dead_letters = vec![dead_letter(3, 41, "missing column")];
        c.sinks.push(sink("file", vec![other.clone()]));
        let receipt = store.commit_blocking(c).unwrap();
        assert_eq!(
            receipt.batch_seqs,
            vec![("ch".to_owned(), vec![0, 1]), ("file".to_owned(), vec![0])]
        );
        let receipt = store
            .commit_blocking(epoch(3, "offset-50", vec![sink("ch", vec![b3.clone()])]))
            .unwrap();
        assert_eq!(receipt.seqs("ch"), &[2]);
        let fp = BTreeMap::from([("default.events".to_owned(), "abc123".to_owned())]);
        store.set_fingerprints_blocking(&key("ch", 3), fp).unwrap();
        store.close().unwrap();
    }
    let store = StateStore::open(dir.path()).unwrap();
    assert_eq!(
        store.position("pipe", 3).unwrap(),
        Some(b"offset-50".to_vec())
    );
    assert_eq!(store.position("pipe", 4).unwrap(), None);
    let stored = store.undelivered(&key("ch", 3)).unwrap();
    assert_eq!(
        stored.iter().map(|b| b.seq).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert_eq!(stored[0].batch, b1);
    assert_eq!(stored[1].batch, b2);
    assert_eq!(stored[2].batch, b3);
    let stored = store.undelivered(&key("file", 3)).unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].batch, other);
    assert_eq!(
        store.fingerprints(&key("ch", 3)).unwrap(),
        BTreeMap::from([("default.events".to_owned(), "abc123".to_owned())])
    );
    assert_eq!(
        store.fingerprints(&key("file", 3)).unwrap(),
        BTreeMap::new()
    );
    assert_eq!(
        store.dead_letters("pipe", SOURCE_OWNER, 3).unwrap(),
        vec![dead_letter(3, 40, "bad json")]
    );
    assert_eq!(
        store.dead_letters("pipe", "ch", 3).unwrap(),
        vec![dead_letter(3, 41, "missing column")]
    );
    assert_eq!(store.dead_letters("pipe", "file", 3).unwrap(), vec![]);
    store.close().unwrap();
}

#[test]
fn acknowledge_removes_only_the_oldest_batch_and_rejects_others_with_not_oldest_batch() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let k = key("ch", 0);
    let batches: Vec<_> = (0..3).map(|n| batch(0, n, 100)).collect();
    store
        .commit_blocking(epoch(0, "p1", vec![sink("ch", batches.clone())]))
        .unwrap();

    let err = store.acknowledge_blocking(&k, 1, vec![]).unwrap_err();
    assert!(
        matches!(&err, StateError::NotOldestBatch { key, expected: Some(0), got: 1 } if *key == k),
        "{err}"
    );
    assert_eq!(store.undelivered(&k).unwrap().len(), 3);

    store
        .acknowledge_blocking(&k, 0, vec![("last_token".to_owned(), b"tok-0-0".to_vec())])
        .unwrap();
    let left = store.undelivered(&k).unwrap();
    assert_eq!(left.iter().map(|b| b.seq).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(left[0].batch, batches[1]);
    assert_eq!(
        store.sink_value("pipe", "ch", "last_token").unwrap(),
        Some(b"tok-0-0".to_vec())
    );

    // Acknowledging the same batch twice is rejected: it is no longer the oldest.
    let err = store.acknowledge_blocking(&k, 0, vec![]).unwrap_err();
    assert!(
        matches!(
            err,
            StateError::NotOldestBatch {
                expected: Some(1),
                got: 0,
                ..
            }
        ),
        "{err}"
    );
    store.acknowledge_blocking(&k, 1, vec![]).unwrap();
    store.acknowledge_blocking(&k, 2, vec![]).unwrap();
    let err = store.acknowledge_blocking(&k, 3, vec![]).unwrap_err();
    assert!(
        matches!(
            err,
            StateError::NotOldestBatch {
                expected: None,
                got: 3,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(store.undelivered(&k).unwrap(), vec![]);
    let stats = store.stats();
    assert_eq!(stats.acknowledgements, 3);
    assert_eq!(stats.failed_requests, 3);
    store.close().unwrap();
}

#[test]
fn sequence_numbers_are_not_reused_after_the_queue_drains_and_the_store_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let k = key("ch", 1);
    {
        let store = StateStore::open(dir.path()).unwrap();
        let r = store
            .commit_blocking(epoch(
                1,
                "a",
                vec![sink("ch", vec![batch(1, 0, 5), batch(1, 1, 5)])],
            ))
            .unwrap();
        assert_eq!(r.seqs("ch"), &[0, 1]);
        store.acknowledge_blocking(&k, 0, vec![]).unwrap();
        store.acknowledge_blocking(&k, 1, vec![]).unwrap();
        store.close().unwrap();
    }
    let store = StateStore::open(dir.path()).unwrap();
    let r = store
        .commit_blocking(epoch(1, "b", vec![sink("ch", vec![batch(1, 2, 5)])]))
        .unwrap();
    assert_eq!(r.seqs("ch"), &[2]);
    assert_eq!(store.undelivered(&k).unwrap()[0].seq, 2);
    store.close().unwrap();
}

#[test]
fn empty_epoch_commit_only_moves_the_position() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    store
        .commit_blocking(epoch(0, "first", vec![sink("ch", vec![batch(0, 0, 10)])]))
        .unwrap();
    let before = store.summary().unwrap();
    let receipt = store
        .commit_blocking(epoch(0, "second", vec![sink("ch", vec![])]))
        .unwrap();
    assert_eq!(receipt.batch_seqs, vec![("ch".to_owned(), vec![])]);
    let receipt = store.commit_blocking(epoch(0, "third", vec![])).unwrap();
    assert_eq!(receipt.batch_seqs, vec![]);
    assert_eq!(store.position("pipe", 0).unwrap(), Some(b"third".to_vec()));
    let after = store.summary().unwrap();
    assert_eq!(
        before.pipelines["pipe"].sinks,
        after.pipelines["pipe"].sinks
    );
    assert_eq!(
        after.pipelines["pipe"].positions[&0].text.as_deref(),
        Some("third")
    );
    assert_eq!(store.undelivered(&key("ch", 0)).unwrap().len(), 1);
    store.close().unwrap();
}

#[test]
fn concurrent_commits_from_threads_share_fsyncs() {
    const THREADS: u32 = 8;
    const COMMITS: u64 = 25;
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let barrier = Arc::new(Barrier::new(THREADS as usize));
    let handles: Vec<_> = (0..THREADS)
        .map(|partition| {
            let store = store.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                for n in 0..COMMITS {
                    let r = store
                        .commit_blocking(epoch(
                            partition,
                            &format!("{n}"),
                            vec![sink("ch", vec![batch(partition, n, 512)])],
                        ))
                        .unwrap();
                    assert_eq!(r.seqs("ch"), &[n]);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let stats = store.stats();
    let total = u64::from(THREADS) * COMMITS;
    assert_eq!(stats.commits, total);
    assert_eq!(stats.requests, total);
    assert_eq!(stats.fsyncs, stats.groups, "one data-file fsync per group");
    assert!(stats.groups < total, "{stats:?}");
    assert!(stats.fsyncs < total, "{stats:?}");
    for partition in 0..THREADS {
        assert_eq!(
            store.undelivered(&key("ch", partition)).unwrap().len() as u64,
            COMMITS
        );
        assert_eq!(
            store.position("pipe", partition).unwrap(),
            Some(format!("{}", COMMITS - 1).into_bytes())
        );
    }
    store.close().unwrap();
}

#[test]
fn concurrent_async_commits_from_tasks_share_fsyncs() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    rt.block_on(async {
        let tasks: Vec<_> = (0..16u32)
            .map(|partition| {
                let store = store.clone();
                tokio::spawn(async move {
                    for n in 0..10u64 {
                        let c = epoch(
                            partition,
                            &n.to_string(),
                            vec![sink("ch", vec![batch(partition, n, 64)])],
                        );
                        assert_eq!(store.commit(c).await.unwrap().seqs("ch"), &[n]);
                    }
                    store
                        .acknowledge(&key("ch", partition), 0, vec![])
                        .await
                        .unwrap();
                    store
                        .set_fingerprints(
                            &key("ch", partition),
                            BTreeMap::from([("t".to_owned(), "f".to_owned())]),
                        )
                        .await
                        .unwrap();
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    let stats = store.stats();
    assert_eq!(stats.commits, 160);
    assert_eq!(stats.acknowledgements, 16);
    assert_eq!(stats.requests, 192);
    assert!(stats.fsyncs < stats.requests, "{stats:?}");
    assert_eq!(store.undelivered(&key("ch", 5)).unwrap().len(), 9);
    store.close().unwrap();
}

#[test]
fn payload_above_blob_threshold_round_trips_and_its_blob_file_is_fsynced() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let big = batch(0, 0, 1 << 20);
    store
        .commit_blocking(epoch(0, "p", vec![sink("ch", vec![big.clone()])]))
        .unwrap();
    let stats = store.stats();
    assert!(stats.blob_fsyncs >= 1, "{stats:?}");
    assert!(std::fs::read_dir(dir.path().join("blobs")).unwrap().count() >= 1);
    assert_eq!(store.undelivered(&key("ch", 0)).unwrap()[0].batch, big);
    store.close().unwrap();
}

#[test]
fn fsync_off_still_commits_without_fsyncs() {
    let dir = tempfile::tempdir().unwrap();
    let options = StoreOptions {
        fsync: false,
        ..StoreOptions::default()
    };
    let store = StateStore::open_with(dir.path(), options.clone()).unwrap();
    store
        .commit_blocking(epoch(0, "p", vec![sink("ch", vec![batch(0, 0, 10)])]))
        .unwrap();
    let stats = store.stats();
    assert_eq!(stats.fsyncs, 0);
    assert_eq!(stats.groups, 1);
    assert_eq!(stats.flushes, 1);
    store.close().unwrap();
    let store = StateStore::open_with(dir.path(), options).unwrap();
    assert_eq!(store.position("pipe", 0).unwrap(), Some(b"p".to_vec()));
    store.close().unwrap();
}

#[test]
fn summary_reports_queues_oldest_batch_fingerprints_and_dead_letters() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let mut c = epoch(
        2,
        "pos-2",
        vec![sink("ch", vec![batch(2, 0, 100), batch(2, 1, 50)])],
    );
    c.sinks[0].dead_letters = (0..7)
        .map(|i| dead_letter(2, i, &format!("r{i}")))
        .collect();
    c.source_dead_letters = vec![dead_letter(2, 99, "undecodable")];
    store.commit_blocking(c).unwrap();
    store.commit_blocking(epoch(1, "pos-1", vec![])).unwrap();
    store
        .set_fingerprints_blocking(
            &key("ch", 2),
            BTreeMap::from([("default.events".to_owned(), "fp".to_owned())]),
        )
        .unwrap();
    store
        .acknowledge_blocking(&key("ch", 2), 0, vec![])
        .unwrap();

    let summary = store.summary().unwrap();
    let pipe = &summary.pipelines["pipe"];
    assert_eq!(
        pipe.positions.keys().copied().collect::<Vec<_>>(),
        vec![1, 2]
    );
    assert_eq!(pipe.positions[&2].text.as_deref(), Some("pos-2"));
    assert_eq!(pipe.positions[&2].hex, "706f732d32");
    assert_eq!(pipe.sinks.len(), 1);
    let s = &pipe.sinks[0];
    assert_eq!((s.sink.as_str(), s.partition), ("ch", 2));
    assert_eq!(s.next_seq, 2);
    assert_eq!(s.undelivered, 1);
    assert_eq!(s.rows, 10);
    assert_eq!(s.bytes, 50);
    let oldest = s.oldest.as_ref().unwrap();
    assert_eq!(
        (oldest.seq, oldest.first_offset, oldest.last_offset),
        (1, 10, 19)
    );
    assert_eq!(s.fingerprints["default.events"], "fp");
    assert_eq!(s.dead_letter_count, 7);
    assert_eq!(
        s.recent_dead_letters
            .iter()
            .map(|d| d.reason.as_str())
            .collect::<Vec<_>>(),
        vec!["r2", "r3", "r4", "r5", "r6"]
    );
    assert_eq!(pipe.source_dead_letters.len(), 1);
    assert_eq!(pipe.source_dead_letters[0].count, 1);
    assert_eq!(pipe.source_dead_letters[0].recent[0].reason, "undecodable");
    // Serializable for `flow-worker status`.
    let json = serde_json::to_string(&summary).unwrap();
    assert!(json.contains("\"undelivered\":1"), "{json}");
    store.close().unwrap();
}

#[test]
fn requests_after_close_fail_with_closed() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let other = store.clone();
    store.close().unwrap();
    let err = other.commit_blocking(epoch(0, "p", vec![])).unwrap_err();
    assert!(matches!(err, StateError::Closed), "{err}");
    let err = other
        .acknowledge_blocking(&key("ch", 0), 0, vec![])
        .unwrap_err();
    assert!(matches!(err, StateError::Closed), "{err}");
}

#[test]
fn names_that_cannot_be_keyed_are_rejected_before_the_commit() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path()).unwrap();
    let err = store
        .commit_blocking(epoch(0, "p", vec![sink("bad\0sink", vec![])]))
        .unwrap_err();
    assert!(
        matches!(&err, StateError::InvalidName { what: "sink", name, .. } if name == "bad\0sink"),
        "{err}"
    );
    let mut c = epoch(0, "p", vec![]);
    c.pipeline = String::new();
    assert!(matches!(
        store.commit_blocking(c).unwrap_err(),
        StateError::InvalidName {
            what: "pipeline",
            ..
        }
    ));
    assert_eq!(store.stats().requests, 0);
    assert_eq!(store.position("pipe", 0).unwrap(), None);
    store.close().unwrap();
}

#[test]
fn dropping_the_last_clone_stops_the_committer_so_the_store_can_be_reopened() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = StateStore::open(dir.path()).unwrap();
        let clone = store.clone();
        clone.commit_blocking(epoch(0, "dropped", vec![])).unwrap();
        drop(store);
        drop(clone);
    }
    let store = StateStore::open(dir.path()).unwrap();
    assert_eq!(
        store.position("pipe", 0).unwrap(),
        Some(b"dropped".to_vec())
    );
    store.close().unwrap();
}

//! Cluster mode's ZooKeeper mirror against the real ZooKeeper of the local cluster
//! (127.0.0.1:12181, `scripts/cluster.sh up`): writes go to ZooKeeper first, fenced by the owner
//! node's version; a fresh directory loads the same state; the pending bound holds commits back.
//! Like the other tests on the local cluster, these fail (not skip) when it does not answer.

// Test code: a failed unwrap is a failed test (helpers outside #[test] fns are not covered by
// clippy.toml's allow-unwrap-in-tests).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use flow_state::zk::ZkMirror;
use flow_state::{
    AckExtras, BatchStorage, CounterAdd, DeadLetter, EpochCommit, SealedBatch, SinkEpochCommit,
    SinkPartition, StateError, StateStore, StoredBody, StoredCounter, SOURCE_OWNER,
};
use zookeeper_client as zk;

const ZK: &str = "127.0.0.1:12181";
const PIPE: &str = "pipe";

/// A ZooKeeper session and a root of its own, deleted at the end.
struct Zk {
    rt: tokio::runtime::Runtime,
    client: zk::Client,
    root: String,
}

impl Zk {
    fn connect(test: &str) -> Zk {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let client = rt.block_on(connect());
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let root = format!("/flow-test/{test}-{}-{nanos}", std::process::id());
        Zk { rt, client, root }
    }

    fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.rt.block_on(future)
    }

    /// Makes this session's worker the owner of `partition` as cluster membership does: the
    /// owner node's data set, its new version the generation.
    fn take(&self, client: &zk::Client, partition: u32, worker: &str) -> (String, i32) {
        let dir = format!("{}/{PIPE}/partitions/{partition}", self.root);
        let owner = format!("{dir}/owner");
        self.block_on(async {
            client.mkdir(&dir, &persistent()).await.unwrap();
            match client.create(&owner, b"", &persistent()).await {
                Ok(_) | Err(zk::Error::NodeExists) => {}
                Err(e) => panic!("create {owner}: {e}"),
            }
            let stat = client
                .set_data(&owner, worker.as_bytes(), None)
                .await
                .unwrap();
            (owner, stat.version)
        })
    }

    /// A store in `dir` with a mirror of [`PIPE`] attached that owns and has loaded `partitions`.
    fn store(&self, dir: &std::path::Path, bound: usize, partitions: &[u32]) -> StateStore {
        self.store_with(&self.client, dir, bound, partitions)
    }

    /// [`Zk::store`] with a session of its own.
    fn store_with(
        &self,
        client: &zk::Client,
        dir: &std::path::Path,
        bound: usize,
        partitions: &[u32],
    ) -> StateStore {
        let store = StateStore::open(dir).unwrap();
        let mirror = ZkMirror::new(client.clone(), &self.root, PIPE, self.rt.handle().clone())
            .unwrap()
            .with_pending_bound(bound);
        store.attach_mirror(mirror).unwrap();
        for &p in partitions {
            self.own_and_load(&store, client, p);
        }
        store
    }

    fn own_and_load(&self, store: &StateStore, client: &zk::Client, partition: u32) {
        let (owner, generation) = self.take(client, partition, "worker-a");
        store.mirror().unwrap().own(partition, owner, generation);
        self.block_on(store.load_partition(PIPE, partition))
            .unwrap();
    }

    fn data(&self, child: &str) -> Option<Vec<u8>> {
        let path = format!("{}/{child}", self.root);
        match self.block_on(self.client.get_data(&path)) {
            Ok((data, _)) => Some(data),
            Err(zk::Error::NoNode) => None,
            Err(e) => panic!("get {path}: {e}"),
        }
    }

    fn children(&self, child: &str) -> Vec<String> {
        let path = format!("{}/{child}", self.root);
        let mut names = self.block_on(self.client.list_children(&path)).unwrap();
        names.sort();
        names
    }
}

impl Drop for Zk {
    fn drop(&mut self) {
        let (client, root) = (self.client.clone(), self.root.clone());
        self.rt.block_on(delete_tree(&client, root));
    }
}

async fn connect() -> zk::Client {
    connect_to(ZK, Duration::from_secs(10)).await
}

async fn connect_to(address: &str, session_timeout: Duration) -> zk::Client {
    let connecting = zk::Client::connector()
        .with_session_timeout(session_timeout)
        .connect(address);
    match tokio::time::timeout(Duration::from_secs(15), connecting).await {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => panic!("ZooKeeper at {ZK} refused a session ({e}): start the local cluster with `scripts/cluster.sh up`"),
        Err(_) => panic!("ZooKeeper at {ZK} did not answer within 15 s: start the local cluster with `scripts/cluster.sh up`"),
    }
}

/// A TCP relay to ZooKeeper that can be cut: every relayed connection is dropped and new ones
/// are refused, as when the network between a worker and ZooKeeper fails.
struct Proxy {
    address: String,
    cut: tokio::sync::watch::Sender<bool>,
}

impl Proxy {
    async fn start() -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (cut, cut_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let mut cut_rx = cut_rx.clone();
                if *cut_rx.borrow() {
                    continue;
                }
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(ZK).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut_rx.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        Proxy { address, cut }
    }

    fn cut(&self) {
        self.cut.send_replace(true);
    }
}

fn persistent() -> zk::CreateOptions<'static> {
    zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all())
}

fn delete_tree(
    client: &zk::Client,
    path: String,
) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> {
    Box::pin(async move {
        if let Ok(children) = client.list_children(&path).await {
            for child in children {
                delete_tree(client, format!("{path}/{child}")).await;
            }
        }
        let _ = client.delete(&path, None).await;
    })
}

fn batch(partition: u32, n: u64) -> SealedBatch {
    SealedBatch {
        target: "default.events".to_owned(),
        columns: vec!["id".to_owned()],
        format: "RowBinary".to_owned(),
        token: format!("tok-{partition}-{n}"),
        shard: if n.is_multiple_of(2) { "a" } else { "b" }.to_owned(),
        first_offset: n * 10,
        last_offset: n * 10 + 9,
        rows: 10,
        encoded_bytes: 90,
        plan: "plan".to_owned(),
        sealed_at_ms: 1_700_000_000_000 + n,
        content_hash: 0xC0FFEE ^ n,
        payload: bytes::Bytes::from(vec![7u8; 90]),
    }
}

fn epoch(partition: u32, position: &str, batches: Vec<SealedBatch>) -> EpochCommit {
    EpochCommit {
        pipeline: PIPE.to_owned(),
        partition,
        position: position.as_bytes().to_vec(),
        sinks: vec![SinkEpochCommit {
            sink: "ch".to_owned(),
            storage: BatchStorage::Bounds {
                epoch_start: Some(b"start".to_vec()),
            },
            batches,
            dead_letters: Vec::new(),
        }],
        ..EpochCommit::default()
    }
}

fn letter(partition: u32, offset: u64) -> DeadLetter {
    DeadLetter {
        partition,
        offset: Some(offset),
        reason: "bad json".to_owned(),
        payload: b"{oops".to_vec(),
    }
}

fn count(owner: &str, name: &str, by: u64) -> CounterAdd {
    CounterAdd {
        owner: owner.to_owned(),
        name: name.to_owned(),
        by,
    }
}

fn key(partition: u32) -> SinkPartition {
    SinkPartition::new(PIPE, "ch", partition)
}

/// What the store answers for a partition: position, pending batches, fingerprints, counters,
/// dead letters and the partition's sink values.
#[derive(Debug, PartialEq)]
struct Seen {
    position: Option<Vec<u8>>,
    undelivered: Vec<(u64, SealedBatch, StoredBody)>,
    fingerprints: BTreeMap<String, String>,
    counters: Vec<StoredCounter>,
    source_letters: Vec<DeadLetter>,
    values: Vec<(String, Vec<u8>)>,
}

fn seen(store: &StateStore, partition: u32) -> Seen {
    Seen {
        position: store.position(PIPE, partition).unwrap(),
        undelivered: store
            .undelivered(&key(partition))
            .unwrap()
            .into_iter()
            .map(|b| (b.seq, b.batch, b.body))
            .collect(),
        fingerprints: store.fingerprints(&key(partition)).unwrap(),
        counters: store
            .counters()
            .unwrap()
            .into_iter()
            .filter(|c| c.partition == partition)
            .collect(),
        source_letters: store.dead_letters(PIPE, SOURCE_OWNER, partition).unwrap(),
        values: store
            .sink_values_with_prefix(PIPE, "ch", &format!("changed/{partition}/"))
            .unwrap(),
    }
}

#[test]
fn mirrored_writes_load_into_a_fresh_directory_as_the_same_state() {
    let zk = Zk::connect("mirror-load");
    let dir_a = tempfile::tempdir().unwrap();
    let a = zk.store(dir_a.path(), 256, &[0, 1]);
    // Both partitions' commits at once: they may share a commit group, which is one multi-op.
    let stats = a.stats();
    let (first, second) = zk.block_on(async {
        let mut c0 = epoch(0, "p0-1", vec![batch(0, 0), batch(0, 1), batch(0, 2)]);
        c0.source_dead_letters = vec![letter(0, 4)];
        c0.counters = vec![count("ch", "rows", 30), count(SOURCE_OWNER, "read", 31)];
        let c1 = epoch(1, "p1-1", vec![batch(1, 0)]);
        tokio::join!(a.commit(c0), a.commit(c1))
    });
    assert_eq!(first.unwrap().seqs("ch"), &[0, 1, 2]);
    assert_eq!(second.unwrap().seqs("ch"), &[0]);
    let after = a.stats();
    assert_eq!(
        after.zk_multis - stats.zk_multis,
        after.groups - stats.groups,
        "{after:?}"
    );
    assert!(after.zk_multis > stats.zk_multis, "{after:?}");
    zk.block_on(async {
        a.acknowledge_with(
            &key(0),
            1,
            AckExtras {
                sink_values: vec![
                    ("changed/0/1".to_owned(), b"yes".to_vec()),
                    ("file_len:/tmp/x".to_owned(), b"local".to_vec()),
                ],
                counters: vec![count("ch", "delivered", 10)],
                ..AckExtras::default()
            },
        )
        .await
        .unwrap();
        a.set_fingerprints(
            &key(0),
            BTreeMap::from([("default.events".to_owned(), "fp1".to_owned())]),
        )
        .await
        .unwrap();
        a.add_counters(PIPE, 0, &[count("ch", "errors", 2)])
            .await
            .unwrap();
        a.set_sink_value(PIPE, "ch", "changed/0/9", Some(b"nine".to_vec()))
            .await
            .unwrap();
        a.set_sink_value(PIPE, "ch", "changed/0/9", None)
            .await
            .unwrap();
        a.set_sink_value(PIPE, "ch", "changed/0/2", Some(b"two".to_vec()))
            .await
            .unwrap();
    });
    let state = format!("{PIPE}/partitions/0/state");
    assert_eq!(
        zk.children(&state),
        vec![
            "batch.ch.00000000000000000000",
            "batch.ch.00000000000000000002",
            "counters",
            "dead.source.00000000000000000000",
            "dlseq.source",
            "fp.ch",
            "position",
            "queue.ch",
            "value.ch.changed%2F0%2F1",
            "value.ch.changed%2F0%2F2",
        ]
    );
    assert_eq!(
        zk.data(&format!("{state}/position")),
        Some(b"p0-1".to_vec())
    );
    let expected_0 = seen(&a, 0);
    let expected_1 = seen(&a, 1);
    assert_eq!(
        expected_0
            .undelivered
            .iter()
            .map(|b| b.0)
            .collect::<Vec<_>>(),
        vec![0, 2]
    );
    assert_eq!(expected_0.counters.len(), 4, "{:?}", expected_0.counters);
    // What `status` reads from ZooKeeper, without a store.
    let read = zk
        .block_on(flow_state::zk::read_partition(
            &zk.client, &zk.root, PIPE, 0,
        ))
        .unwrap();
    assert_eq!(read.position, expected_0.position);
    assert_eq!(
        read.pending
            .iter()
            .map(|(sink, b)| (sink.as_str(), b.seq, b.batch.clone(), b.body.clone()))
            .collect::<Vec<_>>(),
        expected_0
            .undelivered
            .iter()
            .map(|(seq, batch, body)| ("ch", *seq, batch.clone(), body.clone()))
            .collect::<Vec<_>>()
    );
    assert_eq!(read.counters, expected_0.counters);
    assert_eq!(read.dead_letters, 1);
    let never = zk
        .block_on(flow_state::zk::read_partition(
            &zk.client, &zk.root, PIPE, 7,
        ))
        .unwrap();
    assert_eq!(never, flow_state::zk::ZkPartitionState::default());
    assert_eq!(zk.data(&format!("{PIPE}/partitions/7")), None);

    // A fresh directory, holding a stale copy of partition 0 and a partition it does not load.
    let dir_b = tempfile::tempdir().unwrap();
    {
        let plain = StateStore::open(dir_b.path()).unwrap();
        let mut stale = epoch(0, "stale", vec![batch(0, 7)]);
        stale.sinks[0].sink = "old".to_owned();
        stale.counters = vec![count("old", "rows", 5)];
        plain.commit_blocking(stale).unwrap();
        plain
            .commit_blocking(epoch(5, "p5", vec![batch(5, 0)]))
            .unwrap();
        plain.close().unwrap();
    }
    let b = zk.store(dir_b.path(), 256, &[0, 1]);
    let loaded_0 = seen(&b, 0);
    assert_eq!(loaded_0.position, expected_0.position);
    assert_eq!(loaded_0.undelivered, expected_0.undelivered);
    assert_eq!(loaded_0.fingerprints, expected_0.fingerprints);
    assert_eq!(loaded_0.counters, expected_0.counters);
    assert_eq!(loaded_0.values, expected_0.values);
    assert_eq!(
        loaded_0.source_letters,
        vec![DeadLetter {
            reason: "bad json (payload of 5 bytes kept only in the state directory of the worker that set it aside)".to_owned(),
            payload: Vec::new(),
            ..letter(0, 4)
        }]
    );
    assert_eq!(seen(&b, 1), expected_1);
    assert!(b
        .undelivered(&SinkPartition::new(PIPE, "old", 0))
        .unwrap()
        .is_empty());
    assert_eq!(b.sink_value(PIPE, "ch", "file_len:/tmp/x").unwrap(), None);
    assert_eq!(b.position(PIPE, 5).unwrap(), Some(b"p5".to_vec()));
    assert_eq!(b.undelivered(&key(5)).unwrap().len(), 1);
    // The loaded state goes on where the first directory left it.
    let receipt = b
        .commit_blocking(epoch(0, "p0-2", vec![batch(0, 3)]))
        .unwrap();
    assert_eq!(receipt.seqs("ch"), &[3]);
    b.acknowledge_blocking(&key(0), 0, vec![]).unwrap();
    assert_eq!(
        zk.data(&format!("{state}/position")),
        Some(b"p0-2".to_vec())
    );
    assert_eq!(
        zk.children(&state)
            .into_iter()
            .filter(|n| n.starts_with("batch."))
            .collect::<Vec<_>>(),
        vec![
            "batch.ch.00000000000000000002",
            "batch.ch.00000000000000000003"
        ]
    );
    // The first directory takes partition 0 back: the dead letter it set aside keeps its payload.
    zk.own_and_load(&a, &zk.client, 0);
    assert_eq!(a.position(PIPE, 0).unwrap(), Some(b"p0-2".to_vec()));
    assert_eq!(
        a.dead_letters(PIPE, SOURCE_OWNER, 0).unwrap(),
        vec![letter(0, 4)]
    );
    assert_eq!(
        a.undelivered(&key(0))
            .unwrap()
            .iter()
            .map(|b| b.seq)
            .collect::<Vec<_>>(),
        vec![2, 3]
    );
    a.close().unwrap();
    b.close().unwrap();
}

#[test]
fn a_write_after_the_owner_node_moved_is_fenced_and_applies_nothing() {
    let zk = Zk::connect("mirror-fenced");
    let dir = tempfile::tempdir().unwrap();
    let store = zk.store(dir.path(), 256, &[0, 1]);
    store
        .commit_blocking(epoch(0, "kept", vec![batch(0, 0)]))
        .unwrap();
    let before = seen(&store, 0);
    let stats_before = store.stats();

    // Another worker takes partition 0 with a session of its own.
    let other = zk.block_on(connect());
    let (_, taken) = zk.take(&other, 0, "worker-b");
    assert_eq!(taken, 2);

    // Both partitions in flight together: only partition 0's request fails.
    let (p0, p1) = zk.block_on(async {
        tokio::join!(
            store.commit(epoch(0, "lost", vec![batch(0, 1)])),
            store.commit(epoch(1, "fine", vec![batch(1, 0)]))
        )
    });
    let err = p0.unwrap_err();
    let StateError::Fenced {
        partition, source, ..
    } = &err
    else {
        panic!("expected Fenced, got {err}");
    };
    assert_eq!(*partition, 0);
    assert_eq!(source, &Some(zk::Error::BadVersion));
    let text = err.to_string();
    assert!(
        text.starts_with(&format!("partition 0 of pipeline `pipe` is fenced: its owner node {}/pipe/partitions/0/owner is no longer at generation 1: another worker took the partition. Nothing of this request was applied locally", zk.root)),
        "{text}"
    );
    assert_eq!(p1.unwrap().seqs("ch"), &[0]);
    assert_eq!(seen(&store, 0), before);
    assert_eq!(
        zk.data(&format!("{PIPE}/partitions/0/state/position")),
        Some(b"kept".to_vec())
    );
    assert_eq!(store.mirror().unwrap().generation(0), None);

    // Every later write of the partition is refused at once, without ZooKeeper.
    let err = store
        .acknowledge_blocking(&key(0), 0, vec![])
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("partition 0 of pipeline `pipe` is fenced: this worker does not own it."),
        "{err}"
    );
    let err = store
        .commit_blocking(epoch(2, "never owned", vec![]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("partition 2 of pipeline `pipe` is fenced: this worker does not own it"),
        "{err}"
    );
    assert_eq!(seen(&store, 0), before);
    assert_eq!(store.position(PIPE, 2).unwrap(), None);
    let stats = store.stats();
    assert_eq!(stats.commits - stats_before.commits, 1, "{stats:?}");
    assert_eq!(
        stats.failed_requests - stats_before.failed_requests,
        3,
        "{stats:?}"
    );
    assert_eq!(stats.fenced - stats_before.fenced, 3, "{stats:?}");
    // Whether the two commits shared a group or not: partition 0 refused in one multi-op,
    // partition 1 written by another; the refusals after that never reach ZooKeeper.
    assert_eq!(stats.zk_multis - stats_before.zk_multis, 2, "{stats:?}");
    store.close().unwrap();
}

#[test]
fn a_write_zookeeper_does_not_confirm_is_fenced_until_a_new_session_takes_the_partition() {
    let zk = Zk::connect("mirror-session");
    let proxy = zk.block_on(Proxy::start());
    // The shortest session ZooKeeper grants (2 ticks): the unanswered write fails sooner.
    let session = zk.block_on(connect_to(&proxy.address, Duration::from_secs(4)));
    let dir = tempfile::tempdir().unwrap();
    let store = zk.store_with(&session, dir.path(), 256, &[0]);
    store
        .commit_blocking(epoch(0, "kept", vec![batch(0, 0)]))
        .unwrap();
    let before = seen(&store, 0);

    // ZooKeeper out of reach of the mirror's session (once the relays have seen the cut): its
    // write gets no answer.
    proxy.cut();
    std::thread::sleep(Duration::from_millis(200));
    let err = store
        .commit_blocking(epoch(0, "lost", vec![batch(0, 1)]))
        .unwrap_err();
    let StateError::Fenced {
        partition: 0,
        source: Some(cause),
        ..
    } = &err
    else {
        panic!("expected Fenced with ZooKeeper's cause, got {err:?}");
    };
    assert!(
        err.to_string().starts_with("partition 0 of pipeline `pipe` is fenced: ZooKeeper did not confirm the write (the session may be lost)"),
        "{err} ({cause:?})"
    );
    assert_eq!(seen(&store, 0), before);
    assert_eq!(
        zk.data(&format!("{PIPE}/partitions/0/state/position")),
        Some(b"kept".to_vec())
    );

    // A new session: every partition is forgotten until it is taken and loaded again.
    let fresh = zk.block_on(connect());
    store.mirror().unwrap().replace_client(fresh.clone());
    let err = store
        .commit_blocking(epoch(0, "early", vec![]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("is fenced: this worker does not own it"),
        "{err}"
    );
    zk.own_and_load(&store, &fresh, 0);
    assert_eq!(seen(&store, 0), before);
    let receipt = store
        .commit_blocking(epoch(0, "again", vec![batch(0, 1)]))
        .unwrap();
    assert_eq!(receipt.seqs("ch"), &[1]);
    assert_eq!(
        zk.data(&format!("{PIPE}/partitions/0/state/position")),
        Some(b"again".to_vec())
    );
    store.close().unwrap();
}

#[test]
fn commits_wait_at_the_pending_bound_until_acknowledgements_make_room() {
    let zk = Zk::connect("mirror-bound");
    let dir = tempfile::tempdir().unwrap();
    let store = zk.store(dir.path(), 4, &[0, 1]);
    // Into an empty queue a commit goes through whatever its size: it could never wait its turn.
    let receipt = store
        .commit_blocking(epoch(1, "big", (0..6).map(|n| batch(1, n)).collect()))
        .unwrap();
    assert_eq!(receipt.seqs("ch"), &[0, 1, 2, 3, 4, 5]);
    store
        .commit_blocking(epoch(0, "one", (0..3).map(|n| batch(0, n)).collect()))
        .unwrap();
    let err = store
        .commit_blocking(epoch(0, "two", vec![batch(0, 3), batch(0, 4)]))
        .unwrap_err();
    assert!(
        matches!(
            err,
            StateError::PendingBound {
                partition: 0,
                pending: 3,
                adding: 2,
                bound: 4,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "partition 0 of pipeline `pipe` has 3 pending batch(es) in ZooKeeper and this commit adds 2, above the bound of 4: the commit waits until deliveries acknowledge some"
    );
    assert_eq!(store.position(PIPE, 0).unwrap(), Some(b"one".to_vec()));
    assert_eq!(store.undelivered(&key(0)).unwrap().len(), 3);

    // The async commit waits (back-pressure) and goes through after one acknowledgement.
    let waiting = {
        let store = store.clone();
        zk.rt.spawn(async move {
            store
                .commit(epoch(0, "two", vec![batch(0, 3), batch(0, 4)]))
                .await
        })
    };
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        !waiting.is_finished(),
        "the commit did not wait at the bound"
    );
    assert_eq!(store.position(PIPE, 0).unwrap(), Some(b"one".to_vec()));
    store.acknowledge_blocking(&key(0), 0, vec![]).unwrap();
    let receipt = zk.block_on(waiting).unwrap().unwrap();
    assert_eq!(receipt.seqs("ch"), &[3, 4]);
    assert_eq!(store.position(PIPE, 0).unwrap(), Some(b"two".to_vec()));
    assert_eq!(
        zk.children(&format!("{PIPE}/partitions/0/state"))
            .iter()
            .filter(|n| n.starts_with("batch."))
            .count(),
        4
    );
    store.close().unwrap();
}

#[test]
fn an_oversized_node_and_writes_cluster_mode_cannot_mirror_are_refused() {
    let zk = Zk::connect("mirror-refused");
    let dir = tempfile::tempdir().unwrap();
    let store = zk.store(dir.path(), 256, &[0]);
    let big = "x".repeat(600 * 1024);
    let err = store
        .commit_blocking(epoch(0, &big, vec![]))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(&format!("ZooKeeper node {}/pipe/partitions/0/state/position would hold 614400 bytes, above the 524288-byte limit", zk.root)),
        "{err}"
    );
    assert_eq!(store.position(PIPE, 0).unwrap(), None);

    let mut payloads = epoch(0, "p", vec![batch(0, 0)]);
    payloads.sinks[0].storage = BatchStorage::Payload;
    let err = store.commit_blocking(payloads).unwrap_err().to_string();
    assert!(
        err.starts_with("a commit of stored payloads is not allowed in cluster mode: sink `ch` stores batch payloads"),
        "{err}"
    );
    let err = store
        .remove_dead_letters_blocking(&[])
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("removing dead letters is not allowed in cluster mode"),
        "{err}"
    );
    assert_eq!(store.position(PIPE, 0).unwrap(), None);
    // The node was never written: the partition's state holds nothing.
    assert_eq!(
        zk.children(&format!("{PIPE}/partitions/0/state")),
        Vec::<String>::new()
    );
    // Two nodes under the node limit, together above what one multi-op may carry.
    let mut wide = batch(0, 0);
    wide.columns = vec!["c".repeat(400 * 1024)];
    let err = store
        .commit_blocking(epoch(0, "p", vec![wide.clone(), wide]))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("the write of partition 0 of pipeline `pipe` would send "),
        "{err}"
    );
    assert!(
        err.contains("bytes to ZooKeeper in one multi-op, above the 786432-byte limit"),
        "{err}"
    );
    assert_eq!(store.position(PIPE, 0).unwrap(), None);
    // A sink value scoped to another partition cannot ride on this partition's fence.
    store
        .commit_blocking(epoch(0, "p", vec![batch(0, 0)]))
        .unwrap();
    let err = store
        .acknowledge_blocking(&key(0), 0, vec![("gave_up/1".to_owned(), b"x".to_vec())])
        .unwrap_err()
        .to_string();
    assert_eq!(err, "a sink value of another partition is not allowed in cluster mode: sink value `gave_up/1` belongs to partition 1, but it was written with an acknowledgement of partition 0, whose fence does not cover it");
    assert_eq!(store.undelivered(&key(0)).unwrap().len(), 1);

    let plain_dir = tempfile::tempdir().unwrap();
    let plain = StateStore::open(plain_dir.path()).unwrap();
    let err = zk
        .block_on(plain.load_partition(PIPE, 0))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("loading a partition needs the ZooKeeper mirror of cluster mode, and this store has none"),
        "{err}"
    );
    store.close().unwrap();
    plain.close().unwrap();

    // Reopened without its mirror (`dead-letters` on a stopped worker's directory), the
    // directory still refuses dead-letter changes ZooKeeper would not see.
    let reopened = StateStore::open(dir.path()).unwrap();
    assert_eq!(reopened.cluster_cache().unwrap().as_deref(), Some(PIPE));
    for err in [
        reopened.remove_dead_letters_blocking(&[]).unwrap_err(),
        reopened
            .requeue_dead_letters_blocking(Vec::new())
            .unwrap_err(),
    ] {
        let err = err.to_string();
        assert!(
            err.contains("is not allowed in cluster mode: this directory is the local cache of a cluster worker of pipeline `pipe`"),
            "{err}"
        );
    }
    reopened.close().unwrap();
    let plain = StateStore::open(plain_dir.path()).unwrap();
    assert_eq!(plain.cluster_cache().unwrap(), None);
    assert_eq!(plain.remove_dead_letters_blocking(&[]).unwrap(), 0);
    plain.close().unwrap();
}

#[test]
fn status_reads_beside_an_owner_that_delivers_never_fail_on_a_batch_deleted_after_the_listing() {
    let zk = Zk::connect("mirror-status-race");
    let dir = tempfile::tempdir().unwrap();
    let store = zk.store(dir.path(), 256, &[0]);
    const EPOCHS: u64 = 150;
    // The owner commits 8 batches per epoch and acknowledges them at once: batch nodes appear
    // and vanish all through the reads below.
    let owner = {
        let store = store.clone();
        zk.rt.spawn(async move {
            for e in 0..EPOCHS {
                let batches = (0..8).map(|n| batch(0, e * 8 + n)).collect();
                let receipt = store.commit(epoch(0, &format!("p{e}"), batches)).await?;
                for &seq in receipt.seqs("ch") {
                    store.acknowledge(&key(0), seq, vec![]).await?;
                }
            }
            Ok::<_, StateError>(())
        })
    };
    let mut reads = 0;
    while !owner.is_finished() {
        let read = zk.block_on(flow_state::zk::read_partition(
            &zk.client, &zk.root, PIPE, 0,
        ));
        let read = read.unwrap_or_else(|e| panic!("read {reads} beside the owner: {e}"));
        assert!(read.pending.len() <= 8, "{} pending", read.pending.len());
        reads += 1;
    }
    zk.block_on(owner).unwrap().unwrap();
    assert!(
        reads > 10,
        "only {reads} reads overlapped the owner's writes"
    );
    let last = zk
        .block_on(flow_state::zk::read_partition(
            &zk.client, &zk.root, PIPE, 0,
        ))
        .unwrap();
    assert_eq!(last.position, Some(format!("p{}", EPOCHS - 1).into_bytes()));
    assert!(last.pending.is_empty(), "{:?}", last.pending);
    store.close().unwrap();
}

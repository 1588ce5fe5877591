//! Crash test: a child process opens the store, commits epochs and acknowledges batches, closes
//! it and again, in a loop, and is killed with SIGKILL at a random moment; the parent reopens the
//! store and checks that everything the child reported durable is there, consistent, in order and
//! bit-identical.
//!
//! Sink `ch` commits with [`BatchStorage::Bounds`] (only metadata and the epoch start are kept),
//! sink `file` with [`BatchStorage::Payload`] (payloads in segment files). After every reopen the
//! payload directory must hold exactly the segments that stored batches reference: a crash must
//! not leak disk. The persisted counters added in each commit (epochs) and acknowledgement
//! (acknowledged batches) must equal, after every kill, what the store holds: they ride in the
//! same transactions.

// Test code: a failed unwrap is a failed test (helpers outside #[test] fns are not covered by
// clippy.toml's allow-unwrap-in-tests).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flow_state::{
    AckExtras, BatchStorage, CounterAdd, DeadLetter, EpochCommit, PayloadRef, SealedBatch,
    SinkEpochCommit, SinkPartition, StateStore, StoredBody, SOURCE_OWNER,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CHILD_DIR_ENV: &str = "FLOW_STATE_CRASH_CHILD_DIR";
const CHILD_SEED_ENV: &str = "FLOW_STATE_CRASH_CHILD_SEED";
const SEED_ENV: &str = "FLOW_STATE_CRASH_SEED";
const ITERATIONS_ENV: &str = "FLOW_STATE_CRASH_ITERATIONS";
const DEFAULT_SEED: u64 = 0x5EED_F10E;
const DEFAULT_ITERATIONS: u32 = 60;
const TEST_NAME: &str = "sigkill_during_commits_never_loses_or_reorders_durable_state";

const PIPELINE: &str = "pipe";
const PARTITIONS: [u32; 2] = [0, 1];
const SINKS: [&str; 2] = ["ch", "file"];
/// The sink whose batches are stored as bounds only; the others store payloads.
const BOUNDS_SINK: &str = "ch";
/// A child closes and reopens the store after 1 to this many epochs per partition.
const EPOCHS_PER_OPEN_MAX: u64 = 20;

// ---------- deterministic content ----------

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn sink_index(sink: &str) -> u64 {
    SINKS.iter().position(|s| *s == sink).unwrap() as u64
}

fn hash(partition: u32, epoch: u64, sink: &str, i: u64, what: u64) -> u64 {
    let mut h = splitmix(u64::from(partition) ^ 0xA5A5);
    h = splitmix(h ^ epoch);
    h = splitmix(h ^ sink_index(sink));
    h = splitmix(h ^ i);
    splitmix(h ^ what)
}

/// Number of batches epoch `epoch` of `partition` produces for `sink` (0..=2).
fn batch_count(partition: u32, epoch: u64, sink: &str) -> u64 {
    hash(partition, epoch, sink, 0, 1) % 3
}

fn payload_len(partition: u32, epoch: u64, sink: &str, i: u64) -> usize {
    let h = hash(partition, epoch, sink, i, 2);
    if h.is_multiple_of(10) {
        // Above 64 KiB, and often above sled's blob threshold (~128 KiB).
        65 * 1024 + (h >> 8) as usize % (240 * 1024)
    } else {
        (h >> 8) as usize % 4000
    }
}

fn expected_batch(partition: u32, epoch: u64, sink: &str, i: u64) -> SealedBatch {
    let len = payload_len(partition, epoch, sink, i);
    let mut state = hash(partition, epoch, sink, i, 3);
    let mut payload = Vec::with_capacity(len + 8);
    while payload.len() < len {
        state = splitmix(state);
        payload.extend_from_slice(&state.to_le_bytes());
    }
    payload.truncate(len);
    SealedBatch {
        target: format!("default.{sink}"),
        columns: vec!["id".to_owned(), format!("c{}", i)],
        format: "RowBinary".to_owned(),
        token: format!("{sink}-{partition}-{epoch}-{i}"),
        shard: if i.is_multiple_of(2) {
            String::new()
        } else {
            "s2".to_owned()
        },
        first_offset: epoch * 1000 + i * 10,
        last_offset: epoch * 1000 + i * 10 + 9,
        rows: 10 + i,
        encoded_bytes: len as u64 / 2,
        plan: format!("plan-{sink}-{}", epoch % 3),
        sealed_at_ms: 1_700_000_000_000 + epoch * 1000 + i,
        content_hash: hash(partition, epoch, sink, i, 4),
        payload: payload.into(),
    }
}

/// The position an epoch starts at: the position committed by the previous epoch.
fn epoch_start(epoch: u64) -> Option<Vec<u8>> {
    epoch
        .checked_sub(1)
        .map(|previous| format!("epoch-{previous}").into_bytes())
}

fn storage(sink: &str, epoch: u64) -> BatchStorage {
    if sink == BOUNDS_SINK {
        BatchStorage::Bounds {
            epoch_start: epoch_start(epoch),
        }
    } else {
        BatchStorage::Payload
    }
}

fn expected_source_dead_letters(partition: u32, epoch: u64) -> Vec<DeadLetter> {
    if !epoch.is_multiple_of(5) {
        return Vec::new();
    }
    vec![DeadLetter {
        partition,
        offset: Some(epoch * 1000),
        reason: format!("epoch {epoch} undecodable"),
        payload: epoch.to_be_bytes().to_vec(),
    }]
}

fn epoch_commit(partition: u32, epoch: u64) -> EpochCommit {
    EpochCommit {
        pipeline: PIPELINE.to_owned(),
        partition,
        position: format!("epoch-{epoch}").into_bytes(),
        source_dead_letters: expected_source_dead_letters(partition, epoch),
        sinks: SINKS
            .iter()
            .map(|sink| SinkEpochCommit {
                sink: (*sink).to_owned(),
                storage: storage(sink, epoch),
                batches: (0..batch_count(partition, epoch, sink))
                    .map(|i| expected_batch(partition, epoch, sink, i))
                    .collect(),
                dead_letters: Vec::new(),
            })
            .collect(),
        counters: vec![counter_add(SOURCE_OWNER, EPOCHS_COUNTER)],
    }
}

/// Counts epochs in each commit's transaction (owner "source") and acknowledgements in each
/// acknowledgement's (owner = sink): after any crash they must equal what the store holds.
const EPOCHS_COUNTER: &str = "epochs";
const ACKS_COUNTER: &str = "acknowledged";

fn counter_add(owner: &str, name: &str) -> CounterAdd {
    CounterAdd {
        owner: owner.to_owned(),
        name: name.to_owned(),
        by: 1,
    }
}

fn counter(store: &StateStore, owner: &str, partition: u32, name: &str) -> u64 {
    store
        .counters()
        .unwrap()
        .into_iter()
        .find(|c| c.owner == owner && c.partition == partition && c.name == name)
        .map_or(0, |c| c.value)
}

fn parse_epoch(position: &[u8]) -> u64 {
    let text = std::str::from_utf8(position).unwrap();
    text.strip_prefix("epoch-").unwrap().parse().unwrap()
}

fn key(sink: &str, partition: u32) -> SinkPartition {
    SinkPartition::new(PIPELINE, sink, partition)
}

fn acked_value_name(partition: u32) -> String {
    format!("acked-{partition}")
}

// ---------- child ----------

/// Commits `epochs` epochs of `partition` from its durable position, acknowledging some of the
/// oldest batches after each.
fn child_partition_loop(store: StateStore, partition: u32, seed: u64, epochs: u64) {
    let mut rng = StdRng::seed_from_u64(seed ^ u64::from(partition));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let first_epoch = store
        .position(PIPELINE, partition)
        .unwrap()
        .map(|p| parse_epoch(&p) + 1)
        .unwrap_or(0);
    for next_epoch in first_epoch..first_epoch + epochs {
        let receipt = store
            .commit_blocking(epoch_commit(partition, next_epoch))
            .unwrap();
        let seqs: Vec<String> = receipt
            .batch_seqs
            .iter()
            .map(|(sink, seqs)| format!("{sink}:{seqs:?}"))
            .collect();
        println!("@@ COMMITTED {partition} {next_epoch} {}", seqs.join(" "));
        for sink in SINKS {
            for _ in 0..rng.gen_range(0..=3) {
                let k = key(sink, partition);
                let Some(oldest) = store.oldest_undelivered(&k).unwrap() else {
                    break;
                };
                let value = (
                    acked_value_name(partition),
                    oldest.seq.to_be_bytes().to_vec(),
                );
                let extras = AckExtras {
                    sink_values: vec![value],
                    counters: vec![counter_add(sink, ACKS_COUNTER)],
                    ..AckExtras::default()
                };
                runtime
                    .block_on(store.acknowledge_with(&k, oldest.seq, extras))
                    .unwrap();
                println!("@@ ACKED {sink} {partition} {}", oldest.seq);
            }
        }
    }
}

/// Opens the store, commits and acknowledges a few epochs per partition, closes it, and again,
/// until it is killed: kills land in opens (sled's recovery) and closes as well as in commits.
fn run_child(dir: &Path, seed: u64) -> ! {
    let mut rng = StdRng::seed_from_u64(seed);
    loop {
        let store = StateStore::open(dir).unwrap();
        println!("@@ OPENED");
        let epochs = rng.gen_range(1..=EPOCHS_PER_OPEN_MAX);
        let threads: Vec<_> = PARTITIONS
            .iter()
            .map(|&partition| {
                let store = store.clone();
                let seed: u64 = rng.gen();
                std::thread::spawn(move || child_partition_loop(store, partition, seed, epochs))
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        store.close().unwrap();
    }
}

// ---------- parent ----------

/// What the children printed as durable, over all runs.
#[derive(Default)]
struct Printed {
    committed: HashMap<u32, u64>,
    acked: HashMap<(String, u32), u64>,
    commits: u64,
    acks: u64,
}

impl Printed {
    fn absorb(&mut self, line: &str) {
        // libtest may print "test <name> ... " on the same line before the child's output.
        let Some(start) = line.find("@@ ") else {
            return;
        };
        let words: Vec<&str> = line[start..].split_whitespace().collect();
        match words.as_slice() {
            ["@@", "COMMITTED", partition, epoch, ..] => {
                let partition: u32 = partition.parse().unwrap();
                let epoch: u64 = epoch.parse().unwrap();
                let previous = self.committed.insert(partition, epoch);
                assert!(
                    previous.is_none_or(|p| p < epoch),
                    "epochs printed out of order: {line}"
                );
                self.commits += 1;
            }
            ["@@", "ACKED", sink, partition, seq] => {
                let k = ((*sink).to_owned(), partition.parse().unwrap());
                let seq: u64 = seq.parse().unwrap();
                let previous = self.acked.insert(k, seq);
                assert!(
                    previous.is_none_or(|p| p < seq),
                    "acks printed out of order: {line}"
                );
                self.acks += 1;
            }
            _ => {}
        }
    }
}

/// What the previous check found durable (must never go backwards).
#[derive(Default, Clone)]
struct Durable {
    epoch: HashMap<u32, u64>,
    head: HashMap<(String, u32), u64>,
}

/// Checks every invariant; returns the durable state found.
fn check_invariants(
    store: &StateStore,
    printed: &Printed,
    before: &Durable,
    round: u32,
) -> Durable {
    let mut now = Durable::default();
    // (queue, segment id) of every stored payload.
    let mut referenced: BTreeSet<(SinkPartition, u64)> = BTreeSet::new();
    for partition in PARTITIONS {
        let epoch = store
            .position(PIPELINE, partition)
            .unwrap()
            .map(|p| parse_epoch(&p));
        // Nothing reported durable is missing; at most the one in-flight commit is extra.
        // Known durable: printed by a child, or found by the previous check (a commit that became
        // durable just before a kill is never printed). At most the one in-flight commit of the
        // last child may be durable beyond that.
        let known = match (
            printed.committed.get(&partition),
            before.epoch.get(&partition),
        ) {
            (Some(a), Some(b)) => Some(*a.max(b)),
            (a, b) => a.or(b).copied(),
        };
        match (known, epoch) {
            (None, None) => {}
            (None, Some(e)) => assert_eq!(
                e, 0,
                "round {round}: partition {partition} at {e}, nothing known durable"
            ),
            (Some(k), None) => {
                panic!("round {round}: partition {partition}: epoch {k} known durable, no position")
            }
            (Some(k), Some(e)) => assert!(
                e == k || e == k + 1,
                "round {round}: partition {partition}: position epoch {e}, known durable {k} \
                 (printed {:?}, previous check {:?})",
                printed.committed.get(&partition),
                before.epoch.get(&partition)
            ),
        }
        // Dead letters: exactly those of the committed epochs, in order.
        let expected_dls: Vec<DeadLetter> = epoch
            .map(|e| {
                (0..=e)
                    .flat_map(|n| expected_source_dead_letters(partition, n))
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(
            store
                .dead_letters(PIPELINE, SOURCE_OWNER, partition)
                .unwrap(),
            expected_dls,
            "round {round}: source dead letters of partition {partition}"
        );
        assert_eq!(
            counter(store, SOURCE_OWNER, partition, EPOCHS_COUNTER),
            epoch.map_or(0, |e| e + 1),
            "round {round}: partition {partition}: the epochs counter is atomic with the position"
        );
        if let Some(e) = epoch {
            now.epoch.insert(partition, e);
        }

        for sink in SINKS {
            // Every batch ever committed for this queue, in commit order: seq = index.
            let all: Vec<(u64, u64)> = epoch
                .map(|e| {
                    (0..=e)
                        .flat_map(|n| (0..batch_count(partition, n, sink)).map(move |i| (n, i)))
                        .collect()
                })
                .unwrap_or_default();
            let k = key(sink, partition);
            let queue = store.undelivered(&k).unwrap();
            let total = all.len() as u64;
            let head = queue.first().map(|b| b.seq).unwrap_or(total);
            // The queue is exactly the contiguous range head..total: from the oldest
            // unacknowledged batch to the newest batch of the committed epoch.
            assert_eq!(
                queue.len() as u64,
                total.saturating_sub(head),
                "round {round}: {k}: queue of {} batches starting at {head}, {total} committed",
                queue.len()
            );
            for (j, stored) in queue.iter().enumerate() {
                let seq = head + j as u64;
                assert_eq!(
                    stored.seq, seq,
                    "round {round}: {k}: reordered or gap at {j}"
                );
                let (n, i) = all[seq as usize];
                let expected = expected_batch(partition, n, sink, i);
                let expected_meta = SealedBatch {
                    payload: Default::default(),
                    ..expected.clone()
                };
                assert!(
                    stored.batch == expected_meta,
                    "round {round}: {k}: batch seq {seq} (epoch {n} #{i}) metadata differs: \
                     token {} vs {}, stored payload {} bytes (must be empty)",
                    stored.batch.token,
                    expected.token,
                    stored.batch.payload.len(),
                );
                match (&stored.body, storage(sink, n)) {
                    (StoredBody::Payload(payload_ref), BatchStorage::Payload) => {
                        let loaded = store.load_payload(&k, payload_ref).unwrap_or_else(|e| {
                            panic!("round {round}: {k}: payload of seq {seq} (epoch {n} #{i}): {e}")
                        });
                        assert!(
                            loaded == expected.payload,
                            "round {round}: {k}: payload of seq {seq} (epoch {n} #{i}) differs: \
                             {} vs {} bytes",
                            loaded.len(),
                            expected.payload.len()
                        );
                        referenced.insert((k.clone(), segment_of(payload_ref)));
                    }
                    (
                        StoredBody::Rebuild { epoch_start },
                        BatchStorage::Bounds { epoch_start: e },
                    ) => {
                        assert_eq!(
                            *epoch_start, e,
                            "round {round}: {k}: epoch start of seq {seq} (epoch {n} #{i})"
                        );
                    }
                    (body, wanted) => panic!(
                        "round {round}: {k}: seq {seq} (epoch {n} #{i}) stored as {body:?}, \
                         committed with {wanted:?}"
                    ),
                }
            }
            // Acknowledged batches: everything printed as acknowledged is gone; at most the one
            // in-flight acknowledgement is extra; nothing else was removed.
            let ack_key = (sink.to_owned(), partition);
            let printed_head = printed.acked.get(&ack_key).map(|s| s + 1).unwrap_or(0);
            let known_head = printed_head.max(before.head.get(&ack_key).copied().unwrap_or(0));
            assert!(
                head == known_head || head == known_head + 1,
                "round {round}: {k}: oldest batch {head}, known acknowledged up to (excl.) \
                 {known_head} (printed {printed_head}, previous check {:?})",
                before.head.get(&ack_key)
            );
            // The sink value set by the acknowledgement is atomic with the removal.
            let value = store
                .sink_value(PIPELINE, sink, &acked_value_name(partition))
                .unwrap();
            let expected_value = head.checked_sub(1).map(|s| s.to_be_bytes().to_vec());
            assert_eq!(value, expected_value, "round {round}: {k}: acked value");
            // Batches are acknowledged oldest first from seq 0: `head` of them so far.
            assert_eq!(
                counter(store, sink, partition, ACKS_COUNTER),
                head,
                "round {round}: {k}: the acknowledgement counter is atomic with the removal"
            );
            now.head.insert(ack_key, head);
        }
    }
    // Disk is not leaked across crashes: right after the reopen, the payload directory holds
    // exactly the segments that stored batches reference (opening deletes the others).
    let on_disk = segment_files(store.dir());
    assert_eq!(
        on_disk, referenced,
        "round {round}: segment files on disk vs segments referenced by stored batches"
    );
    now
}

/// The segment a stored payload is in. `PayloadRef` is opaque; its derived `Debug` shows it.
fn segment_of(payload_ref: &PayloadRef) -> u64 {
    let shown = format!("{payload_ref:?}");
    let rest = shown
        .split("segment: ")
        .nth(1)
        .unwrap_or_else(|| panic!("no segment in {shown}"));
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().unwrap()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `payloads/<hex pipeline\0sink\0partition>/<segment id, 16 hex digits>` of every queue this test
/// writes; any other file in the payload directory fails the test.
fn segment_files(store_dir: &Path) -> BTreeSet<(SinkPartition, u64)> {
    let mut queues = HashMap::new();
    for partition in PARTITIONS {
        for sink in SINKS {
            let mut queue_key = format!("{PIPELINE}\0{sink}\0").into_bytes();
            queue_key.extend_from_slice(&partition.to_be_bytes());
            queues.insert(hex(&queue_key), key(sink, partition));
        }
    }
    let mut out = BTreeSet::new();
    let root = store_dir.join("payloads");
    for dir in std::fs::read_dir(&root).unwrap() {
        let dir = dir.unwrap();
        let name = dir.file_name().to_string_lossy().into_owned();
        let queue = queues
            .get(&name)
            .unwrap_or_else(|| panic!("unexpected payload directory {}", dir.path().display()));
        for file in std::fs::read_dir(dir.path()).unwrap() {
            let file = file.unwrap();
            let id = u64::from_str_radix(&file.file_name().to_string_lossy(), 16)
                .unwrap_or_else(|_| panic!("unexpected file {}", file.path().display()));
            out.insert((queue.clone(), id));
        }
    }
    out
}

fn spawn_reader<R: Read + Send + 'static>(r: R) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(r);
        let mut lines = Vec::new();
        let mut line = String::new();
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                // A line cut by the kill has no newline and is ignored.
                Ok(_) if line.ends_with('\n') => lines.push(line.trim_end().to_owned()),
                Ok(_) => {}
            }
        }
        lines
    })
}

/// `name (bytes)` of every file directly in `dir`, for a failure message.
fn listing(dir: &Path) -> String {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| {
            let len = e.metadata().map(|m| m.len()).unwrap_or(0);
            format!("{} ({len})", e.file_name().to_string_lossy())
        })
        .collect();
    names.sort();
    names.join(", ")
}

fn dir_size(path: &Path) -> u64 {
    std::fs::read_dir(path)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => dir_size(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn sigkill_during_commits_never_loses_or_reorders_durable_state() {
    if let Ok(dir) = std::env::var(CHILD_DIR_ENV) {
        let seed = std::env::var(CHILD_SEED_ENV).unwrap().parse().unwrap();
        run_child(Path::new(&dir), seed);
    }
    let seed: u64 = std::env::var(SEED_ENV)
        .ok()
        .map(|s| s.parse().unwrap())
        .unwrap_or(DEFAULT_SEED);
    let iterations: u32 = std::env::var(ITERATIONS_ENV)
        .ok()
        .map(|s| s.parse().unwrap())
        .unwrap_or(DEFAULT_ITERATIONS);
    println!("crash test seed = {seed} (set {SEED_ENV} to replay), iterations = {iterations}");
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let started = Instant::now();
    let mut printed = Printed::default();
    let mut durable = Durable::default();
    let mut killed_after_open = 0;
    for round in 0..iterations {
        let child_seed: u64 = rng.gen();
        let delay = Duration::from_millis(rng.gen_range(3..=300));
        let mut child = Command::new(&exe)
            .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR_ENV, dir.path())
            .env(CHILD_SEED_ENV, child_seed.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = spawn_reader(child.stdout.take().unwrap());
        let err = spawn_reader(child.stderr.take().unwrap());
        std::thread::sleep(delay);
        if let Some(status) = child.try_wait().unwrap() {
            let stderr = err.join().unwrap().join("\n");
            panic!("round {round}: child exited by itself ({status}):\n{stderr}");
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let lines = out.join().unwrap();
        let _ = err.join();
        let (commits_before, acks_before) = (printed.commits, printed.acks);
        for line in &lines {
            printed.absorb(line);
        }
        if lines.iter().any(|l| l.contains("@@ OPENED")) {
            killed_after_open += 1;
        }
        let opening = Instant::now();
        let store = StateStore::open(dir.path()).unwrap_or_else(|err| {
            panic!(
                "round {round}: the store does not reopen after the kill: {err:?}; its files: {}",
                listing(dir.path())
            )
        });
        let open_time = opening.elapsed();
        durable = check_invariants(&store, &printed, &durable, round);
        store.close().unwrap();
        println!(
            "round {round}: killed after {delay:?}: +{} commits, +{} acks; durable epochs {:?}; \
             reopen took {open_time:?}, store is {} KiB ({} KiB of payload segments)",
            printed.commits - commits_before,
            printed.acks - acks_before,
            durable.epoch,
            dir_size(dir.path()) / 1024,
            dir_size(&dir.path().join("payloads")) / 1024
        );
    }
    println!(
        "crash test done: {iterations} kills ({killed_after_open} after the store was open), \
         {} commits and {} acks reported durable, seed {seed}, {:?}",
        printed.commits,
        printed.acks,
        started.elapsed()
    );
    assert!(printed.commits > 0, "the children never committed anything");
    assert!(printed.acks > 0, "the children never acknowledged anything");
}

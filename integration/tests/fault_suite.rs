//! The fault suite: each ClickHouse sink class through a seeded random schedule of faults, against
//! the local cluster (`scripts/cluster.sh up`).
//!
//! Every test runs the worker binary on a generator (short schedule: 4 partitions x 42,000
//! messages, rate-limited to ~34 s undisturbed) into a fresh ReplicatedMergeTree table. Every
//! ClickHouse endpoint of the sink sits behind its own [`FaultProxy`] and the spec lists the proxy
//! addresses (the replicated target fingerprint is the ZooKeeper path, so the proxies do not change
//! it). While the worker runs, a schedule drawn from a seeded RNG applies faults one after another,
//! each held for a short random time and then reverted:
//!
//! * on one proxy: `Refuse`, `CutRequestAfter(n)` (random n), a lost acknowledgement
//!   (`set_once_on_insert(CutResponse)`), `Latency(50..300 ms)`, `Stall` (held past the spec's 2 s
//!   `write_timeout`, so it becomes a timeout);
//! * the worker `kill -9`ed and restarted on the same state directory;
//! * a replica stopped (`cluster.sh stop a2`, or `b2` for the sharded classes) and started again.
//!   The stop runs in the background: ClickHouse 18.16 keeps serving keep-alive connections after
//!   SIGTERM, so a graceful stop of a replica the sink writes to can take until cluster.sh's KILL
//!   (30 s); the schedule goes on meanwhile;
//! * ZooKeeper stopped and started (replicated tables turn read-only, code 242, for ~10 s after it
//!   is back): three times for the sharded exactly-once class in every schedule, and at random
//!   in the long schedule.
//!
//! The first faults of a schedule are one of each kind (shuffled), the rest random. After the
//! schedule, every proxy is set to `Pass`, `cluster.sh up` runs, the worker runs to completion
//! (exit 0), `SYSTEM SYNC REPLICA` runs on every replica and the class's promise is checked:
//!
//! | class | end state |
//! | --- | --- |
//! | `ClickHouseBatchingSink`, `ShardedClickHouseBatchingSink` | every id exactly once, identical replicas, (sharded) on the shard its user_id routes to |
//! | `AtLeastOnceClickHouseSink` | every id at least once; duplicates counted and printed |
//! | `AtMostOnceClickHouseSink` | no id twice; every row read once the faults are over lands; losses counted and printed |
//!
//! Short schedule (default, CI): 20 faults per class (at least 20 required). Long schedule
//! (`FLOW_FAULT_LONG=1`): 100 faults per class, 4 x 250,000 messages, ZooKeeper faults included.
//! The sharded exactly-once class adds three ZooKeeper outages to its first faults in every
//! schedule (23 faults in the short one).
//! The seed is printed first (default 20261130); `FLOW_FAULT_SEED=<u64>` replays a schedule (the
//! timing of the worker relative to the faults still varies from run to run).
//!
//! The tests stop replicas, so they are serialised by a mutex, and a guard runs `cluster.sh up`
//! whatever happens.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const PARTITIONS: u64 = 4;
const DEFAULT_SEED: u64 = 20_261_130;

/// The tests stop replicas: never two at once.
static SERIAL: Mutex<()> = Mutex::new(());

// ---------------------------------------------------------------------------------------------
// Schedule parameters

struct Schedule {
    /// `short`, `long` or `ZooKeeper`, as the output names it.
    name: &'static str,
    /// What replays it besides the seed (an environment variable), printed with the seed.
    replay: &'static str,
    faults: usize,
    /// The faults applied first, in a shuffled order; the rest are drawn from `kinds`.
    first: Vec<Kind>,
    kinds: Vec<Kind>,
    per_partition: u64,
    rate_per_partition: u64,
    /// How long the last run may take to finish.
    finish_timeout: Duration,
}

impl Schedule {
    fn from_env() -> Schedule {
        let long = std::env::var("FLOW_FAULT_LONG").is_ok_and(|v| !v.is_empty() && v != "0");
        let mut kinds = vec![
            Kind::Refuse,
            Kind::CutRequest,
            Kind::LostAck,
            Kind::Latency,
            Kind::Stall,
            Kind::WorkerKill,
            Kind::ReplicaRestart,
        ];
        if long {
            kinds.push(Kind::ZooKeeperRestart);
            // ~250 s undisturbed per class; 100 faults take ~200 s plus the ZooKeeper outages.
            Schedule {
                name: "long",
                replay: " FLOW_FAULT_LONG=1",
                faults: 100,
                first: kinds.clone(),
                kinds,
                per_partition: 250_000,
                rate_per_partition: 1_000,
                finish_timeout: Duration::from_secs(900),
            }
        } else {
            // ~34 s undisturbed per class; 20 faults take ~30-38 s. Sized so that the clean-clone
            // CI run, which also runs the cluster-mode suites, stays within its 20 minutes.
            Schedule {
                name: "short",
                replay: "",
                faults: 20,
                first: kinds.clone(),
                kinds,
                per_partition: 42_000,
                rate_per_partition: 1_250,
                finish_timeout: Duration::from_secs(300),
            }
        }
    }

    /// The schedule with `outages` ZooKeeper outages among its first faults (every run of the
    /// sharded exactly-once class has them: each leaves the replicated tables read-only, code 242,
    /// for ~10 s after ZooKeeper is back, so they stay few and the rest of the faults keep their
    /// kinds).
    fn with_zookeeper_outages(mut self, outages: usize) -> Schedule {
        let have = self
            .first
            .iter()
            .filter(|k| **k == Kind::ZooKeeperRestart)
            .count();
        for _ in have..outages {
            self.first.push(Kind::ZooKeeperRestart);
            self.faults += 1;
        }
        self
    }

    /// The fewest faults a run must apply before the worker finishes.
    fn required(&self) -> usize {
        self.faults.min(20)
    }
}

// ---------------------------------------------------------------------------------------------
// The classes

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)]
enum Promise {
    ExactlyOnce,
    AtLeastOnce,
    AtMostOnce,
}

struct Class {
    /// `sink_class_name`, also the name the failures carry.
    name: &'static str,
    /// Pipeline name (and table prefix).
    pipeline: &'static str,
    /// Salt mixed into the seed so that the four classes draw different schedules.
    salt: u64,
    promise: Promise,
    /// (shard, replicas); one entry `("", [a1, a2])` for the `hosts` form.
    shards: Vec<(&'static str, Vec<Node>)>,
    /// Route by `user_id` (checked at the end).
    keyed: bool,
    /// Replicas the replica fault may stop.
    stoppable: Vec<Node>,
}

impl Class {
    fn nodes(&self) -> Vec<Node> {
        self.shards
            .iter()
            .flat_map(|(_, nodes)| nodes.iter().copied())
            .collect()
    }

    /// The host parameters, every node written as `addr` gives it.
    fn host_parameters(&self, addr: impl Fn(&Node) -> String) -> String {
        let addr = |n: &Node| format!("\"{}\"", addr(n));
        let list = |nodes: &[Node]| nodes.iter().map(addr).collect::<Vec<_>>().join(", ");
        if self.shards.len() == 1 && self.shards[0].0.is_empty() {
            format!("hosts: [{}]", list(&self.shards[0].1))
        } else {
            let shards: Vec<String> = self
                .shards
                .iter()
                .map(|(s, nodes)| format!("{s}: [{}]", list(nodes)))
                .collect();
            let mut text = format!("shard_hosts: {{{}}}", shards.join(", "));
            if self.keyed {
                text.push_str(", sharding_key_columns: [user_id]");
            }
            text
        }
    }

    /// Messages per partition: the schedule's, and for at-most-once as many again, which the
    /// last run reads after the faults without a rate limit (see [`quiet_positions`]).
    fn per_partition(&self, schedule: &Schedule) -> u64 {
        match self.promise {
            Promise::AtMostOnce => 2 * schedule.per_partition,
            Promise::ExactlyOnce | Promise::AtLeastOnce => schedule.per_partition,
        }
    }

    /// The spec the worker runs at `rate` messages per second per partition (0: unlimited):
    /// every node behind its proxy.
    fn spec(&self, table: &str, schedule: &Schedule, rate: u64, proxies: &Proxies) -> String {
        GeneratorSpec::new(
            self.pipeline,
            self.name,
            format!(
                "{{{}, database: default, table: {table}}}",
                self.host_parameters(|n| proxies.addr(n.name))
            ),
        )
        .partitions(PARTITIONS)
        .epoch(5000, 500)
        .count(self.per_partition(schedule))
        .rate(rate)
        .payload_bytes(16)
        .sink_name("events")
        .dynamic("{max_rows_per_batch: 2000, retry_backoff: 200ms, max_retry_backoff: 2s, write_timeout: 2s}")
        .yaml()
    }

    /// The spec `verify` reads: the nodes themselves.
    fn verify_spec(&self, table: &str) -> String {
        GeneratorSpec::new(
            self.pipeline,
            self.name,
            format!(
                "{{{}, database: default, table: {table}}}",
                self.host_parameters(Node::http_addr)
            ),
        )
        .partitions(PARTITIONS)
        .sink_name("events")
        .yaml()
    }
}

/// At-most-once: where the run stands once every fault is over. The run the schedule left (if
/// any) is stopped with SIGTERM, which delivers what it holds (nothing is in flight that a fault
/// could cut any more) and commits; the committed positions are returned. The last run starts
/// from there with no fault, so every row it reads must land: a lower bound on the rows
/// delivered, asserted exactly. The class reads twice the schedule's messages, and the schedule
/// (rate-limited) ends about halfway, so the bound covers about half of them.
fn quiet_positions(tag: &str, class: &Class, worker: &mut Worker, state: &Path) -> Vec<u64> {
    if worker.running() {
        worker.signal("TERM").unwrap();
        let code = worker
            .wait_exit(Duration::from_secs(120))
            .unwrap_or_else(|err| panic!("{tag}: stopping the run after the schedule: {err:#}"));
        assert_eq!(
            code,
            Some(0),
            "{tag}: SIGTERM after the schedule\n{}",
            worker.log_tail()
        );
    }
    let positions = pipeline_status(worker_bin!(), state, class.pipeline)
        .unwrap()
        .expect("status failed: not a flow state directory")
        .positions;
    // One per partition, in partition order (status keys them by partition number).
    assert_eq!(
        positions.len(),
        PARTITIONS as usize,
        "{tag}: committed positions after the schedule: {positions:?}"
    );
    positions
}

fn batching() -> Class {
    Class {
        name: "ClickHouseBatchingSink",
        pipeline: "fs_batching",
        salt: 1,
        promise: Promise::ExactlyOnce,
        shards: vec![("", SHARD_A.to_vec())],
        keyed: false,
        stoppable: vec![A2],
    }
}

fn sharded_batching() -> Class {
    Class {
        name: "ShardedClickHouseBatchingSink",
        pipeline: "fs_sharded",
        salt: 2,
        promise: Promise::ExactlyOnce,
        shards: vec![("a", SHARD_A.to_vec()), ("b", SHARD_B.to_vec())],
        keyed: true,
        stoppable: vec![A2, B2],
    }
}

fn at_least_once() -> Class {
    Class {
        name: "AtLeastOnceClickHouseSink",
        pipeline: "fs_at_least_once",
        salt: 3,
        promise: Promise::AtLeastOnce,
        shards: vec![("a", SHARD_A.to_vec()), ("b", SHARD_B.to_vec())],
        keyed: false,
        stoppable: vec![A2, B2],
    }
}

fn at_most_once() -> Class {
    Class {
        name: "AtMostOnceClickHouseSink",
        pipeline: "fs_at_most_once",
        salt: 4,
        promise: Promise::AtMostOnce,
        shards: vec![("", SHARD_A.to_vec())],
        keyed: false,
        stoppable: vec![A2],
    }
}

// ---------------------------------------------------------------------------------------------
// Processes, proxies and the cluster

/// One proxy per node of the class, on a runtime of their own.
struct Proxies {
    runtime: tokio::runtime::Runtime,
    by_node: Vec<(&'static str, FaultProxy)>,
}

impl Proxies {
    fn start(nodes: &[Node]) -> Proxies {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let by_node = nodes
            .iter()
            .map(|n| {
                let upstream = n.http_addr().parse().unwrap();
                (
                    n.name,
                    runtime.block_on(FaultProxy::start(upstream)).unwrap(),
                )
            })
            .collect();
        Proxies { runtime, by_node }
    }

    fn get(&self, node: &str) -> &FaultProxy {
        &self.by_node.iter().find(|(n, _)| *n == node).unwrap().1
    }

    fn addr(&self, node: &str) -> String {
        self.get(node).addr().to_string()
    }

    /// The node whose proxy saw the most requests since the last call (`seen` holds the counts
    /// of that call); `None` if none saw any.
    fn busiest(&self, seen: &mut [u64]) -> Option<Node> {
        let mut best: Option<(u64, &str)> = None;
        for ((name, p), last) in self.by_node.iter().zip(seen.iter_mut()) {
            let now = p.stats().requests;
            let delta = now - *last;
            *last = now;
            if delta > 0 && best.is_none_or(|(d, _)| delta > d) {
                best = Some((delta, name));
            }
        }
        best.and_then(|(_, name)| NODES.iter().copied().find(|n| n.name == name))
    }

    fn all_pass(&self) {
        for (_, p) in &self.by_node {
            p.set(Fault::Pass);
        }
    }

    fn stats(&self) -> String {
        self.by_node
            .iter()
            .map(|(n, p)| {
                let s = p.stats();
                format!(
                    "{n}: {} conn, {} req, {} refused, {} cut, {} stalled, {} upstream errors",
                    s.connections, s.requests, s.refused, s.cuts, s.stalled, s.upstream_errors
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

impl Drop for Proxies {
    fn drop(&mut self) {
        let by_node = std::mem::take(&mut self.by_node);
        self.runtime.block_on(async move {
            for (_, p) in by_node {
                p.stop().await;
            }
        });
    }
}

/// A replica fault running in the background: stop, hold, start.
#[derive(Default)]
struct ReplicaFault {
    handle: Option<JoinHandle<String>>,
}

impl ReplicaFault {
    fn busy(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| !h.is_finished())
    }

    fn start(
        &mut self,
        node: Node,
        hold: Duration,
        started: Instant,
        log: Arc<Mutex<Vec<String>>>,
    ) {
        self.join();
        self.handle = Some(std::thread::spawn(move || {
            let t0 = Instant::now();
            let stop = cluster_sh(&["stop", node.name]);
            let stopped_in = t0.elapsed();
            std::thread::sleep(hold);
            let start = cluster_sh(&["start", node.name]);
            let note = format!(
                "replica {}: stop at {:.1}s took {:.1}s ({}), down {:.1}s, start took {:.1}s ({})",
                node.name,
                (t0 - started).as_secs_f64(),
                stopped_in.as_secs_f64(),
                if stop.is_ok() { "ok" } else { "failed" },
                hold.as_secs_f64(),
                (t0.elapsed() - stopped_in - hold).as_secs_f64(),
                match &start {
                    Ok(_) => "ok".to_owned(),
                    Err(e) => format!("failed: {e:#}"),
                }
            );
            log.lock().unwrap().push(note.clone());
            note
        }));
    }

    /// Waits for a fault in progress to end.
    fn join(&mut self) {
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for ReplicaFault {
    fn drop(&mut self) {
        self.join();
    }
}

// ---------------------------------------------------------------------------------------------
// Faults

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Refuse,
    CutRequest,
    LostAck,
    Latency,
    Stall,
    WorkerKill,
    ReplicaRestart,
    ZooKeeperRestart,
}

impl Kind {
    /// A fault of the cluster itself (a replica or ZooKeeper restarted in the background), of
    /// which one runs at a time.
    fn is_cluster(self) -> bool {
        matches!(self, Kind::ReplicaRestart | Kind::ZooKeeperRestart)
    }

    fn label(self) -> &'static str {
        match self {
            Kind::Refuse => "proxy Refuse",
            Kind::CutRequest => "proxy CutRequestAfter",
            Kind::LostAck => "proxy CutResponse (lost ack)",
            Kind::Latency => "proxy Latency",
            Kind::Stall => "proxy Stall",
            Kind::WorkerKill => "worker kill -9",
            Kind::ReplicaRestart => "replica stop/start",
            Kind::ZooKeeperRestart => "ZooKeeper stop/start",
        }
    }
}

fn run_class(class: &Class, schedule: &Schedule) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let seed = fault_seed(DEFAULT_SEED);
    let tag = format!("[{} seed {seed}]", class.name);
    let per_partition = class.per_partition(schedule);
    let total = PARTITIONS * per_partition;
    println!(
        "{tag} fault suite, {} schedule: {} faults over {} messages (replay with FLOW_FAULT_SEED={seed}{})",
        schedule.name,
        schedule.faults,
        total,
        schedule.replay
    );
    let mut rng = StdRng::seed_from_u64(seed ^ class.salt.wrapping_mul(0x9E37_79B9_7F4A_7C15));

    let name = unique_name(class.pipeline);
    let table =
        ReplicatedTable::create("default", &name, GENERATOR_COLUMNS, "id", &class.nodes()).unwrap();
    let qualified = table.qualified();
    let dir = TestDir::new().unwrap();
    let proxies = Proxies::start(&class.nodes());
    let spec = dir.path().join("spec.yaml");
    let rate = schedule.rate_per_partition;
    std::fs::write(&spec, class.spec(&name, schedule, rate, &proxies)).unwrap();
    let state = dir.path().join("state");
    // Dropped in reverse order: the worker dies, the replica fault ends, the cluster is restored,
    // then the proxies stop and the table is dropped on a whole cluster.
    let _restore = ClusterGuard;
    let mut replica = ReplicaFault::default();

    let started = Instant::now();
    let notes = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut runs = 0usize;
    let spawn = |runs: &mut usize| {
        *runs += 1;
        Worker::spawn(
            worker_bin!(),
            &spec,
            &state,
            dir.path().join(format!("worker-{runs}.log")),
        )
        .unwrap()
    };
    let mut worker = spawn(&mut runs);

    // One of each kind first (shuffled), then random ones.
    let all = &schedule.kinds;
    let mut plan: Vec<Kind> = schedule.first.clone();
    plan.shuffle(&mut rng);
    let mut applied: BTreeMap<Kind, usize> = BTreeMap::new();
    let mut applied_total = 0usize;
    let mut finished_early = false;
    let mut i = 0usize;
    let mut last_requests: Vec<u64> = vec![0; class.nodes().len()];
    // Every planned kind is applied, even where a cluster fault had to wait past the count.
    while applied_total < schedule.faults || i < plan.len() {
        std::thread::sleep(Duration::from_millis(rng.gen_range(200..800)));
        if let Some(code) = worker.exited().unwrap() {
            assert_eq!(
                code,
                Some(0),
                "{tag}: the worker failed during the schedule (after {applied_total} faults)\n{}",
                worker.log_tail()
            );
            finished_early = true;
            break;
        }
        let mut kind = plan
            .get(i)
            .copied()
            .unwrap_or_else(|| *all.choose(&mut rng).unwrap());
        // Never two cluster faults at once: a planned one waits for the one under way (it is
        // planned again next), and another kind goes now.
        if kind.is_cluster() && replica.busy() && i < plan.len() {
            plan.insert(i + 1, kind);
        }
        i += 1;
        while kind.is_cluster() && replica.busy() {
            kind = *all.choose(&mut rng).unwrap();
        }
        let at = started.elapsed().as_secs_f64();
        // Three proxy faults in four hit the endpoint that carried the most requests since the
        // last fault (the host the sink is writing to), the others a random one.
        let nodes = class.nodes();
        let random = nodes[rng.gen_range(0..nodes.len())];
        let endpoint = if rng.gen_bool(0.75) {
            proxies.busiest(&mut last_requests).unwrap_or(random)
        } else {
            proxies.busiest(&mut last_requests);
            random
        };
        let proxy = proxies.get(endpoint.name);
        let detail = match kind {
            Kind::Refuse | Kind::CutRequest | Kind::Latency | Kind::Stall => {
                let (fault, hold) = match kind {
                    Kind::Refuse => (Fault::Refuse, rng.gen_range(300..1_500)),
                    Kind::CutRequest => (
                        Fault::CutRequestAfter(rng.gen_range(1..12_000)),
                        rng.gen_range(300..1_500),
                    ),
                    Kind::Latency => (
                        Fault::Latency(Duration::from_millis(rng.gen_range(50..=300))),
                        rng.gen_range(500..2_000),
                    ),
                    // Held past the 2 s write_timeout.
                    _ => (Fault::Stall, rng.gen_range(2_300..3_500)),
                };
                let text = format!("{fault:?} on {} for {hold} ms", endpoint.name);
                proxy.set(fault);
                std::thread::sleep(Duration::from_millis(hold));
                proxy.set(Fault::Pass);
                text
            }
            Kind::LostAck => {
                let hold = rng.gen_range(500..2_000);
                let cuts = proxy.stats().cuts;
                proxy.set_once_on_insert(Fault::CutResponse);
                std::thread::sleep(Duration::from_millis(hold));
                let hit = proxy.stats().cuts > cuts;
                proxy.set(Fault::Pass);
                format!(
                    "CutResponse once on {} ({} within {hold} ms)",
                    endpoint.name,
                    if hit {
                        "a response was cut"
                    } else {
                        "not consumed"
                    }
                )
            }
            Kind::WorkerKill => {
                let down = rng.gen_range(100..800);
                worker.kill_9().unwrap();
                std::thread::sleep(Duration::from_millis(down));
                worker = spawn(&mut runs);
                format!("restarted after {down} ms (run #{runs})")
            }
            Kind::ReplicaRestart => {
                let node = *class.stoppable.choose(&mut rng).unwrap();
                let hold = Duration::from_millis(rng.gen_range(2_000..6_000));
                replica.start(node, hold, started, Arc::clone(&notes));
                format!(
                    "stop {} (in the background), start again {:.1}s after it is down",
                    node.name,
                    hold.as_secs_f64()
                )
            }
            Kind::ZooKeeperRestart => {
                let hold = rng.gen_range(2_000..5_000);
                cluster_sh(&["stop", "zk"]).unwrap();
                std::thread::sleep(Duration::from_millis(hold));
                cluster_sh(&["start", "zk"]).unwrap();
                format!("ZooKeeper down for {hold} ms")
            }
        };
        applied_total += 1;
        *applied.entry(kind).or_default() += 1;
        println!(
            "{tag} fault #{applied_total} at {at:.1}s: {}: {detail}",
            kind.label()
        );
    }
    let schedule_took = started.elapsed();
    assert!(
        !finished_early && applied_total >= schedule.required(),
        "{tag}: the worker finished after only {applied_total} faults; the schedule needs a slower rate"
    );

    // --- the end: no fault, every node up, the last run to completion -----------------------
    proxies.all_pass();
    replica.join();
    cluster_sh(&["up"]).unwrap();
    let quiet_from = match class.promise {
        Promise::AtMostOnce => {
            let from = quiet_positions(&tag, class, &mut worker, &state);
            // The rest without a rate limit: the data is a function of the offsets alone.
            std::fs::write(&spec, class.spec(&name, schedule, 0, &proxies)).unwrap();
            Some(from)
        }
        Promise::ExactlyOnce | Promise::AtLeastOnce => None,
    };
    if !worker.running() {
        worker = spawn(&mut runs);
    }
    let code = worker
        .wait_exit(schedule.finish_timeout)
        .unwrap_or_else(|err| panic!("{tag}: the last run: {err:#}"));
    assert_eq!(
        code,
        Some(0),
        "{tag}: the last run failed\n{}",
        worker.log_tail()
    );
    let status = pipeline_status(worker_bin!(), &state, class.pipeline)
        .unwrap()
        .expect("status failed: not a flow state directory");
    let (committed, undelivered) = (status.positions.clone(), status.batches());
    assert_eq!(
        committed,
        vec![per_partition; PARTITIONS as usize],
        "{tag}: committed positions after the last run"
    );
    if class.promise == Promise::ExactlyOnce {
        assert_eq!(
            undelivered, 0,
            "{tag}: undelivered batches after a clean exit"
        );
    }
    let run_took = started.elapsed();

    // --- the end state on every replica --------------------------------------------------------
    cluster_sh(&["up"]).unwrap();
    for node in class.nodes() {
        sync_when_writable(node, "default", &name, Duration::from_secs(90)).unwrap();
    }
    let verify_spec = dir.path().join("verify.yaml");
    std::fs::write(&verify_spec, class.verify_spec(&name)).unwrap();
    let orphans = repair_orphans(worker_bin!(), &verify_spec, &qualified, &class.nodes())
        .unwrap_or_else(|err| panic!("{tag}: {err:#}"));
    let mut report = String::new();
    let orphan_rows: u64 = orphans.iter().map(|(_, _, rows)| rows).sum();
    let _ = writeln!(
        report,
        "verify: {} orphan part(s), {orphan_rows} orphan rows, repaired by re-attaching: {orphans:?}",
        orphans.len()
    );
    let mut seen = vec![0u32; total as usize];
    let mut duplicates = 0u64;
    let mut rows = 0u64;
    for (shard, nodes) in &class.shards {
        let per_replica: Vec<(&str, u64, u64)> = nodes
            .iter()
            .map(|n| {
                let (count, unique) = count_uniq(*n, &qualified).unwrap();
                (n.name, count, unique)
            })
            .collect();
        let _ = writeln!(
            report,
            "shard `{shard}`: (replica, count, uniqExact(id)) {per_replica:?}"
        );
        assert!(
            per_replica
                .windows(2)
                .all(|w| (w[0].1, w[0].2) == (w[1].1, w[1].2)),
            "{tag}: the replicas of shard `{shard}` differ: {per_replica:?}"
        );
        let (_, count, unique) = per_replica[0];
        rows += count;
        duplicates += count - unique;
        if class.promise != Promise::AtLeastOnce {
            assert_eq!(
                count, unique,
                "{tag}: shard `{shard}` has {count} rows but {unique} distinct ids: duplicates"
            );
        }
        let ids = query_u64s(
            nodes[0].http_port,
            &format!("SELECT DISTINCT id FROM {qualified} FORMAT TSV"),
        )
        .unwrap();
        for id in ids {
            assert!(id < total, "{tag}: unexpected id {id} on shard `{shard}`");
            seen[id as usize] += 1;
            assert!(
                seen[id as usize] == 1,
                "{tag}: id {id} is on shard `{shard}` and on another shard"
            );
        }
    }
    let distinct = seen.iter().filter(|&&s| s > 0).count() as u64;
    let losses = total - distinct;
    match class.promise {
        Promise::ExactlyOnce | Promise::AtLeastOnce => {
            let missing: Vec<usize> = (0..seen.len()).filter(|&i| seen[i] == 0).take(10).collect();
            assert!(
                missing.is_empty(),
                "{tag}: {losses} ids missing, e.g. {missing:?}"
            );
        }
        Promise::AtMostOnce => {
            // The lower bound: no fault touched the rows read from the quiet positions on, so
            // every one of them lands (the losses are all among the rows read before).
            let from = quiet_from.as_deref().unwrap_or_default();
            let quiet = |(p, &from): (usize, &u64)| {
                (from..per_partition).map(move |offset| offset * PARTITIONS + p as u64)
            };
            let tail: Vec<u64> = from.iter().enumerate().flat_map(quiet).collect();
            let lost: Vec<u64> = tail
                .iter()
                .copied()
                .filter(|&id| seen[id as usize] == 0)
                .collect();
            assert!(
                !tail.is_empty(),
                "{tag}: the schedule left no message to read after the faults (positions {from:?})"
            );
            assert!(
                lost.is_empty(),
                "{tag}: {} of the {} rows read after every fault was over (from positions \
                 {from:?}) are missing, e.g. ids {:?}",
                lost.len(),
                tail.len(),
                &lost[..lost.len().min(10)]
            );
            let _ = writeln!(
                report,
                "after the faults: all {} rows read from positions {from:?} landed; {losses} \
                 losses among the {} rows read during the schedule",
                tail.len(),
                total - tail.len() as u64
            );
        }
    }
    if class.promise == Promise::ExactlyOnce {
        assert_eq!(duplicates, 0, "{tag}: duplicates");
        assert_eq!(rows, total, "{tag}: rows over all shards");
    }
    if class.keyed {
        // The key encoding is checked against `routing_key` in tests/exactly_once_faults.rs.
        check_routing(&class.shards, &qualified, 1000)
            .unwrap_or_else(|err| panic!("{tag}: {err:#}"));
        let _ = writeln!(report, "every user_id is on the shard it routes to");
    }

    // --- summary ---------------------------------------------------------------------------------
    println!("{tag} summary");
    println!(
        "  seed {seed} (FLOW_FAULT_SEED={seed}), {} schedule, {total} messages",
        schedule.name
    );
    println!(
        "  {applied_total} faults in {:.1}s, {runs} worker runs; finished at {:.1}s; elapsed with checks {:.1}s",
        schedule_took.as_secs_f64(),
        run_took.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let by_kind: Vec<String> = applied
        .iter()
        .map(|(k, n)| format!("{}: {n}", k.label()))
        .collect();
    println!("  faults by kind: {}", by_kind.join(", "));
    println!("  proxies: {}", proxies.stats());
    for note in notes.lock().unwrap().iter() {
        println!("  {note}");
    }
    print!(
        "{}",
        report
            .lines()
            .map(|l| format!("  {l}\n"))
            .collect::<String>()
    );
    match class.promise {
        Promise::ExactlyOnce => println!("  all {total} ids exactly once: {rows} rows, 0 duplicates, 0 losses"),
        Promise::AtLeastOnce => println!(
            "  every id at least once: {rows} rows, {distinct} distinct, duplicates {duplicates} (count() - uniqExact(id))"
        ),
        Promise::AtMostOnce => println!(
            "  no id twice: {rows} rows, {distinct} distinct, losses {losses} ({total} - uniqExact(id))"
        ),
    }
    assert!(
        applied_total >= schedule.required(),
        "{tag}: only {applied_total} faults applied"
    );
    for kind in &schedule.first {
        let wanted = schedule.first.iter().filter(|k| *k == kind).count();
        assert!(
            applied.get(kind).copied().unwrap_or(0) >= wanted,
            "{tag}: the schedule wants {wanted} x {} and applied {applied:?}",
            kind.label()
        );
    }
}

#[test]
fn fault_suite_batching_sink_exactly_once() {
    run_class(&batching(), &Schedule::from_env());
}

#[test]
fn fault_suite_sharded_batching_sink_exactly_once() {
    run_class(
        &sharded_batching(),
        &Schedule::from_env().with_zookeeper_outages(3),
    );
}

#[test]
fn fault_suite_at_least_once_sink() {
    run_class(&at_least_once(), &Schedule::from_env());
}

#[test]
fn fault_suite_at_most_once_sink() {
    run_class(&at_most_once(), &Schedule::from_env());
}

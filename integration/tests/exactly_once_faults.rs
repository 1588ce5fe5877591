//! Exactly-once under faults, against the local cluster (`scripts/cluster.sh up`).
//!
//! Each test runs the worker binary on a generator (4 partitions x 75,000 messages, rate-limited so
//! that an undisturbed run takes ~30 s) into a fresh ReplicatedMergeTree table, `kill -9`s it at
//! seeded random moments and restarts it on the same state directory, and in the middle takes one
//! replica down:
//!
//! 1. while a worker is running, a replica of shard `a` goes down, and the running worker must keep
//!    landing rows on shard `a`:
//!    * unsharded test: `cluster.sh kill a1` (SIGKILL), a1 being the host the sink tries first: a
//!      crash with inserts in flight, so the sink must fail over to a2 (and a1 comes back
//!      read-only until its old ZooKeeper session expires);
//!    * sharded test: `cluster.sh stop a2` (graceful). Not a1: ClickHouse 18.16 keeps serving
//!      queries on open keep-alive connections after SIGTERM, so a graceful stop of the replica a
//!      busy sink writes to lasts as long as the sink keeps writing (20 s and more here, until
//!      cluster.sh's KILL after 30 s), which would eat the whole run;
//! 2. the worker is then `kill -9`ed and restarted *while the replica is still down*: the writer
//!    session starts on the shard's other host, leaving the down one out of failover, so the new
//!    worker must write (rows land, it says which host it left out) rather than wait or fail;
//! 3. the replica is started again (`cluster.sh start`): the same worker process admits it on its
//!    own once it answers with the same table. More kills follow, then a last run that must exit
//!    0.
//!
//! The end state is then checked on every replica after `SYSTEM SYNC REPLICA`: no duplicate, every
//! id once, identical replicas and (sharded) every row on the shard its key routes to.
//!
//! `FLOW_FAULT_SEED=<u64>` replays a run's kill schedule (the seed is printed). The tests stop
//! replicas, so they are serialised by a mutex, and a guard runs `cluster.sh up` whatever happens.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use flow_clickhouse::testing::routing_key;
use flow_core::sources::generator;
use flow_core::{MessageBatch, MessageId, Value};
use flow_integration::generation::*;
use flow_integration::worker::*;
use flow_integration::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const PARTITIONS: u64 = 4;
const PER_PARTITION: u64 = 75_000;
const TOTAL: u64 = PARTITIONS * PER_PARTITION;
/// Per partition: 4 x 2,500 = 10,000 messages a second, so ~30 s undisturbed.
const RATE_PER_PARTITION: u64 = 2_500;
const KILLS: usize = 6;

/// The tests stop replicas: never two at once.
static SERIAL: Mutex<()> = Mutex::new(());

/// Panics (with the log's tail) if the worker has exited.
fn assert_alive(worker: &mut Worker, what: &str) {
    let status = worker.exited().unwrap();
    assert!(
        status.is_none(),
        "{what}: the worker exited ({status:?}) but should be running\n{}",
        worker.log_tail()
    );
}

/// `kill -9`; panics if the worker had already exited.
fn kill_9(worker: &mut Worker) {
    if let Some(status) = worker.kill_9().unwrap() {
        panic!(
            "the worker had already exited ({status}) when it was to be killed\n{}",
            worker.log_tail()
        );
    }
}

/// How the replica goes down.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// `cluster.sh kill NODE`: SIGKILL, a crash with inserts in flight.
    Kill,
    /// `cluster.sh stop NODE`: graceful shutdown.
    Stop,
}

impl Fault {
    fn verb(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Stop => "stop",
        }
    }
}

struct Scenario {
    generation: Generation,
    pipeline: &'static str,
    /// The shards as the checks see them: (name, replicas). One entry for the unsharded sink.
    shards: Vec<(&'static str, Vec<Node>)>,
    /// The replica taken down, and how.
    faulty: Node,
    fault: Fault,
    /// `sink_class_name` and the host parameters of the sink.
    sink_class: &'static str,
    host_parameters: String,
}

impl Scenario {
    fn nodes(&self) -> Vec<Node> {
        self.shards
            .iter()
            .flat_map(|(_, nodes)| nodes.iter().copied())
            .collect()
    }

    fn spec(&self, table: &str) -> String {
        GeneratorSpec::new(
            self.pipeline,
            self.sink_class,
            format!(
                "{{{}, database: default, table: {table}}}",
                self.host_parameters
            ),
        )
        .partitions(PARTITIONS)
        .epoch(5000, 1000)
        .count(PER_PARTITION)
        .rate(RATE_PER_PARTITION)
        .payload_bytes(16)
        .sink_name("events")
        .dynamic("{max_rows_per_batch: 2000, retry_backoff: 250ms, max_retry_backoff: 2s}")
        .yaml()
    }
}

/// Rows landed so far on one shard: the largest count over its reachable replicas (a lagging
/// replica only undercounts; a stopped one is skipped).
fn shard_rows(nodes: &[Node], table: &str) -> u64 {
    nodes
        .iter()
        .filter_map(|n| {
            query_u64(n.http_port, &format!("SELECT count() FROM default.{table}")).ok()
        })
        .max()
        .unwrap_or(0)
}

/// Polls the rows of the last shard (never the faulty one in the sharded scenario; any reachable
/// replica in the unsharded one) every few milliseconds until they change: a delivery has just
/// begun. False after 1.5 s without one.
fn wait_for_delivery(scenario: &Scenario, table: &str) -> bool {
    let (_, nodes) = scenario.shards.last().unwrap();
    let baseline = shard_rows(nodes, table);
    let deadline = Instant::now() + Duration::from_millis(1_500);
    while Instant::now() < deadline {
        if shard_rows(nodes, table) != baseline {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

fn rows_landed(scenario: &Scenario, table: &str) -> u64 {
    scenario
        .shards
        .iter()
        .map(|(_, nodes)| shard_rows(nodes, table))
        .sum()
}

/// `flow-worker-it status --json` (the worker must not be running); empty if nothing was
/// committed yet (a kill before the first epoch).
fn status(state: &Path, pipeline: &str) -> PipelineStatus {
    pipeline_status(worker_bin!(), state, pipeline)
        .unwrap()
        .unwrap_or_default()
}

fn seed() -> u64 {
    fault_seed(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(20_261_130),
    )
}

/// One line of the summary.
struct KillRecord {
    at: Duration,
    note: &'static str,
    /// Rows visible on the most advanced replica of each shard (a lower bound of what landed).
    visible: u64,
    undelivered_batches: u64,
    undelivered_rows: u64,
    committed: u64,
}

fn run_scenario(scenario: &Scenario) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    scenario.generation.require().unwrap();

    let seed = seed();
    println!(
        "[{}] seed {seed} (replay with FLOW_FAULT_SEED={seed})",
        scenario.pipeline
    );
    let mut rng = StdRng::seed_from_u64(seed);

    let name = unique_name(&format!("eo_{}", scenario.pipeline));
    let table = scenario
        .generation
        .create_table_on("default", &name, GENERATOR_COLUMNS, "id", &scenario.nodes())
        .unwrap();
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    std::fs::write(&spec, scenario.spec(&name)).unwrap();
    let state = dir.path().join("state");
    // Declared after the table: dropped first, so the cluster is whole again when the table is
    // dropped on every node.
    let _restore = ClusterGuard;

    // The replica goes down during the run after kill number `fault_run` (1 or 2), so that kills
    // follow it as well. Not later: the generator's rate limit counts from the start of a run, so
    // the worker that waited for the replica catches up in a burst afterwards.
    let fault_run = rng.gen_range(1..=2usize);
    let started = Instant::now();
    let mut kills: Vec<KillRecord> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let mut runs = 0usize;
    let spawn = |runs: &mut usize| {
        *runs += 1;
        Worker::spawn(
            worker_bin!(),
            &spec,
            &state,
            dir.path().join(format!("worker-{}.log", *runs)),
        )
        .unwrap()
    };
    let record_kill = |worker: &mut Worker, note: &'static str, kills: &mut Vec<KillRecord>| {
        kill_9(worker);
        let at = started.elapsed();
        // Let inserts already on the wire settle before counting.
        std::thread::sleep(Duration::from_millis(300));
        let rows = rows_landed(scenario, &name);
        let st = status(&state, scenario.pipeline);
        let record = KillRecord {
            at,
            note,
            visible: rows,
            undelivered_batches: st.batches(),
            undelivered_rows: st.rows(),
            committed: st.positions.iter().sum(),
        };
        println!(
            "[{}] kill -9 #{} at {:.1}s{}: {} committed, {} undelivered batch(es) ({} rows) {:?}, {} visible",
            scenario.pipeline,
            kills.len() + 1,
            at.as_secs_f64(),
            if note.is_empty() { String::new() } else { format!(" ({note})") },
            record.committed,
            record.undelivered_batches,
            record.undelivered_rows,
            st.undelivered,
            record.visible,
        );
        kills.push(record);
    };

    while kills.len() < KILLS {
        let rows_before_spawn = rows_landed(scenario, &name);
        let mut worker = spawn(&mut runs);
        if kills.len() == fault_run && !scenario.generation.replicates() {
            node_restart(
                scenario,
                &name,
                &mut worker,
                rows_before_spawn,
                &mut rng,
                &mut notes,
            );
            std::thread::sleep(Duration::from_millis(rng.gen_range(100..800)));
            assert_alive(&mut worker, "after the node came back");
            record_kill(&mut worker, "after node restart", &mut kills);
        } else if kills.len() == fault_run {
            // --- the replica fault -------------------------------------------------------------
            // This case is about a worker that is already writing: wait until the new worker's
            // session has started and rows land, or the fault would test the start-up wait
            // (which the restart below covers) instead of failover.
            wait_until(Duration::from_secs(30), || {
                Ok(rows_landed(scenario, &name) > rows_before_spawn)
            })
            .unwrap_or_else(|err| {
                panic!(
                    "the restarted worker wrote nothing ({err:#})\n{}",
                    worker.log_tail()
                )
            });
            std::thread::sleep(Duration::from_millis(rng.gen_range(500..2_000)));
            assert_alive(&mut worker, "before the replica fault");
            let faulty = scenario.faulty;
            let (shard, replicas) = scenario
                .shards
                .iter()
                .find(|(_, nodes)| nodes.contains(&faulty))
                .unwrap();
            let fault_started = Instant::now();
            cluster_sh(&[scenario.fault.verb(), faulty.name]).unwrap();
            let down_at = Instant::now();
            let before = shard_rows(replicas, &name);
            notes.push(format!(
                "{} {} at {:.1}s (took {:.1}s) with {before} rows on its shard",
                scenario.fault.verb(),
                faulty.name,
                started.elapsed().as_secs_f64(),
                (down_at - fault_started).as_secs_f64()
            ));
            // 1. The running worker keeps writing to the shard (failing over if the replica was
            // the one it wrote to).
            wait_until(Duration::from_secs(30), || {
                Ok(shard_rows(replicas, &name) > before)
            })
            .unwrap_or_else(|err| {
                panic!(
                    "no row landed on shard `{shard}` within 30 s of {} {} ({err:#})\n{}",
                    scenario.fault.verb(),
                    faulty.name,
                    worker.log_tail()
                )
            });
            notes.push(format!(
                "the running worker kept writing: shard `{shard}` grew {before} -> {} within {:.1}s",
                shard_rows(replicas, &name),
                down_at.elapsed().as_secs_f64()
            ));
            std::thread::sleep(Duration::from_millis(rng.gen_range(500..2_000)));
            assert_alive(&mut worker, "with a replica down");
            record_kill(&mut worker, "replica down", &mut kills);

            // 2. A worker started while a listed replica is down writes to the shard's other
            // host and says which one it left out.
            let mut worker = spawn(&mut runs);
            let started_with = rows_landed(scenario, &name);
            wait_until(Duration::from_secs(30), || {
                Ok(rows_landed(scenario, &name) > started_with)
            })
            .unwrap_or_else(|err| {
                panic!(
                    "a worker started while {} is down wrote nothing within 30 s ({err:#})\n{}",
                    faulty.name,
                    worker.log_tail()
                )
            });
            assert_alive(&mut worker, "restarted with a replica down");
            let still = rows_landed(scenario, &name);
            let left_out = std::fs::read_to_string(worker.log())
                .unwrap_or_default()
                .contains("a host did not answer at the session start");
            assert!(
                left_out,
                "the worker started with {} down did not say it left it out\n{}",
                faulty.name,
                worker.log_tail()
            );
            notes.push(format!(
                "restarted with {} down: wrote on ({started_with} -> {still} rows), the host left out of failover",
                faulty.name
            ));

            // 3. The replica comes back; the same worker process resumes on its own.
            cluster_sh(&["start", faulty.name]).unwrap();
            let back = Instant::now();
            notes.push(format!(
                "start {} after {:.1}s down",
                faulty.name,
                down_at.elapsed().as_secs_f64()
            ));
            wait_until(Duration::from_secs(60), || {
                Ok(std::fs::read_to_string(worker.log())
                    .unwrap_or_default()
                    .contains("it takes inserts again"))
            })
            .unwrap_or_else(|err| {
                panic!(
                    "the worker did not admit {} within 60 s of it coming back ({err:#})\n{}",
                    faulty.name,
                    worker.log_tail()
                )
            });
            notes.push(format!(
                "the worker admitted {} {:.1}s after it came back",
                faulty.name,
                back.elapsed().as_secs_f64()
            ));
            std::thread::sleep(Duration::from_millis(rng.gen_range(100..800)));
            assert_alive(&mut worker, "after the replica came back");
            record_kill(&mut worker, "after replica restart", &mut kills);
        } else {
            std::thread::sleep(Duration::from_millis(rng.gen_range(300..2_000)));
            // Two kills in three aim at the window between commit and acknowledgement: right after
            // rows of a new epoch appear, the rest of its batches are usually still in flight.
            let note = if rng.gen_bool(2.0 / 3.0) {
                if wait_for_delivery(scenario, &name) {
                    "just after a delivery"
                } else {
                    "no delivery seen within 1.5 s"
                }
            } else {
                ""
            };
            assert_alive(&mut worker, "before a kill");
            record_kill(&mut worker, note, &mut kills);
        }
    }
    let last_committed = kills.last().map_or(0, |k| k.committed);
    assert!(
        last_committed < TOTAL,
        "every message was committed before the last kill; the kills came too late"
    );

    // --- the last run, to completion ---------------------------------------------------------------
    let last_started = Instant::now();
    let before_last = status(&state, scenario.pipeline);
    let mut worker = spawn(&mut runs);
    let code = worker
        .wait_exit(Duration::from_secs(150))
        .unwrap_or_else(|err| panic!("the last run: {err:#}"));
    assert_eq!(code, Some(0), "the last run failed\n{}", worker.log_tail());
    let last_run = last_started.elapsed();
    let end = status(&state, scenario.pipeline);
    assert_eq!(
        end.batches(),
        0,
        "undelivered batches after a clean exit: {:?}",
        end.undelivered
    );
    assert_eq!(end.positions, vec![PER_PARTITION; PARTITIONS as usize]);

    // --- the end state on every replica ------------------------------------------------------------
    cluster_sh(&["up"]).unwrap();
    let qualified = table.qualified();
    // A replica restarted after a crash may stay read-only until its old ZooKeeper session
    // expires; SYNC REPLICA (where the generation replicates) waits for it to be active.
    scenario
        .generation
        .sync("default", &name, &scenario.nodes())
        .unwrap();
    let mut report = String::new();
    let mut seen = vec![false; TOTAL as usize];
    let mut total = 0u64;
    for (shard, nodes) in &scenario.shards {
        let mut per_replica = Vec::new();
        for node in nodes {
            let (count, unique, sum) = count_uniq_sum(*node, &qualified).unwrap();
            assert_eq!(
                count,
                unique,
                "shard `{shard}` replica {}: {count} rows but {unique} distinct ids: duplicates\n{}",
                node.name,
                duplicates_report(&qualified, nodes)
            );
            per_replica.push((node.name, count, sum));
        }
        let _ = writeln!(
            report,
            "shard `{shard}`: (replica, count, sum(id)) {per_replica:?}"
        );
        assert!(
            per_replica
                .windows(2)
                .all(|w| (w[0].1, w[0].2) == (w[1].1, w[1].2)),
            "the replicas of shard `{shard}` differ: {per_replica:?}"
        );
        let ids = query_u64s(
            nodes[0].http_port,
            &format!("SELECT id FROM {qualified} FORMAT TSV"),
        )
        .unwrap();
        for id in ids {
            assert!(id < TOTAL, "unexpected id {id} on shard `{shard}`");
            assert!(
                !std::mem::replace(&mut seen[id as usize], true),
                "id {id} is on shard `{shard}` and on another shard (or twice)"
            );
            total += 1;
        }
    }
    assert_eq!(total, TOTAL, "rows over all shards");
    let missing: Vec<usize> = (0..seen.len()).filter(|&i| !seen[i]).take(10).collect();
    assert!(missing.is_empty(), "ids missing, e.g. {missing:?}");

    if scenario.shards.len() > 1 {
        check_user_routing(scenario, &qualified);
        let _ = writeln!(report, "every user_id is on the shard it routes to");
    }

    println!("[{}] summary", scenario.pipeline);
    println!("  seed {seed} (FLOW_FAULT_SEED={seed})");
    println!(
        "  {} kills, {} runs, total {:.1}s (last run {:.1}s, starting with {} undelivered batch(es), {} rows committed)",
        kills.len(),
        runs,
        started.elapsed().as_secs_f64(),
        last_run.as_secs_f64(),
        before_last.batches(),
        before_last.positions.iter().sum::<u64>()
    );
    for (i, k) in kills.iter().enumerate() {
        println!(
            "  kill #{} at {:>5.1}s: {:>6} committed, {:>6} acknowledged, {} undelivered batch(es) / {:>4} rows, {:>6} visible{}",
            i + 1,
            k.at.as_secs_f64(),
            k.committed,
            k.committed - k.undelivered_rows,
            k.undelivered_batches,
            k.undelivered_rows,
            k.visible,
            if k.note.is_empty() { String::new() } else { format!("  [{}]", k.note) }
        );
    }
    for note in &notes {
        println!("  {note}");
    }
    print!(
        "{}",
        report
            .lines()
            .map(|l| format!("  {l}\n"))
            .collect::<String>()
    );
    println!("  all {TOTAL} ids exactly once");
    let with_backlog = kills.iter().filter(|k| k.undelivered_batches > 0).count();
    println!(
        "  kills that left undelivered batches: {with_backlog} of {}",
        kills.len()
    );
}

/// What a retried INSERT logs: the sink goes on to the shard's next host, which on a one-host
/// shard is the same host again.
const RETRYING: &str = "insert failed; retrying on the next host of the shard";
/// What an INSERT given up logs: the sink would then fail every later write until a restart.
const GAVE_UP: &str = "Giving up insert into ClickHouse";

/// The worker log written since `offset` bytes.
fn log_since(worker: &Worker, offset: usize) -> String {
    let log = std::fs::read_to_string(worker.log()).unwrap_or_default();
    log.get(offset..).unwrap_or_default().to_owned()
}

/// The node fault of a generation whose shards are one node each (no replica to fail over to):
/// the shard's only node crashes (`cluster.sh kill`) while the worker writes, stays down a
/// little and starts again. The running worker must retry against it (logging each failed
/// INSERT with that node's endpoint) without giving up, and land rows on the shard again once
/// it is back.
fn node_restart(
    scenario: &Scenario,
    table: &str,
    worker: &mut Worker,
    rows_before_spawn: u64,
    rng: &mut StdRng,
    notes: &mut Vec<String>,
) {
    let node = scenario.faulty;
    let (shard, nodes) = scenario
        .shards
        .iter()
        .find(|(_, nodes)| nodes.contains(&node))
        .unwrap();
    // As on 18.16: a worker that is already writing, not one starting.
    wait_until(Duration::from_secs(30), || {
        Ok(rows_landed(scenario, table) > rows_before_spawn)
    })
    .unwrap_or_else(|err| {
        panic!(
            "the restarted worker wrote nothing ({err:#})\n{}",
            worker.log_tail()
        )
    });
    std::thread::sleep(Duration::from_millis(rng.gen_range(500..2_000)));
    assert_alive(worker, "before the node fault");
    let offset = std::fs::read_to_string(worker.log())
        .unwrap_or_default()
        .len();
    let before = shard_rows(nodes, table);
    cluster_sh(&["kill", node.name]).unwrap();
    let down_at = Instant::now();
    let endpoint = format!("endpoint={}", node.http_addr());
    wait_until(Duration::from_secs(15), || {
        Ok(log_since(worker, offset)
            .lines()
            .any(|l| l.contains(RETRYING) && l.contains(&endpoint)))
    })
    .unwrap_or_else(|err| {
        panic!(
            "no INSERT to {} was retried within 15 s of its crash ({err:#})\n{}",
            node.name,
            worker.log_tail()
        )
    });
    std::thread::sleep(Duration::from_millis(rng.gen_range(1_000..3_000)));
    assert_alive(worker, "with the shard's only node down");
    cluster_sh(&["start", node.name]).unwrap();
    let back = Instant::now();
    let down_for = (back - down_at).as_secs_f64();
    let at_start = shard_rows(nodes, table);
    wait_until(Duration::from_secs(30), || {
        Ok(shard_rows(nodes, table) > at_start)
    })
    .unwrap_or_else(|err| {
        panic!(
            "no row landed on shard `{shard}` within 30 s of {} coming back ({err:#})\n{}",
            node.name,
            worker.log_tail()
        )
    });
    let during = log_since(worker, offset);
    let retries = during.lines().filter(|l| l.contains(RETRYING)).count();
    assert!(
        !during.contains(GAVE_UP),
        "the worker gave up an INSERT while {} was down\n{}",
        node.name,
        worker.log_tail()
    );
    notes.push(format!(
        "kill {} with {before} rows on shard `{shard}`, down {down_for:.1}s: {retries} INSERT(s) \
         retried, none given up; rows landed again {:.1}s after the start ({at_start} -> {})",
        node.name,
        back.elapsed().as_secs_f64(),
        shard_rows(nodes, table)
    ));
}

/// Each user_id lands on the shard the rendezvous router picks for its routing key (tag 2 + u64 LE).
fn check_user_routing(scenario: &Scenario, qualified: &str) {
    // The key encoding, checked once against `routing_key` on a real generator row.
    let mut batch = MessageBatch::new(generator::schema());
    let (id, user_id, ts) = generator::row_values(3, 12_345, PARTITIONS as u32);
    let mut row = batch.start_row(MessageId::new(3, 12_345));
    row.push(Value::Uint(id))
        .and_then(|r| r.push(Value::Uint(3)))
        .and_then(|r| r.push(Value::Uint(12_345)))
        .and_then(|r| r.push(Value::Uint(user_id)))
        .and_then(|r| r.push(Value::Uint(ts)))
        .and_then(|r| r.push(Value::Bytes(b"payload")))
        .unwrap();
    row.finish().unwrap();
    let user_column = generator::schema().index_of("user_id").unwrap();
    let mut key = Vec::new();
    routing_key(&batch.row(0), &[user_column], &mut key);
    assert_eq!(key, user_routing_key(user_id));

    let held =
        check_routing(&scenario.shards, qualified, 1000).unwrap_or_else(|err| panic!("{err:#}"));
    for (shard, users) in held {
        println!("  shard `{shard}` holds {users} of the 1000 user_ids, as routed");
    }
}

fn sharded_exactly_once_survives_kill_9_and_a_replica_restart(generation: Generation) {
    let (faulty, fault) = match generation {
        // A graceful stop of the second replica of shard `a` (see the module doc for why not a1).
        Generation::V18 => (A2, Fault::Stop),
        // A crash of shard `a`'s only node.
        Generation::V26 => (M1, Fault::Kill),
    };
    run_scenario(&Scenario {
        generation,
        pipeline: "eo_sharded",
        shards: generation.shards(),
        faulty,
        fault,
        sink_class: "ShardedClickHouseBatchingSink",
        host_parameters: format!(
            "{}, sharding_key_columns: [user_id]",
            generation.shard_hosts_param()
        ),
    });
}
each_generation!(sync sharded_exactly_once_survives_kill_9_and_a_replica_restart);

fn unsharded_exactly_once_survives_kill_9_and_a_replica_restart(generation: Generation) {
    run_scenario(&Scenario {
        generation,
        pipeline: "eo_unsharded",
        shards: vec![("a", generation.shard_a().to_vec())],
        // A crash of the first listed host: on 18.16 the sink must fail over to a2 with inserts
        // in flight; on 26.9 it is the shard's only node, retried until it is back.
        faulty: generation.first(),
        fault: Fault::Kill,
        sink_class: "ClickHouseBatchingSink",
        host_parameters: generation.hosts_param(),
    });
}
each_generation!(sync unsharded_exactly_once_survives_kill_9_and_a_replica_restart);

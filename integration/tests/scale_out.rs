//! Scale-out (issue 27): one JetStream pipeline of 8 partitions on up to 4 workers joined through
//! ZooKeeper (`flow-worker run --cluster`), into the sharded exactly-once sink, under a seeded
//! schedule of faults: `kill -9` of a worker (restarted on its state directory), a worker added,
//! a worker removed (SIGTERM), a ZooKeeper restart, and a zombie: a worker whose INSERT is held
//! back by its proxy is frozen (SIGSTOP) past its session timeout, its partitions are taken over
//! and replayed by the others, then the held INSERT is let go and the worker thawed (SIGCONT). The
//! zombie must log that it lost its partitions (fenced), and every message must be exactly once
//! on the shard it routes to, on both replicas, with `verify` clean.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use async_nats::jetstream;
use flow_integration::nats::{new_stream, publish_id_rows};
use flow_integration::proxy::{Fault, FaultProxy};
use flow_integration::worker::*;
use flow_integration::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const PARTITIONS: u64 = 8;
const MESSAGES: u64 = 40_000;
const USERS: u64 = 1_000;
/// Worker slots: each has its own state directory, proxies and spec.
const SLOTS: usize = 4;
const FAULTS: usize = 30;
/// The session timeout the workers ask for: the shortest this ZooKeeper grants (2 ticks).
const SESSION_TIMEOUT_MS: u64 = 4_000;
const COLUMNS: &str = "id UInt64, user_id UInt64, payload String";
/// The blocks each shard remembers for deduplication. The zombie's INSERT is held for 9 s while
/// the other workers insert about 100 blocks into each shard (at ~300 ms epochs); the held copy
/// is dropped only if its block is still in the window when it arrives, so the server's default
/// of 100 is too small for this pipeline, as flow's start-up warning says (8 partitions x 14
/// epochs of one session timeout = 112 blocks). An operator sizes it the same way.
const DEDUP_WINDOW: u64 = 1_000;

/// Publishes every message, `MESSAGES / 40` at a time every 0.5 s: the stream grows while the
/// faults happen (about 20 s), then stays.
async fn publish(js: jetstream::Context, prefix: String) -> Result<()> {
    let chunk = MESSAGES / 40;
    for first in (0..MESSAGES).step_by(chunk as usize) {
        let ids = first..(first + chunk).min(MESSAGES);
        publish_id_rows(&js, &prefix, ids, PARTITIONS, USERS).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

/// The pipeline spec of a slot: `cluster_key` (the spec's `cluster` line, or nothing), shard
/// `a`'s and `b`'s hosts as YAML lists.
fn spec_yaml(stream: &str, table: &str, cluster_key: &str, a: &str, b: &str) -> String {
    format!(
        "pipeline: scale_it\npartitions: {PARTITIONS}\n{cluster_key}epoch: {{max_messages: 2000, max_duration_ms: 300}}\n\
         source:\n  class: nats_jetstream\n  parameters:\n    servers: ['nats://{}']\n    stream: {stream}\n    subject_template: '{stream}.p.{{partition}}'\n    format: json\n    schema: [{{name: id, type: uint64}}, {{name: user_id, type: uint64}}, {{name: payload, type: string}}]\n\
         sinks:\n  - name: out\n    sink_class_name: ShardedClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{shard_hosts: {{a: {a}, b: {b}}}, database: default, table: {table}, sharding_key_columns: [user_id]}}\n    dynamic_parameters: {{max_rows_per_batch: 1000, retry_backoff: 100ms, max_retry_backoff: 1s, write_timeout: 5s}}\n",
        nats::NATS_ADDR,
    )
}

/// A spec for `flow-worker verify` naming the nodes themselves (the slots' specs name their
/// proxies).
fn verify_spec(dir: &Path, stream: &str, table: &str) -> Result<PathBuf> {
    let hosts =
        |nodes: [Node; 2]| format!("['{}', '{}']", nodes[0].http_addr(), nodes[1].http_addr());
    let spec = dir.join("verify.yaml");
    std::fs::write(
        &spec,
        spec_yaml(stream, table, "", &hosts(SHARD_A), &hosts(SHARD_B)),
    )?;
    Ok(spec)
}

/// One worker slot: its state directory, its spec (whose hosts are its own proxies, so that one
/// worker's INSERTs can be held back), and the worker running in it, if any.
struct Slot {
    state: PathBuf,
    spec: PathBuf,
    proxies: Vec<FaultProxy>,
    worker: Option<Worker>,
    runs: u32,
}

struct Run {
    dir: PathBuf,
    cluster: String,
    slots: Vec<Slot>,
}

impl Run {
    async fn new(dir: &Path, stream: &str, table: &str) -> Result<Run> {
        let dir = dir.to_path_buf();
        let cluster = format!("zk://127.0.0.1:12181/flow-it/{}", unique_name("scale"));
        let mut slots = Vec::new();
        for slot in 0..SLOTS {
            let mut proxies = Vec::new();
            for node in NODES {
                proxies.push(FaultProxy::start(node.http_addr().parse()?).await?);
            }
            let hosts =
                |i: usize| format!("['{}', '{}']", proxies[i].addr(), proxies[i + 1].addr());
            // Odd slots join through the spec's `cluster` key, even ones through `--cluster`.
            let cluster_key = if slot % 2 == 1 {
                format!("cluster: {{url: '{cluster}', session_timeout_ms: {SESSION_TIMEOUT_MS}}}\n")
            } else {
                String::new()
            };
            let yaml = spec_yaml(stream, table, &cluster_key, &hosts(0), &hosts(2));
            let spec = dir.join(format!("spec{slot}.yaml"));
            std::fs::write(&spec, yaml)?;
            slots.push(Slot {
                state: dir.join(format!("state{slot}")),
                spec,
                proxies,
                worker: None,
                runs: 0,
            });
        }
        Ok(Run {
            dir,
            cluster,
            slots,
        })
    }

    fn start(&mut self, slot: usize) -> Result<()> {
        let s = &mut self.slots[slot];
        let log = self.dir.join(format!("w{slot}-{}.log", s.runs));
        s.runs += 1;
        let timeout = SESSION_TIMEOUT_MS.to_string();
        let flags = ["--cluster", &self.cluster, "--session-timeout-ms", &timeout];
        let extra: &[&str] = if slot % 2 == 1 { &[] } else { &flags };
        s.worker = Some(Worker::spawn_with(
            worker_bin!(),
            &s.spec,
            &s.state,
            extra,
            log,
        )?);
        Ok(())
    }

    /// `flow-worker status --cluster ... --json`: what ZooKeeper holds of the pipeline.
    fn status(&self) -> Result<serde_json::Value> {
        let out = run_worker(
            worker_bin!(),
            &[
                "status",
                "--cluster",
                &self.cluster,
                "--pipeline",
                "scale_it",
                "--json",
            ],
            &[],
            Duration::from_secs(30),
        )?;
        ensure!(
            out.code == Some(0),
            "status --cluster: {}{}",
            out.stdout,
            out.stderr
        );
        Ok(serde_json::from_str(&out.stdout)?)
    }

    /// Every partition is listed once with a committed position (and, if `held` says, with or
    /// without a lease holder); the rows still pending in ZooKeeper.
    fn check_partitions(&self, partitions: &serde_json::Value, held: Option<bool>) -> Result<u64> {
        let partitions = partitions.as_array().context("partitions")?;
        let listed: Vec<u64> = partitions
            .iter()
            .filter_map(|p| p["partition"].as_u64())
            .collect();
        ensure!(
            listed == (0..PARTITIONS).collect::<Vec<_>>(),
            "status --cluster lists partitions {listed:?}"
        );
        let mut pending_rows = 0;
        for p in partitions {
            ensure!(p["position"]["value"].is_string(), "no position: {p}");
            if let Some(held) = held {
                ensure!(p["lease_holder"].is_string() == held, "lease holder: {p}");
            }
            for batch in p["pending"].as_array().context("pending")? {
                pending_rows += batch["rows"].as_u64().context("rows")?;
            }
        }
        Ok(pending_rows)
    }

    fn running(&mut self) -> Result<Vec<usize>> {
        let mut running = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(worker) = &mut slot.worker {
                if let Some(code) = worker.exited()? {
                    bail!(
                        "worker {i} exited on its own ({code:?})\n{}",
                        worker.log_tail()
                    );
                }
                running.push(i);
            }
        }
        Ok(running)
    }

    fn logs(&self) -> String {
        let mut all = String::new();
        for slot in &self.slots {
            if let Some(worker) = &slot.worker {
                all.push_str(&worker.log_tail());
                all.push('\n');
            }
        }
        all
    }

    /// Holds the slot's INSERTs back until one is held, freezes the worker past its session
    /// timeout while the others take its partitions over and replay them, then lets the held
    /// INSERT go (ClickHouse drops it as a copy) and thaws the worker, which must find itself
    /// fenced, stop those partitions and join again. Returns the log lines it wrote about losing
    /// partitions; `None` when no INSERT of the worker came to be held (it owned nothing).
    fn zombie(&mut self, slot: usize, table: &str) -> Result<Option<Zombie>> {
        let s = &mut self.slots[slot];
        for proxy in &s.proxies {
            proxy.set_on_inserts(Fault::Hold);
        }
        let held = || s.proxies.iter().map(|p| p.stats().held).sum::<u64>();
        let before = held();
        let deadline = Instant::now() + Duration::from_secs(5);
        while held() == before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if held() == before {
            for proxy in &s.proxies {
                proxy.set(Fault::Pass);
            }
            return Ok(None);
        }
        let worker = s
            .worker
            .as_mut()
            .context("no worker in the zombie's slot")?;
        worker.signal("STOP")?;
        let at_hold = block_numbers(table)?;
        std::thread::sleep(Duration::from_millis(SESSION_TIMEOUT_MS + 5_000));
        let at_release = block_numbers(table)?;
        for proxy in &s.proxies {
            proxy.set(Fault::Pass);
        }
        std::thread::sleep(Duration::from_millis(500));
        worker.signal("CONT")?;
        // Thawed, it finds its commits refused, stops those partitions and joins again.
        let log = worker.log().to_path_buf();
        let fenced_lines = || -> Result<Vec<String>> {
            Ok(std::fs::read_to_string(&log)?
                .lines()
                .filter(|l| l.contains("fenced") || l.contains("lost ownership"))
                .map(str::to_owned)
                .collect())
        };
        wait_until(Duration::from_secs(30), || Ok(!fenced_lines()?.is_empty())).with_context(
            || {
                format!(
                    "the thawed zombie never said it was fenced\n{}",
                    worker.log_tail()
                )
            },
        )?;
        wait_until(Duration::from_secs(30), || {
            Ok(std::fs::read_to_string(&log)?.contains("joined the cluster again"))
        })
        .with_context(|| {
            format!(
                "the thawed zombie did not join again\n{}",
                worker.log_tail()
            )
        })?;
        let fenced = fenced_lines()?;
        let released: u64 = s.proxies.iter().map(|p| p.stats().released).sum();
        ensure!(released >= 1, "the held INSERT was never let go");
        let blocks_while_held = [0, 1].map(|i| at_release[i] - at_hold[i]);
        Ok(Some(Zombie {
            fenced,
            blocks_while_held,
        }))
    }
}

/// What a zombie left: its log lines about losing partitions, and how many blocks each shard was
/// given while its INSERT was held (the held copy is dropped only if its block is still among the
/// last `replicated_deduplication_window` blocks of the shard when it arrives).
struct Zombie {
    fenced: Vec<String>,
    blocks_while_held: [u64; 2],
}

/// The highest block number each shard (`a`, `b`) has allocated to the table: every INSERT takes
/// one, so a difference counts the INSERTs in between.
fn block_numbers(table: &str) -> Result<[u64; 2]> {
    let sql = format!(
        "SELECT max(max_block_number) FROM system.parts WHERE database = 'default' AND table = '{table}'"
    );
    Ok([
        query_u64(A1.http_port, &sql)?,
        query_u64(B1.http_port, &sql)?,
    ])
}

/// For a failure message: the rows stored more than once with their parts
/// ([`duplicates_report`]), and how many held or replayed blocks each shard's replicas logged as
/// dropped copies.
fn duplicates(qualified: &str) -> String {
    let mut report = duplicates_report(qualified, &[A1, B1]);
    for shard in ["a", "b"] {
        let dropped: usize = NODES
            .iter()
            .filter(|n| n.shard == shard)
            .map(|n| deduplicated_blocks_logged(*n, qualified))
            .sum();
        report.push_str(&format!(
            "shard {shard}: {dropped} copies dropped as duplicates\n"
        ));
    }
    report
}

#[test]
fn workers_joining_leaving_killed_and_frozen_hand_partitions_over_and_every_message_lands_once() {
    // A failure panics while the directory is alive, so that it is kept with the workers' logs.
    let dir = TestDir::new().unwrap_or_else(|err| panic!("{err:#}"));
    if let Err(err) = hand_over_under_faults(&dir) {
        panic!("{err:?}");
    }
}

fn hand_over_under_faults(dir: &TestDir) -> Result<()> {
    require_cluster()?;
    let rt = tokio::runtime::Runtime::new()?;
    let name = unique_name("scale_it");
    let js = rt.block_on(new_stream(&name))?;
    let order_by = format!("id SETTINGS replicated_deduplication_window = {DEDUP_WINDOW}");
    let table = ReplicatedTable::create("default", &name, COLUMNS, &order_by, &NODES)?;
    let mut run = rt.block_on(Run::new(dir.path(), &name, &name))?;
    let publisher = rt.spawn(publish(js.clone(), format!("{name}.p")));
    for slot in 0..3 {
        run.start(slot)?;
    }

    let seed = fault_seed(27);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut done = Vec::new();
    let mut fenced_lines = Vec::new();
    let mut blocks_while_held = None;
    while done.len() < FAULTS {
        std::thread::sleep(Duration::from_millis(rng.gen_range(300..900)));
        let running = run.running()?;
        let free: Vec<usize> = (0..SLOTS).filter(|s| !running.contains(s)).collect();
        let pick = |rng: &mut StdRng, from: &[usize]| from[rng.gen_range(0..from.len())];
        match rng.gen_range(0..10) {
            0..=3 if !running.is_empty() => {
                let slot = pick(&mut rng, &running);
                run.slots[slot]
                    .worker
                    .as_mut()
                    .context("worker")?
                    .kill_9()?;
                run.slots[slot].worker = None;
                run.start(slot)?;
                done.push(format!("kill -9 {slot}"));
            }
            4..=5 if !free.is_empty() => {
                let slot = pick(&mut rng, &free);
                run.start(slot)?;
                done.push(format!("add {slot}"));
            }
            6..=7 if running.len() > 1 => {
                let slot = pick(&mut rng, &running);
                let worker = run.slots[slot].worker.as_mut().context("worker")?;
                worker.signal("TERM")?;
                let code = worker.wait_exit(Duration::from_secs(30))?;
                ensure!(
                    code == Some(0),
                    "SIGTERM: worker {slot} exited {code:?}\n{}",
                    worker.log_tail()
                );
                run.slots[slot].worker = None;
                done.push(format!("remove {slot}"));
            }
            8 if fenced_lines.is_empty() && running.len() > 1 => {
                let slot = pick(&mut rng, &running);
                if let Some(zombie) = run.zombie(slot, &name)? {
                    ensure!(
                        !zombie.fenced.is_empty(),
                        "the zombie {slot} never said it was fenced"
                    );
                    fenced_lines.extend(zombie.fenced);
                    ensure!(
                        zombie.blocks_while_held.iter().all(|b| *b < DEDUP_WINDOW),
                        "the window of {DEDUP_WINDOW} blocks is too small for this schedule: \
                         {:?} blocks went into the shards while the zombie's INSERT was held",
                        zombie.blocks_while_held
                    );
                    blocks_while_held = Some(zombie.blocks_while_held);
                    run.start(slot)?;
                    done.push(format!("zombie {slot}"));
                }
            }
            9 if !done.iter().any(|d| d == "zookeeper restart") => {
                cluster_sh(&["stop", "zk"])?;
                std::thread::sleep(Duration::from_millis(500));
                cluster_sh(&["start", "zk"])?;
                done.push("zookeeper restart".to_owned());
            }
            _ => {}
        }
    }
    ensure!(
        !fenced_lines.is_empty(),
        "the schedule (seed {seed}) froze no zombie: {done:?}"
    );
    if run.running()?.is_empty() {
        run.start(0)?;
    }
    rt.block_on(publisher)??;

    let qualified = table.qualified();
    wait_until(Duration::from_secs(120), || {
        Ok(landed_on_both_shards(&qualified)?.1 == MESSAGES)
    })
    .with_context(|| format!("not every message landed after {done:?}\n{}", run.logs()))?;
    // A worker killed a moment ago stays a member until its session (4 s) expires.
    let live = run.running()?.len();
    wait_until(Duration::from_secs(15), || {
        Ok(run.status()?["members"].as_array().map(Vec::len) == Some(live))
    })
    .with_context(|| {
        format!(
            "status --cluster with {live} workers running: {}",
            run.status().map(|s| s.to_string()).unwrap_or_default()
        )
    })?;
    let status = run.status()?;
    let pending_rows = run.check_partitions(&status["partitions"], None)?;
    println!("status --cluster while running: {live} members, {pending_rows} row(s) pending");
    for slot in run.running()? {
        let worker = run.slots[slot].worker.as_mut().context("worker")?;
        worker.signal("TERM")?;
        let code = worker.wait_exit(Duration::from_secs(30))?;
        ensure!(
            code == Some(0),
            "final SIGTERM: worker {slot} exited {code:?}\n{}",
            worker.log_tail()
        );
    }
    let status = run.status()?;
    ensure!(
        status["members"].as_array().is_some_and(Vec::is_empty),
        "status --cluster after every worker stopped: {status}"
    );
    let pending_rows = run.check_partitions(&status["partitions"], Some(false))?;
    assert_eq!(
        pending_rows, 0,
        "nothing pending after every worker stopped: {status}"
    );
    for node in NODES {
        sync_when_writable(node, "default", &name, Duration::from_secs(60))?;
    }
    // An INSERT answered 319 as ZooKeeper restarted may have left an orphan part on its
    // replica, its rows delivered again by the retry (docs/guarantees.md): `verify` names it and
    // its repair, done here as an operator would; `verify` must then find the replicas agree.
    let verify = verify_spec(&run.dir, &name, &name)?;
    let orphans = repair_orphans(worker_bin!(), &verify, &qualified, &NODES)
        .with_context(|| format!("verify after {done:?}"))?;
    let landed = landed_on_both_shards(&qualified)?;
    if landed != (MESSAGES, MESSAGES) {
        bail!(
            "every message once: {landed:?} (rows, distinct ids) of {MESSAGES} after {done:?}; \
             blocks per shard while the zombie's INSERT was held: {blocks_while_held:?}\n{}",
            duplicates(&qualified)
        );
    }
    for [first, second] in [SHARD_A, SHARD_B] {
        assert_eq!(
            count_uniq(first, &qualified)?,
            count_uniq(second, &qualified)?
        );
    }
    check_routing(
        &[("a", SHARD_A.to_vec()), ("b", SHARD_B.to_vec())],
        &qualified,
        USERS,
    )?;
    println!(
        "seed {seed}: {} faults ({:?}); blocks per shard while the zombie's INSERT was held: \
         {blocks_while_held:?}; the zombie said: {:?}; orphan parts repaired: {orphans:?}",
        done.len(),
        done,
        fenced_lines
    );
    let _ = rt.block_on(js.delete_stream(&name));
    Ok(())
}

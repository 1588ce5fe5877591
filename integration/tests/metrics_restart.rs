//! The Prometheus endpoint across a kill -9, against the local cluster (`scripts/cluster.sh up`).
//!
//! An exactly-once pipeline (2 rate-limited generator partitions into a ReplicatedMergeTree on
//! a1) serves `/metrics` (`metrics: {listen}` in the spec). The test scrapes it while rows are
//! being delivered, kills the worker with SIGKILL, restarts it and scrapes again: every `_total`
//! series must be at least what it was before the kill (the counters are persisted with what they
//! count, and loaded before the endpoint answers), and never go down while the run goes on. At
//! the end `flow_sink_rows_delivered_total` (as persisted, which is what the endpoint serves after
//! any restart) equals the rows in ClickHouse, every id once.
//!
//! The test fails, not skips, without a cluster. It stops no node.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use flow_integration::worker::*;
use flow_integration::*;

const PARTITIONS: u64 = 2;
const PER_PARTITION: u64 = 8_000;
const TOTAL: u64 = PARTITIONS * PER_PARTITION;
/// Per partition: ~3 s of generating in all.
const RATE: u64 = 2_500;
const BATCH: u64 = 500;
/// Rows delivered before the kill.
const DELIVERED_BEFORE_KILL: u64 = 3_000;

/// Every series of a Prometheus text exposition whose name ends in `_total`, with its value.
type Totals = BTreeMap<String, f64>;

/// `GET /metrics`: the `_total` series, or an error if the endpoint does not answer 200.
fn scrape(port: u16) -> Result<Totals> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: flow\r\nConnection: close\r\n\r\n")?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    let Some((head, body)) = answer.split_once("\r\n\r\n") else {
        bail!("no HTTP answer: {answer:?}");
    };
    if !head.starts_with("HTTP/1.1 200") {
        bail!("the endpoint answered {head}");
    }
    let mut totals = Totals::new();
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = series.split('{').next().unwrap_or(series);
        if name.ends_with("_total") {
            totals.insert(series.to_owned(), value.parse().context("a sample value")?);
        }
    }
    Ok(totals)
}

/// The sum of every series of metric `name`.
fn sum(totals: &Totals, name: &str) -> f64 {
    totals
        .iter()
        .filter(|(series, _)| series.split('{').next() == Some(name))
        .map(|(_, v)| v)
        .sum()
}

/// Fails unless every series of `before` is in `after` with a value at least as large.
fn assert_not_below(before: &Totals, after: &Totals, when: &str) {
    for (series, value) in before {
        let now = after.get(series).copied();
        assert!(
            now.is_some_and(|now| now >= *value),
            "{when}: {series} was {value}, now {now:?}"
        );
    }
}

/// A TCP port nobody listens on now.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Scrapes until `done` holds for a scrape or the worker exits, checking that no `_total`
/// series ever goes down: the last scrape, and the exit code if the worker exited.
fn scrape_until(
    worker: &mut Worker,
    port: u16,
    mut last: Totals,
    done: impl Fn(&Totals) -> bool,
) -> Result<(Totals, Option<Option<i32>>)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Some(code) = worker.exited()? {
            return Ok((last, Some(code)));
        }
        if let Ok(now) = scrape(port) {
            assert_not_below(&last, &now, "while running");
            last = now;
            if done(&last) {
                return Ok((last, None));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!(
        "the scrapes did not get there within 30 s\n{}",
        worker.log_tail()
    )
}

fn persisted_rows_delivered(state: &Path, pipeline: &str) -> u64 {
    let summary = status_json(worker_bin!(), state).unwrap().unwrap();
    summary["pipelines"][pipeline]["sinks"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|sink| sink["counters"].as_object().cloned().unwrap_or_default())
        .filter(|(name, _)| name.split(';').next() == Some("rows_delivered"))
        .map(|(_, value)| value.as_u64().unwrap())
        .sum()
}

#[test]
fn total_counters_survive_a_kill_9_and_rows_delivered_ends_equal_to_the_table() {
    wait_for_cluster(Duration::from_secs(120)).unwrap();
    let started = Instant::now();
    let table = unique_name("metrics_restart");
    let replicated =
        ReplicatedTable::create("default", &table, GENERATOR_COLUMNS, "id", &[A1]).unwrap();
    let pipeline = unique_name("metrics");
    let port = free_port();
    let mut yaml = GeneratorSpec::new(
        &pipeline,
        "ClickHouseBatchingSink",
        format!("{{host: '{}', table: {table}}}", A1.http_addr()),
    )
    .partitions(PARTITIONS)
    .epoch(BATCH, 600_000)
    .count(PER_PARTITION)
    .rate(RATE)
    .dynamic(format!("{{max_rows_per_batch: {BATCH}}}"))
    .yaml();
    yaml.push_str(&format!("metrics: {{listen: '127.0.0.1:{port}'}}\n"));
    let dir = TestDir::new().unwrap();
    let (spec, state) = (dir.path().join("spec.yaml"), dir.path().join("state"));
    std::fs::write(&spec, yaml).unwrap();

    let log = dir.path().join("first.log");
    let mut first = Worker::spawn(worker_bin!(), &spec, &state, log).unwrap();
    let delivered = |t: &Totals| sum(t, "flow_sink_rows_delivered_total");
    let (before, exited) = scrape_until(&mut first, port, Totals::new(), |t| {
        delivered(t) >= DELIVERED_BEFORE_KILL as f64
    })
    .unwrap();
    assert_eq!(exited, None, "the worker ended before the kill");
    assert!(
        first.kill_9().unwrap().is_none(),
        "the worker ended before the kill"
    );
    for name in [
        "flow_source_messages_total",
        "flow_epochs_committed_total",
        "flow_sink_batches_delivered_total",
    ] {
        assert!(
            sum(&before, name) > 0.0,
            "{name} missing before the kill: {before:?}"
        );
    }

    let log = dir.path().join("second.log");
    let mut second = Worker::spawn(worker_bin!(), &spec, &state, log).unwrap();
    // The first answer of the restarted worker, whenever it comes, is already not below.
    let (restarted, exited) =
        scrape_until(&mut second, port, Totals::new(), |t| !t.is_empty()).unwrap();
    assert_eq!(exited, None, "no scrape answered before the worker ended");
    assert_not_below(&before, &restarted, "after the restart");
    let (last, exited) = scrape_until(&mut second, port, restarted, |t| {
        delivered(t) >= TOTAL as f64
    })
    .unwrap();
    let code = match exited {
        Some(code) => code,
        None => second.wait_exit(Duration::from_secs(60)).unwrap(),
    };
    assert_eq!(code, Some(0), "{}", second.log_tail());

    let q = replicated.qualified();
    let rows = query_u64(A1.http_port, &format!("SELECT count() FROM {q}")).unwrap();
    let ids = query_u64(A1.http_port, &format!("SELECT uniqExact(id) FROM {q}")).unwrap();
    assert_eq!((rows, ids), (TOTAL, TOTAL));
    let persisted = persisted_rows_delivered(&state, &pipeline);
    assert_eq!(persisted, rows);
    assert!(delivered(&last) <= persisted as f64, "{last:?}");
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());
}

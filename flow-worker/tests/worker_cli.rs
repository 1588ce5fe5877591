//! The worker binary as users run it: exit codes, printed violations, crash recovery.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

fn worker() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flow-worker"))
}

/// `flow-worker run SPEC --state-dir STATE`, for the caller to set up its output and start.
fn run_command(spec: &Path, state: &Path) -> Command {
    let mut command = worker();
    command.arg("run").arg(spec).arg("--state-dir").arg(state);
    command
}

fn write_spec(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("spec.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

fn generator_spec(output: &Path, partitions: u32, count: u64, rate: u64) -> String {
    format!(
        "pipeline: crashy\npartitions: {partitions}\nepoch: {{max_messages: 2000, max_duration_ms: 100}}\nsource:\n  class: generator\n  parameters: {{count: {count}, rate_per_second: {rate}, payload_bytes: 16}}\nsinks:\n  - name: out\n    sink_class_name: DebugSink\n    input_stream_ids: [rows]\n    parameters: {{path: {}}}\n    dynamic_parameters: {{max_rows_per_batch: 500}}\n",
        output.display()
    )
}

#[test]
fn validate_prints_every_violation_with_its_path_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_spec(
        dir.path(),
        "pipeline: 'no spaces allowed'\npartitions: 0\nepoch: {max_messages: 10, max_duration_ms: 0}\nsource:\n  class: generator\n  parameters: {count: 10}\nsinks:\n  - name: out\n    sink_class_name: DebugSink\n    input_stream_ids: [rows, missing]\n    parameters: {path: /tmp/x.jsonl}\n    dynamic_parameters: {max_rows_per_batch: 0}\n",
    );
    let output = worker().arg("validate").arg(&spec).output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let paths: Vec<&str> = stdout
        .lines()
        .map(|line| line.split(": ").next().unwrap())
        .collect();
    assert_eq!(
        paths,
        vec![
            "pipeline",
            "partitions",
            "epoch.max_duration_ms",
            "sinks[0].input_stream_ids[1]",
            "sinks[0].dynamic_parameters.max_rows_per_batch"
        ],
        "{stdout}"
    );
    assert!(String::from_utf8(output.stderr)
        .unwrap()
        .contains("5 violation(s)"));
}

/// A NATS JetStream source pulls only when the epoch's end is more than its 20 ms least pull
/// away: an epoch of 20 ms read nothing, silently, and `validate` accepted it.
#[test]
fn validate_refuses_an_epoch_too_short_for_a_nats_pull() {
    let dir = tempfile::tempdir().unwrap();
    let spec = |ms: u64| {
        format!(
            "pipeline: short\nepoch: {{max_duration_ms: {ms}}}\nsource:\n  class: nats_jetstream\n  parameters: {{servers: ['nats://127.0.0.1:14222'], stream: EVENTS, subjects: [events.0], schema: [{{name: id, type: uint64}}]}}\nsinks:\n  - {{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: out.jsonl}}}}\n"
        )
    };
    let output = worker()
        .arg("validate")
        .arg(write_spec(dir.path(), &spec(20)))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert_eq!(
        String::from_utf8(output.stdout).unwrap(),
        "epoch.max_duration_ms: 20 is too short for this source: a NATS JetStream pull waits at least 20 ms, and an epoch that ends within that never pulls a message; set at least 21\n"
    );
    let output = worker()
        .arg("validate")
        .arg(write_spec(dir.path(), &spec(21)))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0), "{output:?}");
}

#[test]
fn validate_accepts_a_good_spec_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_spec(dir.path(), &generator_spec(&dir.path().join("o"), 2, 10, 0));
    let output = worker().arg("validate").arg(&spec).output().unwrap();
    assert_eq!(output.status.code(), Some(0), "{output:?}");
}

#[test]
fn every_example_spec_validates() {
    let specs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/specs");
    let mut checked = Vec::new();
    for entry in std::fs::read_dir(&specs).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let output = worker().arg("validate").arg(&path).output().unwrap();
            assert_eq!(
                output.status.code(),
                Some(0),
                "{}: {output:?}",
                path.display()
            );
            checked.push(path.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    checked.sort();
    assert_eq!(
        checked,
        [
            "kafka_to_clickhouse.yaml",
            "nats_to_clickhouse.yaml",
            "quickstart.yaml"
        ]
    );
}

#[test]
fn run_without_state_dir_is_refused_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_spec(dir.path(), &generator_spec(&dir.path().join("o"), 1, 10, 0));
    let output = worker().arg("run").arg(&spec).output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("no state directory"), "{stderr}");
}

#[test]
fn run_logs_plain_text_without_colour_codes_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_spec(dir.path(), &generator_spec(&dir.path().join("o"), 1, 10, 0));
    let output = worker()
        .arg("run")
        .arg(&spec)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env_remove("NO_COLOR")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let stderr = String::from_utf8(output.stderr).unwrap();
    let finished = stderr
        .lines()
        .find(|l| l.contains("pipeline finished"))
        .unwrap_or_else(|| panic!("no `pipeline finished` line in:\n{stderr}"));
    assert!(
        finished.contains(" INFO ") && finished.contains("pipeline=crashy messages=10"),
        "{finished}"
    );
    assert!(
        !stderr.contains('\u{1b}'),
        "colour codes in a piped log:\n{stderr}"
    );
}

fn count_lines(path: &Path) -> usize {
    std::fs::File::open(path)
        .map(|f| BufReader::new(f).lines().count())
        .unwrap_or(0)
}

/// Checks that the output holds ids `0..total` each exactly once.
fn assert_exactly_once(path: &Path, total: u64) {
    let file = std::fs::File::open(path).unwrap();
    let mut seen = HashSet::new();
    let mut lines = 0u64;
    for line in BufReader::new(file).lines() {
        let line = line.unwrap();
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        let id = value["row"]["id"].as_u64().unwrap();
        assert!(seen.insert(id), "id {id} appears twice");
        lines += 1;
    }
    assert_eq!(lines, total);
    assert_eq!(seen.len() as u64, total);
    assert!((0..total).all(|id| seen.contains(&id)));
}

#[test]
fn kill_9_three_times_then_rerun_leaves_every_message_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("out.jsonl");
    let state = dir.path().join("state");
    // 4 partitions x 50,000 = 200,000 messages; the rate limit keeps the run long enough to be
    // killed at several points.
    let spec = write_spec(dir.path(), &generator_spec(&output, 4, 50_000, 10_000));
    let seed: u64 = std::env::var("FLOW_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261130);
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut lines_at_kill = Vec::new();
    for _ in 0..3 {
        let mut child = run_command(&spec, &state)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let before = count_lines(&output);
        // Kill once some new output exists, after a random extra delay.
        let started = Instant::now();
        while count_lines(&output) <= before && started.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..400)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        lines_at_kill.push(count_lines(&output));
    }
    println!("lines at each kill: {lines_at_kill:?}");
    assert!(
        lines_at_kill.iter().all(|&n| n < 200_000),
        "a kill came too late to test anything: {lines_at_kill:?}"
    );
    let status = run_command(&spec, &state)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    assert_exactly_once(&output, 200_000);

    let status = worker()
        .args(["status", "--json", "--state-dir"])
        .arg(&state)
        .output()
        .unwrap();
    assert!(status.status.success());
    let summary: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let sinks = summary["pipelines"]["crashy"]["sinks"].as_array().unwrap();
    assert_eq!(sinks.len(), 4);
    assert!(sinks.iter().all(|s| s["undelivered"] == 0));
    let positions = summary["pipelines"]["crashy"]["positions"]
        .as_object()
        .unwrap();
    assert_eq!(positions.len(), 4);
    assert!(positions
        .values()
        .all(|p| p["hex"] == format!("{:016x}", 50_000u64)));
}

#[test]
fn sigterm_stops_gracefully_with_exit_0_and_a_rerun_completes() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("out.jsonl");
    let state = dir.path().join("state");
    let spec = write_spec(dir.path(), &generator_spec(&output, 2, 20_000, 10_000));
    let child = run_command(&spec, &state)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while count_lines(&output) == 0 && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    send_signal(child.id(), "TERM");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(count_lines(&output) < 40_000);
    let status = run_command(&spec, &state).status().unwrap();
    assert!(status.success());
    assert_exactly_once(&output, 40_000);
}

/// The ClickHouse sinks wait for an unreachable target at session start; a stop signal must end
/// that wait (every class), exit 0 and commit nothing.
#[test]
fn sigterm_while_the_clickhouse_target_is_unreachable_exits_0_for_every_class() {
    // Nothing listens on ports 1 and 2 of the loopback: every connection is refused at once. The
    // sharded class waits while every host of some shard is silent; here both shards are.
    let single = "host: '127.0.0.1:1'";
    let sharded = "shard_hosts: {a: ['127.0.0.1:1'], b: ['127.0.0.1:2']}";
    for (class, hosts) in [
        ("ClickHouseBatchingSink", single),
        ("ShardedClickHouseBatchingSink", sharded),
        ("AtLeastOnceClickHouseSink", single),
        ("AtMostOnceClickHouseSink", single),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let spec = write_spec(
            dir.path(),
            &format!(
                "pipeline: unreachable\npartitions: 2\nsource:\n  class: generator\n  parameters: {{count: 1000}}\nsinks:\n  - name: ch\n    sink_class_name: {class}\n    input_stream_ids: [rows]\n    parameters: {{{hosts}, table: t}}\n    dynamic_parameters: {{retry_backoff: 100ms, max_retry_backoff: 2s}}\n"
            ),
        );
        let mut child = run_command(&spec, &state)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Wait until the sink reports the unreachable target, then stop the worker.
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut log = String::new();
        loop {
            let mut line = String::new();
            assert!(
                stderr.read_line(&mut line).unwrap() > 0,
                "{class}: the worker ended before reporting the unreachable target:\n{log}"
            );
            log.push_str(&line);
            if line.contains("cannot start the ClickHouse writer session yet") {
                break;
            }
        }
        // The session is started in the background as the pipeline starts, so the warning can
        // come before a partition has read its first epoch; a stop then ends the run before any
        // epoch, with nothing to report. The epoch (1000 messages) is read in milliseconds and
        // then waits in the sink for the session: stop it there.
        std::thread::sleep(Duration::from_millis(500));
        send_signal(child.id(), "TERM");
        let deadline = Instant::now() + Duration::from_secs(20);
        let code = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status.code();
            }
            if Instant::now() >= deadline {
                child.kill().unwrap();
                panic!("{class}: still running 20 s after SIGTERM:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        std::io::Read::read_to_string(&mut stderr, &mut log).unwrap();
        assert_eq!(code, Some(0), "{class}:\n{log}");
        // A stop is not a failure to act on: the uncommitted epoch is reported at info level.
        assert!(
            log.contains("epoch not committed: the pipeline is stopping")
                && !log.contains("epoch vetoed"),
            "{class}:\n{log}"
        );

        let status = worker()
            .args(["status", "--json", "--state-dir"])
            .arg(&state)
            .output()
            .unwrap();
        assert_eq!(status.status.code(), Some(0), "{status:?}");
        let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"pipelines": {}}),
            "{class}: nothing may be committed"
        );
    }
}

fn send_signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn status_while_running_shows_the_running_workers_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("out.jsonl");
    let state = dir.path().join("state");
    let spec = write_spec(dir.path(), &generator_spec(&output, 2, 1_000_000, 5_000));
    let mut child = run_command(&spec, &state)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let snapshot = state.join("status-snapshot.json");
    let started = Instant::now();
    while !(snapshot.exists() && count_lines(&output) > 0)
        && started.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    // Let a later snapshot include committed positions.
    std::thread::sleep(Duration::from_millis(2_500));
    let status = worker()
        .args(["status", "--json", "--state-dir"])
        .arg(&state)
        .output()
        .unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(status.status.success(), "{status:?}");
    let stderr = String::from_utf8(status.stderr).unwrap();
    assert!(stderr.contains("a running worker holds"), "{stderr}");
    let summary: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let positions = summary["pipelines"]["crashy"]["positions"]
        .as_object()
        .unwrap();
    assert_eq!(positions.len(), 2, "{summary}");
}

#[test]
fn status_on_a_store_that_cannot_be_opened_exits_non_zero_and_calls_a_leftover_snapshot_stale() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_spec(
        dir.path(),
        &generator_spec(&dir.path().join("out.jsonl"), 1, 100, 0),
    );
    let state = dir.path().join("state");
    let status = run_command(&spec, &state)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    // A snapshot left by a worker that was killed, and a store sled cannot open.
    std::fs::write(state.join("status-snapshot.json"), r#"{"pipelines":{}}"#).unwrap();
    std::fs::remove_file(state.join("db")).unwrap();
    std::fs::create_dir(state.join("db")).unwrap();
    let output = worker()
        .arg("status")
        .arg("--state-dir")
        .arg(&state)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("Is a directory") && stderr.contains(&format!(
            "The status snapshot `{}` there is stale: the worker that wrote it is gone, so it is not shown",
            state.join("status-snapshot.json").display()
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("another worker"), "{stderr}");
    assert!(output.stdout.is_empty());
}

#[test]
fn status_with_a_leftover_snapshot_but_an_openable_store_shows_the_store_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_spec(
        dir.path(),
        &generator_spec(&dir.path().join("out.jsonl"), 1, 100, 0),
    );
    let state = dir.path().join("state");
    assert!(run_command(&spec, &state)
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success());
    std::fs::write(state.join("status-snapshot.json"), r#"{"pipelines":{}}"#).unwrap();
    let output = worker()
        .args(["status", "--json", "--state-dir"])
        .arg(&state)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("is left over from a worker that is gone"),
        "{stderr}"
    );
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    // The store, not the empty snapshot; a binary position has a defined encoding.
    let position = &summary["pipelines"]["crashy"]["positions"]["0"];
    assert_eq!(position["encoding"], "hex", "{summary}");
    assert_eq!(position["value"], format!("{:016x}", 100u64), "{summary}");
    assert_eq!(position["text"], serde_json::Value::Null, "{summary}");
}

#[test]
fn another_worker_is_blamed_only_when_it_holds_the_state_directory() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("out.jsonl");
    let state = dir.path().join("state");
    let spec = write_spec(dir.path(), &generator_spec(&output, 1, 1_000_000, 5_000));
    let mut first = run_command(&spec, &state)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while count_lines(&output) == 0 && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let second = run_command(&spec, &state).output().unwrap();
    first.kill().unwrap();
    first.wait().unwrap();
    assert_eq!(second.status.code(), Some(1));
    let stderr = String::from_utf8(second.stderr).unwrap();
    assert!(
        stderr.contains("is in use by another process (is another worker running on it?)"),
        "{stderr}"
    );

    // A state directory that is a plain file: an error, but not another worker's.
    let file = dir.path().join("not-a-directory");
    std::fs::write(&file, b"x").unwrap();
    let refused = run_command(&spec, &file).output().unwrap();
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8(refused.stderr).unwrap();
    assert!(
        stderr.contains("cannot open the state directory"),
        "{stderr}"
    );
    assert!(!stderr.contains("another worker"), "{stderr}");
}

#[test]
fn sigterm_logs_what_each_sink_leaves_in_the_outbox() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("out.jsonl");
    let state = dir.path().join("state");
    let spec = write_spec(dir.path(), &generator_spec(&output, 2, 1_000_000, 5_000));
    let child = run_command(&spec, &state)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while count_lines(&output) == 0 && started.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    send_signal(child.id(), "TERM");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let log = String::from_utf8(out.stderr).unwrap();
    // The debug sink delivers within the drain time: each partition says so.
    for partition in 0..2 {
        assert!(
            log.lines()
                .any(|l| l.contains("stopped with nothing left in the outbox")
                    && l.contains(&format!("partition={partition}"))
                    && l.contains("sink=out")),
            "{log}"
        );
    }
}

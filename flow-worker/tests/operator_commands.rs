//! The operator's commands around a run, without a cluster: `status --watch` on and off a
//! terminal, `drain` with nothing pending, and `run` with its progress line on a terminal and
//! without it off one. A terminal is util-linux `script`'s pseudo-terminal.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

fn worker() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flow-worker"))
}

/// Runs a small DebugSink pipeline to its end in `dir`; (spec, state dir, its stderr).
fn finished_run(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, String) {
    let spec = dir.join("spec.yaml");
    let text = format!(
        "pipeline: ops\npartitions: 2\nepoch: {{max_messages: 100, max_duration_ms: 100}}\nsource:\n  class: generator\n  parameters: {{count: 500}}\nsinks:\n  - name: out\n    sink_class_name: DebugSink\n    input_stream_ids: [rows]\n    parameters: {{path: {}}}\n",
        dir.join("out.jsonl").display()
    );
    std::fs::write(&spec, text).unwrap();
    let state = dir.join("state");
    let output = worker()
        .arg("run")
        .arg(&spec)
        .arg("--state-dir")
        .arg(&state)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    (spec, state, stderr)
}

#[test]
fn run_shows_no_progress_line_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let (_, _, stderr) = finished_run(dir.path());
    assert!(stderr.contains("pipeline finished"), "{stderr}");
    assert!(
        !stderr.contains("msg/s") && !stderr.contains("\x1b[2K"),
        "{stderr}"
    );
}

#[test]
fn drain_with_nothing_pending_says_so_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let (spec, state, _) = finished_run(dir.path());
    let output = worker()
        .arg("drain")
        .arg(&spec)
        .arg("--state-dir")
        .arg(&state)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "nothing pending in the outbox of pipeline `ops`: the topology can be changed now\n"
    );
}

/// `status --watch --interval 1` with stdout on a pipe, read for `for_ms`, then killed.
fn watch_output(state: &Path, json: bool, for_ms: u64) -> String {
    let mut command = worker();
    command
        .args(["status", "--watch", "--interval", "1", "--state-dir"])
        .arg(state)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if json {
        command.arg("--json");
    }
    let mut child = command.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(for_ms));
    child.kill().unwrap();
    let mut text = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    child.wait().unwrap();
    text
}

#[test]
fn status_watch_off_a_terminal_appends_one_frame_per_interval_without_clearing() {
    let dir = tempfile::tempdir().unwrap();
    let (_, state, _) = finished_run(dir.path());
    let text = watch_output(&state, false, 2_500);
    let headers = text.lines().filter(|l| l.starts_with("--- ")).count();
    let frames = text.matches("pipeline ops\n").count();
    assert!((2..=3).contains(&headers) && frames == headers, "{text}");
    assert!(!text.contains('\x1b'), "{text}");

    let json = watch_output(&state, true, 1_500);
    let objects: Vec<serde_json::Value> = json
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert!(!objects.is_empty(), "{json}");
    for object in objects {
        // The generator's position: offset 500 as a big-endian u64.
        assert_eq!(
            object["pipelines"]["ops"]["positions"]["1"]["hex"],
            "00000000000001f4"
        );
    }
}

#[test]
fn status_watch_on_a_directory_that_is_not_a_state_directory_fails_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let output = worker()
        .args(["status", "--watch", "--state-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("is not a flow state directory"));
}

#[test]
fn run_on_a_terminal_shows_a_live_progress_line_erased_before_log_lines() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.yaml");
    let text = format!(
        "pipeline: ops\nepoch: {{max_messages: 100, max_duration_ms: 100}}\nsource:\n  class: generator\n  parameters: {{count: 2500, rate_per_second: 1000}}\nsinks:\n  - name: out\n    sink_class_name: DebugSink\n    input_stream_ids: [rows]\n    parameters: {{path: {}}}\n",
        dir.path().join("out.jsonl").display()
    );
    std::fs::write(&spec, text).unwrap();
    let command = format!(
        "{} run {} --state-dir {}",
        env!("CARGO_BIN_EXE_flow-worker"),
        spec.display(),
        dir.path().join("state").display()
    );
    // util-linux `script` runs the worker on a pseudo-terminal and copies what it wrote.
    let output = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let terminal = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{terminal}");
    let lines = terminal.matches("\r\x1b[2Kops: in ").count();
    assert!(lines >= 2, "{terminal}");
    assert!(terminal.contains(" msg/s | out "), "{terminal}");
    // The last log line comes after the line was erased, not after its text.
    let finished = terminal.find("pipeline finished").unwrap();
    let last_line = terminal[..finished].rfind("ops: in ").unwrap();
    assert!(
        terminal[last_line..finished].contains("\r\x1b[2K"),
        "{terminal}"
    );
}

#[test]
fn status_watch_on_a_terminal_clears_and_redraws_every_interval() {
    let dir = tempfile::tempdir().unwrap();
    let (_, state, _) = finished_run(dir.path());
    let command = format!(
        "timeout 2.5 {} status --watch --interval 1 --state-dir {}",
        env!("CARGO_BIN_EXE_flow-worker"),
        state.display()
    );
    let output = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let terminal = String::from_utf8_lossy(&output.stdout);
    // `timeout` ends the watch.
    assert_eq!(output.status.code(), Some(124), "{terminal}");
    let redraws = terminal.matches("\x1b[H\x1b[2J").count();
    assert!((2..=3).contains(&redraws), "{terminal}");
    assert_eq!(
        terminal.matches("pipeline ops").count(),
        redraws,
        "{terminal}"
    );
}

#[test]
fn drain_of_a_directory_that_is_not_a_state_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (spec, _, _) = finished_run(dir.path());
    let missing = dir.path().join("typo");
    let output = worker()
        .arg("drain")
        .arg(&spec)
        .arg("--state-dir")
        .arg(&missing)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("is not a flow state directory"));
    assert!(output.stdout.is_empty() && !missing.exists());
}

/// `dead-letters <action> --state-dir STATE --sink SINK [--yes]`: (exit code, stdout, stderr).
fn dead_letters(state: &Path, action: &str, sink: &str) -> (Option<i32>, String, String) {
    let output = worker()
        .args([
            "dead-letters",
            action,
            "--sink",
            sink,
            "--yes",
            "--state-dir",
        ])
        .arg(state)
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn dead_letters_refuse_an_unknown_sink_and_name_the_known_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (_, state, _) = finished_run(dir.path());
    let expected = format!(
        "error: the state directory `{}` knows no sink `nosuch`: its sinks are `out`; pass one of them to --sink (`source` for the source's dead letters), or leave --sink out for every dead letter\n",
        state.display()
    );
    for action in ["list", "purge", "export", "requeue"] {
        assert_eq!(
            dead_letters(&state, action, "nosuch"),
            (Some(1), String::new(), expected.clone()),
            "{action}"
        );
    }
    // A known sink without dead letters, and the source, still answer with nothing to do.
    assert_eq!(
        dead_letters(&state, "list", "out"),
        (Some(0), "0 dead letter(s)\n".to_owned(), String::new())
    );
    assert_eq!(
        dead_letters(&state, "purge", "out"),
        (
            Some(0),
            "removed 0 dead letter(s)\n".to_owned(),
            String::new()
        )
    );
    assert_eq!(
        dead_letters(&state, "list", "source"),
        (Some(0), "0 dead letter(s)\n".to_owned(), String::new())
    );
}

#[test]
fn a_source_record_that_is_not_utf8_is_exported_byte_for_byte_in_base64() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    // Line 1 is the bytes ff fe: not UTF-8, so not JSON; the source sets it aside.
    let mut bytes = b"{\"id\":1}\n".to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe, b'\n']);
    bytes.extend_from_slice(b"{\"id\":3}\n");
    std::fs::write(&input, &bytes).unwrap();
    let spec = dir.path().join("spec.yaml");
    let text = format!(
        "pipeline: raw\npartitions: 1\nepoch: {{max_messages: 100, max_duration_ms: 100}}\nsource:\n  class: jsonl_file\n  parameters: {{files: [{}], schema: [{{name: id, type: uint64}}], on_bad_record: dead_letter}}\nsinks:\n  - name: out\n    sink_class_name: DebugSink\n    input_stream_ids: [rows]\n    parameters: {{path: {}}}\n",
        input.display(),
        dir.path().join("out.jsonl").display()
    );
    std::fs::write(&spec, text).unwrap();
    let state = dir.path().join("state");
    let output = worker()
        .arg("run")
        .arg(&spec)
        .arg("--state-dir")
        .arg(&state)
        .output()
        .unwrap();
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (code, stdout, stderr) = dead_letters(&state, "export", "source");
    assert_eq!((code, stderr.as_str()), (Some(0), ""));
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{stdout}");
    assert_eq!(lines[0]["message_id"], "0-1");
    assert_eq!(lines[0]["record"], serde_json::Value::Null);
    assert_eq!(lines[0]["record_base64"], "//4=");
}

#[test]
fn status_and_dead_letters_list_into_a_pipe_already_closed_exit_0_without_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let (_, state, _) = finished_run(dir.path());
    // The reader is gone before the command writes (as `status | head` once head has its lines);
    // `dead-letters list` writes its answer the same way as `status`.
    for command in [&["status"][..], &["dead-letters", "list"][..]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let output = worker()
            .args(command)
            .arg("--state-dir")
            .arg(&state)
            .stdout(writer)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            (output.status.code(), stderr.as_ref()),
            (Some(0), ""),
            "{command:?}"
        );
    }
}

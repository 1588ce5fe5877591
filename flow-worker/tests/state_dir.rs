//! Where the state directory is (issue 24 item 3) and what the inspection commands do with one
//! they cannot write (item 16), through the worker binary as users run it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn worker() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flow-worker"))
}

/// A spec directory `spec/` holding `spec.yaml` (relative `state_dir: ./flow-state`, a
/// generator of 300 messages into a debug sink) and an unrelated working directory `elsewhere/`.
struct Layout {
    _root: tempfile::TempDir,
    spec_dir: PathBuf,
    spec: PathBuf,
    elsewhere: PathBuf,
}

fn layout() -> Layout {
    let root = tempfile::tempdir().unwrap();
    // The worker logs canonical paths (the spec's directory, the working directory).
    let base = std::fs::canonicalize(root.path()).unwrap();
    let spec_dir = base.join("spec");
    let elsewhere = base.join("elsewhere");
    std::fs::create_dir_all(&spec_dir).unwrap();
    std::fs::create_dir_all(&elsewhere).unwrap();
    let spec = spec_dir.join("spec.yaml");
    std::fs::write(
        &spec,
        format!(
            "pipeline: rel\nstate_dir: ./flow-state\nepoch: {{max_messages: 100, max_duration_ms: 100}}\nsource:\n  class: generator\n  parameters: {{count: 300, payload_bytes: 8}}\nsinks:\n  - name: out\n    sink_class_name: DebugSink\n    input_stream_ids: [rows]\n    parameters: {{path: {}}}\n",
            base.join("out.jsonl").display()
        ),
    )
    .unwrap();
    Layout {
        _root: root,
        spec_dir,
        spec,
        elsewhere,
    }
}

fn run_in(cwd: &Path, spec: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let output = worker()
        .current_dir(cwd)
        .arg("run")
        .arg(spec)
        .args(extra)
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

fn lines_with<'a>(log: &'a str, needle: &str) -> Vec<&'a str> {
    log.lines().filter(|line| line.contains(needle)).collect()
}

#[test]
fn a_relative_state_dir_is_the_spec_files_from_any_working_directory() {
    let l = layout();
    let state = l.spec_dir.join("flow-state");
    let (code, first) = run_in(&l.spec_dir, Path::new("spec.yaml"), &[]);
    assert_eq!(code, Some(0), "{first}");
    // One WARN for the pipeline (not one per partition), naming the absolute directory.
    let fresh = format!(
        "no earlier state at {}: reading from the beginning",
        state.display()
    );
    let warned = lines_with(&first, &fresh);
    assert_eq!(warned.len(), 1, "{first}");
    assert!(warned[0].contains(" WARN "), "{first}");
    let started = lines_with(&first, "pipeline started");
    assert_eq!(started.len(), 1, "{first}");
    assert!(
        started[0].contains(&format!("state_dir={}", state.display())),
        "{first}"
    );
    assert_eq!(
        lines_with(&first, "pipeline finished pipeline=rel messages=300").len(),
        1,
        "{first}"
    );

    // The same spec from another working directory continues the same outbox: nothing is read
    // or sent again, and no state directory appears where the worker was started.
    let (code, second) = run_in(&l.elsewhere, &l.spec, &[]);
    assert_eq!(code, Some(0), "{second}");
    assert_eq!(
        lines_with(&second, "pipeline finished pipeline=rel messages=0").len(),
        1,
        "{second}"
    );
    assert!(
        lines_with(&second, "no earlier state").is_empty(),
        "{second}"
    );
    assert!(!l.elsewhere.join("flow-state").exists());
}

#[test]
fn state_dir_on_the_command_line_is_relative_to_the_working_directory() {
    let l = layout();
    let (code, log) = run_in(&l.elsewhere, &l.spec, &["--state-dir", "mine"]);
    assert_eq!(code, Some(0), "{log}");
    let state = l.elsewhere.join("mine");
    assert!(state.join("db").exists());
    assert!(!l.spec_dir.join("flow-state").exists());
    assert_eq!(
        lines_with(
            &log,
            &format!(
                "no earlier state at {}: reading from the beginning",
                state.display()
            )
        )
        .len(),
        1,
        "{log}"
    );
}

#[test]
fn a_state_dir_where_earlier_versions_put_it_is_not_abandoned() {
    let l = layout();
    // What an earlier version made of `state_dir: ./flow-state` started from `elsewhere/`.
    let (code, log) = run_in(&l.elsewhere, &l.spec, &["--state-dir", "flow-state"]);
    assert_eq!(code, Some(0), "{log}");
    let (code, log) = run_in(&l.elsewhere, &l.spec, &[]);
    assert_eq!(code, Some(1), "{log}");
    let (old, new) = (
        l.elsewhere.join("flow-state"),
        l.spec_dir.join("flow-state"),
    );
    let errors = lines_with(&log, "error: ");
    assert_eq!(errors.len(), 1, "{log}");
    assert!(
        errors[0].contains(&format!(
            "Starting on `{new}` would read the source from the beginning and send everything again. Move `{old}` to `{new}`, or pass --state-dir `{old}`",
            new = new.display(),
            old = old.display()
        )),
        "{log}"
    );
    assert!(!new.exists(), "nothing was created at the new place");
}

/// Runs `f` with a worker command for `args` that finds `dir` unwritable: as root (whom
/// permissions do not stop) the command runs under a read-only bind mount of `dir` onto itself in
/// a private mount namespace; otherwise `dir` loses its write permissions until `f` returns.
fn with_read_only<T>(dir: &Path, args: &[&str], f: impl FnOnce(Command) -> T) -> T {
    let root = Command::new("id").arg("-u").output().unwrap();
    if String::from_utf8_lossy(&root.stdout).trim() == "0" {
        let script =
            r#"mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" "$1" && shift && exec "$@""#;
        let mut command = Command::new("unshare");
        command
            .args(["-m", "sh", "-c", script, "sh"])
            .arg(dir)
            .arg(env!("CARGO_BIN_EXE_flow-worker"))
            .args(args);
        f(command)
    } else {
        let chmod = |mode: &str| {
            let status = Command::new("chmod")
                .args(["-R", mode])
                .arg(dir)
                .status()
                .unwrap();
            assert!(status.success());
        };
        chmod("a-w");
        let mut command = worker();
        command.args(args);
        let result = f(command);
        chmod("u+w");
        result
    }
}

/// The output of the worker run with `args` while `dir` cannot be written.
fn worker_on_read_only(dir: &Path, args: &[&str]) -> Output {
    let output = with_read_only(dir, args, |mut command| command.output().unwrap());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("mount:") && !stderr.contains("unshare:"),
        "this test needs `unshare -m` and bind mounts as root: {stderr}"
    );
    output
}

#[test]
fn status_and_dead_letters_list_read_a_state_directory_they_cannot_write() {
    let l = layout();
    let (code, log) = run_in(&l.spec_dir, &l.spec, &[]);
    assert_eq!(code, Some(0), "{log}");
    let state = l.spec_dir.join("flow-state");
    let dir = state.to_str().unwrap();
    let copy_note =
        format!("`{dir}` cannot be written (a read-only file system, or no write permission);");

    let status = worker_on_read_only(&state, &["status", "--state-dir", dir]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&status.stdout),
        String::from_utf8_lossy(&status.stderr),
    );
    assert_eq!(status.status.code(), Some(0), "{stdout}{stderr}");
    assert_eq!(
        stderr.trim_end(),
        format!("{copy_note} showing a copy of it taken just now")
    );
    assert!(stdout.starts_with("pipeline rel\n"), "{stdout}");
    assert!(
        stdout.contains("  0                           300\n"),
        "{stdout}"
    );

    let list = worker_on_read_only(&state, &["dead-letters", "list", "--state-dir", dir]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&list.stdout),
        String::from_utf8_lossy(&list.stderr),
    );
    assert_eq!(list.status.code(), Some(0), "{stdout}{stderr}");
    assert_eq!(
        stderr.trim_end(),
        format!("{copy_note} reading a copy of it taken just now")
    );
    assert_eq!(stdout, "0 dead letter(s)\n");

    // `--watch` (off a terminal) says it once, not at every refresh.
    let (frames, stderr) = with_read_only(
        &state,
        &[
            "status",
            "--state-dir",
            dir,
            "--watch",
            "--json",
            "--interval",
            "1",
        ],
        |mut command| {
            let mut child = command
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let mut lines =
                std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
            let frames: Vec<String> = (0..3).map(|_| lines.next().unwrap().unwrap()).collect();
            child.kill().unwrap();
            let output = child.wait_with_output().unwrap();
            (frames, String::from_utf8_lossy(&output.stderr).into_owned())
        },
    );
    assert!(
        frames
            .iter()
            .all(|f| f.starts_with("{\"pipelines\":{\"rel\"")),
        "{frames:?}"
    );
    assert_eq!(
        stderr.trim_end(),
        format!("{copy_note} showing a copy of it taken just now")
    );

    // What changes the directory fails, with the reason printed once.
    for action in ["purge", "requeue"] {
        let changed = worker_on_read_only(
            &state,
            &["dead-letters", action, "--yes", "--state-dir", dir],
        );
        let stderr = String::from_utf8_lossy(&changed.stderr);
        assert_eq!(changed.status.code(), Some(1), "{stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(
            lines[0].starts_with(&format!(
                "error: dead-letters {action} changes the state directory, and the state directory {dir} cannot be opened for writing ("
            )),
            "{stderr}"
        );
        assert!(
            lines[0].ends_with(
                "needs it writable: run as a user that may write it, or on a read-write mount"
            ),
            "{stderr}"
        );
        let reason = if stderr.contains("Read-only file system") {
            "Read-only file system"
        } else {
            "Permission denied"
        };
        assert_eq!(stderr.matches(reason).count(), 1, "{stderr}");
    }
}

//! Specs that take values from the environment and a password from a file, against the real
//! server: `${VAR}` and `${VAR:-default}` fill the sink's host, user and table; an unset variable
//! is a `validate` violation at its path; the password of `flow_secret` comes from
//! `password_file`. The password (and a secret passed as a variable) appears in no output:
//! `validate`, the run's log at debug level, `status --json`, the status snapshot, and the
//! error of a wrong password.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::path::Path;
use std::time::Duration;

use flow_integration::worker::*;
use flow_integration::*;

const ROWS: u64 = 200;

fn worker(args: &[&str], env: &[(&str, &str)]) -> WorkerOutput {
    run_worker(worker_bin!(), args, env, Duration::from_secs(30))
        .unwrap_or_else(|err| panic!("{err:#}"))
}

/// Every output a secret must not reach: both streams of `out`, and every file of the state
/// directory that is text (the status snapshot).
fn assert_absent(secret: &str, out: &WorkerOutput, state: Option<&Path>) {
    assert!(!out.stdout.contains(secret), "stdout: {}", out.stdout);
    assert!(!out.stderr.contains(secret), "stderr: {}", out.stderr);
    if let Some(state) = state {
        let snapshot =
            std::fs::read_to_string(state.join("status-snapshot.json")).unwrap_or_default();
        assert!(!snapshot.contains(secret), "{snapshot}");
    }
}

#[test]
fn environment_values_and_a_password_file_run_and_no_output_shows_the_secret() {
    require_cluster().unwrap();
    let t = unique_name("it_spec_env");
    let _table = ReplicatedTable::create("default", &t, GENERATOR_COLUMNS, "id", &[A1]).unwrap();
    let dir = TestDir::new().unwrap();
    let password_file = dir.path().join("ch-password");
    std::fs::write(&password_file, format!("{SECRET_PASSWORD}\n")).unwrap();
    let spec = dir.path().join("spec.yaml");
    let parameters = format!(
        "{{host: '${{FLOW_IT_CH_HOST}}', user: '${{FLOW_IT_CH_USER:-nobody}}', \
         table: '${{FLOW_IT_TABLE_PREFIX}}{}', password_file: '{}', \
         token_namespace: '${{FLOW_IT_NAMESPACE:-ns}}/'}}",
        t.strip_prefix("it_").unwrap(),
        password_file.display()
    );
    let yaml = GeneratorSpec::new("spec_env", "ClickHouseBatchingSink", parameters)
        .count(ROWS)
        .dynamic("{retry_backoff: 100ms, max_retry_backoff: 1s}")
        .yaml();
    std::fs::write(&spec, yaml).unwrap();
    let spec_arg = spec.to_str().unwrap();
    let host = A1.http_addr();
    // A secret passed in a variable the spec does not use must not leak either.
    let env = [
        ("FLOW_IT_CH_HOST", host.as_str()),
        ("FLOW_IT_CH_USER", SECRET_USER),
        ("FLOW_IT_TABLE_PREFIX", "it_"),
        ("FLOW_IT_UNUSED_SECRET", "unused-s3cret"),
    ];

    // Unset: one violation per unset variable without a default, at its path, exit 1.
    let unset = worker(&["validate", spec_arg], &[("FLOW_IT_TABLE_PREFIX", "it_")]);
    assert_eq!(unset.code, Some(1), "{}\n{}", unset.stdout, unset.stderr);
    assert_eq!(
        unset.stdout.lines().collect::<Vec<_>>(),
        ["sinks[0].parameters.host: the environment variable `FLOW_IT_CH_HOST` (from `${FLOW_IT_CH_HOST}`) is not set; export it, or give a default with `${FLOW_IT_CH_HOST:-value}`"],
        "{}",
        unset.stderr
    );

    let valid = worker(&["validate", spec_arg], &env);
    assert_eq!(valid.code, Some(0), "{}\n{}", valid.stdout, valid.stderr);
    assert_absent(SECRET_PASSWORD, &valid, None);

    // A wrong password in the file: refused by the server (code 193), the password unprinted.
    let wrong_file = dir.path().join("wrong-password");
    std::fs::write(&wrong_file, "wr0ng-s3cret\n").unwrap();
    let wrong_spec = dir.path().join("wrong.yaml");
    std::fs::write(
        &wrong_spec,
        std::fs::read_to_string(&spec).unwrap().replace(
            &password_file.display().to_string(),
            &wrong_file.display().to_string(),
        ),
    )
    .unwrap();
    let wrong_state = dir.path().join("state-wrong");
    let wrong = worker(
        &[
            "run",
            wrong_spec.to_str().unwrap(),
            "--state-dir",
            wrong_state.to_str().unwrap(),
        ],
        &env,
    );
    assert_eq!(wrong.code, Some(1), "{}", wrong.stderr);
    assert!(wrong.stderr.contains("code 193"), "{}", wrong.stderr);
    assert_absent("wr0ng-s3cret", &wrong, Some(&wrong_state));

    let state = dir.path().join("state");
    let mut debug_env = env.to_vec();
    debug_env.push(("RUST_LOG", "debug"));
    let run = worker(
        &["run", spec_arg, "--state-dir", state.to_str().unwrap()],
        &debug_env,
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(
        run.stderr.contains(" DEBUG "),
        "the log is at debug level: {}",
        run.stderr
    );
    assert_eq!(
        query_u64(A1.http_port, &format!("SELECT count() FROM default.{t}")).unwrap(),
        ROWS
    );
    assert_absent(SECRET_PASSWORD, &run, Some(&state));
    let status = worker(
        &["status", "--state-dir", state.to_str().unwrap(), "--json"],
        &env,
    );
    assert_eq!(status.code, Some(0), "{}", status.stderr);
    assert_absent(SECRET_PASSWORD, &status, None);
    for out in [&valid, &wrong, &run, &status] {
        assert_absent("unused-s3cret", out, None);
    }
}

/// A value from a variable that fails validation is reported at its path naming the variable,
/// never with the value itself (issue 46 item 15): it may be a secret pasted into the wrong
/// variable.
#[test]
fn a_violation_about_an_interpolated_value_names_the_variable_not_the_value() {
    let dir = TestDir::new().unwrap();
    let spec = dir.path().join("spec.yaml");
    let secret = "s3cret pass/word";
    // A value the parameters' types refuse, and one the sink's own checks refuse.
    for (parameters, variable) in [
        (
            "{host: 'ch:8123', table: t, max_tables: '${FLOW_IT_BAD}'}",
            "FLOW_IT_BAD",
        ),
        ("{host: '${FLOW_IT_BAD}', table: t}", "FLOW_IT_BAD"),
    ] {
        let yaml = GeneratorSpec::new("spec_env_bad", "ClickHouseBatchingSink", parameters).yaml();
        std::fs::write(&spec, yaml).unwrap();
        let out = worker(&["validate", spec.to_str().unwrap()], &[(variable, secret)]);
        assert_eq!(out.code, Some(1), "{}\n{}", out.stdout, out.stderr);
        assert_absent(secret, &out, None);
        assert!(
            out.stdout.contains(&format!("${{{variable}}}")),
            "the violation names the variable: {}",
            out.stdout
        );
    }
}

/// Every relative path of a spec file is taken from the file's directory, not from the worker's
/// working directory (issue 46 item 16): a spec in one directory naming its input, password
/// file, CA certificate, debug output and state directory relatively runs from another working
/// directory, `verify` connects with the same files, and nothing is created where the worker
/// was started. On 1c20a33 the run could not find `input/rows.jsonl`.
#[test]
fn relative_paths_of_a_spec_file_are_taken_from_its_directory_not_the_working_directory() {
    require_cluster().unwrap();
    let t = unique_name("it_spec_paths");
    let _table = ReplicatedTable::create("default", &t, "id UInt64", "id", &[A1]).unwrap();
    let home = TestDir::new().unwrap();
    let elsewhere = TestDir::new().unwrap();
    for sub in ["input", "secrets", "tls", "out"] {
        std::fs::create_dir(home.path().join(sub)).unwrap();
    }
    let lines: Vec<String> = (1..=ROWS).map(|id| format!("{{\"id\": {id}}}")).collect();
    std::fs::write(
        home.path().join("input/rows.jsonl"),
        lines.join("\n") + "\n",
    )
    .unwrap();
    std::fs::write(
        home.path().join("secrets/ch-password"),
        format!("{SECRET_PASSWORD}\n"),
    )
    .unwrap();
    std::fs::copy(tls_ca_cert(), home.path().join("tls/ca.crt")).unwrap();
    let yaml = format!(
        "pipeline: spec_paths\n\
         partitions: 1\n\
         state_dir: ./state\n\
         epoch: {{max_messages: 50, max_duration_ms: 200}}\n\
         source:\n  class: jsonl_file\n  parameters: {{files: [input/rows.jsonl], schema: [{{name: id, type: uint64}}]}}\n\
         sinks:\n\
         \x20 - name: ch\n    sink_class_name: ClickHouseBatchingSink\n    input_stream_ids: [rows]\n    \
         parameters: {{host: '{HOST}:{}', enable_tls: true, tls_ca_files: [tls/ca.crt], user: {SECRET_USER}, password_file: secrets/ch-password, table: {t}}}\n\
         \x20 - name: file\n    sink_class_name: DebugSink\n    input_stream_ids: [rows]\n    parameters: {{path: out/rows.jsonl}}\n",
        A1.https_port
    );
    let spec = home.path().join("flow.yaml");
    std::fs::write(&spec, yaml).unwrap();
    let spec_arg = spec.to_str().unwrap();
    let in_elsewhere = |args: &[&str]| {
        run_worker_in(
            Some(elsewhere.path()),
            worker_bin!(),
            args,
            &[],
            Duration::from_secs(60),
        )
        .unwrap_or_else(|err| panic!("{err:#}"))
    };

    let run = in_elsewhere(&["run", spec_arg]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(
        query_u64(A1.http_port, &format!("SELECT count() FROM default.{t}")).unwrap(),
        ROWS
    );
    let written = std::fs::read_to_string(home.path().join("out/rows.jsonl")).unwrap();
    assert_eq!(written.lines().count() as u64, ROWS, "{written}");
    assert!(
        home.path().join("state").join("db").exists(),
        "the state directory is beside the spec"
    );
    assert_eq!(
        std::fs::read_dir(elsewhere.path()).unwrap().count(),
        0,
        "nothing is created in the working directory"
    );
    let resolved = home.path().canonicalize().unwrap().join("input/rows.jsonl");
    assert!(
        run.stderr.contains(&resolved.display().to_string()),
        "the log names the absolute path a relative one became: {}",
        run.stderr
    );

    let verify = in_elsewhere(&["verify", spec_arg]);
    assert_eq!(verify.code, Some(0), "{}\n{}", verify.stdout, verify.stderr);
}

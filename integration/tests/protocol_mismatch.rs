//! A sink pointed at the wrong kind of port (issue 13, item 7): TLS against a plain HTTP port, or
//! plain HTTP against an HTTPS port, is refused at once with a message saying which side speaks
//! what, instead of being retried forever as "not reachable". Uses a1's HTTP and HTTPS ports.

use std::time::{Duration, Instant};

use anyhow::Context;
use flow_integration::worker::Worker;
use flow_integration::{wait_for_cluster, worker_bin, A1, HOST};

const PLAIN_TO_TLS: &str = "the sink connects with plain HTTP, but this port speaks TLS (HTTPS)";
const TLS_TO_PLAIN: &str =
    "the sink connects with TLS (enable_tls: true), but this port speaks plain HTTP";

/// Runs a one-sink pipeline against `port` with `tls` parameters; returns the exit code, how long
/// it took and the log.
fn run_against(port: u16, tls: &str) -> anyhow::Result<(Option<i32>, Duration, String)> {
    let dir = flow_integration::TestDir::new()?;
    let spec = dir.path().join("spec.yaml");
    std::fs::write(
        &spec,
        format!(
            "pipeline: harden_protocol\nsource:\n  class: generator\n  parameters: {{count: 10}}\nsinks:\n  - name: ch\n    sink_class_name: ClickHouseBatchingSink\n    input_stream_ids: [rows]\n    parameters: {{host: '{HOST}:{port}', table: harden_protocol{tls}}}\n    dynamic_parameters: {{retry_backoff: 100ms}}\n"
        ),
    )?;
    let started = Instant::now();
    let mut worker = Worker::spawn(
        worker_bin!(),
        &spec,
        &dir.path().join("state"),
        dir.path().join("worker.log"),
    )?;
    let code = worker
        .wait_exit(Duration::from_secs(60))
        .context("the worker must stop by itself")?;
    let log = std::fs::read_to_string(worker.log())?;
    Ok((code, started.elapsed(), log))
}

#[test]
fn plain_http_against_the_https_port_is_refused_saying_the_port_speaks_tls() -> anyhow::Result<()> {
    wait_for_cluster(Duration::from_secs(120))?;
    let (code, took, log) = run_against(A1.https_port, "")?;
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains(PLAIN_TO_TLS), "{log}");
    assert!(took < Duration::from_secs(30), "{took:?}\n{log}");
    Ok(())
}

#[test]
fn tls_against_the_plain_http_port_is_refused_saying_the_port_speaks_plain_http(
) -> anyhow::Result<()> {
    wait_for_cluster(Duration::from_secs(120))?;
    let (code, took, log) = run_against(
        A1.http_port,
        ", enable_tls: true, tls_skip_verification: true",
    )?;
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains(TLS_TO_PLAIN), "{log}");
    assert!(took < Duration::from_secs(30), "{took:?}\n{log}");
    Ok(())
}

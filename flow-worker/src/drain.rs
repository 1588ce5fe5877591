//! `flow-worker drain`: delivers every batch pending in the outbox without reading the source,
//! so that a topology change (shard set, sharding key, endpoints) starts with nothing pending.
//!
//! The drain runs under the spec it is given, and the sinks open as for `run`: the topology
//! guard of the exactly-once ClickHouse sinks compares that spec with the fingerprints recorded
//! for the pending batches and refuses a spec that was already edited. Delivering under a
//! recorded topology instead is not possible: the state keeps only the fingerprints and shard
//! names of the pending batches, not the hosts they were meant for. So the order is: stop the
//! worker, drain with the unchanged spec, edit the spec, run.
//!
//! In cluster mode (`--cluster`) every worker of the pipeline is stopped first (a drain refuses
//! to run beside live members); the drain then takes every partition's lease, loads its state
//! from ZooKeeper and delivers and acknowledges with the same fencing as a worker.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use flow::DrainLeases;
use flow_core::{DrainReport, Pipeline, PipelineControl, PipelineSpec, Registry};
use flow_state::cluster::ClusterUrl;
use tokio::signal::unix::{signal, SignalKind};
use tracing::{info, warn};

/// How long a cluster drain waits for each partition's lease: a worker killed just before keeps
/// its leases until its ZooKeeper session expires (at most 20 ZooKeeper ticks, 40 s by default).
const LEASE_WAIT: Duration = Duration::from_secs(45);

pub fn drain(
    registry: &Registry,
    spec_path: &Path,
    state_dir: Option<&Path>,
    cluster: Option<&ClusterUrl>,
) -> anyhow::Result<ExitCode> {
    let spec = PipelineSpec::from_file(spec_path)?;
    let validated = registry.build(&spec)?;
    let cluster = crate::run::ClusterArgs {
        url: cluster.cloned(),
        session_timeout: None,
    }
    .resolve(validated.cluster.as_ref());
    if cluster.is_some() {
        crate::run::check_cluster_capable(&spec, &validated)?;
    }
    let state_dir = crate::run::resolve_state_dir(spec_path, state_dir, &validated)?;
    // A mistyped directory must not read as "nothing pending: change the topology". In cluster
    // mode the pending batches are in ZooKeeper and the directory is only this process's cache.
    if cluster.is_none() && !crate::run::is_state_dir(&state_dir) {
        bail!(
            "`{}` is not a flow state directory: nothing was ever committed there; pass the state directory of the pipeline to drain",
            state_dir.display()
        );
    }
    crate::memory::configure_allocator();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("flow-drain")
        .build()
        .context("starting the tokio runtime")?;
    let outcome = runtime.block_on(async {
        info!(pipeline = %spec.pipeline, state_dir = %state_dir.display(), "draining the outbox");
        let store = flow::open_state_store(&state_dir).await?;
        let leases = match &cluster {
            Some(options) => {
                let taken = DrainLeases::take_all(
                    &options.url,
                    options.session_timeout,
                    &store,
                    &spec.pipeline,
                    spec.partitions,
                    LEASE_WAIT,
                )
                .await;
                match taken {
                    Ok(leases) => Some(leases),
                    Err(err) => {
                        let _ = flow::close_state_store(store).await;
                        return Err(err.into());
                    }
                }
            }
            None => None,
        };
        let pipeline = Pipeline::new(validated, store.clone());
        let signals = tokio::spawn(stop_on_signal(pipeline.control()));
        let drained = pipeline.drain().await;
        signals.abort();
        if let Some(leases) = leases {
            leases.release_all(&store).await;
        }
        let closed = flow::close_state_store(store).await;
        let report = drained?;
        closed?;
        Ok::<_, anyhow::Error>(report)
    });
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    conclude(&spec.pipeline, &outcome?)
}

/// The line an operator waits for, or why the outbox is not empty yet.
fn conclude(pipeline: &str, report: &DrainReport) -> anyhow::Result<ExitCode> {
    let (before, after) = (&report.before, &report.after);
    if before.is_empty() {
        println!(
            "nothing pending in the outbox of pipeline `{pipeline}`: the topology can be changed now"
        );
        return Ok(ExitCode::SUCCESS);
    }
    if !after.is_empty() {
        bail!(
            "the drain stopped with {} batch(es), {} row(s) of pipeline `{pipeline}` still pending; do not change the topology yet: run `flow-worker drain` again",
            after.batches(),
            after.rows()
        );
    }
    info!(
        pipeline,
        batches = before.batches(),
        rows = before.rows(),
        "outbox drained"
    );
    println!(
        "drained pipeline `{pipeline}`: {} batch(es), {} row(s) delivered, nothing pending: the topology can now be changed",
        before.batches(),
        before.rows()
    );
    Ok(ExitCode::SUCCESS)
}

/// SIGINT/SIGTERM stop the drain after the batches in flight; the rest stays pending.
async fn stop_on_signal(control: PipelineControl) {
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        warn!("cannot install signal handlers; stop the drain with SIGKILL, which is safe");
        return;
    };
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
    info!("stop signal: stopping the drain; what is not delivered stays in the outbox");
    control.shutdown();
}

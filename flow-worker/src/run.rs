//! `flow-worker run`: the pipeline on a multi-threaded tokio runtime, with signal handling.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use flow_core::{Pipeline, PipelineControl, PipelineSpec, Registry};
use flow_state::cluster::ClusterUrl;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::progress::{OutboxSample, ProgressLine};

/// What `flow-worker run` was asked for besides the spec.
pub struct RunOptions<'a> {
    pub state_dir: Option<&'a Path>,
    pub show_progress: bool,
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// `--cluster` and `--session-timeout-ms`; they win over the spec's `cluster`.
    pub cluster: ClusterArgs,
}

/// What the command line says about cluster mode.
#[derive(Default)]
pub struct ClusterArgs {
    pub url: Option<ClusterUrl>,
    pub session_timeout: Option<std::time::Duration>,
}

impl ClusterArgs {
    /// The cluster to join: the command line's URL, else the spec's; the session timeout of the
    /// command line, else of the spec, else the default. `None`: one process, no cluster.
    pub fn resolve(self, spec: Option<&flow_core::ClusterSettings>) -> Option<ClusterOptions> {
        let url = self.url.or_else(|| spec.map(|s| s.url.clone()))?;
        let session_timeout = self
            .session_timeout
            .or_else(|| spec.map(|s| s.session_timeout))
            .unwrap_or(flow_state::cluster::DEFAULT_SESSION_TIMEOUT);
        Some(ClusterOptions {
            url,
            session_timeout,
        })
    }
}

/// `--cluster` and its session timeout.
pub struct ClusterOptions {
    pub url: ClusterUrl,
    pub session_timeout: std::time::Duration,
}

pub fn run(
    registry: &Registry,
    spec_path: &Path,
    options: RunOptions<'_>,
) -> anyhow::Result<ExitCode> {
    let RunOptions {
        state_dir,
        show_progress,
        metrics_addr,
        cluster,
    } = options;
    let spec = PipelineSpec::from_file(spec_path)?;
    let validated = registry.build(&spec)?;
    let cluster = cluster.resolve(validated.cluster.as_ref());
    if cluster.is_some() {
        check_cluster_capable(&spec, &validated)?;
    }
    let state_dir = resolve_state_dir(spec_path, state_dir, &validated)?;
    let metrics_addr = metrics_addr.or(validated.metrics.map(|m| m.listen));
    // Before the runtime's threads exist, so that every arena gets the settings.
    crate::memory::configure_allocator();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("flow-worker")
        .build()
        .context("starting the tokio runtime")?;
    let outcome = runtime.block_on(async move {
        let store = flow::open_state_store(&state_dir).await?;
        let leases = match &cluster {
            Some(options) => Some(join_cluster(options, &store, &spec).await?),
            None => {
                flow::warn_if_no_earlier_state(&store, &spec.pipeline, spec.partitions)
                    .context("reading the committed positions")?;
                None
            }
        };
        let pipeline = Pipeline::new(validated, store.clone());
        let control = pipeline.control();
        let metrics = pipeline.metrics();
        pipeline.load_counters().await?;
        let endpoint = match metrics_addr {
            Some(addr) => Some(flow::MetricsEndpoint::serve(addr, Arc::clone(&metrics)).await?),
            None => None,
        };
        let (outbox, outbox_samples) = watch::channel(None);
        let snapshots = tokio::spawn(write_snapshots(Snapshots {
            status: flow::LiveStatus::new(&spec.pipeline, store.clone(), control.clone(), metrics),
            control: control.clone(),
            pipeline: spec.pipeline.clone(),
            outbox,
        }));
        let progress = show_progress.then(|| {
            ProgressLine::start(spec.pipeline.clone(), spec.partitions, control.clone(), outbox_samples)
        });
        let memory = tokio::spawn(crate::memory::report_memory());
        let signals = tokio::spawn(handle_signals(
            control.clone(),
            registry.clone(),
            spec_path.to_path_buf(),
        ));
        info!(pipeline = %spec.pipeline, partitions = spec.partitions, state_dir = %state_dir.display(), "pipeline started");
        let result = match leases {
            Some(leases) => pipeline.run_owned(leases).await,
            None => pipeline.run().await,
        };
        if let Some(line) = progress {
            line.stop();
        }
        signals.abort();
        snapshots.abort();
        memory.abort();
        drop(endpoint);
        // Once the worker is gone, `status` reads the store itself.
        let _ = std::fs::remove_file(flow::snapshot_path(&state_dir));
        let closed = flow::close_state_store(store).await;
        match result {
            Ok(report) => {
                info!(
                    pipeline = %spec.pipeline,
                    messages = report.messages(),
                    stopped_early = report.partitions.iter().any(|p| p.end == flow_core::PartitionEnd::Stopped),
                    "pipeline finished"
                );
                closed.map(|()| ExitCode::SUCCESS).map_err(Into::into)
            }
            // Each partition's failure was logged when it happened; `main` prints the whole.
            Err(err) => Err(err.into()),
        }
    });
    // Blocking tasks still stuck in the file system are not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    outcome
}

/// Cluster mode keeps only batch bounds in ZooKeeper: a pipeline whose outbox keeps payloads
/// cannot run in it.
pub(crate) fn check_cluster_capable(
    spec: &PipelineSpec,
    validated: &flow_core::ValidatedPipeline,
) -> anyhow::Result<()> {
    if !validated.stores_bounds() {
        bail!(
            "pipeline `{}` cannot run with --cluster: its outbox would keep batch payloads (the source `{}` cannot re-read a committed range, or `outbox.payloads: always`), and a cluster keeps only batch bounds in ZooKeeper; run it without --cluster",
            spec.pipeline,
            spec.source.class
        );
    }
    Ok(())
}

/// This process's id among the pipeline's workers: unique while it runs (a restarted worker is
/// a new member; its predecessor's session may still be alive for a while).
fn worker_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| {
            h.trim()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect::<String>()
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".to_owned());
    format!("{host}-{}", std::process::id())
}

async fn join_cluster(
    options: &ClusterOptions,
    store: &flow_state::StateStore,
    spec: &PipelineSpec,
) -> anyhow::Result<Arc<flow::ClusterLeases>> {
    let id = worker_id();
    let url = &options.url;
    let leases = flow::ClusterLeases::join(
        url,
        &id,
        options.session_timeout,
        store,
        &spec.pipeline,
        spec.partitions,
    )
    .await?;
    info!(pipeline = %spec.pipeline, worker = %id, cluster = %url, "running in cluster mode");
    Ok(leases)
}

/// The state directory, absolute: `--state-dir` (relative to the working directory: it is a path
/// typed in the user's shell), else `state_dir` of the spec (which `PipelineSpec::from_file`
/// resolved against the spec file's directory).
pub(crate) fn resolve_state_dir(
    spec_path: &Path,
    state_dir: Option<&Path>,
    validated: &flow_core::ValidatedPipeline,
) -> anyhow::Result<PathBuf> {
    match (state_dir, &validated.state_dir) {
        (Some(dir), _) => {
            if dir.as_os_str().is_empty() {
                bail!("--state-dir is an empty path; name a directory");
            }
            std::path::absolute(dir)
                .with_context(|| format!("making --state-dir `{}` absolute", dir.display()))
        }
        (None, Some(dir)) => {
            if dir.as_os_str().is_empty() {
                bail!(
                    "`state_dir` in {} is an empty path; name a directory",
                    spec_path.display()
                );
            }
            refuse_moved_state_dir(spec_path, dir)?;
            Ok(dir.clone())
        }
        (None, None) => bail!(
            "no state directory: set `state_dir` in {} or pass --state-dir",
            spec_path.display()
        ),
    }
}

/// Whether `dir` holds a state store (sled's files).
pub(crate) fn is_state_dir(dir: &Path) -> bool {
    dir.join("db").exists() || dir.join("conf").exists()
}

/// Refuses to start on an empty `resolved` directory when the spec's relative `state_dir`, read
/// as earlier versions read it (against the working directory), names a directory that holds a
/// store: that is this pipeline's outbox from before `state_dir` became relative to the spec
/// file, and starting without it would read the source from the beginning and send everything
/// again.
fn refuse_moved_state_dir(spec_path: &Path, resolved: &Path) -> anyhow::Result<()> {
    if is_state_dir(resolved) {
        return Ok(());
    }
    // The spec as written: `from_file` already replaced a relative `state_dir`.
    let text = std::fs::read_to_string(spec_path)
        .with_context(|| format!("reading the spec file `{}`", spec_path.display()))?;
    let Some(written) = PipelineSpec::from_yaml(&text)?
        .state_dir
        .filter(|dir| dir.is_relative())
    else {
        return Ok(());
    };
    let Ok(old) = std::path::absolute(&written) else {
        return Ok(());
    };
    if old != resolved && is_state_dir(&old) {
        bail!(
            "`state_dir: {written}` of {spec} is relative to the spec file's directory, so it is `{new}`, which holds no state; but `{old}` (the same path relative to the working directory, where earlier versions put it) is a state directory. Starting on `{new}` would read the source from the beginning and send everything again. Move `{old}` to `{new}`, or pass --state-dir `{old}`, or write the absolute path in the spec",
            written = written.display(),
            spec = spec_path.display(),
            new = resolved.display(),
            old = old.display(),
        );
    }
    Ok(())
}

/// SIGINT/SIGTERM: graceful stop (a second one exits at once; the outbox makes that safe).
/// SIGHUP: reload the spec file and apply changed dynamic parameters.
async fn handle_signals(control: PipelineControl, registry: Registry, spec_path: PathBuf) {
    let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        warn!("cannot install signal handlers; stop the worker with SIGKILL, which is safe");
        return;
    };
    loop {
        let stop = tokio::select! {
            _ = int.recv() => true,
            _ = term.recv() => true,
            _ = hup.recv() => false,
        };
        if stop {
            if control.is_shutting_down() {
                warn!("second stop signal: exiting now; undelivered batches stay in the outbox");
                std::process::exit(130);
            }
            info!("stop signal: finishing the current epoch, then stopping");
            control.shutdown();
            continue;
        }
        let reloaded =
            PipelineSpec::from_file(&spec_path).and_then(|spec| control.reload(&registry, &spec));
        match reloaded {
            Ok(outcome) => {
                info!(spec = %spec_path.display(), reconfigured = ?outcome.reconfigured, "spec reloaded");
                if outcome.static_changed {
                    let changed = outcome.static_changes.join(", ");
                    warn!(spec = %spec_path.display(), changed = %changed, "static parameters changed in the spec ({changed}); they take effect only after a restart of the worker");
                }
            }
            Err(err) => {
                warn!(spec = %spec_path.display(), error = %err, "spec reload rejected; the running parameters stay in force. Fix the spec and send SIGHUP again");
            }
        }
    }
}

/// How often a running worker writes the status snapshot that `flow-worker status` shows while the
/// store is locked.
const SNAPSHOT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);

/// What the snapshot task reads and where it writes.
struct Snapshots {
    status: flow::LiveStatus,
    control: PipelineControl,
    pipeline: String,
    /// Where the progress line takes the outbox from.
    outbox: watch::Sender<Option<OutboxSample>>,
}

/// Writes the pipeline's status (`flow::LiveStatus`: the store's summary with the running
/// pipeline's source lag and what its sinks saw since the start, which also sets the backlog and
/// lag gauges of the metrics) to the state directory every `SNAPSHOT_INTERVAL`, and hands the
/// outbox it shows to the progress line.
async fn write_snapshots(snapshots: Snapshots) {
    let Snapshots {
        status,
        control,
        pipeline,
        outbox,
    } = snapshots;
    let mut warned = false;
    loop {
        let rows_sealed = control.progress().rows_sealed;
        let written = match status.summary().await {
            Ok(summary) => {
                outbox.send_replace(Some(OutboxSample::of(&summary, &pipeline, rows_sealed)));
                status.write_snapshot(&summary).await
            }
            Err(err) => Err(err),
        };
        if let Err(error) = written {
            if !warned {
                warn!(error = %error, "cannot write the status snapshot; `flow-worker status` will not show this worker's progress while it runs");
                warned = true;
            }
        }
        tokio::time::sleep(SNAPSHOT_INTERVAL).await;
    }
}

//! The command line: argument parsing, logging set-up and dispatch.

use crate::dead_letters::{self, Action};
use crate::{drain, progress, run, status, status_cluster, status_watch, verify};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "flow-worker",
    version,
    about = "Runs flow pipelines described by a YAML spec"
)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run a pipeline. SIGINT/SIGTERM stop it gracefully; SIGHUP reloads dynamic parameters. On
    /// a terminal, stderr shows a live progress line (rates in and out, pending, lag).
    Run {
        spec: PathBuf,
        /// State directory; wins over `state_dir` in the spec.
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Serve Prometheus metrics at http://HOST:PORT/metrics (an IP address and port); wins
        /// over `metrics.listen` in the spec.
        #[arg(long, value_name = "HOST:PORT")]
        metrics_addr: Option<std::net::SocketAddr>,
        /// Run as one of several workers of the pipeline, coordinated through ZooKeeper: the
        /// partitions are spread over the live workers, each owned and fenced through the
        /// cluster, and their committed state lives there (`--state-dir` is this worker's own).
        /// Wins over `cluster.url` of the spec.
        #[arg(long, value_name = "zk://HOST:PORT[,HOST:PORT]/PATH")]
        cluster: Option<flow_state::cluster::ClusterUrl>,
        /// With --cluster: the ZooKeeper session timeout this worker asks for, in milliseconds
        /// (default 10000, or `cluster.session_timeout_ms` of the spec; the server bounds it to
        /// 2..20 of its ticks). A worker cut off longer loses its partitions to the others.
        #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..=120_000))]
        session_timeout_ms: Option<u64>,
    },
    /// Deliver every batch pending in the outbox without reading the source, then exit 0: the
    /// topology can then be changed. Run it on a stopped worker with the unchanged spec.
    Drain {
        spec: PathBuf,
        /// State directory; wins over `state_dir` in the spec.
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Drain a pipeline run by several workers (`run --cluster`, or `cluster` in the spec):
        /// stop every worker first; the drain takes every partition and delivers what ZooKeeper
        /// holds pending. Wins over `cluster.url` of the spec.
        #[arg(long, value_name = "zk://HOST:PORT[,HOST:PORT]/PATH")]
        cluster: Option<flow_state::cluster::ClusterUrl>,
    },
    /// Parse and validate a spec without connecting anywhere; exit 1 on any violation.
    Validate { spec: PathBuf },
    /// Check that the replicas of every shard of every ClickHouse sink hold the same rows; name
    /// a diverged replica and how to repair it. Exit 0 consistent, 1 invalid spec or a replica
    /// not reachable, 2 diverged, 3 still replicating.
    Verify {
        spec: PathBuf,
        /// One JSON object per sink instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show committed positions, undelivered batches, fingerprints and dead letters: of a state
    /// directory, or (`--cluster URL --pipeline NAME`) of a pipeline run by several workers, as
    /// ZooKeeper holds it, with its members and each partition's owner.
    Status {
        #[arg(long, required_unless_present = "cluster", conflicts_with = "cluster")]
        state_dir: Option<PathBuf>,
        /// The cluster the pipeline's workers joined (`run --cluster`).
        #[arg(
            long,
            value_name = "zk://HOST:PORT[,HOST:PORT]/PATH",
            requires = "pipeline",
            conflicts_with = "watch"
        )]
        cluster: Option<flow_state::cluster::ClusterUrl>,
        /// With --cluster: the pipeline's name (`pipeline:` in its spec).
        #[arg(long, requires = "cluster")]
        pipeline: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Refresh until Ctrl-C: on a terminal the screen is redrawn; otherwise each refresh is
        /// appended (JSON: one object per line).
        #[arg(long)]
        watch: bool,
        /// Seconds between refreshes of `--watch` (a running worker's snapshot is refreshed
        /// every 2 s).
        #[arg(long, default_value_t = 2, requires = "watch", value_parser = clap::value_parser!(u64).range(1..=3600))]
        interval: u64,
    },
    /// List, export (JSON lines on stdout), requeue (the rows the server refused go back into the
    /// outbox for the next run) or purge the dead letters of a stopped worker.
    DeadLetters {
        #[arg(value_enum)]
        action: Action,
        #[arg(long)]
        state_dir: PathBuf,
        /// Only this sink's dead letters.
        #[arg(long)]
        sink: Option<String>,
        /// Confirms `purge`.
        #[arg(long)]
        yes: bool,
    },
}

fn init_logging(format: LogFormat, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    // Colours only on a terminal: a log redirected to a file or collected by a supervisor must
    // stay greppable. NO_COLOR (https://no-color.org) turns them off on a terminal too.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        // Erases `run`'s progress line, if shown, before each log line.
        .with_writer(progress::log_writer);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Runs the CLI with the process arguments.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // `run` reports progress; the inspection commands print results and log only problems.
    let default_level = match cli.command {
        Command::Run { .. } | Command::Drain { .. } => "info",
        _ => "warn",
    };
    init_logging(cli.log_format, default_level);
    let registry = flow::registry();
    let result = match cli.command {
        Command::Run {
            spec,
            state_dir,
            metrics_addr,
            cluster,
            session_timeout_ms,
        } => {
            let progress = progress::wanted(cli.log_format == LogFormat::Json);
            run::run(
                &registry,
                &spec,
                run::RunOptions {
                    state_dir: state_dir.as_deref(),
                    show_progress: progress,
                    metrics_addr,
                    cluster: run::ClusterArgs {
                        url: cluster,
                        session_timeout: session_timeout_ms.map(std::time::Duration::from_millis),
                    },
                },
            )
        }
        Command::Drain {
            spec,
            state_dir,
            cluster,
        } => drain::drain(&registry, &spec, state_dir.as_deref(), cluster.as_ref()),
        Command::Validate { spec } => Ok(validate(&registry, &spec)),
        Command::Verify { spec, json } => verify::verify(&registry, &spec, json),
        Command::Status {
            cluster: Some(url),
            pipeline: Some(pipeline),
            json,
            ..
        } => status_cluster::status(&url, &pipeline, json),
        Command::Status {
            state_dir: Some(state_dir),
            json,
            watch: false,
            ..
        } => status::status(&state_dir, json),
        Command::Status {
            state_dir: Some(state_dir),
            json,
            interval,
            ..
        } => status_watch::watch(&state_dir, json, std::time::Duration::from_secs(interval)),
        // clap requires --state-dir unless --cluster, and --pipeline with --cluster.
        Command::Status { .. } => Err(anyhow::anyhow!(
            "status needs --state-dir DIR, or --cluster URL with --pipeline NAME"
        )),
        Command::DeadLetters {
            action,
            state_dir,
            sink,
            yes,
        } => dead_letters::dead_letters(&state_dir, action, sink.as_deref(), yes),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", crate::error_text::error_text(&err));
            ExitCode::FAILURE
        }
    }
}

fn validate(registry: &flow_core::Registry, path: &std::path::Path) -> ExitCode {
    let built = flow_core::PipelineSpec::from_file(path).and_then(|spec| registry.build(&spec));
    match built {
        Ok(pipeline) => {
            println!(
                "{}: valid (pipeline `{}`, {} partition(s), {} sink(s))",
                path.display(),
                pipeline.name,
                pipeline.partitions,
                pipeline.sinks.len()
            );
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("{}: {} violation(s)", path.display(), err.violations.len());
            for violation in &err.violations {
                println!("{violation}");
            }
            ExitCode::FAILURE
        }
    }
}

//! The command line: argument parsing, logging set-up and dispatch.

use crate::dead_letters::{self, Action};
use crate::{run, status};
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

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run a pipeline. SIGINT/SIGTERM stop it gracefully; SIGHUP reloads dynamic parameters.
    Run {
        spec: PathBuf,
        /// State directory; wins over `state_dir` in the spec.
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Serve Prometheus metrics at http://HOST:PORT/metrics (an IP address and port); wins
        /// over `metrics.listen` in the spec.
        #[arg(long, value_name = "HOST:PORT")]
        metrics_addr: Option<std::net::SocketAddr>,
    },
    /// Parse and validate a spec without connecting anywhere; exit 1 on any violation.
    Validate { spec: PathBuf },
    /// Show committed positions, undelivered batches, fingerprints and dead letters.
    Status {
        #[arg(long)]
        state_dir: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
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
        .with_writer(std::io::stderr);
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
        Command::Run { .. } => "info",
        _ => "warn",
    };
    init_logging(cli.log_format, default_level);
    let registry = crate::registry();
    let result = match cli.command {
        Command::Run {
            spec,
            state_dir,
            metrics_addr,
        } => run::run(&registry, &spec, state_dir.as_deref(), metrics_addr),
        Command::Validate { spec } => Ok(validate(&registry, &spec)),
        Command::Status { state_dir, json } => status::status(&state_dir, json),
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
            eprintln!("error: {err:#}");
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

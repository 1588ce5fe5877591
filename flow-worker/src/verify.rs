//! `flow-worker verify SPEC`: asks every replica of every ClickHouse sink whether it holds the
//! rows its twins hold (see `flow_clickhouse::verify_replicas`), and prints per shard what it
//! found and, for a diverged replica, how to repair it.
//!
//! Exit codes: 0 every shard consistent, or its table does not replicate (nothing to compare); 1 the spec is invalid or a replica could not be asked;
//! 2 a replica diverged; 3 replicas differ while replication is still running.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use flow_clickhouse::{verify_sink, ShardVerdict};

/// The verdicts of a whole spec, worst first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Consistent,
    NotReplicated,
    Unsettled,
    Diverged,
    Unreachable,
}

impl Outcome {
    fn of(verdict: &ShardVerdict) -> Outcome {
        match verdict {
            ShardVerdict::Consistent { .. } => Outcome::Consistent,
            ShardVerdict::NotReplicated { .. } => Outcome::NotReplicated,
            ShardVerdict::Unsettled => Outcome::Unsettled,
            ShardVerdict::Diverged { .. } => Outcome::Diverged,
            ShardVerdict::Unreachable { .. } => Outcome::Unreachable,
        }
    }

    fn exit_code(self) -> ExitCode {
        match self {
            // Nothing to repair: a plain MergeTree sink is a supported setup, and the report says
            // that nothing was compared.
            Outcome::Consistent | Outcome::NotReplicated => ExitCode::SUCCESS,
            Outcome::Unreachable => ExitCode::from(1),
            Outcome::Diverged => ExitCode::from(2),
            Outcome::Unsettled => ExitCode::from(3),
        }
    }
}

/// Checks every ClickHouse sink of the spec at `path`; prints a report per shard (or, with `json`,
/// one JSON object per sink: `{"sink": NAME, "shards": [...]}`).
pub fn verify(registry: &flow_core::Registry, path: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let spec = flow_core::PipelineSpec::from_file(path)
        .with_context(|| format!("cannot read the spec {}", path.display()))?;
    if let Err(err) = registry.build(&spec) {
        eprintln!("{}: {} violation(s)", path.display(), err.violations.len());
        for violation in &err.violations {
            eprintln!("{violation}");
        }
        return Ok(ExitCode::FAILURE);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let mut worst = Outcome::Consistent;
    let mut checked = 0usize;
    for sink in &spec.sinks {
        let reports = runtime
            .block_on(verify_sink(
                &sink.sink_class_name,
                &sink.parameters,
                &sink.dynamic_parameters,
                spec.paths(),
            ))
            .with_context(|| format!("sink `{}`", sink.name))?;
        let Some(reports) = reports else {
            continue;
        };
        checked += 1;
        for report in &reports {
            worst = worst.max(Outcome::of(&report.verdict));
        }
        if json {
            let line = serde_json::json!({ "sink": sink.name, "shards": reports });
            println!("{line}");
            continue;
        }
        println!("sink `{}`:", sink.name);
        for report in reports {
            for line in report.to_string().lines() {
                println!("  {line}");
            }
        }
    }
    if checked == 0 && !json {
        println!("{}: no ClickHouse sink to verify", path.display());
    }
    Ok(worst.exit_code())
}

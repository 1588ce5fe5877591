//! The runtime's half of the topology guard: the sinks a state directory holds undelivered
//! batches for must still be in the spec, each of the class that sealed them. A sink's own
//! guard (the ClickHouse sinks' fingerprints) can only speak for a sink that opens; a sink
//! renamed or removed never opens, and a sink of another class does not read the batches the
//! first one sealed, so either change would leave them unsent for good while the source goes on
//! from the committed position.
//!
//! Each sink's class is kept as a sink-wide value ([`CLASS_VALUE`]) once nothing of the sink
//! is pending under another class; a state directory from before the record has none, and its
//! pending batches are taken as the spec's class (nothing else can be known about them).

use flow_state::{SinkPartition, StateStore};

use crate::error::RuntimeError;
use crate::spec::ValidatedPipeline;

/// The sink-wide value holding the class that sealed a sink's batches (UTF-8).
const CLASS_VALUE: &str = "runtime/class";

/// What the state directory holds undelivered for one sink, over every partition.
#[derive(Debug, Default, PartialEq, Eq)]
struct Pending {
    batches: u64,
    rows: u64,
}

/// Refuses a spec that drops or changes the class of a sink with undelivered batches, then
/// records every sink's class. Blocking (sled reads and a write per sink whose class is new).
pub(crate) fn check(store: &StateStore, pipeline: &ValidatedPipeline) -> Result<(), RuntimeError> {
    let state = |source| RuntimeError::State {
        partition: 0,
        source,
    };
    for sink in store.sink_names().map_err(state)? {
        if pipeline.sinks.iter().any(|s| s.name == sink) {
            continue;
        }
        let pending = pending(store, pipeline, &sink)?;
        if pending.batches > 0 {
            return Err(RuntimeError::SinkRemoved {
                sink,
                batches: pending.batches,
                rows: pending.rows,
            });
        }
    }
    for sink in &pipeline.sinks {
        let stored = store
            .sink_value(&pipeline.name, &sink.name, CLASS_VALUE)
            .map_err(state)?
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
        if stored.as_deref() == Some(sink.class.as_str()) {
            continue;
        }
        let pending = pending(store, pipeline, &sink.name)?;
        if let (Some(stored), true) = (&stored, pending.batches > 0) {
            return Err(RuntimeError::SinkClassChanged {
                sink: sink.name.clone(),
                stored: stored.clone(),
                spec: sink.class.clone(),
                batches: pending.batches,
                rows: pending.rows,
            });
        }
        store
            .set_sink_value_blocking(
                &pipeline.name,
                &sink.name,
                CLASS_VALUE,
                Some(sink.class.as_bytes().to_vec()),
            )
            .map_err(state)?;
    }
    Ok(())
}

/// The undelivered batches and rows of `sink` over the pipeline's partitions.
fn pending(
    store: &StateStore,
    pipeline: &ValidatedPipeline,
    sink: &str,
) -> Result<Pending, RuntimeError> {
    let mut total = Pending::default();
    for partition in 0..pipeline.partitions {
        let key = SinkPartition {
            pipeline: pipeline.name.clone(),
            sink: sink.to_owned(),
            partition,
        };
        let batches = store
            .undelivered(&key)
            .map_err(|source| RuntimeError::State { partition, source })?;
        total.batches += batches.len() as u64;
        total.rows += batches.iter().map(|b| b.batch.rows).sum::<u64>();
    }
    Ok(total)
}

//! A spec after validation: what the runtime runs, with every plugin built.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::pipeline_spec::ClusterSettings;

use crate::plugin::{ProcessorFactory, SinkFactory, SourceFactory};
use crate::types::StreamSchema;

use super::pipeline_spec::{EpochSpec, MetricsSettings, PayloadPolicy, PipelineSpec};

/// Epoch bounds after validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpochSettings {
    /// Messages per partition after which an epoch ends.
    pub max_messages: usize,
    /// Time after which an epoch ends.
    pub max_duration: Duration,
}

impl EpochSettings {
    /// The bounds `epoch` sets (its values already checked).
    pub fn of(epoch: &EpochSpec) -> EpochSettings {
        EpochSettings {
            max_messages: usize::try_from(epoch.max_messages).unwrap_or(usize::MAX),
            max_duration: Duration::from_millis(epoch.max_duration_ms),
        }
    }
}

impl Default for EpochSettings {
    /// The bounds of a spec without `epoch`.
    fn default() -> Self {
        EpochSettings::of(&EpochSpec::default())
    }
}

/// A processor of a validated spec, built by its factory.
pub struct ValidatedProcessor {
    /// Its name in the spec.
    pub name: String,
    /// Builds the processor of each partition.
    pub factory: Arc<dyn ProcessorFactory>,
    /// The stream it reads.
    pub input_stream_id: String,
    /// The stream it emits.
    pub output_stream_id: String,
}

/// A sink of a validated spec, built by its factory.
pub struct ValidatedSink {
    /// Its name in the spec.
    pub name: String,
    /// Its `sink_class_name`.
    pub class: String,
    /// Opens the sink of each partition.
    pub factory: Arc<dyn SinkFactory>,
    /// The streams it writes.
    pub input_stream_ids: Vec<String>,
    /// The `dynamic_parameters` it starts with.
    pub dynamic_parameters: serde_yaml::Value,
}

/// A spec that passed validation, with every plugin built (none has connected anywhere yet).
pub struct ValidatedPipeline {
    /// The pipeline's name.
    pub name: String,
    /// Its partition count.
    pub partitions: u32,
    /// The spec's `state_dir`, if any (absolute when the spec was read by
    /// [`PipelineSpec::from_file`](crate::PipelineSpec::from_file)).
    pub state_dir: Option<PathBuf>,
    /// When an epoch ends.
    pub epoch: EpochSettings,
    /// Whether sealed batches keep their payloads.
    pub payloads: PayloadPolicy,
    /// How long a graceful stop lets sinks deliver what is pending.
    pub drain_timeout: Duration,
    /// The Prometheus endpoint of the spec, if any.
    pub metrics: Option<MetricsSettings>,
    /// The cluster of the spec, if any.
    pub cluster: Option<ClusterSettings>,
    /// Builds the source of each partition.
    pub source: Arc<dyn SourceFactory>,
    /// The processors, in spec order.
    pub processors: Vec<ValidatedProcessor>,
    /// The sinks, in spec order.
    pub sinks: Vec<ValidatedSink>,
    /// The schema of every stream, by stream id.
    pub streams: BTreeMap<String, Arc<StreamSchema>>,
    /// The spec it was built from.
    pub spec: PipelineSpec,
}

impl ValidatedPipeline {
    /// Whether the outbox keeps only the bounds of rebuildable batches: the source can re-read
    /// a committed range and the spec does not ask for payloads.
    pub fn stores_bounds(&self) -> bool {
        self.payloads == PayloadPolicy::Auto && self.source.replayable()
    }
}

//! [`PipelineSpec`] assembled in code from typed plugin configs: every key the YAML spec takes
//! has a setter, unset keys get the YAML defaults, and the result is the same `PipelineSpec` that
//! [`PipelineSpec::from_yaml`] would give for the equivalent text. Validating it stays
//! [`Registry::build`](crate::Registry::build), which reports every violation with its path.
//! The source is required: `build` exists only once [`PipelineSpecBuilder::source`] was called.

use std::path::PathBuf;

use super::pipeline_spec::{
    ClusterSpec, EpochSpec, MetricsSpec, OutboxSpec, PipelineSpec, ProcessorSpec, ShutdownSpec,
    SinkSpec, SourceSpec,
};
use super::plugin_config::{ProcessorConfig, SinkConfig, SourceConfig};

/// The state of a [`PipelineSpecBuilder`] whose source is not set yet.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NoSource;

/// Assembles a [`PipelineSpec`]; made by [`PipelineSpec::builder`]. `S` is [`NoSource`] until
/// [`source`](PipelineSpecBuilder::source) sets the source's [`SourceSpec`].
#[derive(Clone, Debug, PartialEq)]
#[must_use]
pub struct PipelineSpecBuilder<S = NoSource> {
    spec: SpecParts,
    source: S,
}

/// Everything of the spec but its source.
#[derive(Clone, Debug, PartialEq)]
struct SpecParts {
    pipeline: String,
    partitions: u32,
    state_dir: Option<PathBuf>,
    epoch: EpochSpec,
    outbox: OutboxSpec,
    shutdown: ShutdownSpec,
    metrics: Option<MetricsSpec>,
    cluster: Option<ClusterSpec>,
    processors: Vec<ProcessorSpec>,
    sinks: Vec<SinkSpec>,
}

impl PipelineSpec {
    /// A builder of the spec of pipeline `pipeline` with the YAML defaults: one partition, no
    /// state directory, default epoch, outbox and shutdown, no metrics endpoint.
    ///
    /// ```
    /// use flow_core::sinks::DebugSinkConfig;
    /// use flow_core::sources::GeneratorParams;
    /// use flow_core::{EpochSpec, PipelineSpec, Registry};
    ///
    /// let spec = PipelineSpec::builder("demo")
    ///     .partitions(2)
    ///     .epoch(EpochSpec { max_messages: 1000, ..EpochSpec::default() })
    ///     .source(GeneratorParams::new(100))
    ///     .sink("out", ["rows"], DebugSinkConfig::new("-"))
    ///     .build();
    /// let pipeline = Registry::with_builtins().build(&spec)?;
    /// assert_eq!(pipeline.partitions, 2);
    /// # Ok::<(), flow_core::SpecError>(())
    /// ```
    pub fn builder(pipeline: impl Into<String>) -> PipelineSpecBuilder<NoSource> {
        PipelineSpecBuilder {
            spec: SpecParts {
                pipeline: pipeline.into(),
                partitions: 1,
                state_dir: None,
                epoch: EpochSpec::default(),
                outbox: OutboxSpec::default(),
                shutdown: ShutdownSpec::default(),
                metrics: None,
                cluster: None,
                processors: Vec::new(),
                sinks: Vec::new(),
            },
            source: NoSource,
        }
    }
}

impl<S> PipelineSpecBuilder<S> {
    /// `partitions`: how many partitions read the source in parallel.
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.spec.partitions = partitions;
        self
    }

    /// `state_dir`: where the outbox lives; a relative one is relative to the process's working
    /// directory (unlike one read by [`PipelineSpec::from_file`], which is the spec file's).
    pub fn state_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.spec.state_dir = Some(dir.into());
        self
    }

    /// `epoch`: when an epoch ends.
    pub fn epoch(mut self, epoch: EpochSpec) -> Self {
        self.spec.epoch = epoch;
        self
    }

    /// `outbox`: what the outbox keeps of a sealed batch.
    pub fn outbox(mut self, outbox: OutboxSpec) -> Self {
        self.spec.outbox = outbox;
        self
    }

    /// `shutdown`: what a graceful stop does.
    pub fn shutdown(mut self, shutdown: ShutdownSpec) -> Self {
        self.spec.shutdown = shutdown;
        self
    }

    /// `metrics`: where to serve Prometheus text at `/metrics`.
    pub fn metrics(mut self, metrics: MetricsSpec) -> Self {
        self.spec.metrics = Some(metrics);
        self
    }

    /// `cluster`: run as one of several workers coordinated through ZooKeeper.
    pub fn cluster(mut self, cluster: ClusterSpec) -> Self {
        self.spec.cluster = Some(cluster);
        self
    }

    /// Sets the source (replacing one set before).
    pub fn source(self, source: impl SourceConfig) -> PipelineSpecBuilder<SourceSpec> {
        PipelineSpecBuilder {
            spec: self.spec,
            source: source.source_spec(),
        }
    }

    /// Appends processor `name`, reading stream `input_stream_id` and defining
    /// `output_stream_id`.
    pub fn processor(
        mut self,
        name: &str,
        input_stream_id: &str,
        output_stream_id: &str,
        processor: impl ProcessorConfig,
    ) -> Self {
        let entry = processor.processor_spec(name, input_stream_id, output_stream_id);
        self.spec.processors.push(entry);
        self
    }

    /// Appends sink `name`, reading `input_stream_ids`.
    pub fn sink<I>(mut self, name: &str, input_stream_ids: I, sink: impl SinkConfig) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let inputs = input_stream_ids.into_iter().map(Into::into).collect();
        self.spec.sinks.push(sink.sink_spec(name, inputs));
        self
    }
}

impl PipelineSpecBuilder<SourceSpec> {
    /// The spec; validate it with [`Registry::build`](crate::Registry::build).
    pub fn build(self) -> PipelineSpec {
        let SpecParts {
            pipeline,
            partitions,
            state_dir,
            epoch,
            outbox,
            shutdown,
            metrics,
            cluster,
            processors,
            sinks,
        } = self.spec;
        PipelineSpec {
            pipeline,
            partitions,
            state_dir,
            epoch,
            outbox,
            shutdown,
            metrics,
            cluster,
            source: self.source,
            processors,
            sinks,
            // Built in code: no value came from the environment, and no file holds it.
            from_environment: Default::default(),
            spec_dir: None,
        }
    }
}

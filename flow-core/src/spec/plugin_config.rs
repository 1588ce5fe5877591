//! Typed plugin configuration: the code front-end of a spec entry. A typed config is the serde
//! parameter type the YAML path deserializes into; it turns into the spec entry's `parameters`
//! (and a sink's `dynamic_parameters`) by serialization, so a spec assembled in code
//! ([`PipelineSpec::builder`](crate::PipelineSpec::builder)) and one read from YAML meet the same
//! registry builders and the same violations. Each built-in config also checks itself with the
//! registry's own validation (`validate`, or `build` for the ClickHouse sinks), so a mistake is
//! found where the config is written.

use std::fmt;

use serde::Serialize;

use super::pipeline_spec::{ProcessorSpec, SinkSpec, SourceSpec};
use crate::error::Violation;

/// A source's typed configuration: its class and the `parameters` the class reads.
pub trait SourceConfig {
    /// The class name the registry knows the source by (`generator`).
    fn class_name(&self) -> &str;

    /// The `parameters` section, as the YAML path would hold it.
    fn parameters(&self) -> serde_yaml::Value;

    /// The spec entry of this source.
    fn source_spec(&self) -> SourceSpec {
        SourceSpec {
            class: self.class_name().to_owned(),
            parameters: self.parameters(),
        }
    }
}

/// A processor's typed configuration: its class and the `parameters` the class reads.
pub trait ProcessorConfig {
    /// The class name the registry knows the processor by (`project`).
    fn class_name(&self) -> &str;

    /// The `parameters` section, as the YAML path would hold it.
    fn parameters(&self) -> serde_yaml::Value;

    /// The spec entry of this processor, reading `input_stream_id` and defining
    /// `output_stream_id`.
    fn processor_spec(
        &self,
        name: &str,
        input_stream_id: &str,
        output_stream_id: &str,
    ) -> ProcessorSpec {
        ProcessorSpec {
            name: name.to_owned(),
            class: self.class_name().to_owned(),
            input_stream_id: input_stream_id.to_owned(),
            output_stream_id: output_stream_id.to_owned(),
            parameters: self.parameters(),
        }
    }
}

/// A sink's typed configuration: its class, static `parameters` and reloadable
/// `dynamic_parameters`.
pub trait SinkConfig {
    /// The class name the registry knows the sink by (`DebugSink`).
    fn class_name(&self) -> &str;

    /// The static `parameters` section, as the YAML path would hold it.
    fn parameters(&self) -> serde_yaml::Value;

    /// The `dynamic_parameters` section, as the YAML path would hold it (what a reload takes).
    fn dynamic_parameters(&self) -> serde_yaml::Value;

    /// The spec entry of this sink, named `name`, reading `input_stream_ids`.
    fn sink_spec(&self, name: &str, input_stream_ids: Vec<String>) -> SinkSpec {
        SinkSpec {
            name: name.to_owned(),
            sink_class_name: self.class_name().to_owned(),
            input_stream_ids,
            parameters: self.parameters(),
            dynamic_parameters: self.dynamic_parameters(),
        }
    }
}

// A borrowed config is the config: a spec builder may take `&config` and leave it to the caller.
impl<T: SourceConfig + ?Sized> SourceConfig for &T {
    fn class_name(&self) -> &str {
        (**self).class_name()
    }

    fn parameters(&self) -> serde_yaml::Value {
        (**self).parameters()
    }
}

impl<T: ProcessorConfig + ?Sized> ProcessorConfig for &T {
    fn class_name(&self) -> &str {
        (**self).class_name()
    }

    fn parameters(&self) -> serde_yaml::Value {
        (**self).parameters()
    }
}

impl<T: SinkConfig + ?Sized> SinkConfig for &T {
    fn class_name(&self) -> &str {
        (**self).class_name()
    }

    fn parameters(&self) -> serde_yaml::Value {
        (**self).parameters()
    }

    fn dynamic_parameters(&self) -> serde_yaml::Value {
        (**self).dynamic_parameters()
    }
}

/// A typed parameters value as a spec section. Serialization fails only for a value YAML cannot
/// hold (a path that is not UTF-8); the section then holds the reason as text, which the
/// registry refuses with a violation at the section's path that quotes it.
pub fn to_section<T: Serialize + ?Sized>(value: &T) -> serde_yaml::Value {
    serde_yaml::to_value(value).unwrap_or_else(|err| {
        serde_yaml::Value::String(format!("parameters that YAML cannot hold: {err}"))
    })
}

/// Every violation found in one plugin's typed configuration, with paths relative to its spec
/// entry (`parameters.shard_hosts.a`), as the registry would report them under
/// `sinks[i].` / `source.`.
///
/// ```
/// use flow_core::sources::GeneratorParams;
/// use flow_core::ConfigError;
///
/// let source = GeneratorParams::new(100).payload_bytes(1 << 30);
/// let err = ConfigError::check("generator", source.validate()).unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "the generator configuration has 1 violation(s):\n  parameters.payload_bytes: 1073741824 is out of range 0..=1048576"
/// );
/// ```
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The plugin class whose configuration is wrong.
    pub class: String,
    /// Each violation, in the registry's order.
    pub violations: Vec<Violation>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the {} configuration has {} violation(s):",
            self.class,
            self.violations.len()
        )?;
        for violation in &self.violations {
            write!(f, "\n  {violation}")?;
        }
        Ok(())
    }
}

impl ConfigError {
    /// `Ok(())` without violations, else the error of `class`.
    pub fn check(class: &str, violations: Vec<Violation>) -> Result<(), ConfigError> {
        if violations.is_empty() {
            Ok(())
        } else {
            Err(ConfigError {
                class: class.to_owned(),
                violations,
            })
        }
    }
}

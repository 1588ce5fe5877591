//! `project`: keeps the listed columns of each message, in the listed order.

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::{ProcessorError, Violation};
use crate::message::MessageBatch;
use crate::plugin::{Processor, ProcessorFactory};
use crate::registry::{parse_parameters, BuildResult, ProcessorBuildContext};
use crate::types::StreamSchema;

/// Parameters of the `project` processor, as a spec's `parameters:` map gives them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectParams {
    /// The input columns to keep, by name, in output order.
    pub columns: Vec<String>,
}

/// The violation message of an empty `columns` list.
pub(crate) const NO_COLUMNS: &str = "list at least one column";

pub(crate) fn build(
    ctx: &ProcessorBuildContext<'_>,
    parameters: &serde_yaml::Value,
) -> BuildResult<Arc<dyn ProcessorFactory>> {
    let params: ProjectParams = parse_parameters(parameters, "parameters")?;
    let mut violations = Vec::new();
    let mut indexes = Vec::new();
    let mut columns = Vec::new();
    for (i, name) in params.columns.iter().enumerate() {
        match ctx.input_schema.index_of(name) {
            Some(index) => {
                indexes.push(index);
                columns.push(ctx.input_schema.columns()[index].clone());
            }
            None => violations.push(Violation::new(
                format!("parameters.columns[{i}]"),
                format!(
                    "`{name}` is not a column of the input stream; its columns are {}",
                    ctx.input_schema
                        .columns()
                        .iter()
                        .map(|c| c.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }
    if params.columns.is_empty() {
        violations.push(Violation::new("parameters.columns", NO_COLUMNS));
    }
    let schema = match StreamSchema::new(columns) {
        Ok(schema) => Some(schema),
        Err(err) => {
            violations.push(Violation::new("parameters.columns", err.to_string()));
            None
        }
    };
    match schema {
        Some(schema) if violations.is_empty() => Ok(Arc::new(ProjectFactory {
            indexes: Arc::new(indexes),
            schema,
        })),
        _ => Err(violations),
    }
}

struct ProjectFactory {
    indexes: Arc<Vec<usize>>,
    schema: Arc<StreamSchema>,
}

impl ProcessorFactory for ProjectFactory {
    fn output_schema(&self) -> Arc<StreamSchema> {
        Arc::clone(&self.schema)
    }

    fn create(&self, _partition: u32) -> Box<dyn Processor> {
        Box::new(Project {
            indexes: Arc::clone(&self.indexes),
        })
    }
}

struct Project {
    indexes: Arc<Vec<usize>>,
}

#[async_trait]
impl Processor for Project {
    async fn process(
        &mut self,
        input: &MessageBatch,
        output: &mut MessageBatch,
    ) -> Result<(), ProcessorError> {
        for row in input.rows() {
            let mut writer = output.start_row(row.id());
            for &index in self.indexes.iter() {
                writer
                    .push(row.get(index))
                    .map_err(|source| ProcessorError::Value {
                        message_id: row.id().to_string(),
                        source,
                    })?;
            }
            writer.finish().map_err(|source| ProcessorError::Value {
                message_id: row.id().to_string(),
                source,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{MessageId, Value};
    use crate::types::{Column, StreamType};

    #[tokio::test]
    async fn keeps_listed_columns_in_listed_order() {
        let input_schema = StreamSchema::new(vec![
            Column::new("a", StreamType::Uint8),
            Column::new("b", StreamType::String),
        ])
        .unwrap();
        let params: serde_yaml::Value = serde_yaml::from_str("{columns: [b, a]}").unwrap();
        let factory = build(
            &ProcessorBuildContext {
                pipeline: "p",
                name: "x",
                input_schema: &input_schema,
            },
            &params,
        )
        .ok()
        .unwrap();
        let mut input = MessageBatch::new(input_schema);
        let mut row = input.start_row(MessageId::new(0, 7));
        row.push(Value::Uint(5)).unwrap();
        row.push(Value::Bytes(b"hi")).unwrap();
        row.finish().unwrap();
        let mut output = MessageBatch::new(factory.output_schema());
        factory
            .create(0)
            .process(&input, &mut output)
            .await
            .unwrap();
        assert_eq!(
            output.row(0).values().collect::<Vec<_>>(),
            vec![Value::Bytes(b"hi"), Value::Uint(5)]
        );
        assert_eq!(output.row(0).id(), MessageId::new(0, 7));
    }

    #[test]
    fn unknown_column_is_reported_with_its_index() {
        let input_schema = StreamSchema::new(vec![Column::new("a", StreamType::Uint8)]).unwrap();
        let params: serde_yaml::Value = serde_yaml::from_str("{columns: [a, zz]}").unwrap();
        let err = build(
            &ProcessorBuildContext {
                pipeline: "p",
                name: "x",
                input_schema: &input_schema,
            },
            &params,
        )
        .err()
        .unwrap();
        assert_eq!(err[0].path, "parameters.columns[1]");
    }
}

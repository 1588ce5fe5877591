//! The broker subject in a sink's table names: `{subject}` and `{subject[N]}` in a table
//! template, and the `tables:` map (subject -> table, as Kafka Connect's `topic2TableMap`).
//!
//! A partition reads one subject, fixed by the source's spec ([`SourceSubjects`]), so both are
//! resolved once per partition, when the sink is built (at validation), into a template of
//! literals and column placeholders: every mistake is a validation error naming the partition
//! and its subject, and a replay of a partition resolves the same tables.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use flow_core::registry::SourceSubjects;
use flow_core::{SinkContext, SinkError, StreamSchema, Violation};

use crate::config::params::SinkParams;
use crate::tables::template::{is_name_char_str, BoundTemplate, Piece, TableTemplate};

/// The spec path of a template's errors.
const TABLE: &str = "parameters.table";
/// The spec path of the map's errors.
const TABLES: &str = "parameters.tables";

/// The bound template of each partition: one shared by all partitions when nothing in it
/// depends on the subject, else one per partition, in partition order.
pub struct PartitionTemplates(Vec<Arc<BoundTemplate>>);

impl PartitionTemplates {
    /// The template `partition` resolves its rows' tables with.
    pub fn of(&self, partition: u32) -> Option<&Arc<BoundTemplate>> {
        match self.0.as_slice() {
            [shared] => Some(shared),
            all => all.get(partition as usize),
        }
    }

    /// The template of the sink partition `ctx`; none resolved for it is a bug, refused.
    pub fn for_sink(&self, ctx: &SinkContext) -> Result<Arc<BoundTemplate>, SinkError> {
        self.of(ctx.partition).cloned().ok_or_else(|| {
            SinkError::Refused(format!(
                "{}: no table template was resolved for partition {} of {}; this is a bug, please report it",
                ctx.state_key(),
                ctx.partition,
                ctx.partitions
            ))
        })
    }
}

/// Resolves the sink's template or `tables` map for every partition of `subjects` and binds
/// each to `stream`. `SourceSubjects::Unknown` (the source did not build) resolves nothing and
/// adds no violation: the source's own violations say why.
pub fn partition_templates(
    params: &SinkParams,
    subjects: SourceSubjects<'_>,
    stream: &StreamSchema,
) -> Result<PartitionTemplates, Vec<Violation>> {
    let templates = match (&params.table_template, params.tables.is_empty()) {
        (Some(template), _) if !template.has_subject() => vec![template.clone()],
        (Some(template), _) => of_subjects(
            subjects,
            |class| {
                Violation::new(
                    TABLE,
                    format!(
                        "table template `{}` names the broker subject, but source class `{class}` reads none (only broker sources do); name a message column instead (`{{column}}`)",
                        template.text
                    ),
                )
            },
            |subjects| for_each_partition(subjects, |p, s| for_partition(template, p, s)),
        )?,
        (None, false) => of_subjects(
            subjects,
            |class| {
                Violation::new(
                    TABLES,
                    format!(
                        "`tables` maps broker subjects to tables, but source class `{class}` reads none (only broker sources do); use `table` (a name, or a template over message columns)"
                    ),
                )
            },
            |subjects| mapped(&params.tables, subjects),
        )?,
        (None, true) => {
            return Err(vec![Violation::new(
            TABLE,
            "a table template or a `tables` map was expected here; this is a bug, please report it",
        )])
        }
    };
    // A column mistake is the same for every partition: reported once.
    let mut violations = BTreeSet::new();
    let mut bound = Vec::with_capacity(templates.len());
    for template in &templates {
        match template.bind(stream) {
            Ok(template) => bound.push(Arc::new(template)),
            Err(errs) => violations.extend(errs.into_iter().map(|v| (v.path, v.message))),
        }
    }
    if violations.is_empty() {
        Ok(PartitionTemplates(bound))
    } else {
        Err(violations
            .into_iter()
            .map(|(path, message)| Violation::new(path, message))
            .collect())
    }
}

/// Runs `resolve` over the subjects of every partition, or says that the source has none.
fn of_subjects(
    subjects: SourceSubjects<'_>,
    no_subjects: impl FnOnce(&str) -> Violation,
    resolve: impl FnOnce(&[String]) -> Result<Vec<TableTemplate>, Vec<Violation>>,
) -> Result<Vec<TableTemplate>, Vec<Violation>> {
    match subjects {
        SourceSubjects::Known(subjects) => resolve(subjects),
        SourceSubjects::None { source_class } => Err(vec![no_subjects(source_class)]),
        SourceSubjects::Unknown => Err(Vec::new()),
    }
}

fn for_each_partition(
    subjects: &[String],
    mut resolve: impl FnMut(u32, &str) -> Result<TableTemplate, Violation>,
) -> Result<Vec<TableTemplate>, Vec<Violation>> {
    let mut templates = Vec::with_capacity(subjects.len());
    let mut violations = Vec::new();
    for (partition, subject) in (0u32..).zip(subjects) {
        match resolve(partition, subject) {
            Ok(template) => templates.push(template),
            Err(violation) => violations.push(violation),
        }
    }
    if violations.is_empty() {
        Ok(templates)
    } else {
        Err(violations)
    }
}

/// Whether a subject token is a NATS wildcard.
fn is_wildcard(token: &str) -> bool {
    token == "*" || token == ">"
}

/// `template` with its subject placeholders replaced by the text of `partition`'s `subject`.
fn for_partition(
    template: &TableTemplate,
    partition: u32,
    subject: &str,
) -> Result<TableTemplate, Violation> {
    let tokens: Vec<&str> = subject.split('.').collect();
    let fail = |placeholder: &str, what: String| {
        Violation::new(
            TABLE,
            format!(
                "{placeholder} in table template `{}`: partition {partition} reads subject `{subject}`, {what}",
                template.text
            ),
        )
    };
    // With a wildcard the partition's messages have different subjects: no one text is theirs.
    let wildcard_remedy = "give each partition one subject without wildcards (`subjects: [...]` or `subject_template`), or carry the value in a message column and name that column";
    let mut pieces: Vec<Piece> = Vec::with_capacity(template.pieces.len());
    for piece in &template.pieces {
        let text = match piece {
            Piece::Subject(None) => {
                if tokens.iter().any(|t| is_wildcard(t)) {
                    return Err(fail(
                        "`{subject}`",
                        format!("a pattern with wildcards, so its messages' subjects differ; {wildcard_remedy}"),
                    ));
                }
                tokens.join("_")
            }
            Piece::Subject(Some(n)) => {
                let placeholder = format!("`{{subject[{n}]}}`");
                // `>` stands for every token from its place on.
                let wild = match tokens.iter().take(n + 1).any(|t| *t == ">") {
                    true => Some(">"),
                    false => tokens.get(*n).copied().filter(|t| is_wildcard(t)),
                };
                if let Some(wild) = wild {
                    return Err(fail(
                        &placeholder,
                        format!("whose token {n} is the wildcard `{wild}`, so it differs between its messages; name a literal token, or {wildcard_remedy}"),
                    ));
                }
                let Some(token) = tokens.get(*n) else {
                    return Err(fail(
                        &placeholder,
                        format!(
                            "which has {} token(s) (0..={}); name one of them",
                            tokens.len(),
                            tokens.len() - 1
                        ),
                    ));
                };
                (*token).to_owned()
            }
            other => {
                pieces.push(other.clone());
                continue;
            }
        };
        if !is_name_char_str(&text) {
            let placeholder = match piece {
                Piece::Subject(Some(n)) => format!("`{{subject[{n}]}}`"),
                _ => "`{subject}`".to_owned(),
            };
            return Err(fail(
                &placeholder,
                format!("which gives `{text}`: a table name may only contain letters, digits and `_`; name a token that can, or map the subjects to tables with `tables:`"),
            ));
        }
        match pieces.last_mut() {
            Some(Piece::Literal(literal)) => literal.push_str(&text),
            _ => pieces.push(Piece::Literal(text)),
        }
    }
    Ok(TableTemplate {
        text: template.text.clone(),
        pieces,
    })
}

/// Each partition's table from the `tables` map; every partition's subject must be a key.
fn mapped(
    tables: &BTreeMap<String, String>,
    subjects: &[String],
) -> Result<Vec<TableTemplate>, Vec<Violation>> {
    let mut templates = Vec::with_capacity(subjects.len());
    let mut missing = Vec::new();
    for (partition, subject) in subjects.iter().enumerate() {
        match tables.get(subject) {
            Some(table) => templates.push(TableTemplate {
                text: table.clone(),
                pieces: vec![Piece::Literal(table.clone())],
            }),
            None => missing.push(format!("`{subject}` (partition {partition})")),
        }
    }
    if missing.is_empty() {
        return Ok(templates);
    }
    Err(vec![Violation::new(
        TABLES,
        format!(
            "no table for the subject of every partition: {} {} not in the map; add each as `\"<subject>\": <table>`",
            missing.join(", "),
            if missing.len() == 1 { "is" } else { "are" }
        ),
    )])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::Arc;

    use flow_core::{Column, MessageBatch, MessageId, StreamType, Value};

    use super::*;
    use crate::config::guarantee::SinkClass;
    use crate::config::params::parse;

    fn stream() -> Arc<StreamSchema> {
        StreamSchema::new(vec![
            Column::new("id", StreamType::Uint64),
            Column::new("kind", StreamType::String),
        ])
        .unwrap()
    }

    fn params(table: &str) -> SinkParams {
        let yaml = serde_yaml::from_str(&format!("{{host: h, {table}}}")).unwrap();
        parse(
            SinkClass::Batching,
            &yaml,
            &serde_yaml::Value::Null,
            flow_core::SpecPaths::working_directory(),
        )
        .unwrap()
        .0
    }

    fn subjects(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    /// The table each partition's template gives a row of kind `click`.
    fn tables(table: &str, subjects: &[String]) -> Vec<String> {
        let schema = stream();
        let templates =
            partition_templates(&params(table), SourceSubjects::Known(subjects), &schema).unwrap();
        let mut batch = MessageBatch::new(Arc::clone(&schema));
        let mut w = batch.start_row(MessageId::new(0, 0));
        w.push(Value::Uint(1)).unwrap();
        w.push(Value::Bytes(b"click")).unwrap();
        w.finish().unwrap();
        let mut name = String::new();
        (0..subjects.len() as u32)
            .map(|p| {
                templates
                    .of(p)
                    .unwrap()
                    .resolve(&batch.row(0), &mut name)
                    .unwrap();
                name.clone()
            })
            .collect()
    }

    fn refused(table: &str, subjects: SourceSubjects<'_>) -> Vec<(String, String)> {
        let violations = partition_templates(&params(table), subjects, &stream())
            .err()
            .expect("refused");
        violations
            .into_iter()
            .map(|v| (v.path, v.message))
            .collect()
    }

    #[test]
    fn subject_tokens_and_the_whole_subject_resolve_per_partition() {
        let orders = subjects(&["orders.created", "orders.cancelled"]);
        assert_eq!(
            tables("table: '{subject[1]}_{kind}'", &orders),
            ["created_click", "cancelled_click"]
        );
        assert_eq!(
            tables("table: 'e_{subject}'", &orders),
            ["e_orders_created", "e_orders_cancelled"]
        );
        assert_eq!(
            tables("table: '{subject[0]}{subject[1]}'", &orders),
            ["orderscreated", "orderscancelled"]
        );
        // Without a subject placeholder, one template serves every partition.
        assert_eq!(tables("table: 'e_{kind}'", &orders), ["e_click", "e_click"]);
    }

    #[test]
    fn a_tables_map_gives_each_partition_its_table() {
        let orders = subjects(&["orders.created", "orders.cancelled"]);
        assert_eq!(
            tables(
                "tables: {orders.created: created, orders.cancelled: cancelled, other: x}",
                &orders
            ),
            ["created", "cancelled"]
        );
        assert_eq!(
            refused(
                "tables: {orders.created: created}",
                SourceSubjects::Known(&subjects(&["orders.created", "orders.x", "orders.y"]))
            ),
            [(
                "parameters.tables".to_owned(),
                "no table for the subject of every partition: `orders.x` (partition 1), `orders.y` (partition 2) are not in the map; add each as `\"<subject>\": <table>`".to_owned()
            )]
        );
        assert_eq!(
            refused(
                "tables: {a: b}",
                SourceSubjects::None {
                    source_class: "generator"
                }
            ),
            [(
                "parameters.tables".to_owned(),
                "`tables` maps broker subjects to tables, but source class `generator` reads none (only broker sources do); use `table` (a name, or a template over message columns)".to_owned()
            )]
        );
    }

    #[test]
    fn subjects_that_make_no_table_name_are_refused_with_the_partition() {
        let t = |s: &str| ("parameters.table".to_owned(), s.to_owned());
        assert_eq!(
            refused(
                "table: 't_{subject[2]}'",
                SourceSubjects::Known(&subjects(&["a.b.c", "a.b"]))
            ),
            [t("`{subject[2]}` in table template `t_{subject[2]}`: partition 1 reads subject `a.b`, which has 2 token(s) (0..=1); name one of them")]
        );
        assert_eq!(
            refused(
                "table: '{subject[1]}'",
                SourceSubjects::Known(&subjects(&["orders.*", "a.b-c", "x.>"]))
            ),
            [
                t("`{subject[1]}` in table template `{subject[1]}`: partition 0 reads subject `orders.*`, whose token 1 is the wildcard `*`, so it differs between its messages; name a literal token, or give each partition one subject without wildcards (`subjects: [...]` or `subject_template`), or carry the value in a message column and name that column"),
                t("`{subject[1]}` in table template `{subject[1]}`: partition 1 reads subject `a.b-c`, which gives `b-c`: a table name may only contain letters, digits and `_`; name a token that can, or map the subjects to tables with `tables:`"),
                t("`{subject[1]}` in table template `{subject[1]}`: partition 2 reads subject `x.>`, whose token 1 is the wildcard `>`, so it differs between its messages; name a literal token, or give each partition one subject without wildcards (`subjects: [...]` or `subject_template`), or carry the value in a message column and name that column"),
            ]
        );
        // A literal token of a pattern is the same for all its messages.
        assert_eq!(
            tables("table: '{subject[0]}'", &subjects(&["orders.*"])),
            ["orders"]
        );
        assert_eq!(
            refused("table: 'e_{subject}'", SourceSubjects::Known(&subjects(&["orders.*"]))),
            [t("`{subject}` in table template `e_{subject}`: partition 0 reads subject `orders.*`, a pattern with wildcards, so its messages' subjects differ; give each partition one subject without wildcards (`subjects: [...]` or `subject_template`), or carry the value in a message column and name that column")]
        );
        assert_eq!(
            refused(
                "table: '{subject[1]}_{kind}'",
                SourceSubjects::None {
                    source_class: "generator"
                }
            ),
            [t("table template `{subject[1]}_{kind}` names the broker subject, but source class `generator` reads none (only broker sources do); name a message column instead (`{column}`)")]
        );
        // The source did not build: its own violations say why.
        assert_eq!(refused("table: '{subject}'", SourceSubjects::Unknown), []);
    }

    #[test]
    fn a_column_mistake_is_reported_once_for_all_partitions() {
        assert_eq!(
            refused(
                "table: '{subject[0]}_{nosuch}'",
                SourceSubjects::Known(&subjects(&["a", "b", "c"]))
            ),
            [("parameters.table".to_owned(), "`{nosuch}` in table template `{subject[0]}_{nosuch}` is not a column of the input stream (its columns: id, kind); name one of them".to_owned())]
        );
    }
}

//! A table name template (`table: "events_{event_type}"`): parsed from the spec
//! ([`TableTemplate::parse`]), bound to the input stream's columns when the sink is built
//! ([`TableTemplate::bind`]), and resolved per row ([`BoundTemplate::resolve`]).
//!
//! A template is literal text (letters, digits, `_`) with `{column}` placeholders, and
//! `{subject}` / `{subject[N]}` ones for the partition's broker subject, which are replaced per
//! partition before binding ([`crate::tables::subjects`]). A column placeholder names a column
//! of the input stream of type `string`, `utf8` or an integer (`int8`..`uint64`), optional or
//! not. The resolved name is checked again per row (a string value may hold any
//! byte): a row whose value would make a name with other characters, or whose value is null,
//! resolves to an error naming the value, which the sink turns into a dead letter.

use std::fmt::Write as _;

use flow_core::{Row, StreamSchema, StreamType, Value, Violation};

/// The spec path of a template's errors.
const PATH: &str = "parameters.table";

/// The longest table name a server takes: 26.9 refuses 207 characters in a database
/// (`The max length of table name for database default is 206`, code 69); 18.16 takes names up
/// to its file system's limit. The stricter one holds for every server.
const MAX_TABLE_NAME: usize = 206;

/// One piece of a template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Text copied into every name.
    Literal(String),
    /// The value of this input column.
    Column(String),
    /// The partition's broker subject: `{subject}` (`None`, its dots written as `_`) or
    /// `{subject[N]}` (its 0-based dot-separated token N). Replaced by text per partition
    /// ([`crate::tables::subjects`]) before the template is bound.
    Subject(Option<usize>),
}

/// A parsed template: at least one placeholder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableTemplate {
    /// As the spec gives it (quoted in messages).
    pub text: String,
    pub pieces: Vec<Piece>,
}

impl TableTemplate {
    /// Whether `table` is meant as a template (it has a brace) rather than a name.
    pub fn is_template(table: &str) -> bool {
        table.contains(['{', '}'])
    }

    /// Parses `text`; the violation says what is wrong at which character.
    pub fn parse(text: &str) -> Result<TableTemplate, Violation> {
        let fail = |what: String| {
            Violation::new(
                PATH,
                format!("table template `{text}`: {what}; write literal text (letters, digits, `_`) and `{{column}}` placeholders, e.g. `events_{{event_type}}`"),
            )
        };
        let mut pieces = Vec::new();
        let mut literal = String::new();
        let mut chars = text.char_indices();
        while let Some((at, c)) = chars.next() {
            match c {
                '{' => {
                    let mut name = String::new();
                    let closed = loop {
                        match chars.next() {
                            Some((_, '}')) => break true,
                            Some((_, '{')) | None => break false,
                            Some((_, c)) => name.push(c),
                        }
                    };
                    if !closed {
                        return Err(fail(format!(
                            "the `{{` at character {} is not closed by `}}`",
                            at + 1
                        )));
                    }
                    if name.is_empty() {
                        return Err(fail(format!(
                            "the placeholder at character {} is empty",
                            at + 1
                        )));
                    }
                    match subject_placeholder(&name) {
                        SubjectPlaceholder::No => {}
                        SubjectPlaceholder::Malformed => {
                            return Err(fail(format!(
                                "`{{{name}}}` is not a subject placeholder: write `{{subject}}` or `{{subject[N]}}` with N a 0-based token number"
                            )))
                        }
                        SubjectPlaceholder::Yes(token) => {
                            if !literal.is_empty() {
                                pieces.push(Piece::Literal(std::mem::take(&mut literal)));
                            }
                            pieces.push(Piece::Subject(token));
                            continue;
                        }
                    }
                    if !is_name_char_str(&name) {
                        return Err(fail(format!(
                            "`{{{name}}}` is not a column name (letters, digits, `_`)"
                        )));
                    }
                    if !literal.is_empty() {
                        pieces.push(Piece::Literal(std::mem::take(&mut literal)));
                    }
                    pieces.push(Piece::Column(name));
                }
                '}' => {
                    return Err(fail(format!(
                        "the `}}` at character {} closes no placeholder",
                        at + 1
                    )))
                }
                c if is_name_char(c) => literal.push(c),
                c => {
                    return Err(fail(format!(
                        "the character `{c}` at {} cannot be part of a table name",
                        at + 1
                    )))
                }
            }
        }
        if !literal.is_empty() {
            pieces.push(Piece::Literal(literal));
        }
        Ok(TableTemplate {
            text: text.to_owned(),
            pieces,
        })
    }

    /// Whether a placeholder names the broker subject.
    pub fn has_subject(&self) -> bool {
        self.pieces.iter().any(|p| matches!(p, Piece::Subject(_)))
    }

    /// Binds every placeholder to its input column, checking that it exists and has a type a
    /// name can be made of. Subject placeholders are replaced before
    /// ([`crate::tables::subjects`]); one left here is a bug, refused as such.
    pub fn bind(&self, stream: &StreamSchema) -> Result<BoundTemplate, Vec<Violation>> {
        let mut pieces = Vec::new();
        let mut violations = Vec::new();
        for piece in &self.pieces {
            match piece {
                Piece::Literal(text) => pieces.push(BoundPiece::Literal(text.clone())),
                Piece::Subject(_) => violations.push(Violation::new(
                    PATH,
                    format!(
                        "table template `{}`: the subject was not resolved for the partition; this is a bug, please report it",
                        self.text
                    ),
                )),
                Piece::Column(name) => match stream.index_of(name) {
                    None => {
                        let names: Vec<&str> =
                            stream.columns().iter().map(|c| c.name.as_str()).collect();
                        violations.push(Violation::new(
                            PATH,
                            format!(
                                "`{{{name}}}` in table template `{}` is not a column of the input stream (its columns: {}); name one of them",
                                self.text,
                                names.join(", ")
                            ),
                        ));
                    }
                    Some(index) => {
                        let ty = &stream.columns()[index].ty;
                        if names_a_table(ty) {
                            pieces.push(BoundPiece::Column {
                                index,
                                name: name.clone(),
                            });
                        } else {
                            violations.push(Violation::new(
                                PATH,
                                format!(
                                    "`{{{name}}}` in table template `{}` is a column of type {ty}; a table name can only take a string, utf8 or integer (int8..uint64) column, optional or not",
                                    self.text
                                ),
                            ));
                        }
                    }
                },
            }
        }
        if violations.is_empty() {
            Ok(BoundTemplate {
                text: self.text.clone(),
                pieces,
            })
        } else {
            Err(violations)
        }
    }
}

/// A piece bound to the stream.
#[derive(Clone, Debug)]
enum BoundPiece {
    Literal(String),
    Column { index: usize, name: String },
}

/// A template whose placeholders are input column indices.
#[derive(Clone, Debug)]
pub struct BoundTemplate {
    text: String,
    pieces: Vec<BoundPiece>,
}

/// Why a row resolves to no table; the sink makes it the row's dead letter reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The column's value is null.
    #[error("table template `{template}`: column `{column}` is null, so the row names no table; give the message a value, or route it elsewhere before this sink")]
    Null { template: String, column: String },
    /// The column's value is empty, so the name is the template's literal text alone.
    #[error("table template `{template}`: column `{column}` holds the empty string, so the row names the table `{name}` by the template's text alone; give the message a value, or route it elsewhere before this sink")]
    Empty {
        template: String,
        column: String,
        name: String,
    },
    /// The name made is longer than a server takes.
    #[error("table template `{template}`: the row names a table of {len} characters (`{prefix}...`), longer than the {MAX_TABLE_NAME} ClickHouse allows in a database (a server could not create it); shorten the values of the template's columns, or map them before this sink")]
    TooLong {
        template: String,
        len: usize,
        prefix: String,
    },
    /// The name made has a character a table name cannot have.
    #[error("table template `{template}`: column `{column}` holds `{value}`, which makes the table name `{name}`; a table name may only contain letters, digits and `_`. Fix the message, or map the value before this sink")]
    BadName {
        template: String,
        column: String,
        value: String,
        name: String,
    },
}

impl BoundTemplate {
    /// The table name of `row` (written into `name`, cleared first).
    pub fn resolve(&self, row: &Row<'_>, name: &mut String) -> Result<(), ResolveError> {
        name.clear();
        let mut bad: Option<(&str, String)> = None;
        for piece in &self.pieces {
            match piece {
                BoundPiece::Literal(text) => name.push_str(text),
                BoundPiece::Column {
                    index,
                    name: column,
                } => {
                    let value = match row.get(*index) {
                        Value::Null => {
                            return Err(ResolveError::Null {
                                template: self.text.clone(),
                                column: column.clone(),
                            })
                        }
                        Value::Int(v) => v.to_string(),
                        Value::Uint(v) => v.to_string(),
                        Value::Bytes(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                        // `bind` admits only strings and integers.
                        other => other.kind().to_owned(),
                    };
                    if bad.is_none() && !is_name_char_str(&value) {
                        bad = Some((column, value.clone()));
                    }
                    let _ = write!(name, "{value}");
                }
            }
        }
        match bad {
            Some((column, value)) if value.is_empty() => Err(ResolveError::Empty {
                template: self.text.clone(),
                column: column.to_owned(),
                name: name.clone(),
            }),
            Some((column, value)) => Err(ResolveError::BadName {
                template: self.text.clone(),
                column: column.to_owned(),
                value,
                name: name.clone(),
            }),
            None if name.is_empty() => Err(ResolveError::BadName {
                template: self.text.clone(),
                column: self.first_column().to_owned(),
                value: String::new(),
                name: String::new(),
            }),
            None if name.len() > MAX_TABLE_NAME => Err(ResolveError::TooLong {
                template: self.text.clone(),
                len: name.len(),
                prefix: name.chars().take(40).collect(),
            }),
            None => Ok(()),
        }
    }

    fn first_column(&self) -> &str {
        self.pieces
            .iter()
            .find_map(|p| match p {
                BoundPiece::Column { name, .. } => Some(name.as_str()),
                BoundPiece::Literal(_) => None,
            })
            .unwrap_or_default()
    }
}

/// What a placeholder's text says about the subject.
enum SubjectPlaceholder {
    /// A column (`subject_id` is one).
    No,
    /// `{subject}` (`None`) or `{subject[N]}`.
    Yes(Option<usize>),
    /// `{subject[x]}`, `{subject[1}`, ...
    Malformed,
}

fn subject_placeholder(name: &str) -> SubjectPlaceholder {
    if name == "subject" {
        return SubjectPlaceholder::Yes(None);
    }
    let Some(rest) = name.strip_prefix("subject[") else {
        return SubjectPlaceholder::No;
    };
    match rest
        .strip_suffix(']')
        .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
        .and_then(|n| n.parse().ok())
    {
        Some(token) => SubjectPlaceholder::Yes(Some(token)),
        None => SubjectPlaceholder::Malformed,
    }
}

/// Whether values of `ty` can make part of a table name.
fn names_a_table(ty: &StreamType) -> bool {
    use StreamType as T;
    matches!(
        ty.inner(),
        T::String
            | T::Utf8
            | T::Int8
            | T::Int16
            | T::Int32
            | T::Int64
            | T::Uint8
            | T::Uint16
            | T::Uint32
            | T::Uint64
    )
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

pub(crate) fn is_name_char_str(text: &str) -> bool {
    !text.is_empty() && text.chars().all(is_name_char)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use flow_core::{Column, MessageBatch, MessageId};

    use super::*;

    fn stream() -> Arc<StreamSchema> {
        StreamSchema::new(vec![
            Column::new("id", StreamType::Uint64),
            Column::new(
                "event_type",
                StreamType::Optional(Box::new(StreamType::String)),
            ),
            Column::new("region", StreamType::Int32),
            Column::new("score", StreamType::Double),
        ])
        .unwrap()
    }

    fn message(template: &str) -> String {
        TableTemplate::parse(template).unwrap_err().message
    }

    #[test]
    fn parses_literals_and_placeholders() {
        let t = TableTemplate::parse("events_{event_type}_r{region}").unwrap();
        assert_eq!(
            t.pieces,
            vec![
                Piece::Literal("events_".into()),
                Piece::Column("event_type".into()),
                Piece::Literal("_r".into()),
                Piece::Column("region".into()),
            ]
        );
        assert!(TableTemplate::is_template("events_{event_type}"));
        let t = TableTemplate::parse("{subject}_{subject[2]}{subject_id}").unwrap();
        assert_eq!(
            t.pieces,
            vec![
                Piece::Subject(None),
                Piece::Literal("_".into()),
                Piece::Subject(Some(2)),
                Piece::Column("subject_id".into()),
            ]
        );
        assert!(t.has_subject());
        assert!(!TableTemplate::is_template("events"));
    }

    #[test]
    fn syntax_errors_say_where() {
        let hint = "; write literal text (letters, digits, `_`) and `{column}` placeholders, e.g. `events_{event_type}`";
        assert_eq!(
            message("events_{event_type"),
            format!("table template `events_{{event_type`: the `{{` at character 8 is not closed by `}}`{hint}")
        );
        assert_eq!(
            message("events_{}"),
            format!("table template `events_{{}}`: the placeholder at character 8 is empty{hint}")
        );
        assert_eq!(
            message("events}"),
            format!(
                "table template `events}}`: the `}}` at character 7 closes no placeholder{hint}"
            )
        );
        assert_eq!(
            message("ev-{a}"),
            format!("table template `ev-{{a}}`: the character `-` at 3 cannot be part of a table name{hint}")
        );
        assert_eq!(
            message("{a b}"),
            format!("table template `{{a b}}`: `{{a b}}` is not a column name (letters, digits, `_`){hint}")
        );
        assert_eq!(
            message("{subject[x]}"),
            format!("table template `{{subject[x]}}`: `{{subject[x]}}` is not a subject placeholder: write `{{subject}}` or `{{subject[N]}}` with N a 0-based token number{hint}")
        );
        assert_eq!(
            message("{subject[1}"),
            format!("table template `{{subject[1}}`: `{{subject[1}}` is not a subject placeholder: write `{{subject}}` or `{{subject[N]}}` with N a 0-based token number{hint}")
        );
        assert_eq!(TableTemplate::parse("{").unwrap_err().path, PATH);
    }

    #[test]
    fn binding_checks_the_columns_and_their_types() {
        let t = TableTemplate::parse("e_{nosuch}_{score}_{region}").unwrap();
        let v = t.bind(&stream()).unwrap_err();
        let messages: Vec<&str> = v.iter().map(|v| v.message.as_str()).collect();
        assert_eq!(
            messages,
            vec![
                "`{nosuch}` in table template `e_{nosuch}_{score}_{region}` is not a column of the input stream (its columns: id, event_type, region, score); name one of them",
                "`{score}` in table template `e_{nosuch}_{score}_{region}` is a column of type double; a table name can only take a string, utf8 or integer (int8..uint64) column, optional or not",
            ]
        );
        assert!(v.iter().all(|v| v.path == "parameters.table"));
    }

    #[test]
    fn resolves_per_row_and_names_bad_values() {
        let schema = stream();
        let t = TableTemplate::parse("events_{event_type}_{region}")
            .unwrap()
            .bind(&schema)
            .unwrap();
        let mut batch = MessageBatch::new(Arc::clone(&schema));
        let rows: [(Value<'_>, i64); 4] = [
            (Value::Bytes(b"click"), 7),
            (Value::Bytes(b"a-b"), -1),
            (Value::Null, 1),
            (Value::Bytes(b"view"), -2),
        ];
        for (offset, (kind, region)) in rows.into_iter().enumerate() {
            let mut w = batch.start_row(MessageId::new(0, offset as u64));
            w.push(Value::Uint(offset as u64)).unwrap();
            w.push(kind).unwrap();
            w.push(Value::Int(region)).unwrap();
            w.push(Value::Float(0.5)).unwrap();
            w.finish().unwrap();
        }
        let mut name = String::new();
        assert_eq!(t.resolve(&batch.row(0), &mut name), Ok(()));
        assert_eq!(name, "events_click_7");
        assert_eq!(
            t.resolve(&batch.row(1), &mut name).unwrap_err().to_string(),
            "table template `events_{event_type}_{region}`: column `event_type` holds `a-b`, which makes the table name `events_a-b_-1`; a table name may only contain letters, digits and `_`. Fix the message, or map the value before this sink"
        );
        assert_eq!(
            t.resolve(&batch.row(2), &mut name).unwrap_err().to_string(),
            "table template `events_{event_type}_{region}`: column `event_type` is null, so the row names no table; give the message a value, or route it elsewhere before this sink"
        );
        assert_eq!(
            t.resolve(&batch.row(3), &mut name).unwrap_err().to_string(),
            "table template `events_{event_type}_{region}`: column `region` holds `-2`, which makes the table name `events_view_-2`; a table name may only contain letters, digits and `_`. Fix the message, or map the value before this sink"
        );
    }

    /// Issue 46 item 13: the empty value and a name longer than a server takes are named as
    /// such (they read "may only contain letters, digits and `_`" and "does not exist").
    #[test]
    fn an_empty_value_and_a_name_too_long_for_the_server_are_named_as_such() {
        let schema = stream();
        let t = TableTemplate::parse("events_{event_type}")
            .unwrap()
            .bind(&schema)
            .unwrap();
        let long = "x".repeat(200);
        let mut batch = MessageBatch::new(Arc::clone(&schema));
        for (offset, kind) in [&b""[..], long.as_bytes(), &long.as_bytes()[..199]]
            .into_iter()
            .enumerate()
        {
            let mut w = batch.start_row(MessageId::new(0, offset as u64));
            w.push(Value::Uint(offset as u64)).unwrap();
            w.push(Value::Bytes(kind)).unwrap();
            w.push(Value::Int(1)).unwrap();
            w.push(Value::Float(0.5)).unwrap();
            w.finish().unwrap();
        }
        let mut name = String::new();
        assert_eq!(
            t.resolve(&batch.row(0), &mut name).unwrap_err().to_string(),
            "table template `events_{event_type}`: column `event_type` holds the empty string, so the row names the table `events_` by the template's text alone; give the message a value, or route it elsewhere before this sink"
        );
        assert_eq!(
            t.resolve(&batch.row(1), &mut name).unwrap_err().to_string(),
            "table template `events_{event_type}`: the row names a table of 207 characters (`events_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...`), longer than the 206 ClickHouse allows in a database (a server could not create it); shorten the values of the template's columns, or map them before this sink"
        );
        // 206 characters: the longest name a server takes.
        assert_eq!(t.resolve(&batch.row(2), &mut name), Ok(()));
        assert_eq!(name.len(), 206);
    }
}

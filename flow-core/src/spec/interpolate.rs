//! `${VAR}` and `${VAR:-default}` in the values of a YAML spec, taken from the environment when
//! the spec is read (at the start, and again at each reload). Keys are never interpolated: the
//! shape of a spec is what its text says. `$${` writes a literal `${`.
//!
//! A value that is exactly one reference is read as YAML reads the variable's text, so that
//! `port: ${CH_PORT}` is a number and `enable_tls: ${TLS:-false}` a boolean; anything else
//! around a reference keeps the value a string. The variables' values never appear in a
//! violation: one may hold a secret.

use crate::error::Violation;

/// The environment variables' values interpolated into a spec, by where they went: a violation
/// at (or around) such a path names the variable instead of printing its value, which may be
/// a secret. Defaults are not recorded: they are written in the spec itself.
#[derive(Clone, Debug, Default)]
pub(crate) struct FromEnvironment {
    /// (path, variable name, its value).
    entries: Vec<(String, String, String)>,
}

/// Where a spec's values came from is not part of what the spec says: two specs with the same
/// values are equal whichever variables gave them.
impl PartialEq for FromEnvironment {
    fn eq(&self, _other: &FromEnvironment) -> bool {
        true
    }
}

impl FromEnvironment {
    /// `violations` with each interpolated value in a message about its path (or a path
    /// around it) replaced by its reference, `${NAME}`.
    pub(crate) fn redacted(&self, mut violations: Vec<Violation>) -> Vec<Violation> {
        for violation in &mut violations {
            for (path, name, value) in &self.entries {
                if !value.is_empty() && related(&violation.path, path) {
                    violation.message = violation
                        .message
                        .replace(value.as_str(), &format!("${{{name}}}"));
                }
            }
        }
        violations
    }
}

/// Whether one path is the other, or holds it (`sinks[0].parameters` holds
/// `sinks[0].parameters.host`; the empty path holds every path).
fn related(a: &str, b: &str) -> bool {
    let holds = |outer: &str, inner: &str| {
        outer.is_empty()
            || inner == outer
            || inner
                .strip_prefix(outer)
                .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
    };
    holds(a, b) || holds(b, a)
}

/// Where interpolation reads variables: the process environment in a spec, a map in tests.
pub(super) trait Lookup {
    /// The variable's value, `Ok(None)` when unset, `Err` with the reason it cannot be used.
    fn get(&self, name: &str) -> Result<Option<String>, String>;
}

/// The process environment.
pub(super) struct Environment;

impl Lookup for Environment {
    fn get(&self, name: &str) -> Result<Option<String>, String> {
        match std::env::var(name) {
            Ok(value) => Ok(Some(value)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!(
                "the environment variable `{name}` is not valid UTF-8; export it as UTF-8 text"
            )),
        }
    }
}

/// Replaces every reference in the string values under `value` (at `path`), pushing one
/// violation per reference that cannot be resolved.
pub(super) fn interpolate(
    value: &mut serde_yaml::Value,
    path: &str,
    lookup: &dyn Lookup,
    violations: &mut Vec<Violation>,
    from_environment: &mut FromEnvironment,
) {
    match value {
        serde_yaml::Value::String(text) => {
            if !text.contains('$') {
                return;
            }
            let mut used = Vec::new();
            let expanded = expand(text, lookup, &mut used);
            from_environment.entries.extend(
                used.into_iter()
                    .map(|(name, value)| (path.to_owned(), name, value)),
            );
            match expanded {
                Ok(Expanded::Text(expanded)) => *text = expanded,
                Ok(Expanded::Whole(expanded)) => *value = typed(expanded),
                Err(messages) => violations.extend(
                    messages
                        .into_iter()
                        .map(|message| Violation::new(path, message)),
                ),
            }
        }
        serde_yaml::Value::Sequence(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                let child = format!("{path}[{i}]");
                interpolate(item, &child, lookup, violations, from_environment);
            }
        }
        serde_yaml::Value::Mapping(map) => {
            for (key, item) in map.iter_mut() {
                let key = match key {
                    serde_yaml::Value::String(s) => s.clone(),
                    other => serde_yaml::to_string(other)
                        .map(|s| s.trim().to_owned())
                        .unwrap_or_else(|_| "?".to_owned()),
                };
                let child = if path.is_empty() {
                    key
                } else {
                    format!("{path}.{key}")
                };
                interpolate(item, &child, lookup, violations, from_environment);
            }
        }
        serde_yaml::Value::Tagged(tagged) => interpolate(
            &mut tagged.value,
            path,
            lookup,
            violations,
            from_environment,
        ),
        serde_yaml::Value::Null | serde_yaml::Value::Bool(_) | serde_yaml::Value::Number(_) => {}
    }
}

/// What a string became.
#[derive(Debug, PartialEq, Eq)]
enum Expanded {
    /// Text with references replaced (or escapes undone) inside it.
    Text(String),
    /// The value was exactly one reference: this is the variable's (or the default's) text.
    Whole(String),
}

/// A whole-value reference's text, read as a YAML scalar would be (a number, a boolean); text
/// YAML would read as something else (a list, a mapping, null) stays the text.
fn typed(text: String) -> serde_yaml::Value {
    match serde_yaml::from_str::<serde_yaml::Value>(&text) {
        Ok(scalar @ (serde_yaml::Value::Bool(_) | serde_yaml::Value::Number(_))) => scalar,
        _ => serde_yaml::Value::String(text),
    }
}

/// Expands the references in `text`, or says what is wrong with each that cannot be expanded;
/// each variable taken from `lookup` goes to `used` with its value.
fn expand(
    text: &str,
    lookup: &dyn Lookup,
    used: &mut Vec<(String, String)>,
) -> Result<Expanded, Vec<String>> {
    let mut out = String::with_capacity(text.len());
    let mut errors = Vec::new();
    let mut references = 0usize;
    let mut literal = false;
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if let Some(after) = tail.strip_prefix("$${") {
            // The escape: a literal `${`, never a reference.
            out.push_str("${");
            literal = true;
            rest = after;
            continue;
        }
        let Some(body_start) = tail.strip_prefix("${") else {
            out.push('$');
            literal = true;
            rest = &tail[1..];
            continue;
        };
        let Some(end) = body_start.find('}') else {
            errors.push(format!(
                "`{tail}` opens a `${{` that is never closed; write `${{NAME}}` or \
                 `${{NAME:-default}}`, or `$${{` for a literal `${{`"
            ));
            rest = "";
            break;
        };
        let body = &body_start[..end];
        rest = &body_start[end + 1..];
        references += 1;
        let (name, default) = match body.split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (body, None),
        };
        if !is_variable_name(name) {
            errors.push(format!(
                "`${{{body}}}` does not name an environment variable (letters, digits and `_`, \
                 not starting with a digit; a default follows `:-`); fix the reference, or \
                 write `$${{` for a literal `${{`"
            ));
            continue;
        }
        match (lookup.get(name), default) {
            (Ok(Some(value)), _) => {
                out.push_str(&value);
                used.push((name.to_owned(), value));
            }
            (Ok(None), Some(default)) => out.push_str(default),
            (Ok(None), None) => errors.push(format!(
                "the environment variable `{name}` (from `${{{name}}}`) is not set; export it, \
                 or give a default with `${{{name}:-value}}`"
            )),
            (Err(reason), _) => errors.push(reason),
        }
    }
    out.push_str(rest);
    if !errors.is_empty() {
        return Err(errors);
    }
    let whole = references == 1
        && !literal
        && text.starts_with("${")
        && text.ends_with('}')
        && text[2..].find('}') == Some(text.len() - 3);
    Ok(if whole {
        Expanded::Whole(out)
    } else {
        Expanded::Text(out)
    })
}

fn is_variable_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use std::collections::HashMap;

    struct Vars(HashMap<&'static str, &'static str>);

    impl Lookup for Vars {
        fn get(&self, name: &str) -> Result<Option<String>, String> {
            Ok(self.0.get(name).map(|v| (*v).to_owned()))
        }
    }

    fn vars() -> Vars {
        Vars(HashMap::from([
            ("HOST", "ch1:8123"),
            ("PORT", "18123"),
            ("TLS", "true"),
            ("SECRET", "s3cr3t-value"),
            ("EMPTY", ""),
        ]))
    }

    fn run(yaml: &str) -> (serde_yaml::Value, Vec<Violation>) {
        let (value, violations, _) = run_recorded(yaml);
        (value, violations)
    }

    fn run_recorded(yaml: &str) -> (serde_yaml::Value, Vec<Violation>, FromEnvironment) {
        let mut value: serde_yaml::Value = serde_yaml::from_str(yaml).unwrap();
        let mut violations = Vec::new();
        let mut from_environment = FromEnvironment::default();
        interpolate(
            &mut value,
            "",
            &vars(),
            &mut violations,
            &mut from_environment,
        );
        (value, violations, from_environment)
    }

    /// A violation about an interpolated value names the variable, never prints its value;
    /// messages elsewhere in the spec and defaults written in the spec are left as they are.
    #[test]
    fn violations_about_interpolated_values_name_the_variable_instead_of_the_value() {
        let (_, violations, from_environment) = run_recorded(
            "sinks: [{parameters: {password: '${SECRET}', url: 'http://${HOST}/x', table: '${NOPE:-t1}'}}]\nother: ch1:8123\n",
        );
        assert!(violations.is_empty());
        let reported = from_environment.redacted(vec![
            Violation::new(
                "sinks[0].parameters.password",
                "`s3cr3t-value` is not a password",
            ),
            Violation::new(
                "sinks[0].parameters",
                "url `http://ch1:8123/x` and `s3cr3t-value`",
            ),
            Violation::new("sinks[0].parameters.table", "table `t1` does not exist"),
            Violation::new("other", "`ch1:8123` elsewhere"),
        ]);
        let messages: Vec<&str> = reported.iter().map(|v| v.message.as_str()).collect();
        assert_eq!(
            messages,
            [
                "`${SECRET}` is not a password",
                "url `http://${HOST}/x` and `${SECRET}`",
                "table `t1` does not exist",
                "`ch1:8123` elsewhere",
            ]
        );
    }

    #[test]
    fn references_defaults_and_escapes_expand_in_values_and_whole_references_are_typed() {
        let (value, violations) = run(r#"
host: ${HOST}
port: ${PORT}
tls: ${TLS}
url: "http://${HOST}/x"
table: events_${MISSING:-default}
empty: "[${EMPTY}]"
escaped: "$${HOST} and $$ and $5"
list: ["${PORT}x", "${NOPE:-7}"]
${HOST}: key kept
quoted_number: "${PORT:-1}"
"#);
        assert_eq!(violations, Vec::<Violation>::new());
        let expected: serde_yaml::Value = serde_yaml::from_str(
            r#"
host: "ch1:8123"
port: 18123
tls: true
url: "http://ch1:8123/x"
table: events_default
empty: "[]"
escaped: "${HOST} and $$ and $5"
list: ["18123x", 7]
"${HOST}": key kept
quoted_number: 18123
"#,
        )
        .unwrap();
        assert_eq!(value, expected);
    }

    #[test]
    fn an_unset_variable_without_default_is_a_violation_at_its_path_without_any_value() {
        let (_, violations) = run(r#"
sinks:
  - parameters: {host: "${CH_HOST}", user: "${SECRET}-${NO_USER}"}
bad: "${1X} ${OPEN"
"#);
        let got: Vec<(&str, &str)> = violations
            .iter()
            .map(|v| (v.path.as_str(), v.message.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "sinks[0].parameters.host",
                    "the environment variable `CH_HOST` (from `${CH_HOST}`) is not set; export it, or give a default with `${CH_HOST:-value}`"
                ),
                (
                    "sinks[0].parameters.user",
                    "the environment variable `NO_USER` (from `${NO_USER}`) is not set; export it, or give a default with `${NO_USER:-value}`"
                ),
                (
                    "bad",
                    "`${1X}` does not name an environment variable (letters, digits and `_`, not starting with a digit; a default follows `:-`); fix the reference, or write `$${` for a literal `${`"
                ),
                (
                    "bad",
                    "`${OPEN` opens a `${` that is never closed; write `${NAME}` or `${NAME:-default}`, or `$${` for a literal `${`"
                ),
            ]
        );
        for v in &violations {
            assert!(!v.message.contains("s3cr3t"), "{v}");
        }
    }
}

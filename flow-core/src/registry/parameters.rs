//! Plugin parameters deserialized from a spec section with every structural violation reported.

use serde::de::DeserializeOwned;

use super::classes::BuildResult;
use crate::structural::deserialize_all;

/// Deserializes plugin parameters (a missing section is an empty mapping), reporting each
/// violation's path under `section` (`parameters.payload_bytes: invalid type ...`): every
/// unknown field (`unknown field `x`, expected one of `a`, `b`, ...`), each with its own path,
/// then the first other mistake, if any (serde stops at it).
pub fn parse_parameters<T: DeserializeOwned>(
    value: &serde_yaml::Value,
    section: &str,
) -> BuildResult<T> {
    match value {
        serde_yaml::Value::Null => deserialize_all(
            &serde_yaml::Value::Mapping(serde_yaml::Mapping::new()),
            section,
        ),
        other => deserialize_all(other, section),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use serde::Deserialize;

    use super::*;
    use crate::error::Violation;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Params {
        table: String,
        #[serde(default)]
        rows: u64,
        #[serde(default)]
        inner: Option<Inner>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        depth: u32,
    }

    fn parse(yaml: &str) -> Vec<Violation> {
        let value: serde_yaml::Value = serde_yaml::from_str(yaml).unwrap();
        parse_parameters::<Params>(&value, "sinks[0].parameters").unwrap_err()
    }

    fn paths(violations: &[Violation]) -> Vec<&str> {
        violations.iter().map(|v| v.path.as_str()).collect()
    }

    #[test]
    fn two_unknown_fields_give_two_violations_each_at_its_own_path() {
        let violations = parse("{table: t, tabel: t, rws: 5}");
        assert_eq!(
            paths(&violations),
            ["sinks[0].parameters.tabel", "sinks[0].parameters.rws"]
        );
        assert_eq!(
            violations[0].message,
            "unknown field `tabel`, expected one of `table`, `rows`, `inner`"
        );
        assert_eq!(
            violations[1].message,
            "unknown field `rws`, expected one of `table`, `rows`, `inner`"
        );
    }

    #[test]
    fn an_unknown_field_and_a_bad_value_are_both_reported_in_either_order() {
        let violations = parse("{table: t, tabel: t, rows: many}");
        assert_eq!(
            paths(&violations),
            ["sinks[0].parameters.tabel", "sinks[0].parameters.rows"]
        );
        assert!(
            violations[1].message.starts_with("invalid type"),
            "{violations:?}"
        );
        let violations = parse("{rows: many, table: t, tabel: t}");
        assert_eq!(
            paths(&violations),
            ["sinks[0].parameters.rows", "sinks[0].parameters.tabel"]
        );
    }

    #[test]
    fn unknown_fields_of_a_nested_section_keep_their_full_path() {
        let violations = parse("{table: t, inner: {depth: 1, dpth: 2, width: 3}}");
        assert_eq!(
            paths(&violations),
            [
                "sinks[0].parameters.inner.dpth",
                "sinks[0].parameters.inner.width"
            ]
        );
    }

    #[test]
    fn a_typo_of_a_required_field_also_reports_it_missing_once() {
        let violations = parse("{tabel: t, rws: 1}");
        assert_eq!(
            paths(&violations),
            [
                "sinks[0].parameters.tabel",
                "sinks[0].parameters.rws",
                "sinks[0].parameters"
            ]
        );
        assert_eq!(violations[2].message, "missing field `table`");
    }

    #[test]
    fn a_missing_section_is_an_empty_mapping() {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Empty {}
        assert!(parse_parameters::<Empty>(&serde_yaml::Value::Null, "parameters").is_ok());
    }
}

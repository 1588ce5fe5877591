//! The static `settings` parameter: ClickHouse settings added to every INSERT of the sink
//! (`settings: { max_insert_block_size: 100000 }`), checked when the spec is validated. The
//! settings flow sends itself, and the HTTP parameters that are not settings at all, are refused
//! with the reason: a user value would silently undo what a guarantee rests on.

use std::collections::BTreeMap;
use std::fmt;

use flow_core::Violation;
use serde::{Deserialize, Serialize};

/// A setting's value: any YAML scalar, kept as the text ClickHouse reads (`true` is `1`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SettingValue(pub String);

impl From<&str> for SettingValue {
    fn from(text: &str) -> Self {
        SettingValue(text.to_owned())
    }
}

impl From<String> for SettingValue {
    fn from(text: String) -> Self {
        SettingValue(text)
    }
}

impl From<u64> for SettingValue {
    fn from(value: u64) -> Self {
        SettingValue(value.to_string())
    }
}

impl From<bool> for SettingValue {
    fn from(value: bool) -> Self {
        SettingValue(if value { "1" } else { "0" }.to_owned())
    }
}

impl Serialize for SettingValue {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for SettingValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl serde::de::Visitor<'_> for ScalarVisitor {
    type Value = SettingValue;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a scalar ClickHouse setting value (a number, a text or true/false)")
    }

    fn visit_bool<E: serde::de::Error>(self, value: bool) -> Result<SettingValue, E> {
        Ok(SettingValue::from(value))
    }

    fn visit_i64<E: serde::de::Error>(self, value: i64) -> Result<SettingValue, E> {
        Ok(SettingValue(value.to_string()))
    }

    fn visit_u64<E: serde::de::Error>(self, value: u64) -> Result<SettingValue, E> {
        Ok(SettingValue(value.to_string()))
    }

    fn visit_f64<E: serde::de::Error>(self, value: f64) -> Result<SettingValue, E> {
        Ok(SettingValue(value.to_string()))
    }

    fn visit_str<E: serde::de::Error>(self, value: &str) -> Result<SettingValue, E> {
        Ok(SettingValue(value.to_owned()))
    }
}

/// Why flow refuses a setting of its own, by exact name.
const OWNED: &[(&str, &str)] = &[
    (
        "insert_deduplicate",
        "flow turns deduplication on for the classes whose replays rest on it",
    ),
    (
        "insert_deduplication_token",
        "flow sends each batch's own token; a fixed one would make distinct batches collapse",
    ),
    (
        "async_insert",
        "it is flow's dynamic parameter `async_insert`, which also sets the settings that keep \
         its acknowledgements and deduplication",
    ),
    (
        "decompress",
        "flow sets it from `codec` to match how the INSERT body is compressed",
    ),
    ("compress", "flow reads the server's answers uncompressed"),
    ("readonly", "a read-only session refuses every INSERT"),
];

/// Why flow refuses a setting, by prefix.
const OWNED_PREFIXES: &[(&str, &str)] = &[
    (
        "async_insert_",
        "the async insert knobs follow flow's dynamic parameter `async_insert`",
    ),
    (
        "wait_for_async_insert",
        "flow waits for every async insert so that an acknowledged batch is stored",
    ),
    (
        "input_format_binary_",
        "it changes how the server reads the RowBinary flow encodes for the table's types",
    ),
];

/// HTTP parameters of ClickHouse's interface that are not settings: the client sets them, or
/// they would change the query itself.
const HTTP_PARAMETERS: &[&str] = &[
    "database",
    "default_format",
    "query",
    "query_id",
    "session_id",
    "session_timeout",
    "session_check",
    "user",
    "password",
    "quota_key",
    "role",
    "buffer_size",
    "wait_end_of_query",
    "client_protocol_version",
];

/// Every violation of `settings`, with paths under `parameters.settings`.
pub fn validate(settings: &BTreeMap<String, SettingValue>, v: &mut Vec<Violation>) {
    for name in settings.keys() {
        let path = format!("parameters.settings.{name}");
        if !is_setting_name(name) {
            v.push(Violation::new(
                path,
                format!(
                    "`{name}` is not a ClickHouse setting name (letters, digits and `_`, not \
                     starting with a digit); fix the name"
                ),
            ));
        } else if let Some(why) = owned_reason(name) {
            v.push(Violation::new(
                path,
                format!("flow sets `{name}` itself ({why}); remove it from `settings`"),
            ));
        } else if HTTP_PARAMETERS.contains(&name.as_str()) {
            v.push(Violation::new(
                path,
                format!(
                    "`{name}` is a parameter of ClickHouse's HTTP interface, not a setting, and \
                     flow's client sets what it needs of those; remove it from `settings` (the \
                     sink's own parameters say which database and user it uses)"
                ),
            ));
        }
    }
}

/// Why flow owns `name`, when it does.
fn owned_reason(name: &str) -> Option<&'static str> {
    let name = name.to_ascii_lowercase();
    OWNED
        .iter()
        .find(|(owned, _)| name == *owned)
        .or_else(|| {
            OWNED_PREFIXES
                .iter()
                .find(|(prefix, _)| name.starts_with(prefix))
        })
        .map(|(_, why)| *why)
}

fn is_setting_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The settings as the INSERT sends them, in name order.
pub fn to_pairs(settings: &BTreeMap<String, SettingValue>) -> Vec<(String, String)> {
    settings
        .iter()
        .map(|(name, value)| (name.clone(), value.0.clone()))
        .collect()
}

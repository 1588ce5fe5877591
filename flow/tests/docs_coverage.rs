//! Every parameter the code accepts is in the docs' tables, and every parameter those tables list
//! is one the code accepts.
//!
//! The accepted keys come from the code, not from a list kept here: for every class that
//! `flow::registry()` knows, a spec whose section holds one unknown key is built, and the keys are
//! read from serde's `deny_unknown_fields` violation (``unknown field `probe`, expected one of
//! `a`, `b` ``). Each accepted key is then probed one level down the same way (a map or a list of
//! maps holding the unknown key: the keys of a nested struct such as `at_most_once_strategy` or
//! `auth`) and with an unknown string (``unknown variant `probe`, expected one of `stop`,
//! `dead_letter` ``: the values of an enum), and those nested keys and values must be named in the
//! row that documents the key.
//!
//! Where each class's table lives is the one thing written here ([`DOCS`]); a class registered
//! without an entry fails the test.

use std::collections::BTreeSet;
use std::path::PathBuf;

/// A key no class accepts.
const PROBE: &str = "flow_docs_probe";
/// How deep nested structs are probed (`auth.user_password.user` is two levels down).
const MAX_DEPTH: usize = 3;

/// Where a section of a class is documented.
#[derive(Clone, Copy, Debug)]
enum Doc {
    /// The row of the README's *Built-in plugins* table whose first cell names the class: every
    /// key is named in it as `` `key` ``.
    PluginRow,
    /// The tables of the section under a heading starting with this text, in this file (relative
    /// to the repository): every key is the first cell of a row (`` `key` ``), and every key a
    /// first cell names is accepted.
    KeyTable(&'static str, &'static str),
}

/// A class's kind, which says where its spec entry goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Source,
    Processor,
    Sink,
}

/// The sections of a spec entry that hold parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Section {
    Parameters,
    DynamicParameters,
}

impl Section {
    fn key(self) -> &'static str {
        match self {
            Section::Parameters => "parameters",
            Section::DynamicParameters => "dynamic_parameters",
        }
    }
}

const README: &str = "README.md";
const CLICKHOUSE: &str = "docs/clickhouse.md";
/// The heading of the README table with one row per class.
const PLUGINS_HEADING: &str = "Built-in plugins";
/// The prefix of the reference aliases of the ClickHouse classes.
const ALIAS_PREFIX: &str = "NYT::NFlow::T";

/// Where each class documents its sections: (class, static `parameters`, `dynamic_parameters`).
/// `None` for the dynamic section: the class has none (sources and processors).
const DOCS: &[(&str, Doc, Option<Doc>)] = &[
    ("generator", Doc::PluginRow, None),
    ("jsonl_file", Doc::PluginRow, None),
    (
        "nats_jetstream",
        Doc::KeyTable(README, "Reading from NATS JetStream"),
        None,
    ),
    ("kafka", Doc::KeyTable(README, "Reading from Kafka"), None),
    ("project", Doc::PluginRow, None),
    ("DebugSink", Doc::PluginRow, Some(Doc::PluginRow)),
    ("ClickHouseBatchingSink", CH_STATIC, Some(CH_DYNAMIC)),
    ("ShardedClickHouseBatchingSink", CH_STATIC, Some(CH_DYNAMIC)),
    ("AtLeastOnceClickHouseSink", CH_STATIC, Some(CH_DYNAMIC)),
    ("AtMostOnceClickHouseSink", CH_STATIC, Some(CH_DYNAMIC)),
];
const CH_STATIC: Doc = Doc::KeyTable(CLICKHOUSE, "Static parameters");
const CH_DYNAMIC: Doc = Doc::KeyTable(CLICKHOUSE, "Dynamic parameters");

// ---------------------------------------------------------------------------------------------
// What the code accepts

/// One accepted key with what was found below it.
#[derive(Debug, Default)]
struct Key {
    name: String,
    /// Keys of a nested struct, each with its own nested keys, flattened (`user_password`,
    /// `user`, `password_env_var`).
    nested: BTreeSet<String>,
    /// Values of an enum.
    variants: BTreeSet<String>,
}

/// The spec of a pipeline in which `class` (of `kind`) has `section` = `value` (flow-style YAML);
/// returns the path prefix of that section's violations.
fn probe_spec(kind: Kind, class: &str, section: Section, value: &str) -> (String, String) {
    let (params, dynamic) = match section {
        Section::Parameters => (value, "{}"),
        Section::DynamicParameters => ("{}", value),
    };
    let debug = "{name: out, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {path: out.jsonl}}";
    let generator = "{class: generator, parameters: {count: 1}}";
    let (yaml, prefix) = match kind {
        Kind::Source => (
            format!("pipeline: docs\nsource: {{class: {class}, parameters: {params}}}\nsinks: [{debug}]\n"),
            "source",
        ),
        Kind::Processor => (
            format!(
                "pipeline: docs\nsource: {generator}\nprocessors: [{{name: p, class: {class}, input_stream_id: rows, output_stream_id: projected, parameters: {params}}}]\nsinks: [{debug}]\n"
            ),
            "processors[0]",
        ),
        Kind::Sink => (
            format!(
                "pipeline: docs\nsource: {generator}\nsinks: [{{name: s, sink_class_name: '{class}', input_stream_ids: [rows], parameters: {params}, dynamic_parameters: {dynamic}}}]\n"
            ),
            "sinks[0]",
        ),
    };
    (yaml, format!("{prefix}.{}", section.key()))
}

/// The messages of the violations of `section` when it holds `value`.
fn violations(kind: Kind, class: &str, section: Section, value: &str) -> Vec<String> {
    let (yaml, prefix) = probe_spec(kind, class, section, value);
    let spec = match flow::PipelineSpec::from_yaml(&yaml) {
        Ok(spec) => spec,
        Err(err) => panic!("the probe spec does not parse: {err}\n{yaml}"),
    };
    match flow::registry().build(&spec) {
        Ok(_) => Vec::new(),
        Err(err) => err
            .violations
            .into_iter()
            .filter(|v| v.path.starts_with(&prefix))
            .map(|v| v.message)
            .collect(),
    }
}

/// The names serde lists after `unknown <what> `probe`, expected` in one of `messages`: `None`
/// when no message says that.
fn expected_names(messages: &[String], what: &str) -> Option<BTreeSet<String>> {
    let head = format!("unknown {what} `{PROBE}`, expected");
    let message = messages.iter().find(|m| m.contains(&head))?;
    let (_, tail) = message.split_once(&head)?;
    Some(backticked(tail).into_iter().collect())
}

/// The text of every `` `span` `` of `text`.
fn backticked(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The keys the struct accepts that `wrap` puts its argument (a flow-style YAML value) in: the
/// section itself, or a key of it, or a key of a key; a list of such structs too.
fn accepted_keys(
    kind: Kind,
    class: &str,
    section: Section,
    wrap: &dyn Fn(&str) -> String,
) -> Option<BTreeSet<String>> {
    let map = format!("{{{PROBE}: 1}}");
    let list = format!("[{{{PROBE}: 1}}]");
    [map, list]
        .iter()
        .find_map(|shape| expected_names(&violations(kind, class, section, &wrap(shape)), "field"))
}

/// The nested keys below `path`, flattened, up to [`MAX_DEPTH`].
fn nested_keys(
    kind: Kind,
    class: &str,
    section: Section,
    path: &[String],
    found: &mut BTreeSet<String>,
) {
    if path.len() > MAX_DEPTH {
        return;
    }
    let wrap = |inner: &str| {
        path.iter()
            .rev()
            .fold(inner.to_owned(), |acc, key| format!("{{{key}: {acc}}}"))
    };
    let Some(keys) = accepted_keys(kind, class, section, &wrap) else {
        return;
    };
    for key in keys {
        found.insert(key.clone());
        let mut deeper = path.to_vec();
        deeper.push(key);
        nested_keys(kind, class, section, &deeper, found);
    }
}

/// Every key `section` of `class` accepts, with its nested keys and enum values.
fn section_keys(kind: Kind, class: &str, section: Section) -> Vec<Key> {
    let top =
        accepted_keys(kind, class, section, &|inner: &str| inner.to_owned()).unwrap_or_else(|| {
            panic!(
                "{class}.{}: a key it does not know gave no `unknown field` violation, so its keys \
                 cannot be read: {:?}",
                section.key(),
                violations(kind, class, section, &format!("{{{PROBE}: 1}}"))
            )
        });
    top.into_iter()
        .map(|name| {
            let mut nested = BTreeSet::new();
            nested_keys(
                kind,
                class,
                section,
                std::slice::from_ref(&name),
                &mut nested,
            );
            let messages = violations(kind, class, section, &format!("{{{name}: {PROBE}}}"));
            let variants = expected_names(&messages, "variant").unwrap_or_default();
            Key {
                name,
                nested,
                variants,
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// What the docs say

fn repository() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(file: &str) -> String {
    let path = repository().join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// The table rows of the section under the heading that starts with `heading`, as cells (`\|`
/// inside a cell is not a separator); separator rows left out.
fn section_rows(file: &str, heading: &str) -> Vec<Vec<String>> {
    let text = read(file);
    let mut lines = text.lines();
    let found = lines.by_ref().any(|line| {
        line.starts_with('#') && line.trim_start_matches('#').trim().starts_with(heading)
    });
    assert!(found, "{file}: no heading starting with `{heading}`");
    lines
        .take_while(|line| !line.starts_with('#'))
        .filter(|line| line.trim_start().starts_with('|'))
        .map(cells)
        .filter(|row| {
            !row.iter()
                .all(|c| c.chars().all(|ch| ch == '-' || ch == ':'))
        })
        .collect()
}

fn cells(line: &str) -> Vec<String> {
    let line = line.trim().trim_start_matches('|').trim_end_matches('|');
    let mut cells = vec![String::new()];
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '|' => cells.push(String::new()),
            c => {
                let c = if c == '\\' && chars.peek() == Some(&'|') {
                    chars.next().unwrap_or(c)
                } else {
                    c
                };
                if let Some(cell) = cells.last_mut() {
                    cell.push(c);
                }
            }
        }
    }
    cells.into_iter().map(|c| c.trim().to_owned()).collect()
}

/// `word` occurs in `text` with no identifier character on either side.
fn mentions(text: &str, word: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(word).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(ident)
    })
}

/// The README's *Built-in plugins* row of `class`.
fn plugin_row(class: &str) -> Option<String> {
    section_rows(README, PLUGINS_HEADING)
        .into_iter()
        .find(|row| backticked(&row[0]).iter().any(|name| name == class))
        .map(|row| row.join(" | "))
}

/// What is missing from the docs for `keys` of `class`'s `section`, documented at `doc`.
fn missing(class: &str, section: Section, keys: &[Key], doc: Doc) -> Vec<String> {
    let mut missing = Vec::new();
    let what = format!("{} {}", canonical(class), section.key());
    let rows: Vec<(Vec<String>, String)> = match doc {
        Doc::PluginRow => match plugin_row(class) {
            Some(row) => vec![(Vec::new(), row)],
            None => {
                return vec![format!(
                    "{what}: no row for `{class}` in {README} ({PLUGINS_HEADING})"
                )]
            }
        },
        Doc::KeyTable(file, heading) => section_rows(file, heading)
            .into_iter()
            .map(|row| (backticked(&row[0]), row.join(" | ")))
            .collect(),
    };
    for key in keys {
        let row = match doc {
            Doc::PluginRow => rows
                .iter()
                .find(|(_, row)| row.contains(&format!("`{}`", key.name))),
            Doc::KeyTable(..) => rows.iter().find(|(names, _)| names.contains(&key.name)),
        };
        let Some((_, row)) = row else {
            missing.push(format!(
                "{what}: `{}` is not documented ({doc:?})",
                key.name
            ));
            continue;
        };
        for word in key.nested.iter().chain(&key.variants) {
            if !mentions(row, word) {
                missing.push(format!(
                    "{what}: `{}` accepts `{word}`, which its row does not name ({doc:?})",
                    key.name
                ));
            }
        }
    }
    if let Doc::KeyTable(file, heading) = doc {
        let accepted: BTreeSet<&str> = keys.iter().map(|k| k.name.as_str()).collect();
        for (names, _) in &rows {
            for name in names.iter().filter(|n| !accepted.contains(n.as_str())) {
                missing.push(format!(
                    "{what}: {file} ({heading}) lists `{name}`, which the code does not accept"
                ));
            }
        }
    }
    missing
}

fn canonical(class: &str) -> &str {
    class.strip_prefix(ALIAS_PREFIX).unwrap_or(class)
}

fn docs_of(class: &str) -> Option<(Doc, Option<Doc>)> {
    DOCS.iter()
        .find(|(name, _, _)| *name == canonical(class))
        .map(|(_, params, dynamic)| (*params, *dynamic))
}

// ---------------------------------------------------------------------------------------------

#[test]
fn every_parameter_the_code_accepts_is_in_the_docs_tables_and_no_other() {
    let registry = flow::registry();
    let classes: Vec<(Kind, String)> = [
        (Kind::Source, registry.source_classes()),
        (Kind::Processor, registry.processor_classes()),
        (Kind::Sink, registry.sink_classes()),
    ]
    .into_iter()
    .flat_map(|(kind, names)| names.into_iter().map(move |n| (kind, n.to_owned())))
    .collect();
    // A set: an alias reports what its class reports.
    let mut problems = BTreeSet::new();
    let mut checked = 0usize;
    for (kind, class) in &classes {
        let Some((params, dynamic)) = docs_of(class) else {
            problems.insert(format!(
                "`{class}` is registered but this test does not know where its parameters are \
                 documented: add it to DOCS"
            ));
            continue;
        };
        if plugin_row(canonical(class)).is_none() {
            problems.insert(format!(
                "`{}` has no row in the {README} table under {PLUGINS_HEADING}",
                canonical(class)
            ));
        }
        let keys = section_keys(*kind, class, Section::Parameters);
        checked += keys.len();
        problems.extend(missing(class, Section::Parameters, &keys, params));
        if *kind == Kind::Sink {
            let keys = section_keys(*kind, class, Section::DynamicParameters);
            checked += keys.len();
            match dynamic {
                Some(doc) => {
                    problems.extend(missing(class, Section::DynamicParameters, &keys, doc))
                }
                None if keys.is_empty() => {}
                None => {
                    problems.insert(format!(
                        "{class} accepts dynamic_parameters but DOCS names no table for them"
                    ));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the docs do not match the parameters the code accepts:\n  {}",
        problems.into_iter().collect::<Vec<_>>().join("\n  ")
    );
    // Every class of DOCS is registered (a renamed class would leave a stale entry).
    for (name, _, _) in DOCS {
        assert!(
            classes.iter().any(|(_, c)| c == name),
            "DOCS names `{name}`, which flow::registry() does not know"
        );
    }
    println!("{} classes, {checked} keys checked", classes.len());
}

#[test]
fn the_probe_reads_every_key_of_a_section() {
    // The ClickHouse dynamic section as the code defines it today, nested keys and values too:
    // the probing itself is what this pins, not the docs.
    let keys = section_keys(
        Kind::Sink,
        "AtMostOnceClickHouseSink",
        Section::DynamicParameters,
    );
    let names: Vec<&str> = keys.iter().map(|k| k.name.as_str()).collect();
    assert!(names.contains(&"max_rows_per_batch"), "{names:?}");
    assert!(names.contains(&"at_most_once_strategy"), "{names:?}");
    let strategy = keys
        .iter()
        .find(|k| k.name == "at_most_once_strategy")
        .map(|k| k.nested.iter().cloned().collect::<Vec<_>>());
    assert_eq!(strategy, Some(vec!["total_queue_bytes_limit".to_owned()]));
    let keys = section_keys(Kind::Source, "nats_jetstream", Section::Parameters);
    let format = keys
        .iter()
        .find(|k| k.name == "format")
        .map(|k| &k.variants);
    assert_eq!(
        format.map(|v| v.iter().cloned().collect::<Vec<_>>()),
        Some(vec!["json".to_owned(), "raw".to_owned()])
    );
    let auth = keys.iter().find(|k| k.name == "auth").map(|k| &k.nested);
    assert!(
        auth.is_some_and(|n| n.contains("user_password") && n.contains("password_env_var")),
        "{auth:?}"
    );
}

#[test]
fn integration_readme_lists_every_test_file() {
    let readme = read("integration/README.md");
    let dir = repository().join("integration/tests");
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|err| panic!("{}: {err}", dir.display()));
    let mut files: Vec<String> = entries
        .filter_map(Result::ok)
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".rs"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no test file in {}", dir.display());
    let unlisted: Vec<&String> = files
        .iter()
        .filter(|name| !readme.contains(&format!("| `tests/{name}` |")))
        .collect();
    assert!(
        unlisted.is_empty(),
        "integration/README.md has no row `| `tests/<file>` | what it checks |` for {unlisted:?}"
    );
}

//! Bounded property tests (issue 13): the spec parser and validation, and the JSON-lines decoding
//! of `jsonl_file`, never panic or hang on arbitrary input; they accept or refuse with a message.
//! 128 cases each, so they run with the normal test suite.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::time::{Duration, Instant};

use flow_core::{MessageBatch, PipelineSpec, ReadLimits, Registry, SourceOutput};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Text made of the characters YAML gives a meaning to, letters and digits.
fn yamlish(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            Just("\n".to_owned()),
            Just("  ".to_owned()),
            Just("- ".to_owned()),
            Just(": ".to_owned()),
            Just("[".to_owned()),
            Just("]".to_owned()),
            Just("{".to_owned()),
            Just("}".to_owned()),
            Just(",".to_owned()),
            Just("'".to_owned()),
            Just("\"".to_owned()),
            Just("#".to_owned()),
            Just("&a ".to_owned()),
            Just("*a".to_owned()),
            Just("!!str ".to_owned()),
            Just("|\n".to_owned()),
            Just("pipeline".to_owned()),
            Just("partitions".to_owned()),
            Just("sinks".to_owned()),
            Just("source".to_owned()),
            Just("99999999999999999999999".to_owned()),
            Just("\u{feff}".to_owned()),
            "[a-z0-9_]{1,8}",
        ],
        0..max,
    )
    .prop_map(|parts| parts.concat())
}

/// A valid spec with arbitrary values put in its parameters.
fn spec_with(value: &str) -> String {
    format!(
        "pipeline: p\npartitions: 2\nsource:\n  class: generator\n  parameters: {{count: {value}}}\nsinks:\n  - name: s\n    sink_class_name: DebugSink\n    input_stream_ids: [rows]\n    parameters: {{path: {value}}}\n    dynamic_parameters: {{max_rows_per_batch: {value}}}\n"
    )
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn the_spec_parser_and_validation_never_panic(text in yamlish(200)) {
        let registry = Registry::with_builtins();
        let started = Instant::now();
        if let Ok(spec) = PipelineSpec::from_yaml(&text) {
            let _ = registry.build(&spec);
        }
        prop_assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn arbitrary_parameter_values_are_accepted_or_refused_with_a_path(value in yamlish(12)) {
        let registry = Registry::with_builtins();
        match PipelineSpec::from_yaml(&spec_with(&value)) {
            Ok(spec) => {
                if let Err(err) = registry.build(&spec) {
                    prop_assert!(!err.violations.is_empty());
                }
            }
            Err(err) => prop_assert!(!err.violations.is_empty()),
        }
    }

    #[test]
    fn jsonl_decoding_never_panics_on_arbitrary_lines(
        lines in proptest::collection::vec(
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..64),
                json_object().prop_map(String::into_bytes),
            ],
            0..8,
        )
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        let mut file = std::fs::File::create(&path).unwrap();
        for line in &lines {
            let line: Vec<u8> = line.iter().copied().filter(|&b| b != b'\n').collect();
            file.write_all(&line).unwrap();
            file.write_all(b"\n").unwrap();
        }
        drop(file);
        let spec = PipelineSpec::from_yaml(&format!(
            "pipeline: p\nsource:\n  class: jsonl_file\n  parameters:\n    files: ['{}']\n    on_bad_record: dead_letter\n    max_record_bytes: 48\n    schema: [{{name: a, type: 'optional<int64>'}}, {{name: b, type: 'optional<utf8>'}}, {{name: c, type: 'optional<date>'}}, {{name: d, type: 'optional<double>'}}, {{name: e, type: 'optional<boolean>'}}]\nsinks:\n  - {{name: s, sink_class_name: DebugSink, input_stream_ids: [rows], parameters: {{path: x}}}}\n",
            path.display()
        ))
        .unwrap();
        let pipeline = Registry::with_builtins().build(&spec).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (messages, dead) = runtime.block_on(async {
            let mut source = pipeline.source.open_partition(0, None).unwrap();
            let mut batch = MessageBatch::new(pipeline.source.schema());
            let mut dead = Vec::new();
            loop {
                let read = source
                    .read(
                        &mut SourceOutput { batch: &mut batch, dead_letters: &mut dead },
                        ReadLimits {
                            max_messages: 100,
                            deadline: tokio::time::Instant::now() + Duration::from_secs(5),
                        },
                    )
                    .await
                    .unwrap();
                if read.exhausted {
                    break;
                }
            }
            (batch.len(), dead)
        });
        // Every non-blank line is a message or a dead letter, and no dead letter is over the cap.
        let non_blank = lines
            .iter()
            .filter(|l| !l.iter().filter(|&&b| b != b'\n').all(u8::is_ascii_whitespace))
            .count();
        prop_assert_eq!(messages + dead.len(), non_blank);
        prop_assert!(dead.iter().all(|d| d.payload.len() <= 48));
    }
}

/// JSON objects over the schema's keys (and one more), with values of every JSON kind.
fn json_object() -> impl Strategy<Value = String> {
    let value = prop_oneof![
        Just("null".to_owned()),
        Just("true".to_owned()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| serde_json::to_string(&f).unwrap_or_default()),
        Just("18446744073709551616".to_owned()),
        "[a-z0-9 :-]{0,12}".prop_map(|s| format!("\"{s}\"")),
        Just("[1,2]".to_owned()),
        Just("{\"x\":1}".to_owned()),
    ];
    proptest::collection::btree_map(
        prop_oneof![
            Just("a"),
            Just("b"),
            Just("c"),
            Just("d"),
            Just("e"),
            Just("zz")
        ],
        value,
        0..6,
    )
    .prop_map(|fields| {
        let body: Vec<String> = fields
            .into_iter()
            .map(|(k, v)| format!("\"{k}\":{v}"))
            .collect();
        format!("{{{}}}", body.join(","))
    })
}

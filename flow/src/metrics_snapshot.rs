//! The values `/metrics` shows, as Rust values: [`Metrics::encode`] read back into samples, so a
//! program sees exactly what a Prometheus scrape would (counters with their `_total` suffix,
//! gauges, histogram `_bucket`/`_sum`/`_count` series).

use std::collections::BTreeMap;

use flow_core::Metrics;

/// Why a metrics text could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsParseError {
    /// The metrics could not be encoded.
    #[error("encoding the metrics failed: {0}")]
    Encode(#[source] std::fmt::Error),
    /// A line is not a sample of the Prometheus text format.
    #[error("line {line} of the metrics text is not a sample: {text}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// The line.
        text: String,
    },
}

/// One sample: a series name, its labels and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricSample {
    /// The series name (`flow_sink_rows_delivered_total`, `flow_commit_seconds_count`).
    pub name: String,
    /// The labels, by name.
    pub labels: BTreeMap<String, String>,
    /// The value.
    pub value: f64,
}

/// Every sample of a pipeline's metrics at one instant.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MetricsSnapshot {
    /// The samples, in the order `/metrics` lists them.
    pub samples: Vec<MetricSample>,
}

impl MetricsSnapshot {
    /// The current values of `metrics`.
    pub fn of(metrics: &Metrics) -> Result<MetricsSnapshot, MetricsParseError> {
        let text = metrics.encode().map_err(MetricsParseError::Encode)?;
        MetricsSnapshot::parse(&text)
    }

    /// Reads a Prometheus text exposition (what `/metrics` answers).
    pub fn parse(text: &str) -> Result<MetricsSnapshot, MetricsParseError> {
        let mut samples = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let sample = parse_sample(line).ok_or_else(|| MetricsParseError::Line {
                line: index + 1,
                text: line.to_owned(),
            })?;
            samples.push(sample);
        }
        Ok(MetricsSnapshot { samples })
    }

    /// The samples of series `name` whose labels include every `(label, value)` of `labels`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a MetricSample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|l| l == v))
        })
    }

    /// The sum of the samples [`matching`](Self::matching) `name` and `labels` (0 when none):
    /// `sum("flow_sink_rows_delivered_total", &[("sink", "events")])` is what sink `events`
    /// delivered over every partition and shard.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|s| s.value).sum()
    }

    /// Source messages committed, over every partition (`flow_source_messages_total`).
    pub fn source_messages(&self) -> u64 {
        self.sum("flow_source_messages_total", &[]) as u64
    }

    /// Rows sink `sink` delivered, over every partition and shard
    /// (`flow_sink_rows_delivered_total`).
    pub fn rows_delivered(&self, sink: &str) -> u64 {
        self.sum("flow_sink_rows_delivered_total", &[("sink", sink)]) as u64
    }

    /// Batches sink `sink` has pending in the outbox, over every partition and shard, as last
    /// refreshed from the store (`flow_sink_pending_batches`).
    pub fn pending_batches(&self, sink: &str) -> u64 {
        self.sum("flow_sink_pending_batches", &[("sink", sink)]) as u64
    }
}

/// `name{a="x",b="y"} value` or `name value` (an optional timestamp after the value is ignored).
fn parse_sample(line: &str) -> Option<MetricSample> {
    let (name, rest) = match line.find(['{', ' ']) {
        Some(at) => line.split_at(at),
        None => return None,
    };
    let (labels, rest) = if let Some(inner) = rest.strip_prefix('{') {
        parse_labels(inner)?
    } else {
        (BTreeMap::new(), rest)
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        other => other.parse().ok()?,
    };
    Some(MetricSample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// The labels up to the closing `}`, and what follows it.
fn parse_labels(mut text: &str) -> Option<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        text = text.trim_start_matches([',', ' ']);
        if let Some(rest) = text.strip_prefix('}') {
            return Some((labels, rest));
        }
        let (key, rest) = text.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next()? {
                (at, '"') => break at,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.trim().to_owned(), value);
        text = &rest[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_with_escaped_labels_and_a_histogram_bucket_are_read_exactly() {
        let text = "# HELP x a counter\n# TYPE x counter\n\
                    flow_sink_rows_delivered_total{pipeline=\"p\",sink=\"a\\\"b\\\\c\",partition=\"1\"} 42\n\
                    flow_commit_seconds_bucket{le=\"+Inf\",pipeline=\"p\",partition=\"0\"} 3\n\
                    flow_up 1.5\n# EOF\n";
        let snapshot = MetricsSnapshot::parse(text);
        let samples = snapshot.map(|s| s.samples).unwrap_or_default();
        let labels = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>()
        };
        assert_eq!(
            samples,
            vec![
                MetricSample {
                    name: "flow_sink_rows_delivered_total".to_owned(),
                    labels: labels(&[("pipeline", "p"), ("sink", "a\"b\\c"), ("partition", "1")]),
                    value: 42.0,
                },
                MetricSample {
                    name: "flow_commit_seconds_bucket".to_owned(),
                    labels: labels(&[("le", "+Inf"), ("pipeline", "p"), ("partition", "0")]),
                    value: 3.0,
                },
                MetricSample {
                    name: "flow_up".to_owned(),
                    labels: BTreeMap::new(),
                    value: 1.5,
                },
            ]
        );
    }

    #[test]
    fn a_line_that_is_not_a_sample_is_refused_with_its_number() {
        let err = MetricsSnapshot::parse("# TYPE x counter\nx{a=\"1\" 3\n").err();
        assert_eq!(
            err.map(|e| e.to_string()).as_deref(),
            Some("line 2 of the metrics text is not a sample: x{a=\"1\" 3")
        );
    }

    #[test]
    fn the_snapshot_of_metrics_sums_what_the_source_counted_per_partition() {
        let metrics = Metrics::new();
        metrics.applied("p", 0, &[flow_core::SourceCount::Messages.addition(3)]);
        metrics.applied("p", 1, &[flow_core::SourceCount::Messages.addition(4)]);
        let snapshot = MetricsSnapshot::of(&metrics).unwrap_or_default();
        assert_eq!(snapshot.source_messages(), 7);
        assert_eq!(
            snapshot.sum("flow_source_messages_total", &[("partition", "1")]),
            4.0
        );
    }
}

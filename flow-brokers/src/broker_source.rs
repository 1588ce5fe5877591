//! What the two broker sources share: the parameters every broker source has (set through
//! [`BrokerSourceParams`]), the [`SourceFactory`] that opens one reader per flow partition
//! ([`BrokerFactory`], generic over the [`Broker`]), and the paced wait after broker trouble
//! ([`TroubleWait`]).

use std::sync::Arc;
use std::time::Duration;

use flow_core::sources::{BrokerDecoder, BrokerFormat, OnBadRecord};
use flow_core::{
    is_valid_name, Column, Source, SourceError, SourceFactory, StreamSchema, Violation,
};
use tokio::time::Instant;

/// Between two warnings about the same partition's broker trouble.
const WARN_EVERY: Duration = Duration::from_secs(30);
/// The longest wait after broker trouble before the partition reads again.
const TROUBLE_PAUSE: Duration = Duration::from_secs(1);

/// The parameters every broker source has, set the same way on
/// [`NatsJetStreamParams`](crate::NatsJetStreamParams) and [`KafkaParams`](crate::KafkaParams).
pub trait BrokerSourceParams: sealed::Sealed + Sized {
    /// How a message's payload becomes a row.
    fn format(mut self, format: BrokerFormat) -> Self {
        *self.common().format = format;
        self
    }

    /// The declared columns, with `format: json`.
    fn schema(mut self, schema: Vec<Column>) -> Self {
        *self.common().schema = Some(schema);
        self
    }

    /// What a message that does not fit the schema does.
    fn on_bad_record(mut self, on_bad_record: OnBadRecord) -> Self {
        *self.common().on_bad_record = on_bad_record;
        self
    }

    /// The id of the stream the source defines.
    fn stream_id(mut self, stream_id: impl Into<String>) -> Self {
        *self.common().stream_id = stream_id.into();
        self
    }
}

impl<P: sealed::Sealed> BrokerSourceParams for P {}

pub(crate) mod sealed {
    use flow_core::sources::{BrokerFormat, OnBadRecord};
    use flow_core::Column;

    /// The fields behind [`BrokerSourceParams`](super::BrokerSourceParams)'s setters.
    pub struct Common<'a> {
        pub format: &'a mut BrokerFormat,
        pub schema: &'a mut Option<Vec<Column>>,
        pub on_bad_record: &'a mut OnBadRecord,
        pub stream_id: &'a mut String,
    }

    /// Only this crate's parameter types are broker source parameters.
    pub trait Sealed {
        fn common(&mut self) -> Common<'_>;
    }
}

/// The `stream_id` of a broker source that does not name one.
pub(crate) fn default_stream_id() -> String {
    "rows".to_owned()
}

/// The violation of a `stream_id` that cannot name a stream.
pub(crate) fn stream_id_violation(stream_id: &str) -> Option<Violation> {
    (!is_valid_name(stream_id)).then(|| {
        Violation::new(
            "parameters.stream_id",
            format!("`{stream_id}` is not a valid stream id"),
        )
    })
}

/// One broker's side of a broker source: what a flow partition reads there and how its reader
/// opens.
pub(crate) trait Broker: Send + Sync + 'static {
    /// What one flow partition reads: a subject, a Kafka partition.
    type Target: Clone + Send + Sync + 'static;
    /// Whether the broker's messages have keys (the `raw` format's `key` column).
    const WITH_KEY: bool;

    /// The error text when no target is configured for `partition`.
    fn no_target(partition: u32) -> String;

    /// The broker subject of a partition reading `target` ([`SourceFactory::subject`]).
    fn subject(&self, target: &Self::Target) -> String;

    /// The reader of `partition` from its committed position (`None` before any commit).
    fn open(
        &self,
        partition: u32,
        target: Self::Target,
        decoder: BrokerDecoder,
        position: Option<&[u8]>,
    ) -> Result<Box<dyn Source>, SourceError>;

    /// The shortest epoch its readers read in, and why ([`SourceFactory::min_epoch_duration`]).
    fn min_epoch_duration(&self) -> Option<(Duration, String)> {
        None
    }

    /// What keeps `partition` from reading while it waits ([`SourceFactory::unavailable`]).
    fn unavailable(&self, partition: u32) -> Option<String> {
        let _ = partition;
        None
    }

    /// Whether two positions stand at the same place ([`SourceFactory::same_position`]).
    fn same_position(&self, a: &[u8], b: &[u8]) -> bool {
        a == b
    }

    /// Pulls of `partition` dropped as silent since the start ([`SourceFactory::stalled_pulls`]).
    fn stalled_pulls(&self, partition: u32) -> u64 {
        let _ = partition;
        0
    }
}

/// The factory of a broker source: one reader per flow partition, each on its own target.
pub(crate) struct BrokerFactory<B: Broker> {
    pub broker: B,
    pub stream_id: String,
    pub schema: Arc<StreamSchema>,
    pub format: BrokerFormat,
    pub on_bad_record: OnBadRecord,
    /// The target of each flow partition, in partition order.
    pub targets: Vec<B::Target>,
}

impl<B: Broker> SourceFactory for BrokerFactory<B> {
    fn stream_id(&self) -> &str {
        &self.stream_id
    }

    fn schema(&self) -> Arc<StreamSchema> {
        Arc::clone(&self.schema)
    }

    /// A broker keeps its messages under their positions (stream sequences, offsets) until its
    /// retention removes them; a removed message under a pending batch is caught by the batch's
    /// row count and hash (JetStream) or stops the partition (Kafka, `auto.offset.reset: error`).
    fn replayable(&self) -> bool {
        true
    }

    fn min_epoch_duration(&self) -> Option<(Duration, String)> {
        self.broker.min_epoch_duration()
    }

    fn unavailable(&self, partition: u32) -> Option<String> {
        self.broker.unavailable(partition)
    }

    fn same_position(&self, a: &[u8], b: &[u8]) -> bool {
        self.broker.same_position(a, b)
    }

    fn stalled_pulls(&self, partition: u32) -> u64 {
        self.broker.stalled_pulls(partition)
    }

    fn subject(&self, partition: u32) -> Option<String> {
        let target = self.targets.get(partition as usize)?;
        Some(self.broker.subject(target))
    }

    fn open_partition(
        &self,
        partition: u32,
        position: Option<&[u8]>,
    ) -> Result<Box<dyn Source>, SourceError> {
        let target = self
            .targets
            .get(partition as usize)
            .cloned()
            .ok_or_else(|| SourceError::BadPosition {
                position: Vec::new(),
                what: B::no_target(partition),
            })?;
        let decoder = BrokerDecoder::new(
            partition,
            Arc::clone(&self.schema),
            self.format,
            self.on_bad_record,
            B::WITH_KEY,
        );
        self.broker.open(partition, target, decoder, position)
    }
}

/// Paces a partition after broker trouble that waiting can cure: a warning now and then, then a
/// short wait (never past the read's deadline) before the partition reads on.
#[derive(Default)]
pub(crate) struct TroubleWait {
    last_warning: Option<Instant>,
}

impl TroubleWait {
    /// Calls `warn` unless it was called in the last 30 s, then waits up to a second.
    pub(crate) async fn wait(&mut self, deadline: Instant, warn: impl FnOnce()) {
        let now = Instant::now();
        if self.last_warning.is_none_or(|at| now >= at + WARN_EVERY) {
            self.last_warning = Some(now);
            warn();
        }
        tokio::time::sleep_until(deadline.min(now + TROUBLE_PAUSE)).await;
    }
}

/// `nanos` since the Unix epoch as RFC 3339 UTC text (`2025-12-03T12:00:00.000000000Z`), for
/// messages that name a broker's times.
pub(crate) fn utc_text(nanos: u64) -> String {
    let seconds = nanos / 1_000_000_000;
    let (days, of_day) = (seconds / 86_400, seconds % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        of_day / 3_600,
        of_day % 3_600 / 60,
        of_day % 60,
        nanos % 1_000_000_000
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use flow_core::registry::SourceBuildContext;

    use super::utc_text;

    /// What a sink names its tables after: the subject each partition reads.
    #[test]
    fn each_partition_reports_its_subject() {
        let ctx = SourceBuildContext {
            pipeline: "p",
            partitions: 2,
            paths: flow_core::SpecPaths::working_directory(),
        };
        let build = |yaml: &str, kafka: bool| {
            let parameters: serde_yaml::Value = serde_yaml::from_str(yaml).unwrap();
            let factory = if kafka {
                crate::kafka::build(&ctx, &parameters)
            } else {
                crate::nats::build(&ctx, &parameters)
            };
            let factory = factory.unwrap_or_else(|v| panic!("{v:?}"));
            (0..3).map(|p| factory.subject(p)).collect::<Vec<_>>()
        };
        let some = |s: &str| Some(s.to_owned());
        assert_eq!(
            build(
                "{servers: ['nats://h:4222'], stream: s, subject_template: 'orders.{partition}.x', format: raw}",
                false
            ),
            [some("orders.0.x"), some("orders.1.x"), None]
        );
        assert_eq!(
            build(
                "{servers: ['nats://h:4222'], stream: s, subjects: [orders.created, orders.cancelled], format: raw}",
                false
            ),
            [some("orders.created"), some("orders.cancelled"), None]
        );
        assert_eq!(
            build("{brokers: ['h:9092'], topic: orders, format: raw}", true),
            [some("orders"), some("orders"), None]
        );
    }

    #[test]
    fn utc_text_of_known_instants() {
        assert_eq!(utc_text(0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(
            utc_text(951_827_696_000_000_007),
            "2000-02-29T12:34:56.000000007Z"
        );
        assert_eq!(
            utc_text(1_764_763_260_500_000_000),
            "2025-12-03T12:01:00.500000000Z"
        );
    }
}

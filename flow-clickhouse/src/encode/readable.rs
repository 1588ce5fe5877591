//! The `Date` and `DateTime` values a server reads back as what was sent.
//!
//! RowBinary stores any u16 in a `Date` and any u32 in a `DateTime`, but a server formats a
//! value through its date lookup table, and before 21.4 (ClickHouse PR 9404 extended the table)
//! that table ends early: the value is stored and read back as another date, without an error.
//! Measured on the local 18.16.1 (`clickhouse-client`, every zone of the system's tz database
//! from `toDateTime(toUInt32(v), zone)` against Python's `zoneinfo`):
//!
//! - `Date`: day 0 reads back as `0000-00-00`; days 1 ..= 49710 (1970-01-02 ..= 2106-02-07)
//!   read back right; day 49711 and beyond read back as `1970-01-01` (`2149-06-06`, day 65535,
//!   too).
//! - `DateTime`: 0 reads back as `0000-00-00 00:00:00`. In UTC, 1 ..= 4294943999
//!   (2106-02-06 23:59:59) read back right and 4294943999 + 1 .. 2^32-1 as 1970. In other zones
//!   the table covers other spans: west of UTC a time before local midnight of 1970-01-01 is
//!   shown wrong (`1970-01-01 12:00:01` for second 1 in America/New_York), half-hour zones show
//!   garbage minutes before 1970-01-01 21:00 UTC (`19:io:00` in Asia/Calcutta), and the table ends
//!   as early as 2106-02-06 00:00 UTC (America/Anguilla). 86400 ..= 4294857599
//!   (1970-01-02 00:00:00 ..= 2106-02-05 23:59:59 UTC) reads back right in every zone (but
//!   Africa/Monrovia, whose offset before 1972 had seconds, which 18.16 never shows right). The
//!   sink does not keep a column's zone, so it checks that range.
//!
//! From 21.4 on, `Date` reads back every u16 (1970-01-01 ..= 2149-06-06) and `DateTime` every u32
//! (..= 2106-02-07 06:28:15). A version that cannot be read (the probe of `version()` failed) gets
//! the old ranges: refusing a far date a newer server could have read is the safe side.

use std::fmt::Write as _;

/// The version from which the full ranges read back.
const FULL_RANGES_SINCE: (u32, u32) = (21, 4);

/// What a `Date` and a `DateTime` column read back on the servers of one sink.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadableRanges {
    /// Days since 1970-01-01, inclusive.
    pub date_days: (u16, u16),
    /// Seconds since the epoch (UTC), inclusive, in every time zone.
    pub datetime_seconds: (u32, u32),
    /// The oldest server version these come from, for messages (empty when unknown).
    pub version: String,
}

impl ReadableRanges {
    /// Every value (an encoder not planned against a server, e.g. in tests of the bytes).
    pub fn unchecked() -> ReadableRanges {
        ReadableRanges {
            date_days: (0, u16::MAX),
            datetime_seconds: (0, u32::MAX),
            version: String::new(),
        }
    }

    /// The ranges of a server that answers `version()` with `version`; see the module doc.
    pub fn of_version(version: &str) -> ReadableRanges {
        if parse_version(version).is_some_and(|v| v >= FULL_RANGES_SINCE) {
            ReadableRanges {
                version: version.to_owned(),
                ..ReadableRanges::unchecked()
            }
        } else {
            ReadableRanges {
                date_days: (1, 49_710),
                datetime_seconds: (86_400, 4_294_857_599),
                version: version.to_owned(),
            }
        }
    }

    /// What both `self`'s and `other`'s servers read back (the version named is the one with the
    /// narrower ranges).
    pub fn intersect(self, other: ReadableRanges) -> ReadableRanges {
        let narrower = if other.date_days.1 < self.date_days.1
            || other.datetime_seconds.1 < self.datetime_seconds.1
            || self.version.is_empty()
        {
            other.version.clone()
        } else {
            self.version.clone()
        };
        ReadableRanges {
            date_days: (
                self.date_days.0.max(other.date_days.0),
                self.date_days.1.min(other.date_days.1),
            ),
            datetime_seconds: (
                self.datetime_seconds.0.max(other.datetime_seconds.0),
                self.datetime_seconds.1.min(other.datetime_seconds.1),
            ),
            version: narrower,
        }
    }

    /// Whether a `Date` column reads `days` back.
    #[inline]
    pub(crate) fn date_fits(&self, days: u16) -> bool {
        days >= self.date_days.0 && days <= self.date_days.1
    }

    /// Whether a `DateTime` column reads `seconds` back, in every zone.
    #[inline]
    pub(crate) fn datetime_fits(&self, seconds: u32) -> bool {
        seconds >= self.datetime_seconds.0 && seconds <= self.datetime_seconds.1
    }

    /// The refusal of `days` in a `Date` column (built only on the error path).
    pub(crate) fn date_refusal(&self, days: u16) -> String {
        format!(
            "{} (day {days}) is outside the Date range {} reads back ({} ..= {}): it would be \
             stored and read back as another date. Correct the value at the source{}",
            date_text(days.into()),
            self.server(),
            date_text(self.date_days.0.into()),
            date_text(self.date_days.1.into()),
            self.upgrade_hint("Date up to 2149-06-06"),
        )
    }

    /// The refusal of `seconds` in a `DateTime` column (built only on the error path).
    pub(crate) fn datetime_refusal(&self, seconds: u32) -> String {
        format!(
            "{seconds} ({} UTC) is outside the DateTime range {} reads back in every time zone \
             ({} ..= {} UTC): it would be stored and read back as another time. Correct the \
             value at the source{}",
            datetime_text(seconds.into()),
            self.server(),
            datetime_text(self.datetime_seconds.0.into()),
            datetime_text(self.datetime_seconds.1.into()),
            self.upgrade_hint("DateTime up to 2106-02-07 06:28:15"),
        )
    }

    fn server(&self) -> String {
        if self.version.is_empty() {
            "ClickHouse (version unknown, so the range of 18.16)".to_owned()
        } else {
            format!("ClickHouse {}", self.version)
        }
    }

    fn upgrade_hint(&self, what: &str) -> String {
        if parse_version(&self.version).is_some_and(|v| v >= FULL_RANGES_SINCE) {
            String::new()
        } else {
            format!(", or upgrade the server (21.4 and later read {what})")
        }
    }
}

/// `(major, minor)` of a `version()` answer such as `18.16.1` or `23.8.2.7`.
fn parse_version(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.split('.');
    let major = parts.next()?.trim().parse().ok()?;
    let minor = parts.next()?.trim().parse().ok()?;
    Some((major, minor))
}

/// `YYYY-MM-DD` of a day number since 1970-01-01 (proleptic Gregorian).
fn date_text(days: i64) -> String {
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}")
}

/// `YYYY-MM-DD HH:MM:SS` of seconds since the epoch, in UTC.
fn datetime_text(seconds: i64) -> String {
    let mut text = date_text(seconds.div_euclid(86_400));
    let s = seconds.rem_euclid(86_400);
    let _ = write!(text, " {:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
    text
}

/// Howard Hinnant's `civil_from_days`.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranges_follow_the_server_version() {
        for old in [
            "18.16.1",
            "19.17.4.11",
            "20.8.3.18",
            "21.3.20.1",
            "",
            "unknown",
        ] {
            let ranges = ReadableRanges::of_version(old);
            assert_eq!(ranges.date_days, (1, 49_710), "{old}");
            assert_eq!(ranges.datetime_seconds, (86_400, 4_294_857_599), "{old}");
        }
        for new in ["21.4.1.1", "22.8.5.29", "23.8.2.7", "24.3.1"] {
            let ranges = ReadableRanges::of_version(new);
            assert_eq!(ranges.date_days, (0, u16::MAX), "{new}");
            assert_eq!(ranges.datetime_seconds, (0, u32::MAX), "{new}");
        }
        let mixed =
            ReadableRanges::of_version("23.8.2.7").intersect(ReadableRanges::of_version("18.16.1"));
        assert_eq!(mixed, ReadableRanges::of_version("18.16.1"));
    }

    #[test]
    fn the_edges_measured_on_18_16_are_named_in_the_refusals() {
        let ranges = ReadableRanges::of_version("18.16.1");
        assert!(!ranges.date_fits(0));
        assert!(ranges.date_fits(1));
        assert!(ranges.date_fits(49_710));
        assert!(!ranges.date_fits(49_711));
        assert!(!ranges.datetime_fits(86_399));
        assert!(ranges.datetime_fits(86_400));
        assert!(ranges.datetime_fits(4_294_857_599));
        assert!(!ranges.datetime_fits(4_294_857_600));
        assert_eq!(
            ranges.date_refusal(65_535),
            "2149-06-06 (day 65535) is outside the Date range ClickHouse 18.16.1 reads back \
             (1970-01-02 ..= 2106-02-07): it would be stored and read back as another date. \
             Correct the value at the source, or upgrade the server (21.4 and later read Date up \
             to 2149-06-06)"
        );
        assert_eq!(
            ranges.datetime_refusal(u32::MAX),
            "4294967295 (2106-02-07 06:28:15 UTC) is outside the DateTime range ClickHouse \
             18.16.1 reads back in every time zone (1970-01-02 00:00:00 ..= 2106-02-05 23:59:59 \
             UTC): it would be stored and read back as another time. Correct the value at the \
             source, or upgrade the server (21.4 and later read DateTime up to 2106-02-07 \
             06:28:15)"
        );
        assert!(ReadableRanges::of_version("")
            .date_refusal(0)
            .contains("1970-01-01 (day 0) is outside the Date range ClickHouse (version unknown, so the range of 18.16) reads back"));
    }
}

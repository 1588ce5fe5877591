//! `Time` and `Time64(P)` values: a signed time of day or duration, `Int32` seconds and `Int64`
//! ticks of 10^-P s in RowBinary. The server stores any such number but reads one beyond
//! ±999:59:59 back as the bound (tried on 26.9: 3,600,000 s shows as `999:59:59`), so a value
//! outside the range is refused here rather than stored as another time.

use flow_core::Value;

use super::Reason;
use crate::encode::chtype::ChType;

/// The seconds of `999:59:59`, the widest time either type shows.
const MAX_SECONDS: i64 = 999 * 3600 + 59 * 60 + 59;

/// Writes a `Time` value: whole seconds, from an integer or `[-]H:MM:SS` text.
pub(super) fn write_time<'t>(
    ty: &'t ChType,
    value: Value<'_>,
    out: &mut Vec<u8>,
) -> Result<(), Reason<'t>> {
    let seconds = ticks(ty, 0, value)?;
    // Within ±MAX_SECONDS, which fits 32 bits.
    let seconds = i32::try_from(seconds).map_err(|_| Reason::IntOutOfRange {
        value: seconds.into(),
        ty,
    })?;
    out.extend_from_slice(&seconds.to_le_bytes());
    Ok(())
}

/// Writes a `Time64(precision)` value: ticks, from an integer or `[-]H:MM:SS[.fraction]` text.
pub(super) fn write_time64<'t>(
    ty: &'t ChType,
    precision: u8,
    value: Value<'_>,
    out: &mut Vec<u8>,
) -> Result<(), Reason<'t>> {
    let ticks = ticks(ty, precision, value)?;
    out.extend_from_slice(&ticks.to_le_bytes());
    Ok(())
}

/// The value in ticks of 10^-precision s, within ±999:59:59 and the finest tick.
fn ticks<'t>(ty: &'t ChType, precision: u8, value: Value<'_>) -> Result<i64, Reason<'t>> {
    let per_second = 10i64.pow(precision.into());
    let max = (MAX_SECONDS + 1) * per_second - 1;
    let ticks = match value {
        Value::Int(v) => i128::from(v),
        Value::Uint(v) => i128::from(v),
        Value::Bytes(text) => i128::from(parse(text, precision).ok_or_else(|| {
            Reason::Value(format!(
                "`{}` is not a time {ty} reads: [-]H:MM:SS{} with hours up to 999",
                String::from_utf8_lossy(text),
                if precision > 0 {
                    format!(" and up to {precision} fractional digits")
                } else {
                    String::new()
                }
            ))
        })?),
        other => {
            return Err(Reason::WrongKind {
                kind: other.kind(),
                ty,
            })
        }
    };
    if ticks.abs() > i128::from(max) {
        return Err(Reason::Value(format!(
            "{ticks} is outside the range of {ty} (±999:59:59; the server would read it back as \
             the bound)"
        )));
    }
    // Checked against `max` just above.
    Ok(ticks as i64)
}

/// Ticks of `[-]H{1,3}:MM:SS[.F{1,precision}]`; `None` for any other text.
fn parse(text: &[u8], precision: u8) -> Option<i64> {
    let (negative, text) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    let (clock, fraction) = match text.iter().position(|b| *b == b'.') {
        Some(dot) => (&text[..dot], Some(&text[dot + 1..])),
        None => (text, None),
    };
    let mut parts = clock.split(|b| *b == b':');
    let hours = digits(parts.next()?, 1..=3)?;
    let minutes = digits(parts.next()?, 2..=2).filter(|m| *m < 60)?;
    let seconds = digits(parts.next()?, 2..=2).filter(|s| *s < 60)?;
    if parts.next().is_some() {
        return None;
    }
    let per_second = 10i64.pow(precision.into());
    let mut ticks = (hours * 3600 + minutes * 60 + seconds) * per_second;
    if let Some(fraction) = fraction {
        let width = fraction.len();
        let value = digits(fraction, 1..=usize::from(precision))?;
        ticks += value * 10i64.pow((usize::from(precision) - width) as u32);
    }
    Some(if negative { -ticks } else { ticks })
}

/// The number written by `text`, all ASCII digits, of a length in `len`.
fn digits(text: &[u8], len: std::ops::RangeInclusive<usize>) -> Option<i64> {
    if !len.contains(&text.len()) || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(text.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0')))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn time(value: Value<'_>) -> Result<i32, String> {
        let mut out = Vec::new();
        write_time(&ChType::Time, value, &mut out).map_err(|r| r.describe())?;
        Ok(i32::from_le_bytes(out.try_into().unwrap()))
    }

    fn time64(precision: u8, value: Value<'_>) -> Result<i64, String> {
        let ty = ChType::Time64(precision);
        let mut out = Vec::new();
        write_time64(&ty, precision, value, &mut out).map_err(|r| r.describe())?;
        Ok(i64::from_le_bytes(out.try_into().unwrap()))
    }

    #[test]
    fn times_are_seconds_from_integers_or_text_within_999_hours() {
        assert_eq!(time(Value::Int(-5)), Ok(-5));
        assert_eq!(time(Value::Bytes(b"999:59:59")), Ok(3_599_999));
        assert_eq!(time(Value::Bytes(b"-05:06:07")), Ok(-18_367));
        assert_eq!(time(Value::Bytes(b"5:06:07")), Ok(18_367));
        assert_eq!(
            time(Value::Uint(3_600_000)),
            Err(
                "3600000 is outside the range of Time (±999:59:59; the server would read it \
                 back as the bound)"
                    .into()
            )
        );
        for bad in [
            &b"1000:00:00"[..],
            b"12:60:00",
            b"12:00",
            b"1:2:3",
            b"12:00:00.5",
            b"",
        ] {
            assert_eq!(
                time(Value::Bytes(bad)),
                Err(format!(
                    "`{}` is not a time Time reads: [-]H:MM:SS with hours up to 999",
                    String::from_utf8_lossy(bad)
                ))
            );
        }
    }

    #[test]
    fn time64_keeps_every_digit_of_its_precision_and_refuses_finer_ones() {
        assert_eq!(time64(3, Value::Bytes(b"-00:00:00.001")), Ok(-1));
        assert_eq!(time64(3, Value::Bytes(b"01:00:00.5")), Ok(3_600_500));
        assert_eq!(time64(3, Value::Bytes(b"999:59:59.999")), Ok(3_599_999_999));
        assert_eq!(time64(3, Value::Int(-3_599_999_999)), Ok(-3_599_999_999));
        assert!(time64(3, Value::Int(3_600_000_000)).is_err());
        assert!(time64(3, Value::Bytes(b"00:00:00.0001")).is_err());
        assert_eq!(time64(0, Value::Bytes(b"00:00:01")), Ok(1));
        assert_eq!(
            time64(6, Value::Float(1.0)),
            Err("a floating-point number cannot be written to Time64(6)".into())
        );
    }
}

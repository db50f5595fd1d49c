//! ISO-8601 durations in the form Java's `java.time.Duration` reads and writes
//! (`PT30M`, `PT1H`, `P1DT12H`, `PT0.5S`): how a profile can advertise the key
//! lifetime, and how the [configuration](crate::config) takes its
//! durations.

use std::fmt::Write as _;
use std::time::Duration;

/// Formats a duration the way `java.time.Duration.toString` does, so that
/// `java.time.Duration.parse` accepts it:
/// hours, minutes and seconds only (`PT30M`, `PT1H`, `PT36H`, `PT1.5S`), never days,
/// weeks, months or years.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::iso8601::format_duration;
///
/// assert_eq!(format_duration(Duration::from_secs(30 * 60)), "PT30M");
/// assert_eq!(format_duration(Duration::from_secs(90_061)), "PT25H1M1S");
/// assert_eq!(format_duration(Duration::from_millis(1500)), "PT1.5S");
/// ```
pub fn format_duration(lifetime: Duration) -> String {
    let total = lifetime.as_secs();
    let (hours, minutes, seconds) = (total / 3600, total % 3600 / 60, total % 60);
    let nanos = lifetime.subsec_nanos();
    let mut out = String::from("PT");
    if hours > 0 {
        let _ = write!(out, "{hours}H");
    }
    if minutes > 0 {
        let _ = write!(out, "{minutes}M");
    }
    if seconds > 0 || nanos > 0 || total == 0 {
        let _ = write!(out, "{seconds}");
        if nanos > 0 {
            let fraction = format!("{nanos:09}");
            let _ = write!(out, ".{}", fraction.trim_end_matches('0'));
        }
        out.push('S');
    }
    out
}

/// Why a string is not a duration this crate accepts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{value:?} is not an ISO-8601 duration of days, hours, minutes and seconds ({reason}); write it like PT30M, PT1H or P1DT12H"
)]
pub struct DurationError {
    value: String,
    reason: &'static str,
}

impl DurationError {
    /// What is wrong with the value, in a few words.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

/// Parses an ISO-8601 duration in the form `java.time.Duration.parse` accepts:
/// `PnDTnHnMn.nS`, each part optional but at least one present, case-insensitive.
/// Weeks, months and years are refused (their length is not fixed), and so are
/// negative durations.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::iso8601::parse_duration;
///
/// assert_eq!(parse_duration("PT30M").unwrap(), Duration::from_secs(1800));
/// assert_eq!(parse_duration("p1dt0.5s").unwrap(), Duration::from_millis(86_400_500));
/// assert!(parse_duration("P1W").is_err());
/// ```
pub fn parse_duration(value: &str) -> Result<Duration, DurationError> {
    let error = |reason| DurationError {
        value: value.to_owned(),
        reason,
    };
    let upper = value.trim().to_ascii_uppercase();
    if upper.starts_with('-') {
        return Err(error("a duration cannot be negative"));
    }
    let body = upper
        .strip_prefix('P')
        .ok_or_else(|| error("it must start with P"))?;
    let (date, time) = match body.split_once('T') {
        Some((_, "")) => return Err(error("nothing follows T")),
        Some((date, time)) => (date, Some(time)),
        None => (body, None),
    };
    let mut total = Duration::ZERO;
    let mut parts = 0;
    let mut take = |text: &str, units: &[(char, u64)]| -> Result<(), DurationError> {
        let mut rest = text;
        let mut last_unit = None;
        while !rest.is_empty() {
            let end = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .ok_or_else(|| error("a number has no unit"))?;
            let (number, tail) = rest.split_at(end);
            let Some(unit) = tail.chars().next() else {
                return Err(error("a number has no unit"));
            };
            let position = units
                .iter()
                .position(|(u, _)| *u == unit)
                .ok_or_else(|| {
                    error("only D, H, M and S units are allowed: weeks, months and years have no fixed length")
                })?;
            if last_unit.is_some_and(|last| position <= last) {
                return Err(error("units must come in the order D, H, M, S, once each"));
            }
            last_unit = Some(position);
            let seconds_per_unit = units[position].1;
            let amount = if unit == 'S' {
                number
                    .parse::<f64>()
                    .ok()
                    .filter(|n| n.is_finite())
                    .map(Duration::from_secs_f64)
            } else {
                number
                    .parse::<u64>()
                    .ok()
                    .and_then(|n| n.checked_mul(seconds_per_unit))
                    .map(Duration::from_secs)
            }
            .ok_or_else(|| error("a number is malformed or too large"))?;
            total = total
                .checked_add(amount)
                .ok_or_else(|| error("the duration is too large"))?;
            parts += 1;
            rest = &tail[1..];
        }
        Ok(())
    };
    take(date, &[('D', 86_400)])?;
    if let Some(time) = time {
        take(time, &[('H', 3600), ('M', 60), ('S', 1)])?;
    }
    if parts == 0 {
        return Err(error("it has no parts"));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_trip() {
        for (text, seconds) in [
            ("PT30M", 1800.0),
            ("PT1H", 3600.0),
            ("PT24H", 86_400.0),
            ("PT1H30M5S", 5405.0),
            ("PT0.25S", 0.25),
            ("PT0S", 0.0),
        ] {
            let parsed = parse_duration(text).unwrap();
            assert_eq!(parsed.as_secs_f64(), seconds, "{text}");
            assert_eq!(format_duration(parsed), text);
        }
        assert_eq!(parse_duration("P2D").unwrap(), Duration::from_secs(172_800));
        assert_eq!(format_duration(Duration::from_secs(172_800)), "PT48H");
    }

    #[test]
    fn bad_durations_say_what_is_wrong() {
        for (text, reason) in [
            ("30M", "start with P"),
            ("P1W", "only D, H, M and S"),
            ("P1M", "only D, H, M and S"),
            ("PT", "nothing follows T"),
            ("P", "no parts"),
            ("PT5", "no unit"),
            ("PT1M1H", "order"),
            ("-PT1M", "negative"),
            ("PT99999999999999999999H", "too large"),
        ] {
            let error = parse_duration(text).unwrap_err().to_string();
            assert!(error.contains(reason), "{text}: {error}");
            assert!(error.contains("PT30M"), "{error}");
        }
    }
}

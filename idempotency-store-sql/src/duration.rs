//! ISO-8601 durations as `java.time.Duration.parse` reads them, and as
//! `Duration.toString` writes them: what the Iceberg Java client expects in
//! `idempotency-key-lifetime`.

use std::fmt::Write as _;
use std::time::Duration;

/// Why a duration was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid ISO-8601 duration {input:?}: {reason} (expected the form PnDTnHnMn.nS that java.time.Duration accepts, e.g. PT30M, PT1H, PT90S, P1D)"
)]
pub struct DurationParseError {
    /// The text as given.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// Parses an ISO-8601 duration of the form `[-+]PnDTnHnMn.nS` exactly as
/// `java.time.Duration.parse` does: letters in either case, each number optionally
/// signed, days counted as 24 hours, up to nine fractional digits of seconds (after `.`
/// or `,`). Weeks, months and years (`P1W`, `P1M`, `P1Y`) are refused, as Java refuses
/// them. A duration whose total is negative is refused too, since `std::time::Duration`
/// cannot hold it.
///
/// ```
/// use std::time::Duration;
/// use idempotency_store_sql::parse_iso8601_duration;
///
/// assert_eq!(parse_iso8601_duration("PT30M").unwrap(), Duration::from_secs(1800));
/// assert_eq!(parse_iso8601_duration("P1DT1.5S").unwrap(), Duration::from_millis(86_401_500));
/// assert!(parse_iso8601_duration("P1M").is_err());
/// ```
pub fn parse_iso8601_duration(input: &str) -> Result<Duration, DurationParseError> {
    let fail = |reason| DurationParseError {
        input: input.to_owned(),
        reason,
    };
    let mut cursor = Cursor {
        rest: input.as_bytes(),
    };
    let negate_all = cursor.sign();
    if !cursor.eat_letter(b'P') {
        return Err(fail("it must start with 'P' (optionally after a sign)"));
    }
    // Total in nanoseconds; i128 holds far more than Java's range.
    let mut total: i128 = 0;
    let mut components = 0;

    if cursor.starts_number() {
        let days = cursor.integer().map_err(fail)?;
        if !cursor.eat_letter(b'D') {
            return Err(fail(
                "a number before 'T' must be days ('D'); weeks, months and years are not supported",
            ));
        }
        total += i128::from(days) * 86_400 * NANOS_PER_SEC;
        components += 1;
    }
    if cursor.eat_letter(b'T') {
        let mut time_components = 0;
        let mut last_unit = 0;
        while cursor.starts_number() {
            let negative = cursor.peek() == Some(b'-');
            let whole = cursor.integer().map_err(fail)?;
            let unit = cursor.next_upper();
            let (rank, nanos) = match unit {
                Some(b'H') => (1, i128::from(whole) * 3_600 * NANOS_PER_SEC),
                Some(b'M') => (2, i128::from(whole) * 60 * NANOS_PER_SEC),
                Some(b'.' | b',') => {
                    let fraction = cursor.fraction().map_err(fail)?;
                    if cursor.next_upper() != Some(b'S') {
                        return Err(fail("a fraction is only allowed on seconds ('S')"));
                    }
                    let fraction = if negative { -fraction } else { fraction };
                    (3, i128::from(whole) * NANOS_PER_SEC + fraction)
                }
                Some(b'S') => (3, i128::from(whole) * NANOS_PER_SEC),
                _ => {
                    return Err(fail(
                        "after 'T' each number must be followed by 'H', 'M' or 'S'",
                    ));
                }
            };
            if rank <= last_unit {
                return Err(fail(
                    "hours, minutes and seconds must each appear at most once, in that order",
                ));
            }
            last_unit = rank;
            total += nanos;
            time_components += 1;
        }
        if time_components == 0 {
            return Err(fail("'T' must be followed by hours, minutes or seconds"));
        }
        components += time_components;
    }
    if !cursor.rest.is_empty() {
        return Err(fail("unexpected text after the duration"));
    }
    if components == 0 {
        return Err(fail("it names no days, hours, minutes or seconds"));
    }
    if negate_all {
        total = -total;
    }
    if total < 0 {
        return Err(fail("negative durations are not supported"));
    }
    let secs = u64::try_from(total / NANOS_PER_SEC).map_err(|_| fail("it is too long"))?;
    Ok(Duration::new(secs, (total % NANOS_PER_SEC) as u32))
}

/// Writes `duration` as `java.time.Duration.toString` would: `PT30M`, `PT1H`,
/// `PT24H`, `PT1.5S`, `PT0S`. What this writes, [`parse_iso8601_duration`] and
/// `java.time.Duration.parse` read back as the same duration.
///
/// ```
/// use std::time::Duration;
/// use idempotency_store_sql::format_iso8601_duration;
///
/// assert_eq!(format_iso8601_duration(Duration::from_secs(1800)), "PT30M");
/// assert_eq!(format_iso8601_duration(Duration::from_millis(90_500)), "PT1M30.5S");
/// ```
pub fn format_iso8601_duration(duration: Duration) -> String {
    let total = duration.as_secs();
    let (hours, minutes, seconds) = (total / 3600, total / 60 % 60, total % 60);
    let nanos = duration.subsec_nanos();
    let mut out = String::from("PT");
    if hours > 0 {
        let _ = write!(out, "{hours}H");
    }
    if minutes > 0 {
        let _ = write!(out, "{minutes}M");
    }
    if seconds > 0 || nanos > 0 || out.len() == 2 {
        let _ = write!(out, "{seconds}");
        if nanos > 0 {
            let fraction = format!("{nanos:09}");
            let _ = write!(out, ".{}", fraction.trim_end_matches('0'));
        }
        out.push('S');
    }
    out
}

const NANOS_PER_SEC: i128 = 1_000_000_000;

struct Cursor<'a> {
    rest: &'a [u8],
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.rest.first().copied()
    }

    fn bump(&mut self) {
        self.rest = &self.rest[1..];
    }

    /// Consumes an optional leading sign; true for '-'.
    fn sign(&mut self) -> bool {
        match self.peek() {
            Some(b'-') => {
                self.bump();
                true
            }
            Some(b'+') => {
                self.bump();
                false
            }
            _ => false,
        }
    }

    fn eat_letter(&mut self, upper: u8) -> bool {
        if self.peek().map(|b| b.to_ascii_uppercase()) == Some(upper) {
            self.bump();
            true
        } else {
            false
        }
    }

    fn next_upper(&mut self) -> Option<u8> {
        let next = self.peek()?.to_ascii_uppercase();
        self.bump();
        Some(next)
    }

    fn starts_number(&self) -> bool {
        match self.rest {
            [b'-' | b'+', digit, ..] | [digit, ..] => digit.is_ascii_digit(),
            [] => false,
        }
    }

    /// A signed integer that fits in an i64 (as Java's `Long.parseLong` demands).
    fn integer(&mut self) -> Result<i64, &'static str> {
        let negative = self.sign();
        let digits = self.rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 {
            return Err("a sign must be followed by digits");
        }
        let mut value: i64 = 0;
        for &digit in &self.rest[..digits] {
            value = value
                .checked_mul(10)
                .and_then(|v| v.checked_add(i64::from(digit - b'0')))
                .ok_or("a number is too large")?;
        }
        self.rest = &self.rest[digits..];
        Ok(if negative { -value } else { value })
    }

    /// Up to nine fractional digits (possibly none), as nanoseconds.
    fn fraction(&mut self) -> Result<i128, &'static str> {
        let digits = self.rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits > 9 {
            return Err("seconds may have at most nine fractional digits");
        }
        let mut nanos: i128 = 0;
        for index in 0..9 {
            nanos *= 10;
            if index < digits {
                nanos += i128::from(self.rest[index] - b'0');
            }
        }
        self.rest = &self.rest[digits..];
        Ok(nanos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> Duration {
        parse_iso8601_duration(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn reads_what_java_reads() {
        let cases = [
            ("PT30M", 1_800_000),
            ("PT1H", 3_600_000),
            ("PT90S", 90_000),
            ("P1D", 86_400_000),
            ("P2DT3H4M", 183_840_000),
            ("pt15m", 900_000),
            ("PT0.5S", 500),
            ("PT0,25S", 250),
            ("PT1.S", 1_000),
            ("+PT1M", 60_000),
            ("PT1H-30M", 1_800_000),
            ("-PT-1M", 60_000),
            ("PT0S", 0),
            ("P0D", 0),
        ];
        for (text, millis) in cases {
            assert_eq!(ok(text), Duration::from_millis(millis), "{text}");
        }
        assert_eq!(ok("PT0.000000001S"), Duration::from_nanos(1));
    }

    #[test]
    fn refuses_what_java_refuses() {
        for text in [
            "",
            "P",
            "PT",
            "P1DT",
            "30M",
            "P1W",
            "P1M",
            "P1Y",
            "PT1D",
            "PT1M1H",
            "PT1H1H",
            "PT1.5M",
            "PT1.1234567890S",
            "PT 1M",
            "PT1M ",
            "PT-M",
            "P1DT1",
            "PTS",
            "PT99999999999999999999S",
        ] {
            assert!(
                parse_iso8601_duration(text).is_err(),
                "{text:?} was accepted"
            );
        }
    }

    #[test]
    fn negative_totals_are_refused_with_a_reason() {
        for text in ["-PT1M", "PT-0.5S", "P-1D", "PT1M-61S"] {
            let error = parse_iso8601_duration(text).unwrap_err();
            assert!(error.to_string().contains("negative"), "{text}: {error}");
        }
    }

    #[test]
    fn formats_like_java() {
        let cases = [
            (Duration::ZERO, "PT0S"),
            (Duration::from_secs(1800), "PT30M"),
            (Duration::from_secs(3600), "PT1H"),
            (Duration::from_secs(86_400), "PT24H"),
            (Duration::from_secs(3661), "PT1H1M1S"),
            (Duration::from_millis(1500), "PT1.5S"),
            (Duration::from_nanos(1), "PT0.000000001S"),
        ];
        for (duration, text) in cases {
            assert_eq!(format_iso8601_duration(duration), text);
            assert_eq!(ok(text), duration);
        }
    }
}

//! Durations in the configuration and on the command line: read as
//! humantime reads them (`30s`, `5m`, `72h`, `7d`), except for months and
//! years, and printed in the largest unit that divides them exactly, the way
//! they are written: `7d` and `31d`, where humantime prints `7days` and, with
//! its 30.44-day month, `1month 13h 26m 24s`.

use std::fmt;
use std::time::Duration;

use serde::de::Visitor;
use serde::{Deserializer, Serializer};

const UNITS: [(&str, u128); 5] = [
    ("d", 86_400_000_000_000),
    ("h", 3_600_000_000_000),
    ("m", 60_000_000_000),
    ("s", 1_000_000_000),
    ("ms", 1_000_000),
];

/// `duration` as a configuration file would say it.
pub fn format(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    match UNITS.iter().find(|(_, size)| nanos.is_multiple_of(*size)) {
        Some((unit, size)) => format!("{}{unit}", nanos / size),
        // Finer than a millisecond: humantime's mixed units are exact.
        None => humantime::format_duration(duration).to_string(),
    }
}

/// The longest duration accepted anywhere. Leases and retentions are added
/// to and taken from the clock, in the store and in what `keys` prints; past
/// this, those times leave what PostgreSQL's intervals and RFC 3339's four
/// digit years can hold, and a lease of millennia would fail every claim.
pub const MAX: Duration = Duration::from_secs(36_500 * 86_400);

/// Reads a duration. Months and years are refused: humantime's `M` (months)
/// is one shift key away from `m` (minutes), so `lease: 5M` would quietly
/// hold a crashed delivery's key for five months, and its month is an
/// average (30.44 days) anyway.
pub fn parse(text: &str) -> Result<Duration, String> {
    let duration = parse_unbounded(text)?;
    if duration > MAX {
        return Err(format!(
            "`{text}`: longer than {}, the longest duration accepted",
            format(MAX)
        ));
    }
    Ok(duration)
}

fn parse_unbounded(text: &str) -> Result<Duration, String> {
    const HINT: &str = "write durations like 500ms, 30s, 5m, 72h or 7d";
    let months_or_years = text.split(|c: char| !c.is_ascii_alphabetic()).find(|unit| {
        matches!(
            *unit,
            "M" | "month" | "months" | "y" | "yr" | "yrs" | "year" | "years"
        )
    });
    if let Some(unit) = months_or_years {
        return Err(format!(
            "`{text}`: `{unit}` is months or years, which are not accepted ({HINT}; `m` is minutes)"
        ));
    }
    humantime::parse_duration(text).map_err(|error| match error {
        // humantime's own text for this lists months and years among the
        // units, which this parser refuses.
        // humantime's own suggests `90sec`, a spelling used nowhere else.
        humantime::DurationError::UnknownUnit { unit, .. } if unit.is_empty() => {
            // As written: humantime's value drops a fraction (`0.5` is 0).
            let number = text.trim();
            format!("`{text}`: a unit is needed, as in {number}s or {number}ms ({HINT})")
        }
        humantime::DurationError::UnknownUnit { unit, .. } => {
            format!("`{text}`: unknown unit `{unit}` ({HINT}; units: ns, us, ms, s, m, h, d, w)")
        }
        error => format!("`{text}`: {error} ({HINT})"),
    })
}

pub fn serialize<S: Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format(*duration))
}

pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    deserializer.deserialize_str(DurationText)
}

/// Parses while the value is being read, so that an error is reported at the
/// field's own path and line.
struct DurationText;

impl Visitor<'_> for DurationText {
    type Value = Duration;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a duration such as 30s, 5m, 72h or 7d")
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Duration, E> {
        parse(text).map_err(E::custom)
    }
}

/// The same, for optional fields.
pub mod option {
    use super::*;

    pub fn serialize<S: Serializer>(
        duration: &Option<Duration>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match duration {
            Some(duration) => super::serialize(duration, serializer),
            None => serializer.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Duration>, D::Error> {
        deserializer.deserialize_option(OptionalDurationText)
    }

    struct OptionalDurationText;

    impl<'de> Visitor<'de> for OptionalDurationText {
        type Value = Option<Duration>;

        fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
            DurationText.expecting(formatter)
        }

        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(
            self,
            deserializer: D,
        ) -> Result<Self::Value, D::Error> {
            super::deserialize(deserializer).map(Some)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_printed_in_the_largest_exact_unit() {
        for (duration, printed) in [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(7 * 86_400), "7d"),
            (Duration::from_secs(31 * 86_400), "31d"),
            (Duration::from_secs(36 * 3_600), "36h"),
            (Duration::from_secs(300), "5m"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_millis(1_500), "1500ms"),
            (Duration::from_micros(1_500), "1ms 500us"),
        ] {
            assert_eq!(format(duration), printed);
            assert_eq!(parse(printed).unwrap(), duration);
        }
    }

    #[test]
    fn months_and_years_are_refused_and_minutes_are_not() {
        assert_eq!(parse("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse("1h 30m").unwrap(), Duration::from_secs(5_400));
        for text in [
            "5M", "1month", "2 months", "1y", "1yr", "2yrs", "1year 2d", "3years",
        ] {
            let error = parse(text).unwrap_err();
            assert!(error.contains("months or years"), "{text}: {error}");
        }
    }

    #[test]
    fn durations_past_the_longest_are_refused() {
        assert_eq!(parse("36500d").unwrap(), MAX);
        for text in ["36501d", "5215w", "3000000d", "999999999d"] {
            let error = parse(text).unwrap_err();
            assert!(error.contains("longer than 36500d"), "{text}: {error}");
        }
        let overflowing = parse("99999999999999999999d").unwrap_err();
        assert!(overflowing.contains("too large"), "{overflowing}");
    }

    #[test]
    fn an_unreadable_duration_says_how_to_write_one() {
        let error = parse("5 parsecs").unwrap_err();
        assert!(error.starts_with("`5 parsecs`: "), "{error}");
        assert!(error.contains("30s, 5m, 72h or 7d"), "{error}");
        let unknown = parse("5x").unwrap_err();
        assert!(unknown.contains("unknown unit `x`"), "{unknown}");
        assert!(
            !unknown.contains("month"),
            "refused units not offered: {unknown}"
        );
        let fraction = parse("0.5").unwrap_err();
        assert!(fraction.contains("as in 0.5s or 0.5ms"), "{fraction}");
        let unitless = parse("30").unwrap_err();
        assert!(
            unitless.contains("a unit is needed, as in 30s or 30ms"),
            "{unitless}"
        );
    }
}

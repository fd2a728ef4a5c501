//! Durations in the configuration: read as humantime reads them (`30s`,
//! `5m`, `72h`, `7d`), and printed in the largest unit that divides them
//! exactly, the way they are written: `7d` and `31d`, where humantime prints
//! `7days` and, with its 30.44-day month, `1month 13h 26m 24s`.

use std::time::Duration;

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

pub fn serialize<S: Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format(*duration))
}

pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    humantime_serde::deserialize(deserializer)
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
        humantime_serde::deserialize(deserializer)
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
            assert_eq!(humantime::parse_duration(printed).unwrap(), duration);
        }
    }
}

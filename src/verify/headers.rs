//! Reading signature headers defensively: the first present one of a
//! header and its fallbacks, as text within a size cap; multi-signature
//! headers split with an entry cap; Unix-seconds timestamps checked against
//! the tolerance. Nothing here panics or does unbounded work on any input.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName};

use super::VerifyError;

/// Longer signature header values are rejected unread.
const MAX_HEADER_BYTES: usize = 8 * 1024;

/// Most entries a multi-signature header may hold; real senders use one or
/// two (secret rotation), so more is malformed rather than work to do.
const MAX_ENTRIES: usize = 32;

/// The value of `name`, as text within the size cap.
pub(super) fn header<'a>(
    headers: &'a HeaderMap,
    name: &HeaderName,
) -> Result<&'a str, VerifyError> {
    first_header(headers, name, &[]).map(|(_, value)| value)
}

/// The first of `name` and `fallbacks` that is present and non-empty, with
/// its value as text within the size cap.
pub(super) fn first_header<'a>(
    headers: &'a HeaderMap,
    name: &HeaderName,
    fallbacks: &[HeaderName],
) -> Result<(HeaderName, &'a str), VerifyError> {
    let (found, value) = std::iter::once(name)
        .chain(fallbacks)
        .filter_map(|candidate| Some((candidate, headers.get(candidate)?)))
        .find(|(_, value)| !value.is_empty())
        .ok_or_else(|| VerifyError::MissingHeader(name.clone()))?;
    if value.len() > MAX_HEADER_BYTES {
        return Err(malformed(found));
    }
    let text = value.to_str().map_err(|_| malformed(found))?;
    Ok((found.clone(), text))
}

pub(super) fn malformed(header: &HeaderName) -> VerifyError {
    VerifyError::MalformedHeader(header.clone())
}

/// Splits a multi-signature header, refusing more than [`MAX_ENTRIES`].
pub(super) fn entries<'a>(
    value: &'a str,
    separator: char,
    header: &HeaderName,
) -> Result<Vec<&'a str>, VerifyError> {
    let entries: Vec<&str> = value
        .split(separator)
        .filter(|entry| !entry.is_empty())
        .take(MAX_ENTRIES + 1)
        .collect();
    if entries.len() > MAX_ENTRIES {
        return Err(malformed(header));
    }
    Ok(entries)
}

/// Checks a Unix-seconds timestamp header against `now`, either direction;
/// exactly `tolerance` away is still accepted.
pub(super) fn check_timestamp(
    text: &str,
    header: &HeaderName,
    tolerance: Duration,
    now: SystemTime,
) -> Result<(), VerifyError> {
    // Twelve digits reach the year 33658, and cannot overflow anything below.
    if text.is_empty() || text.len() > 12 || !text.bytes().all(|byte| byte.is_ascii_digit()) {
        return Err(malformed(header));
    }
    let seconds = text.parse::<u64>().map_err(|_| malformed(header))?;
    let signed_at = UNIX_EPOCH
        .checked_add(Duration::from_secs(seconds))
        .ok_or_else(|| malformed(header))?;
    let skew = match now.duration_since(signed_at) {
        Ok(age) => age,
        Err(ahead) => ahead.duration(),
    };
    if skew > tolerance {
        return Err(VerifyError::OutsideTolerance);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::at;
    use super::*;

    #[test]
    fn timestamps_are_checked_both_ways_inclusive() {
        let name = HeaderName::from_static("t");
        let tolerance = Duration::from_secs(300);
        let check = |text: &str, now: u64| check_timestamp(text, &name, tolerance, at(now));
        assert_eq!(check("1000", 1000), Ok(()));
        assert_eq!(check("1000", 1300), Ok(()));
        assert_eq!(check("1000", 700), Ok(()));
        assert_eq!(check("1000", 1301), Err(VerifyError::OutsideTolerance));
        assert_eq!(check("1000", 699), Err(VerifyError::OutsideTolerance));
        for bad in [
            "",
            "-1",
            "+1000",
            "1e3",
            "10.5",
            " 1000",
            "9999999999999",
            "１",
        ] {
            assert_eq!(check(bad, 1000), Err(malformed(&name)), "{bad:?}");
        }
    }

    #[test]
    fn oversized_and_non_text_headers_are_malformed() {
        let name = HeaderName::from_static("x-sig");
        let mut map = HeaderMap::new();
        map.insert(&name, "a".repeat(MAX_HEADER_BYTES + 1).parse().unwrap());
        assert_eq!(header(&map, &name), Err(malformed(&name)));
        map.insert(&name, http::HeaderValue::from_bytes(b"\xff\xfe").unwrap());
        assert_eq!(header(&map, &name), Err(malformed(&name)));
        map.insert(&name, "".parse().unwrap());
        assert_eq!(header(&map, &name), Err(VerifyError::MissingHeader(name)));
    }

    #[test]
    fn entries_are_capped() {
        let name = HeaderName::from_static("x-sig");
        let many = vec!["v1,AAAA"; MAX_ENTRIES + 1].join(" ");
        assert_eq!(entries(&many, ' ', &name), Err(malformed(&name)));
        let enough = vec!["v1,AAAA"; MAX_ENTRIES].join("  ");
        assert_eq!(entries(&enough, ' ', &name).unwrap().len(), MAX_ENTRIES);
    }
}

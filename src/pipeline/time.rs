//! RFC 3339 timestamps to milliseconds since the epoch, without a clock or a crate.

/// Parse `2026-11-29T11:12:39Z`, `2026-11-29T11:12:39.123+01:00` and the like.
/// Returns `None` for anything else, including dates before 1970.
pub fn parse_rfc3339_ms(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        if !t.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        t.parse().ok()
    };
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, min, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return None;
    }
    if hour > 23 || min > 59 || sec > 60 {
        return None;
    }
    let mut i = 19;
    let mut millis = 0i64;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == start {
            return None;
        }
        // Keep milliseconds; finer digits are truncated, never rounded up.
        let frac = &s[start..i.min(start + 3)];
        millis = frac.parse::<i64>().ok()? * 10i64.pow(3 - frac.len() as u32);
    }
    let offset_min = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        c @ (b'+' | b'-') if i + 6 == b.len() && b[i + 3] == b':' => {
            let h = num(i + 1..i + 3)?;
            let m = num(i + 4..i + 6)?;
            if h > 23 || m > 59 {
                return None;
            }
            let o = h * 60 + m;
            if *c == b'+' { o } else { -o }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + min * 60 + sec.min(59) - offset_min * 60;
    let ms = secs.checked_mul(1000)?.checked_add(millis)?;
    u64::try_from(ms).ok()
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_parses_to_epoch_ms() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339_ms("2000-03-01T00:00:00Z"),
            Some(951_868_800_000)
        );
        assert_eq!(
            parse_rfc3339_ms("2026-11-29T11:12:39.5Z"),
            Some(1_795_950_759_500)
        );
        assert_eq!(
            parse_rfc3339_ms("2026-11-29T12:12:39.123+01:00"),
            Some(1_795_950_759_123)
        );
        assert_eq!(parse_rfc3339_ms("2026-02-30T00:00:00Z"), None);
        assert_eq!(parse_rfc3339_ms("1969-12-31T23:59:59Z"), None);
        assert_eq!(parse_rfc3339_ms("2026-11-29 11:12"), None);
        assert_eq!(parse_rfc3339_ms("2026-11-29T11:12:39"), None);
    }

    #[test]
    fn rfc3339_extremes_parse_or_are_refused_without_a_panic() {
        assert_eq!(
            parse_rfc3339_ms("9999-12-31T23:59:60.999999+00:00"),
            Some(253_402_300_799_999)
        );
        assert_eq!(
            parse_rfc3339_ms("1970-01-01T00:00:00-23:59"),
            Some(86_340_000)
        );
        // Before the epoch once the offset is applied.
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00+00:01"), None);
        assert_eq!(parse_rfc3339_ms("0000-01-01T00:00:00Z"), None);
        assert_eq!(parse_rfc3339_ms("2026-11-29T11:12:39.Z"), None);
        assert_eq!(parse_rfc3339_ms("2026-11-29T11:12:39+01:00x"), None);
        assert_eq!(parse_rfc3339_ms("2026-1é-29T11:12:39Z"), None);
        assert_eq!(parse_rfc3339_ms("2026-11-29T11:12:3é"), None);
    }
}

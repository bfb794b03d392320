//! Durations and sizes as the config writes them: `"250ms"`, `"1h30m"`, `"512MiB"`.
//!
//! Both are an unsigned integer followed by a unit, never a bare number: `segment_size = 64`
//! could mean bytes or MiB, and a wrong guess is a limit off by a factor of a million.
//! Arithmetic is checked: a value that does not fit in `u64` is an error, never a wrap.

/// The duration units, for messages.
pub(crate) const DURATION_UNITS: &str = "ms, s, m, h, d";

/// The size units, for messages.
pub(crate) const SIZE_UNITS: &str =
    "B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)";

/// Duration units from the largest to the smallest, with their length in milliseconds.
const DURATION_TABLE: [(&str, u64); 5] = [
    ("d", 86_400_000),
    ("h", 3_600_000),
    ("m", 60_000),
    ("s", 1_000),
    ("ms", 1),
];

/// Size units with their factor; binary first so that [`format_size`] prefers them.
const SIZE_TABLE: [(&str, u64); 10] = [
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("TB", 1_000_000_000_000),
    ("GB", 1_000_000_000),
    ("MB", 1_000_000),
    ("KB", 1_000),
    ("kB", 1_000),
    ("B", 1),
];

/// Parse a duration such as `"250ms"`, `"7d"` or `"1h30m"` into milliseconds.
///
/// Parts go from the largest unit to the smallest, each unit at most once, so that every
/// duration has one spelling a reader can check at a glance.
pub(crate) fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let example = format!(
        "write an integer and a unit, e.g. \"250ms\", \"30s\" or \"1h30m\"; accepted units: {DURATION_UNITS}"
    );
    if s.is_empty() {
        return Err(format!("empty duration: {example}"));
    }
    let mut total: u64 = 0;
    let mut rest = s;
    // Index into DURATION_TABLE of the previous part's unit.
    let mut previous: Option<usize> = None;
    while !rest.is_empty() {
        let (number, unit, after) = split_number_unit(rest);
        if number.is_empty() {
            return Err(format!("`{text}` is not a duration: {example}"));
        }
        if unit.is_empty() {
            if after.starts_with(['.', ',']) {
                return Err(format!(
                    "`{text}`: fractions are not accepted; use a smaller unit, e.g. \"1500ms\" for 1.5s"
                ));
            }
            if after.is_empty() && previous.is_none() {
                return Err(format!(
                    "`{text}` has no unit: write e.g. \"{number}s\"; accepted units: {DURATION_UNITS}"
                ));
            }
            return Err(format!("`{text}` is not a duration: {example}"));
        }
        let Some(rank) = DURATION_TABLE.iter().position(|(u, _)| *u == unit) else {
            return Err(format!(
                "`{text}`: unknown unit `{unit}`; accepted units: {DURATION_UNITS}"
            ));
        };
        if previous.is_some_and(|p| rank <= p) {
            return Err(format!(
                "`{text}`: write the parts from the largest unit to the smallest, each once, e.g. \"1h30m\""
            ));
        }
        let too_large = || format!("`{text}` is too large");
        let n: u64 = number.parse().map_err(|_| too_large())?;
        total = n
            .checked_mul(DURATION_TABLE[rank].1)
            .and_then(|ms| total.checked_add(ms))
            .ok_or_else(too_large)?;
        previous = Some(rank);
        rest = after;
    }
    Ok(total)
}

/// Parse a size such as `"512MiB"`, `"64KB"` or `"100B"` into bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let (number, unit, after) = split_number_unit(s);
    if number.is_empty() || !after.is_empty() && !after.starts_with(['.', ',']) {
        return Err(format!(
            "`{text}` is not a size: write an integer and a unit, e.g. \"64MiB\"; accepted units: {SIZE_UNITS}"
        ));
    }
    if after.starts_with(['.', ',']) {
        return Err(format!(
            "`{text}`: fractions are not accepted; use a smaller unit, e.g. \"1536MiB\" for 1.5GiB"
        ));
    }
    if unit.is_empty() {
        return Err(format!(
            "`{text}` has no unit: write e.g. \"{number}MiB\" or \"{number}B\"; accepted units: {SIZE_UNITS}"
        ));
    }
    let Some((_, factor)) = SIZE_TABLE.iter().find(|(u, _)| *u == unit) else {
        return Err(format!(
            "`{text}`: unknown unit `{unit}`; accepted units: {SIZE_UNITS}"
        ));
    };
    let too_large = || format!("`{text}` is too large");
    let n: u64 = number.parse().map_err(|_| too_large())?;
    n.checked_mul(*factor).ok_or_else(too_large)
}

/// Split `"30ms..."` into `("30", "ms", "...")`; a space between number and unit is allowed.
fn split_number_unit(s: &str) -> (&str, &str, &str) {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (number, after) = s.split_at(digits);
    let unit_start = if digits > 0 && after.starts_with(' ') {
        &after[1..]
    } else {
        after
    };
    let letters = unit_start
        .bytes()
        .take_while(u8::is_ascii_alphabetic)
        .count();
    let (unit, after) = unit_start.split_at(letters);
    (number, unit, after)
}

/// The canonical spelling of a duration, e.g. `1h30m`, `250ms`, `0s`.
pub(crate) fn format_duration_ms(ms: u64) -> String {
    if ms == 0 {
        return "0s".to_string();
    }
    let mut out = String::new();
    let mut rest = ms;
    for (unit, factor) in DURATION_TABLE {
        let n = rest / factor;
        if n > 0 {
            out.push_str(&format!("{n}{unit}"));
            rest -= n * factor;
        }
    }
    out
}

/// The shortest exact spelling of a size, e.g. `64MiB`, `100KB`, `1000001B`.
pub(crate) fn format_size(bytes: u64) -> String {
    if bytes == 0 {
        return "0B".to_string();
    }
    for (unit, factor) in SIZE_TABLE {
        if bytes % factor == 0 {
            return format!("{}{unit}", bytes / factor);
        }
    }
    unreachable!("every size is a whole number of bytes")
}

//! A stored pipeline definition shown as the user wrote it: `key = value` lines in the
//! config's own words (`format = "delimited"`, `window = { size = "1m" }`), not the JSON the
//! store keeps (see [`super::engine::definition`]). Works on that JSON, not on a
//! `PipelineSpec`, because the stored side may come from another build.

use serde_json::Value;

/// The config keys a definition covers, in the order a `[[pipeline]]` table lists them.
const ORDER: [&str; 8] = [
    "format",
    "separator",
    "event_id",
    "key",
    "value",
    "event_time",
    "aggregate",
    "window",
];

/// The definition's settings as `(key, value)`, the value in TOML syntax. Keys that are not
/// set (no `event_time`, no `window`) are left out, as in a config file.
pub fn describe(definition: &str) -> Vec<(String, String)> {
    let Ok(Value::Object(m)) = serde_json::from_str::<Value>(definition) else {
        return vec![("definition".into(), quote(definition))];
    };
    let mut out = Vec::new();
    for (k, v) in &m {
        match (k.as_str(), v) {
            (_, Value::Null) => {}
            ("format", Value::String(f)) => out.push(("format".into(), quote(&f.to_lowercase()))),
            ("format", Value::Object(f)) if f.contains_key("Delimited") => {
                out.push(("format".into(), quote("delimited")));
                if let Some(sep) = f["Delimited"].get("separator").and_then(Value::as_str) {
                    out.push(("separator".into(), quote(sep)));
                }
            }
            ("event_id" | "key" | "value" | "event_time", f) => {
                if let Some(text) = field(f) {
                    out.push((k.clone(), quote(&text)));
                } else {
                    out.push((k.clone(), v.to_string()));
                }
            }
            ("aggregate", Value::String(a)) => out.push((k.clone(), quote(&a.to_lowercase()))),
            ("window", Value::Object(w)) => {
                let ms = |name: &str| w.get(name).and_then(Value::as_u64);
                let mut parts = Vec::new();
                if let Some(size) = ms("size_ms") {
                    parts.push(format!("size = {}", quote(&duration(size))));
                }
                if let Some(late) = ms("allowed_lateness_ms").filter(|&l| l > 0) {
                    parts.push(format!("allowed_lateness = {}", quote(&duration(late))));
                }
                out.push((k.clone(), format!("{{ {} }}", parts.join(", "))));
            }
            _ => out.push((k.clone(), v.to_string())),
        }
    }
    let rank = |k: &str| ORDER.iter().position(|o| *o == k).unwrap_or(ORDER.len());
    out.sort_by_key(|(k, _)| rank(k));
    out
}

/// The settings that differ: `(key, stored, configured)`, `None` where one side has none.
pub fn changes(stored: &str, configured: &str) -> Vec<(String, Option<String>, Option<String>)> {
    let (a, b) = (describe(stored), describe(configured));
    let get = |side: &[(String, String)], k: &str| {
        side.iter().find(|(x, _)| x == k).map(|(_, v)| v.clone())
    };
    let mut keys: Vec<&String> = a.iter().chain(&b).map(|(k, _)| k).collect();
    let rank = |k: &str| ORDER.iter().position(|o| *o == k).unwrap_or(ORDER.len());
    keys.sort_by_key(|k| (rank(k), k.to_string()));
    keys.dedup();
    keys.into_iter()
        .filter_map(|k| {
            let (s, c) = (get(&a, k), get(&b, k));
            (s != c).then(|| (k.clone(), s, c))
        })
        .collect()
}

/// The changed settings as indented lines, stored above configured.
pub(crate) fn explain_changes(stored: &str, configured: &str) -> String {
    let mut lines = Vec::new();
    for (k, s, c) in changes(stored, configured) {
        let show = |v: Option<String>| v.map_or(format!("{k} not set"), |v| format!("{k} = {v}"));
        lines.push(format!("    stored:     {}", show(s)));
        lines.push(format!("    configured: {}", show(c)));
    }
    if lines.is_empty() {
        // Same settings, different text: a build that wrote the definition differently.
        lines.push(format!("    stored:     {stored}"));
        lines.push(format!("    configured: {configured}"));
    }
    lines.join("\n")
}

/// A field reference as written: `/id`, `"2"`, or a template `{/device}-{/seq}`.
fn field(v: &Value) -> Option<String> {
    let Value::Object(m) = v else { return None };
    let (kind, inner) = m.iter().next()?;
    match (kind.as_str(), inner) {
        ("Pointer", Value::String(p)) => Some(p.clone()),
        ("Index", Value::Number(n)) => Some(n.to_string()),
        ("Template", Value::Array(parts)) => {
            let mut s = String::new();
            for part in parts {
                let Value::Object(p) = part else { return None };
                let (kind, inner) = p.iter().next()?;
                match (kind.as_str(), inner) {
                    ("Literal", Value::String(l)) => s.push_str(l),
                    ("Field", f) => s.push_str(&format!("{{{}}}", field(f)?)),
                    _ => return None,
                }
            }
            Some(s)
        }
        _ => None,
    }
}

/// A TOML basic string (JSON's escapes are valid TOML ones).
fn quote(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// Milliseconds in the largest unit that divides them, as the config writes durations.
fn duration(ms: u64) -> String {
    if ms == 0 {
        return "0ms".into();
    }
    for (unit, n) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms % n == 0 {
            return format!("{}{unit}", ms / n);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::engine::definition;

    fn spec(body: &str) -> crate::pipeline::spec::PipelineSpec {
        crate::config::pipeline_from_toml(&format!(
            "name = \"p\"\ntopics = [\"t/#\"]\noutput_topic = \"o/{{key}}\"\n{body}"
        ))
        .unwrap()
    }

    #[test]
    fn a_definition_reads_as_the_config_that_wrote_it() {
        let s = spec(
            "format = \"delimited\"\nseparator = \";\"\nevent_id = \"{0}-{1}\"\nkey = \"1\"\n\
             value = \"2\"\naggregate = \"avg\"\nwindow = { size = \"1m\", allowed_lateness = \"30s\" }",
        );
        let lines: Vec<String> = describe(&definition(&s))
            .into_iter()
            .map(|(k, v)| format!("{k} = {v}"))
            .collect();
        assert_eq!(
            lines,
            [
                r#"format = "delimited""#,
                r#"separator = ";""#,
                r#"event_id = "{0}-{1}""#,
                r#"key = "1""#,
                r#"value = "2""#,
                r#"aggregate = "avg""#,
                r#"window = { size = "1m", allowed_lateness = "30s" }"#,
            ]
        );
    }

    #[test]
    fn a_change_shows_only_the_settings_that_differ_without_debug_syntax() {
        let a = spec("event_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\naggregate = \"sum\"");
        let b = spec(
            "event_id = \"/id\"\nkey = \"/k\"\nvalue = \"/v\"\naggregate = \"max\"\n\
             event_time = \"/ts\"",
        );
        let text = explain_changes(&definition(&a), &definition(&b));
        assert_eq!(
            text.lines().collect::<Vec<_>>(),
            [
                "    stored:     event_time not set",
                "    configured: event_time = \"/ts\"",
                "    stored:     aggregate = \"sum\"",
                "    configured: aggregate = \"max\"",
            ]
        );
        for debug in ["Pointer", "Sum", "{\"", "Some("] {
            assert!(!text.contains(debug), "{debug} in {text}");
        }
    }
}

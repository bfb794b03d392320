//! The table of keys against the parser, the defaults and the committed reference.

use std::collections::BTreeSet;
use std::path::Path;

use super::*;
use crate::config::{ConfigError, parse_str};

const MINIMAL: &str = "[mqtt]\nclient_id = \"box-1\"\n\n[storage]\ndata_dir = \"/d\"\n\n\
                       [[pipeline]]\nname = \"p\"\ntopics = [\"t/#\"]\nevent_id = \"/id\"\n\
                       key = \"/k\"\nvalue = \"/v\"\naggregate = \"sum\"\n\
                       output_topic = \"o/{key}\"\n";

/// MINIMAL with `lines` in table `section` (below its header, or in a new table).
fn with(section: &str, lines: &str) -> String {
    match section {
        "" => format!("{lines}\n{MINIMAL}"),
        "pipeline" => format!("{MINIMAL}{lines}\n"),
        "sink" => format!("[[sink]]\n{lines}\n\n{MINIMAL}"),
        s => {
            let header = format!("[{s}]\n");
            match MINIMAL.find(&header) {
                Some(i) => {
                    let at = i + header.len();
                    format!("{}{lines}\n{}", &MINIMAL[..at], &MINIMAL[at..])
                }
                None => format!("{header}{lines}\n\n{MINIMAL}"),
            }
        }
    }
}

/// The keys serde names as accepted when it meets an unknown one in the table where
/// `lines` put it.
fn accepted(section: &str, lines: &str) -> BTreeSet<String> {
    let text = with(section, lines);
    let Err(ConfigError::Invalid { problems, .. }) = parse_str(&text, Path::new("t.toml")) else {
        panic!("`zzz_unknown` was accepted in {section}:\n{text}");
    };
    let p = problems
        .iter()
        .find(|p| p.message.contains("unknown key `zzz_unknown`"))
        .unwrap_or_else(|| panic!("{problems:#?}"));
    // serde: "expected `a`", "expected `a` or `b`", "expected one of `a`, `b`, `c`".
    let list = p
        .message
        .split(", expected ")
        .nth(1)
        .unwrap_or_else(|| panic!("{section}: {}", p.message));
    let list = list.strip_prefix("one of ").unwrap_or(list);
    list.split(", ")
        .flat_map(|k| k.split(" or "))
        .map(|k| k.trim_matches('`').to_string())
        .collect()
}

/// The table's keys directly below `prefix` (`mqtt` gives `host`, ..., `tls`).
fn in_table(prefix: &str) -> BTreeSet<String> {
    KEYS.iter()
        .filter_map(|k| {
            let rest = if prefix.is_empty() {
                k.name
            } else {
                k.name.strip_prefix(prefix)?.strip_prefix('.')?
            };
            Some(rest.split('.').next().unwrap().to_string())
        })
        .collect()
}

#[test]
fn every_key_the_parser_accepts_is_in_the_table_and_no_other() {
    let tables = [
        ("", "", "zzz_unknown = 1"),
        ("mqtt", "mqtt", "zzz_unknown = 1"),
        ("mqtt", "mqtt.tls", "tls = { zzz_unknown = 1 }"),
        ("storage", "storage", "zzz_unknown = 1"),
        ("log", "log", "zzz_unknown = 1"),
        ("checkpoint", "checkpoint", "zzz_unknown = 1"),
        ("outbox", "outbox", "zzz_unknown = 1"),
        ("metrics", "metrics", "zzz_unknown = 1"),
        ("savepoint", "savepoint", "zzz_unknown = 1"),
        ("logging", "logging", "zzz_unknown = 1"),
        ("dead_letters", "dead_letters", "zzz_unknown = 1"),
        ("uplink", "uplink", "client_id = \"up\"\nzzz_unknown = 1"),
        (
            "uplink",
            "uplink.tls",
            "client_id = \"up\"\ntls = { zzz_unknown = 1 }",
        ),
        ("sparkplug", "sparkplug", "zzz_unknown = 1"),
        ("sink", "sink", "zzz_unknown = 1"),
        ("sink", "sink.tls", "tls = { zzz_unknown = 1 }"),
        ("pipeline", "pipeline", "zzz_unknown = 1"),
        (
            "pipeline",
            "pipeline.window",
            "window = { zzz_unknown = \"1m\" }",
        ),
    ];
    let mut covered = BTreeSet::new();
    for (section, prefix, lines) in tables {
        let parser = accepted(section, lines);
        assert_eq!(parser, in_table(prefix), "table `{prefix}`");
        for k in KEYS {
            if k.name
                .strip_prefix(prefix)
                .is_some_and(|r| r.starts_with('.'))
                && !k.name[prefix.len() + 1..].contains('.')
            {
                covered.insert(k.name);
            }
        }
    }
    // And every row is a key of one of those tables.
    let all: BTreeSet<&str> = KEYS.iter().map(|k| k.name).collect();
    assert_eq!(covered, all, "rows in no table the parser has");
}

/// A default in the table is what validation gives a key left out.
#[test]
fn the_defaults_in_the_table_are_the_ones_validation_applies() {
    let text = with("uplink", "client_id = \"up\"\ntls = { ca_file = \"/ca\" }");
    let text = format!(
        "[[sink]]\nname = \"s\"\nkind = \"mqtt\"\nclient_id = \"s\"\ntls = {{ ca_file = \"/ca\" }}\n\n{text}"
    );
    let text = text
        .replace(
            "aggregate = \"sum\"",
            "aggregate = \"sum\"\nwindow = { size = \"1m\" }",
        )
        .replace("o/{key}", "o/{key}/{window_start}");
    let cfg = parse_str(&text, Path::new("t.toml")).unwrap();
    // The keys of the other sink kinds, read from a config whose first sink is of that kind.
    let first_sink = |sink: &str| {
        let t = text.replacen("[[sink]]", &format!("{sink}\n[[sink]]"), 1);
        parse_str(&t, Path::new("t.toml")).unwrap()
    };
    let pg = first_sink(
        "[[sink]]\nname = \"db\"\nkind = \"postgres\"\nurl = \"postgresql://c@db/t\"\nsource = \"b\"\n",
    );
    let js = first_sink(
        "[[sink]]\nname = \"js\"\nkind = \"jetstream\"\nservers = [\"nats://n:4222\"]\nstream = \"R\"\nsource = \"b\"\n",
    );
    let mut checked = 0;
    for k in KEYS {
        let value = k
            .value(&cfg)
            .or_else(|| k.value(&pg))
            .or_else(|| k.value(&js));
        match k.default {
            Def::Int(_) | Def::Ms(_) | Def::Bytes(_) | Def::Text(_) | Def::Bool(_) => {
                assert_eq!(value, Some(k.default_text()), "{}", k.name);
                checked += 1;
            }
            Def::Unset if k.name.ends_with("file") && k.name.contains("tls.ca") => {}
            Def::Unset if k.name == "pipeline.window.size" => {}
            Def::Unset => assert_eq!(value, None, "{}", k.name),
            Def::Required => assert!(value.is_some(), "{}", k.name),
            Def::Derived(_) => {}
        }
    }
    assert!(checked > 40, "{checked}");
}

#[test]
fn the_reference_doc_is_what_the_table_generates() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md");
    let want = reference();
    if std::env::var_os("CAIRN_WRITE_DOCS").is_some() {
        std::fs::write(&file, &want).unwrap();
    }
    let have = std::fs::read_to_string(&file).unwrap_or_default();
    assert!(
        have == want,
        "docs/configuration.md differs from the table of keys: run \
         `CAIRN_WRITE_DOCS=1 cargo test --lib the_reference_doc_is_what_the_table_generates` \
         and commit the file"
    );
    for k in KEYS {
        let short = &k.name[section_of(k.name).len() + 1..];
        assert!(have.contains(&format!("| `{short}` |")), "{}", k.name);
    }
}

#[test]
fn a_path_with_indices_names_its_row() {
    assert_eq!(row("pipeline[12].window.size").name, "pipeline.window.size");
    assert_eq!(row("mqtt.tls.ca_file").name, "mqtt.tls.ca_file");
    let names: BTreeSet<&str> = KEYS.iter().map(|k| k.name).collect();
    assert_eq!(names.len(), KEYS.len(), "a key twice");
}

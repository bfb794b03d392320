//! The layering DESIGN §2 draws, checked instead of hoped (issue 12, item 6):
//!
//! - only `src/store/` imports sled;
//! - only `src/mqtt/` imports rumqttc or tokio;
//! - `src/pipeline/` is pure: no file system, network, wall clock, `Instant`, threads,
//!   randomness, sled, rumqttc, tokio, and none of the crate's IO rooms (`store`, `log`,
//!   `mqtt`).
//!
//! The sources are read as text: comments, strings and char literals are blanked first so a
//! doc comment that says "sled" is not an import, then every `use` tree is expanded into full
//! paths and every other path expression (`sled::Db::open(..)`, `tokio::select!`) is read as
//! written. A violation is reported as `file:line`. The scanner's own tests below show that it
//! catches a forbidden `use` (so this test can fail) and ignores the look-alikes.
//!
//! What it cannot see: a forbidden crate reached through a re-export under another name
//! (`crate::something::Db` that is really `sled::Db`). The rule that only `store`/`mqtt` name
//! those crates keeps such re-exports inside those rooms, where this test looks.

use std::path::{Path, PathBuf};

/// One rule: paths starting with `prefix` may appear only in files for which `allowed`
/// holds (`rel` is the path under `src/`, with `/` separators).
struct Rule {
    prefix: &'static [&'static str],
    allowed: fn(&str) -> bool,
    why: &'static str,
}

fn in_store(rel: &str) -> bool {
    rel.starts_with("store/")
}
fn in_mqtt(rel: &str) -> bool {
    rel.starts_with("mqtt/")
}
fn outside_pipeline(rel: &str) -> bool {
    !rel.starts_with("pipeline/")
}

const RULES: &[Rule] = &[
    Rule {
        prefix: &["sled"],
        allowed: in_store,
        why: "only store/ imports sled",
    },
    Rule {
        prefix: &["rumqttc"],
        allowed: in_mqtt,
        why: "only mqtt/ imports rumqttc",
    },
    Rule {
        prefix: &["tokio"],
        allowed: in_mqtt,
        why: "only mqtt/ imports tokio",
    },
    Rule {
        prefix: &["std", "fs"],
        allowed: outside_pipeline,
        why: "pipeline/ is pure: no file system",
    },
    Rule {
        prefix: &["std", "net"],
        allowed: outside_pipeline,
        why: "pipeline/ is pure: no network",
    },
    Rule {
        prefix: &["std", "time", "SystemTime"],
        allowed: outside_pipeline,
        why: "pipeline/ is pure: no wall clock",
    },
    Rule {
        prefix: &["std", "time", "Instant"],
        allowed: outside_pipeline,
        why: "pipeline/ is pure: no clock",
    },
    Rule {
        prefix: &["std", "thread"],
        allowed: outside_pipeline,
        why: "pipeline/ is pure: no threads",
    },
    Rule {
        prefix: &["rand"],
        allowed: outside_pipeline,
        why: "pipeline/ is pure: no randomness",
    },
    Rule {
        prefix: &["crate", "store"],
        allowed: outside_pipeline,
        why: "pipeline/ never sees the store (it reads through the Base trait)",
    },
    Rule {
        prefix: &["crate", "log"],
        allowed: outside_pipeline,
        why: "pipeline/ never sees the log",
    },
    Rule {
        prefix: &["crate", "mqtt"],
        allowed: outside_pipeline,
        why: "pipeline/ never sees MQTT",
    },
];

/// Known violations of today's code, each with the reason it is tolerated. Entries are
/// `(file under src/, path prefix joined by "::")`. Empty: the tree obeys every rule. An
/// entry that no longer matches anything fails the test, so the list cannot go stale.
const ALLOWED: &[(&str, &str, &str)] = &[];

/// Blank out comments, string literals and char literals, keeping newlines (so line numbers
/// hold) and everything else as written.
fn strip(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let blank = |out: &mut String, ch: char| out.push(if ch == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < c.len() {
        let at = |k: usize| c.get(k).copied().unwrap_or('\0');
        // Line comment (doc comments included).
        if c[i] == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                out.push(' ');
                i += 1;
            }
            continue;
        }
        // Block comment; Rust's nest.
        if c[i] == '/' && at(i + 1) == '*' {
            let mut depth = 0usize;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, c[i]);
                    i += 1;
                }
            }
            continue;
        }
        let prev_ident = i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_');
        // Raw strings: r"..", r#".."#, br#".."#, cr"..".
        if !prev_ident && (c[i] == 'r' || ((c[i] == 'b' || c[i] == 'c') && at(i + 1) == 'r')) {
            let mut j = if c[i] == 'r' { i + 1 } else { i + 2 };
            let mut hashes = 0;
            while at(j) == '#' {
                hashes += 1;
                j += 1;
            }
            if at(j) == '"' {
                j += 1;
                loop {
                    if j >= c.len() {
                        break;
                    }
                    if c[j] == '"' && (1..=hashes).all(|h| at(j + h) == '#') {
                        j += 1 + hashes;
                        break;
                    }
                    j += 1;
                }
                for &ch in &c[i..j.min(c.len())] {
                    blank(&mut out, ch);
                }
                i = j;
                continue;
            }
        }
        // Plain strings, b"..", c"..".
        if c[i] == '"' || (!prev_ident && (c[i] == 'b' || c[i] == 'c') && at(i + 1) == '"') {
            let mut j = if c[i] == '"' { i + 1 } else { i + 2 };
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(c.len());
            for &ch in &c[i..end] {
                blank(&mut out, ch);
            }
            i = end;
            continue;
        }
        // Char literals ('x', '\n', '\u{1F600}', b'x'); a lifetime ('a) is left alone.
        if c[i] == '\'' {
            let end = if at(i + 1) == '\\' {
                // The escaped char sits at i + 2, so the closing quote is searched after it.
                let mut j = i + 3;
                while j < c.len() && c[j] != '\'' {
                    j += 1;
                }
                Some(j + 1)
            } else if at(i + 2) == '\'' {
                Some(i + 3)
            } else {
                None
            };
            if let Some(end) = end {
                let end = end.min(c.len());
                for &ch in &c[i..end] {
                    blank(&mut out, ch);
                }
                i = end;
                continue;
            }
        }
        out.push(c[i]);
        i += 1;
    }
    out
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
}

/// Tokens with their 1-based line numbers.
fn tokens(stripped: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = stripped.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let mut word: String = c[start..i].iter().collect();
            // Raw identifiers: r#type is the identifier `type`.
            if word == "r" && c.get(i) == Some(&'#') {
                let s = i + 1;
                i = s;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
                word = c[s..i].iter().collect();
            }
            out.push((Tok::Ident(word), line));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push((Tok::PathSep, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// Expand the use tree starting at `toks[*i]` under `prefix` into full paths.
fn use_tree(
    toks: &[(Tok, usize)],
    i: &mut usize,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, usize)>,
) {
    let mut path = prefix.to_vec();
    let mut line = toks.get(*i).map_or(0, |t| t.1);
    loop {
        match toks.get(*i) {
            Some((Tok::PathSep, _)) => *i += 1,
            Some((Tok::Ident(w), l)) if w != "as" => {
                path.push(w.clone());
                line = *l;
                *i += 1;
            }
            Some((Tok::Punct('{'), _)) => {
                *i += 1;
                loop {
                    match toks.get(*i) {
                        None => return,
                        Some((Tok::Punct('}'), _)) => {
                            *i += 1;
                            return;
                        }
                        Some((Tok::Punct(','), _)) => *i += 1,
                        _ => use_tree(toks, i, &path, out),
                    }
                }
            }
            Some((Tok::Punct('*'), _)) => {
                *i += 1;
                out.push((path, line));
                return;
            }
            _ => {
                // `as alias`: the alias does not change what is imported.
                if let Some((Tok::Ident(w), _)) = toks.get(*i) {
                    if w == "as" {
                        *i += 2;
                    }
                }
                // `use crate::x::{self}` names `crate::x`.
                if path.last().is_some_and(|s| s == "self") {
                    path.pop();
                }
                if !path.is_empty() {
                    out.push((path, line));
                }
                return;
            }
        }
    }
}

/// Every path the source names, with the line it is on: each leaf of each `use` tree, each
/// `extern crate`, and each other `a::b::c` written out.
fn paths(src: &str) -> Vec<(Vec<String>, usize)> {
    let toks = tokens(&strip(src));
    let mut out = Vec::new();
    let mut i = 0;
    let ident = |k: usize| match toks.get(k) {
        Some((Tok::Ident(w), _)) => Some(w.as_str()),
        _ => None,
    };
    while i < toks.len() {
        match ident(i) {
            Some("use") => {
                i += 1;
                use_tree(&toks, &mut i, &[], &mut out);
            }
            Some("extern") if ident(i + 1) == Some("crate") => {
                if let Some(name) = ident(i + 2) {
                    out.push((vec![name.to_string()], toks[i + 2].1));
                }
                i += 3;
            }
            Some(first) => {
                // A path starts at an identifier not itself after `::` (that one belongs to
                // the path before it) and goes on while `:: ident` follows.
                let continues =
                    i > 0 && toks[i - 1].0 == Tok::PathSep && !(i >= 2 && is_open(&toks[i - 2].0));
                let line = toks[i].1;
                let mut path = vec![first.to_string()];
                let mut j = i + 1;
                while toks.get(j).map(|t| &t.0) == Some(&Tok::PathSep) {
                    match ident(j + 1) {
                        Some(w) => path.push(w.to_string()),
                        None => break,
                    }
                    j += 2;
                }
                if !continues && path.len() > 1 {
                    out.push((path, line));
                }
                i = j.max(i + 1);
            }
            None => i += 1,
        }
    }
    out
}

/// A `::` right after one of these starts an absolute path (`::sled::Db`, `(::tokio::x)`).
fn is_open(t: &Tok) -> bool {
    !matches!(t, Tok::Ident(_) | Tok::Punct('>'))
}

#[derive(Debug, PartialEq)]
struct Violation {
    file: String,
    line: usize,
    path: String,
    why: &'static str,
}

/// Check one file's text against the rules. `rel` is its path under `src/`.
fn check(rel: &str, src: &str) -> Vec<Violation> {
    let mut found = Vec::new();
    for (path, line) in paths(src) {
        for rule in RULES {
            let matches = path.len() >= rule.prefix.len()
                && path.iter().zip(rule.prefix).all(|(a, b)| a == b);
            if matches && !(rule.allowed)(rel) {
                found.push(Violation {
                    file: rel.to_string(),
                    line,
                    path: path.join("::"),
                    why: rule.why,
                });
            }
        }
    }
    found
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// (file under src/, its text) for every `.rs` file.
fn sources() -> Vec<(String, String)> {
    let root = src_dir();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files
        .into_iter()
        .map(|p| {
            let rel = p
                .strip_prefix(&root)
                .expect("under src")
                .to_string_lossy()
                .replace('\\', "/");
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
            (rel, text)
        })
        .collect()
}

#[test]
fn no_source_file_imports_across_the_layers_design_draws() {
    let sources = sources();
    // A walk that found nothing would pass vacuously.
    assert!(
        sources.iter().any(|(f, _)| f.starts_with("pipeline/")),
        "no src/pipeline/ files found"
    );
    assert!(
        sources.len() >= 30,
        "only {} source files found under src/",
        sources.len()
    );
    let mut violations = Vec::new();
    let mut used_allowances = vec![false; ALLOWED.len()];
    for (rel, text) in &sources {
        for v in check(rel, text) {
            match ALLOWED
                .iter()
                .position(|(f, p, _)| *f == v.file && v.path.starts_with(p))
            {
                Some(k) => used_allowances[k] = true,
                None => violations.push(v),
            }
        }
    }
    let report: Vec<String> = violations
        .iter()
        .map(|v| format!("src/{}:{}: `{}` ({})", v.file, v.line, v.path, v.why))
        .collect();
    assert!(
        report.is_empty(),
        "forbidden imports:\n{}",
        report.join("\n")
    );
    let stale: Vec<_> = ALLOWED
        .iter()
        .zip(&used_allowances)
        .filter(|(_, used)| !**used)
        .map(|(a, _)| a)
        .collect();
    assert!(
        stale.is_empty(),
        "allowances that no longer match anything (delete them): {stale:?}"
    );
}

#[test]
fn the_scanner_sees_the_imports_the_allowed_rooms_really_make() {
    // Negative control on the real tree: the store does name sled and mqtt does name rumqttc
    // and tokio. If the scanner missed these, it would also miss them anywhere else.
    let sources = sources();
    let named = |room: &str, krate: &str| {
        sources
            .iter()
            .filter(|(f, _)| f.starts_with(room))
            .any(|(_, text)| paths(text).iter().any(|(p, _)| p[0] == krate))
    };
    assert!(
        named("store/", "sled"),
        "scanner saw no sled path in src/store/"
    );
    assert!(
        named("mqtt/", "rumqttc"),
        "scanner saw no rumqttc path in src/mqtt/"
    );
    assert!(
        named("mqtt/", "tokio"),
        "scanner saw no tokio path in src/mqtt/"
    );
}

#[test]
fn a_forbidden_use_is_reported_with_file_and_line() {
    let text = "//! engine\nuse std::collections::BTreeMap;\nuse sled::Db;\n";
    let found = check("pipeline/engine.rs", text);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        (
            found[0].file.as_str(),
            found[0].line,
            found[0].path.as_str()
        ),
        ("pipeline/engine.rs", 3, "sled::Db")
    );
    // The same line is fine where sled belongs.
    assert!(check("store/mod.rs", text).is_empty());
    // ... and forbidden in any other room.
    assert_eq!(check("agent/mod.rs", text).len(), 1);
}

#[test]
fn use_trees_aliases_and_absolute_paths_are_expanded() {
    let text = "use std::{collections::BTreeMap, fs, time::{Duration, Instant as Now}};\n\
                use crate::{model::Record, store::{self}};\n\
                fn f() { let _ = ::tokio::spawn(async {}); }\n\
                extern crate rand;\n";
    let found: Vec<(usize, String)> = check("pipeline/x.rs", text)
        .into_iter()
        .map(|v| (v.line, v.path))
        .collect();
    assert_eq!(
        found,
        vec![
            (1, "std::fs".to_string()),
            (1, "std::time::Instant".to_string()),
            (2, "crate::store".to_string()),
            (3, "tokio::spawn".to_string()),
            (4, "rand".to_string()),
        ]
    );
}

#[test]
fn path_expressions_and_macros_are_seen_not_only_use_lines() {
    let text = "fn f() {\n    let db = sled::Config::new().open();\n    tokio::select! {}\n    let t = std::time::SystemTime::now();\n}\n";
    let found: Vec<(usize, String)> = check("pipeline/x.rs", text)
        .into_iter()
        .map(|v| (v.line, v.path))
        .collect();
    assert_eq!(
        found,
        vec![
            (2, "sled::Config::new".to_string()),
            (3, "tokio::select".to_string()),
            (4, "std::time::SystemTime::now".to_string()),
        ]
    );
}

#[test]
fn comments_strings_and_lookalikes_are_not_imports() {
    let text = r####"//! pipeline never sees sled::Db or tokio::spawn
/* block /* nested sled::x */ still comment tokio::y */
/// uses `std::fs::read` in the docs only
fn f<'a>(x: &'a str) -> char {
    let _ = "sled::Db::open";
    let _ = r#"use tokio::runtime; "quoted" "#;
    let _ = b"rumqttc::Client";
    let sled = 1; // a variable may be called sled
    let _ = my::sled::Thing; // not at the start of a path
    let _ = std::time::Duration::from_secs(1); // Duration is plain data
    let _ = '"'; let _ = '\''; let _ = "std::net";
    'x'
}
"####;
    assert_eq!(check("pipeline/x.rs", text), vec![]);
    // Line numbers survive the blanking: a hit after all that is on the right line.
    let with_hit = format!("{text}use std::net::TcpStream;\n");
    let found = check("pipeline/x.rs", &with_hit);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].line, text.lines().count() + 1);
}

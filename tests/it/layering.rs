//! The layering DESIGN §2 draws, checked instead of hoped (issue 12, item 6):
//!
//! - only `src/store/` imports sled;
//! - only `src/mqtt/` imports rumqttc; only `src/mqtt/` and `src/sink/` import tokio (each
//!   sink client runs its own runtime on its own thread, issue 30);
//! - only `src/sink/` imports the PostgreSQL and NATS clients (`tokio_postgres`,
//!   `tokio_postgres_rustls`, `async_nats`);
//! - `src/pipeline/` is pure: no file system, network, wall clock, `Instant`, threads,
//!   randomness, sled, rumqttc, tokio, and none of the crate's IO rooms (`store`, `log`,
//!   `mqtt`).
//!
//! And the rooms of the agent (issue 28, item 5):
//!
//! - `store`, `log` and `pipeline` never import `agent` or `mqtt`;
//! - nothing imports `cli` (only the binary, `main.rs`, runs it);
//! - no part of the agent imports `agent/mod.rs`: a path from any file under `agent/` other
//!   than `mod.rs` that resolves (through `crate::`, `super::`, `self::`) to an item
//!   `agent/mod.rs` defines (`Agent`, `Shutdown`, ...) is a part reaching into the loop;
//! - `impl Agent` is written only in `agent/mod.rs`, and `Agent` has at most 12 fields;
//! - the wall clock (`SystemTime::now`) is read only in `clock.rs` (issue 28, item 7).
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
fn in_sink(rel: &str) -> bool {
    rel.starts_with("sink/")
}
fn in_mqtt_or_sink(rel: &str) -> bool {
    in_mqtt(rel) || in_sink(rel)
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
        allowed: in_mqtt_or_sink,
        why: "only mqtt/ and sink/ import tokio",
    },
    Rule {
        prefix: &["tokio_postgres"],
        allowed: in_sink,
        why: "only sink/ imports the PostgreSQL client",
    },
    Rule {
        prefix: &["tokio_postgres_rustls"],
        allowed: in_sink,
        why: "only sink/ imports the PostgreSQL client",
    },
    Rule {
        prefix: &["async_nats"],
        allowed: in_sink,
        why: "only sink/ imports the NATS client",
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
    Rule {
        prefix: &["crate", "agent"],
        allowed: outside_lower_rooms,
        why: "store/, log/ and pipeline/ never import the agent",
    },
    Rule {
        prefix: &["crate", "mqtt"],
        allowed: outside_lower_rooms,
        why: "store/, log/ and pipeline/ never import mqtt",
    },
    Rule {
        prefix: &["crate", "cli"],
        allowed: in_cli,
        why: "nothing imports cli (only main.rs runs it)",
    },
    Rule {
        prefix: &["std", "time", "SystemTime", "now"],
        allowed: in_clock,
        why: "the wall clock is read only in clock.rs",
    },
    Rule {
        prefix: &["SystemTime", "now"],
        allowed: in_clock,
        why: "the wall clock is read only in clock.rs",
    },
];

fn in_clock(rel: &str) -> bool {
    rel == "clock.rs"
}

/// The rooms below the agent: they know nothing of the loop or the broker.
fn outside_lower_rooms(rel: &str) -> bool {
    !["store/", "log/", "pipeline/"]
        .iter()
        .any(|room| rel.starts_with(room))
}
fn in_cli(rel: &str) -> bool {
    rel.starts_with("cli/") || rel == "main.rs"
}

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
    paths_indexed(&toks)
        .into_iter()
        .map(|(p, line, _)| (p, line))
        .collect()
}

/// [`paths`] over tokens, each with the index of the token its statement starts at (the
/// `use` of a use tree, else the path's first token).
fn paths_indexed(toks: &[(Tok, usize)]) -> Vec<(Vec<String>, usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    let ident = |k: usize| match toks.get(k) {
        Some((Tok::Ident(w), _)) => Some(w.as_str()),
        _ => None,
    };
    while i < toks.len() {
        match ident(i) {
            Some("use") => {
                let at = i;
                i += 1;
                let mut tree = Vec::new();
                use_tree(toks, &mut i, &[], &mut tree);
                out.extend(tree.into_iter().map(|(p, line)| (p, line, at)));
            }
            Some("extern") if ident(i + 1) == Some("crate") => {
                if let Some(name) = ident(i + 2) {
                    out.push((vec![name.to_string()], toks[i + 2].1, i));
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
                    out.push((path, line, i));
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

/// The module a file is, as a path under the crate root: `agent/mod.rs` is `agent`,
/// `agent/results/mqtt.rs` is `agent::results::mqtt`, `lib.rs` is the root.
fn module_of(rel: &str) -> Vec<String> {
    let rel = rel.strip_suffix(".rs").unwrap_or(rel);
    let mut parts: Vec<String> = rel.split('/').map(str::to_string).collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// Every path the source names, with its line and the inline modules (`mod tests { .. }`)
/// it is written in, so that `super::` can be resolved.
fn paths_in_modules(src: &str) -> Vec<(Vec<String>, usize, Vec<String>)> {
    let toks = tokens(&strip(src));
    // The inline modules open at each token.
    let mut depth = 0usize;
    let mut open: Vec<(usize, String)> = Vec::new();
    let mut context_at: Vec<Vec<String>> = Vec::with_capacity(toks.len());
    let mut pending_mod: Option<String> = None;
    for (i, (t, _)) in toks.iter().enumerate() {
        context_at.push(open.iter().map(|(_, n)| n.clone()).collect());
        match t {
            Tok::Ident(w) if w == "mod" => {
                if let Some((Tok::Ident(name), _)) = toks.get(i + 1) {
                    pending_mod = Some(name.clone());
                }
            }
            Tok::Punct('{') => {
                depth += 1;
                if let Some(name) = pending_mod.take() {
                    open.push((depth, name));
                }
            }
            Tok::Punct(';') => pending_mod = None,
            Tok::Punct('}') => {
                if open.last().is_some_and(|(d, _)| *d == depth) {
                    open.pop();
                }
                depth = depth.saturating_sub(1);
            }
            _ => {}
        }
    }
    paths_indexed(&toks)
        .into_iter()
        .map(|(p, line, at)| (p, line, context_at[at].clone()))
        .collect()
}

/// `path`, written in module `module` (inline modules included), as a path from the crate
/// root; `None` for a path that does not start at `crate`, `super` or `self` (another
/// crate, or a name in scope).
fn absolute(path: &[String], module: &[String]) -> Option<Vec<String>> {
    let mut base: Vec<String>;
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => {
            base = Vec::new();
            rest = &path[1..];
        }
        Some("super") | Some("self") => {
            base = module.to_vec();
            while let Some(head) = rest.first() {
                match head.as_str() {
                    "super" => {
                        base.pop()?;
                    }
                    "self" => {}
                    _ => break,
                }
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The names `agent/mod.rs` defines at its top level (types, functions, constants): what a
/// part must not reach back for.
fn loop_items(mod_rs: &str) -> Vec<String> {
    let toks = tokens(&strip(mod_rs));
    let mut depth = 0usize;
    let mut names = Vec::new();
    for (i, (t, _)) in toks.iter().enumerate() {
        match t {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth = depth.saturating_sub(1),
            Tok::Ident(w)
                if depth == 0
                    && matches!(
                        w.as_str(),
                        "struct" | "enum" | "fn" | "const" | "static" | "type" | "trait"
                    ) =>
            {
                if let Some((Tok::Ident(name), _)) = toks.get(i + 1) {
                    names.push(name.clone());
                }
            }
            _ => {}
        }
    }
    names
}

/// Paths in a file under `agent/` (not `mod.rs`) that reach an item of `agent/mod.rs`.
fn reaches_into_the_loop(rel: &str, src: &str, items: &[String]) -> Vec<(usize, String)> {
    if !rel.starts_with("agent/") || rel == "agent/mod.rs" {
        return Vec::new();
    }
    let module = module_of(rel);
    let mut found = Vec::new();
    for (path, line, inline) in paths_in_modules(src) {
        let mut at = module.clone();
        at.extend(inline);
        let Some(abs) = absolute(&path, &at) else {
            continue;
        };
        let into_loop = abs.len() == 2 && abs[0] == "agent" && items.contains(&abs[1]);
        // `use super::*` from a part: everything of the loop.
        let glob = abs == ["agent"] && path.last().is_some_and(|p| p == "super");
        if into_loop || glob {
            found.push((line, path.join("::")));
        }
    }
    found
}

/// Lines with an `impl` whose self type is `Agent` (inherent or a trait's).
fn impls_of_agent(src: &str) -> Vec<usize> {
    let toks = tokens(&strip(src));
    let mut found = Vec::new();
    for (i, (t, line)) in toks.iter().enumerate() {
        if *t != Tok::Ident("impl".into()) {
            continue;
        }
        // The header runs to the opening brace; the self type follows `for` if there is one.
        let header: Vec<&Tok> = toks[i + 1..]
            .iter()
            .map(|(t, _)| t)
            .take_while(|t| **t != Tok::Punct('{') && **t != Tok::Punct(';'))
            .collect();
        let after_for = header
            .iter()
            .position(|t| **t == Tok::Ident("for".into()))
            .map_or(0, |k| k + 1);
        // Skip generics right after `impl`.
        let mut k = after_for;
        if after_for == 0 && header.first() == Some(&&Tok::Punct('<')) {
            let mut angle = 0i32;
            while k < header.len() {
                match header[k] {
                    Tok::Punct('<') => angle += 1,
                    Tok::Punct('>') => angle -= 1,
                    _ => {}
                }
                k += 1;
                if angle == 0 {
                    break;
                }
            }
        }
        // The self type's path: idents joined by `::`; its last segment names the type.
        let mut last = None;
        for t in &header[k.min(header.len())..] {
            match t {
                Tok::Ident(w) => last = Some(w.as_str()),
                Tok::PathSep => {}
                _ => break,
            }
        }
        if last == Some("Agent") {
            found.push(*line);
        }
    }
    found
}

/// The named fields of `struct name { .. }` in `src`, if it is there.
fn struct_fields(src: &str, name: &str) -> Option<Vec<String>> {
    let toks = tokens(&strip(src));
    let start = toks.windows(3).position(|w| {
        w[0].0 == Tok::Ident("struct".into())
            && w[1].0 == Tok::Ident(name.into())
            && w[2].0 == Tok::Punct('{')
    })?;
    let mut depth = 0usize;
    let mut fields = Vec::new();
    for k in start + 2..toks.len() {
        // The `>` of `->` closes nothing.
        let arrow = toks[k].0 == Tok::Punct('>') && k > 0 && toks[k - 1].0 == Tok::Punct('-');
        match &toks[k].0 {
            _ if arrow => {}
            Tok::Punct('{') | Tok::Punct('(') | Tok::Punct('<') | Tok::Punct('[') => depth += 1,
            Tok::Punct('}') | Tok::Punct(')') | Tok::Punct('>') | Tok::Punct(']') => {
                depth -= 1;
                if depth == 0 {
                    return Some(fields);
                }
            }
            Tok::Ident(w)
                if depth == 1 && toks.get(k + 1).map(|t| &t.0) == Some(&Tok::Punct(':')) =>
            {
                fields.push(w.clone());
            }
            _ => {}
        }
    }
    None
}

/// The most fields `Agent` may have (issue 28): past it, the loop is several things again.
const AGENT_FIELDS_MAX: usize = 12;

#[test]
fn no_part_of_the_agent_reaches_into_the_loop_and_the_loop_is_one_impl_of_few_fields() {
    let sources = sources();
    let mod_rs = &sources
        .iter()
        .find(|(f, _)| f == "agent/mod.rs")
        .expect("src/agent/mod.rs")
        .1;
    let items = loop_items(mod_rs);
    assert!(
        items.iter().any(|i| i == "Agent"),
        "the scanner found no `Agent` in agent/mod.rs: {items:?}"
    );
    let mut problems = Vec::new();
    for (rel, text) in &sources {
        for (line, path) in reaches_into_the_loop(rel, text, &items) {
            problems.push(format!(
                "src/{rel}:{line}: `{path}`: a part reaches into agent/mod.rs (hand it what it \
                 needs instead)"
            ));
        }
        if rel != "agent/mod.rs" {
            for line in impls_of_agent(text) {
                problems.push(format!(
                    "src/{rel}:{line}: `impl Agent` outside agent/mod.rs (make it a part)"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert_eq!(
        impls_of_agent(mod_rs).len(),
        1,
        "agent/mod.rs should hold exactly one `impl Agent`"
    );
    let fields = struct_fields(mod_rs, "Agent").expect("struct Agent in agent/mod.rs");
    assert!(
        fields.len() <= AGENT_FIELDS_MAX,
        "Agent has {} fields (at most {AGENT_FIELDS_MAX}): {fields:?}",
        fields.len()
    );
    // Negative control on the real tree: the parts do name their siblings (the scanner
    // resolves their paths), and the loop does name its parts.
    let resolved_a_part = sources.iter().any(|(rel, text)| {
        rel.starts_with("agent/results/")
            && paths_in_modules(text).iter().any(|(p, _, inline)| {
                let mut at = module_of(rel);
                at.extend(inline.iter().cloned());
                absolute(p, &at).is_some_and(|a| a.starts_with(&["agent".into(), "error".into()]))
            })
    });
    assert!(
        resolved_a_part,
        "no path from agent/results/ to agent/error.rs was resolved"
    );
}

#[test]
fn a_part_that_reaches_into_the_loop_is_caught_however_it_is_written() {
    let items: Vec<String> = ["Agent", "Shutdown", "HELD"].map(String::from).to_vec();
    let caught = |rel: &str, src: &str| reaches_into_the_loop(rel, src, &items);
    assert_eq!(
        caught("agent/work.rs", "use super::Agent;\n"),
        [(1, "super::Agent".to_string())]
    );
    assert_eq!(
        caught("agent/keeper/mod.rs", "fn f(a: &mut super::Agent) {}\n").len(),
        1
    );
    assert_eq!(
        caught(
            "agent/results/mqtt.rs",
            "use super::super::{Agent, error::x};\n"
        ),
        [(1, "super::super::Agent".to_string())]
    );
    assert_eq!(
        caught("agent/ingest.rs", "use crate::agent::Shutdown;\n").len(),
        1
    );
    assert_eq!(
        caught("agent/ingest.rs", "use super::*;\n").len(),
        1,
        "a glob"
    );
    // Not a reach: siblings, the file's own test module, and the loop itself.
    assert!(caught("agent/ingest.rs", "use super::error::AgentError;\n").is_empty());
    assert!(
        caught(
            "agent/ingest.rs",
            "fn f() {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n    use super::f;\n}\n"
        )
        .is_empty(),
        "`super` in a test module is the file itself"
    );
    assert!(
        caught(
            "agent/ingest.rs",
            "mod tests {\n    use super::{\n        Queue,\n        Agent,\n    };\n}\n"
        )
        .is_empty(),
        "a use tree over several lines in a test module"
    );
    assert!(caught("agent/mod.rs", "use self::Agent;\n").is_empty());
    assert!(caught("processor.rs", "use crate::agent::Agent;\n").is_empty());
    assert_eq!(
        loop_items(
            "pub struct Agent {\n a: u8,\n}\nimpl Agent { fn inner() {} }\nconst HELD: u8 = 1;\nmod x;\n"
        ),
        ["Agent", "HELD"]
    );
}

#[test]
fn an_impl_of_agent_and_a_fat_agent_are_found() {
    assert_eq!(impls_of_agent("impl Agent {\n}\n"), [1]);
    assert_eq!(impls_of_agent("\nimpl super::Agent {}\n"), [2]);
    assert_eq!(
        impls_of_agent("impl Drop for crate::agent::Agent {}\n"),
        [1]
    );
    assert_eq!(impls_of_agent("impl<'a> Agent { }\n"), [1]);
    assert!(impls_of_agent("impl AgentError {}\nimpl Ingest {}\n// impl Agent {}\n").is_empty());
    assert!(impls_of_agent("impl From<Agent> for X {}\n").is_empty());
    let fat: String = (0..13)
        .map(|i| format!("    f{i}: Box<dyn Fn(u8) -> u8>,\n"))
        .collect();
    let src = format!("pub struct Agent {{\n{fat}}}\nstruct Other {{ a: u8 }}\n");
    assert_eq!(struct_fields(&src, "Agent").map(|f| f.len()), Some(13));
    assert_eq!(
        struct_fields(
            "pub struct Agent {\n    pub(crate) cfg: Config,\n    log: Log,\n}\n",
            "Agent"
        ),
        Some(vec!["cfg".to_string(), "log".to_string()])
    );
}

#[test]
fn the_lower_rooms_never_import_the_agent_mqtt_or_cli() {
    let text = "use crate::agent::Agent;\nuse crate::mqtt::Event;\nuse crate::cli::run;\n";
    let whys = |rel: &str| -> Vec<&str> { check(rel, text).into_iter().map(|v| v.why).collect() };
    assert_eq!(
        whys("store/mod.rs"),
        [
            "store/, log/ and pipeline/ never import the agent",
            "store/, log/ and pipeline/ never import mqtt",
            "nothing imports cli (only main.rs runs it)"
        ]
    );
    assert_eq!(whys("log/reader.rs").len(), 3);
    assert_eq!(
        whys("agent/mod.rs"),
        ["nothing imports cli (only main.rs runs it)"]
    );
    assert!(whys("cli/run.rs").iter().all(|w| !w.contains("cli")));
}

#[test]
fn the_wall_clock_read_anywhere_but_clock_rs_is_reported() {
    let text = "fn f() {\n    let a = std::time::SystemTime::now();\n    let b = SystemTime::now();\n    let c = SystemTime::UNIX_EPOCH;\n}\n";
    let lines = |rel: &str| -> Vec<usize> {
        check(rel, text)
            .into_iter()
            .filter(|v| v.why.contains("wall clock"))
            .map(|v| v.line)
            .collect()
    };
    assert_eq!(lines("logging.rs"), [2, 3]);
    assert_eq!(lines("store/copy.rs"), [2, 3]);
    assert!(lines("clock.rs").is_empty());
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
    assert!(
        named("sink/", "tokio_postgres"),
        "scanner saw no tokio_postgres path in src/sink/"
    );
    assert!(
        named("sink/", "async_nats"),
        "scanner saw no async_nats path in src/sink/"
    );
}

#[test]
fn the_database_and_stream_clients_outside_the_sink_module_are_reported() {
    let text = "use async_nats::Client;\nfn f() { let _ = tokio_postgres::NoTls; }\n";
    let whys = |rel: &str| -> Vec<&str> { check(rel, text).into_iter().map(|v| v.why).collect() };
    assert_eq!(
        whys("agent/results/mod.rs"),
        [
            "only sink/ imports the NATS client",
            "only sink/ imports the PostgreSQL client"
        ]
    );
    assert!(whys("sink/jetstream.rs").is_empty());
    assert_eq!(whys("mqtt/worker.rs").len(), 2, "not mqtt/ either");
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
            // Twice: pipeline/ sees no clock, and only clock.rs reads the wall clock.
            (4, "std::time::SystemTime::now".to_string()),
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

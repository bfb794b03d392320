//! The docs (issue 32, item 4): a README a newcomer reads on a screen or two, and `docs/`
//! where everything else is found. Two of its pages are generated, like
//! `docs/configuration.md` from the key table: `docs/metrics.md` from the table of metric
//! families the agent serves, `docs/journal.md` from the `event!` lines in `src/`
//! (`CAIRN_WRITE_DOCS=1 cargo test --all-features --test it docs::` writes them). The tests
//! fail when a config key, a metric, a journal event, a CLI command or a dead-letter reason
//! is missing from the docs, and hold the docs to what the README check found (item 7).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every hand-written and generated page: README.md and docs/*.md.
fn all_docs() -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    out.insert("README.md".to_string(), read("README.md"));
    for e in std::fs::read_dir(repo().join("docs")).unwrap().flatten() {
        let name = format!("docs/{}", e.file_name().to_string_lossy());
        if name.ends_with(".md") {
            out.insert(name.clone(), read(&name));
        }
    }
    out
}

/// Every page, with each run of white space (line breaks included) as one space, so that
/// a phrase is found however the paragraph is wrapped.
fn all_text() -> String {
    let text = all_docs().into_values().collect::<Vec<_>>().join("\n");
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Compare a generated page with the committed one, or write it under `CAIRN_WRITE_DOCS`.
fn generated(rel: &str, want: &str) {
    let path = repo().join(rel);
    if std::env::var_os("CAIRN_WRITE_DOCS").is_some() {
        std::fs::write(&path, want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "{rel} differs from what it is generated from: run `CAIRN_WRITE_DOCS=1 cargo test \
         --all-features --test it docs::` and commit it"
    );
}

// ---------------------------------------------------------------------------------------------
// The README

/// The pages the README links to, each a file that exists.
const PAGES: &[&str] = &[
    "docs/configuration.md",
    "docs/pipelines.md",
    "docs/operations.md",
    "docs/metrics.md",
    "docs/journal.md",
    "docs/fleet-and-sinks.md",
    "docs/guarantees.md",
    "docs/performance.md",
    "docs/testing.md",
];

#[test]
fn the_readme_fits_two_screens_keeps_the_two_commands_and_links_every_page() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 130,
        "the README has {lines} lines: it is for a newcomer, move detail to docs/"
    );
    for command in [
        "cargo run --release -- run --config config/cairn.toml",
        ".ci/test",
    ] {
        assert!(readme.contains(command), "the README lost `{command}`");
    }
    for page in PAGES {
        assert!(repo().join(page).exists(), "{page} is missing");
        assert!(
            readme.contains(&format!("]({page})")),
            "the README does not link {page}"
        );
    }
    for section in [
        "## Set up",
        "## Quickstart",
        "## What it guarantees",
        "## Where to find",
    ] {
        assert!(readme.contains(section), "no `{section}` in the README");
    }
}

#[test]
fn every_link_between_the_pages_names_a_file_that_exists() {
    for (page, text) in all_docs() {
        let base = repo().join(&page).parent().unwrap().to_path_buf();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let target = rest.split(')').next().unwrap_or("");
            let file = target.split('#').next().unwrap_or("");
            if file.is_empty() || file.contains("://") || file.contains(' ') {
                continue;
            }
            let path: PathBuf = base.join(file);
            assert!(path.exists(), "{page} links {target}, which is not there");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Everything an operator looks up is in the docs

#[test]
fn every_config_key_is_in_the_reference_and_every_command_in_the_docs() {
    // The reference itself is held to the key table by
    // `config::keys::tests::the_reference_doc_is_what_the_table_generates`; here: it is
    // linked, and each key of the example config is in it.
    let reference = read("docs/configuration.md");
    let example = read("config/cairn.toml");
    let mut section = String::new();
    for line in example.lines() {
        let line = line.trim_start_matches('#').trim();
        if let Some(s) = line.strip_prefix("[[").and_then(|s| s.strip_suffix("]]")) {
            section = s.to_string();
        } else if let Some(s) = line.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            section = s.to_string();
        } else if let Some((key, value)) = line.split_once(" = ") {
            let key = key.trim();
            if key.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') && !section.is_empty() {
                // An inline table (`tls = { ca_file = .. }`) has rows `tls.ca_file`, ...
                let row = if value.trim_start().starts_with('{') {
                    format!("| `{key}.")
                } else {
                    format!("| `{key}` |")
                };
                assert!(
                    reference.contains(&row),
                    "[{section}] {key} is not in docs/configuration.md"
                );
            }
        }
    }
    // Commands: every man page's command (held to the CLI by the lib test
    // `cli::generated`), as `cairn A B`.
    let text = all_text();
    for e in std::fs::read_dir(repo().join("dist/man"))
        .unwrap()
        .flatten()
    {
        let page = e
            .file_name()
            .to_string_lossy()
            .trim_end_matches(".1")
            .to_string();
        let command = page
            .replace('-', " ")
            .replacen("dead letters", "dead-letters", 1);
        assert!(text.contains(&command), "`{command}` is not in the docs");
    }
}

/// The families the agent serves, with a pipeline and an uplink so every one is there.
fn families() -> Vec<cairn::metrics::Family> {
    let mut f = cairn::metrics::Figures {
        uplink: Some(Default::default()),
        ..Default::default()
    };
    f.pipelines.insert("p".into(), Default::default());
    cairn::metrics::families(&f, 0)
}

#[test]
fn the_metrics_page_is_the_table_the_agent_serves() {
    let mut out = String::from(
        "# Metrics\n\nGenerated from the table of families the agent serves (`src/metrics/`; \
         `tests/it/docs.rs` fails when this page differs, and `CAIRN_WRITE_DOCS=1` on it \
         writes it). Served as Prometheus text 0.0.4 at `/metrics` on `[metrics] listen` and \
         on the data directory's `cairn.sock`; the same figures are in `cairn status --json`. \
         Alerts and a dashboard over them: [operations](operations.md#alerts-and-a-dashboard).\n\n\
         | metric | type | labels | what |\n|---|---|---|---|\n",
    );
    for fam in families() {
        let labels: BTreeSet<&str> = fam
            .samples
            .iter()
            .flat_map(|s| s.labels.keys().map(String::as_str))
            .filter(|l| *l != "le")
            .collect();
        let labels = labels
            .iter()
            .map(|l| format!("`{l}`"))
            .collect::<Vec<_>>()
            .join(", ");
        out.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            fam.name,
            fam.kind,
            labels,
            fam.help.replace('|', "\\|")
        ));
    }
    generated("docs/metrics.md", &out);
    for fam in families() {
        assert!(out.contains(&format!("| `{}` |", fam.name)));
    }
}

/// One `event!` call: level, name, field keys, message format.
struct Call {
    level: String,
    name: String,
    fields: Vec<String>,
    message: String,
    file: String,
}

/// The text of the macro call that starts right after `event!(`, up to its closing paren.
fn call_body(text: &str) -> &str {
    let (mut depth, mut in_str, mut escaped) = (1, false, false);
    for (i, c) in text.char_indices() {
        if in_str {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => {
                depth -= 1;
                if depth == 0 {
                    return &text[..i];
                }
            }
            _ => {}
        }
    }
    text
}

/// The first string literal in `text`, its line continuations joined.
fn first_literal(text: &str) -> String {
    let Some(start) = text.find('"') else {
        return String::new();
    };
    let mut out = String::new();
    let mut chars = text[start + 1..].chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => break,
            '\\' => match chars.next() {
                Some('\n') => {
                    while chars.peek().is_some_and(|c| c.is_whitespace()) {
                        chars.next();
                    }
                }
                Some('n') => out.push(' '),
                Some(o) => out.push(o),
                None => {}
            },
            c => out.push(c),
        }
    }
    out
}

fn calls() -> Vec<Call> {
    let mut out = Vec::new();
    let root = repo().join("src");
    let mut files = Vec::new();
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    walk(&root, &mut files);
    files.sort();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let file = path
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("event!(") {
            rest = &rest[at + "event!(".len()..];
            let body = call_body(rest);
            let Some((level, after)) = body.split_once(',') else {
                continue;
            };
            let level = level.trim();
            if !["error", "warn", "info", "debug", "trace"].contains(&level) {
                continue;
            }
            let name = first_literal(after);
            let (head, message) = after.split_once(';').unwrap_or((after, ""));
            let fields = head
                .split(',')
                .skip(1)
                .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.trim().to_string()))
                .collect();
            out.push(Call {
                level: level.to_string(),
                name,
                fields,
                message: first_literal(message),
                file: file.clone(),
            });
        }
    }
    out
}

#[test]
fn the_journal_page_lists_every_event_the_agent_logs() {
    let mut events: BTreeMap<String, Vec<Call>> = BTreeMap::new();
    for c in calls() {
        events.entry(c.name.clone()).or_default().push(c);
    }
    let priority = |level: &str| match level {
        "error" => "3 err",
        "warn" => "4 warning",
        "info" => "6 info",
        _ => "7 debug",
    };
    let mut out = String::from(
        "# Journal events\n\nGenerated from the `event!` lines in `src/` (`tests/it/docs.rs` \
         fails when this page differs, and `CAIRN_WRITE_DOCS=1` on it writes it). Under \
         systemd each line is a journal entry with `CAIRN_EVENT` set to the name below, \
         `PRIORITY`, `SYSLOG_IDENTIFIER=cairn`, `CODE_FILE`/`CODE_LINE`, and the fields it \
         names (`CAIRN_PIPELINE`, `CAIRN_SINK`, `CAIRN_REASON`, `CAIRN_OFFSET`, `CAIRN_KEY`, \
         `CAIRN_SUPPRESSED`); see [operations](operations.md#the-journal) for queries. The \
         names are stable: a line may be reworded, its event name stays.\n\n\
         | event | priority | fields | message (as written; `{}` are values) | from |\n\
         |---|---|---|---|---|\n\
         | `fatal` | 3 err | | `cairn: ` and what ended the process (a config error, a failed start) | `logging.rs` |\n",
    );
    for (name, cs) in &events {
        let levels: BTreeSet<&str> = cs.iter().map(|c| priority(&c.level)).collect();
        let fields: BTreeSet<String> = cs
            .iter()
            .flat_map(|c| {
                c.fields
                    .iter()
                    .map(|f| format!("`CAIRN_{}`", f.to_uppercase()))
            })
            .collect();
        let messages: BTreeSet<String> = cs
            .iter()
            .map(|c| format!("`{}`", c.message.replace('`', "'").replace('|', "\\|")))
            .collect();
        let files: BTreeSet<String> = cs.iter().map(|c| format!("`{}`", c.file)).collect();
        out.push_str(&format!(
            "| `{name}` | {} | {} | {} | {} |\n",
            levels.into_iter().collect::<Vec<_>>().join(", "),
            fields.into_iter().collect::<Vec<_>>().join(", "),
            messages.into_iter().collect::<Vec<_>>().join("<br>"),
            files.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    generated("docs/journal.md", &out);
    // The names the lint in tests/it/journal.rs collects are all here.
    for name in crate::journal::event_names() {
        assert!(
            out.contains(&format!("| `{name}` |")),
            "{name} is not in docs/journal.md"
        );
    }
}

#[test]
fn every_event_a_page_names_exists() {
    let known = crate::journal::event_names();
    for (page, text) in all_docs() {
        let mut rest = text.as_str();
        while let Some(at) = rest.find("CAIRN_EVENT=") {
            rest = &rest[at + "CAIRN_EVENT=".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            assert!(
                known.contains(&name),
                "{page} names CAIRN_EVENT={name}, which no line has"
            );
        }
    }
    let rules = read("monitoring/cairn.rules.yml");
    for part in rules.split("CAIRN_EVENT=").skip(1) {
        let name: String = part
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        assert!(
            known.contains(&name),
            "the alert rules name CAIRN_EVENT={name}, which no line has"
        );
    }
}

/// Dead-letter reasons as the code writes them where refusals are made (`src/pipeline/`,
/// `src/processor.rs`, and the sinks' refusals in `src/sink/`): `reason: "x"`, `refuse("x"`, and the string given to
/// `refuse_at(..)`, over line breaks.
fn dead_letter_reasons() -> BTreeSet<String> {
    let snake = |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
    let mut out = BTreeSet::new();
    let mut stack = vec![
        repo().join("src/pipeline"),
        repo().join("src/processor.rs"),
        repo().join("src/sink"),
    ];
    while let Some(dir) = stack.pop() {
        let entries: Vec<PathBuf> = if dir.is_dir() {
            std::fs::read_dir(&dir)
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .collect()
        } else {
            vec![dir]
        };
        for p in entries {
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            for marker in ["reason: ", "refuse("] {
                for part in text.split(marker).skip(1) {
                    if let Some(lit) = part.trim_start().strip_prefix('"') {
                        let name: String = lit.chars().take_while(|&c| c != '"').collect();
                        if snake(&name) {
                            out.insert(name);
                        }
                    }
                }
            }
            for part in text.split("refuse_at(").skip(1) {
                let name = first_literal(call_body(part));
                if snake(&name) {
                    out.insert(name);
                }
            }
        }
    }
    out
}

#[test]
fn every_dead_letter_reason_is_in_the_reasons_table() {
    let reasons = dead_letter_reasons();
    for want in [
        "late",
        "not_json",
        "bad_key",
        "out_of_range",
        "key_limit",
        "too_large",
        "internal",
    ] {
        assert!(
            reasons.contains(want),
            "the scan lost `{want}`: {reasons:?}"
        );
    }
    let page = read("docs/pipelines.md");
    let table = page
        .split("### Dead-letter reasons")
        .nth(1)
        .expect("a `### Dead-letter reasons` section in docs/pipelines.md");
    for r in &reasons {
        assert!(
            table.contains(&format!("| `{r}` |")),
            "dead-letter reason `{r}` is not in the table"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// What the README check found (item 7): the docs agree with the behaviour

#[test]
fn the_docs_agree_with_the_binary_where_the_readme_check_found_they_did_not() {
    let text = all_text();
    // `emit = "final"`: the watermark already has the lateness taken off.
    assert!(
        !text.contains("passes its end plus `allowed_lateness`"),
        "lateness counted twice"
    );
    assert!(
        text.contains("when the watermark (the highest event time seen minus `allowed_lateness`) reaches its end"),
        "the final-result rule"
    );
    // Required keys are not shown with an example as if it were their default.
    let reference = read("docs/configuration.md");
    for key in ["event_id", "output_topic"] {
        assert!(
            reference.contains(&format!("| `{key}` | required |")),
            "{key} is required in the reference"
        );
        for (page, body) in all_docs() {
            for part in body.split(&format!("`{key}` (")).skip(1) {
                assert!(
                    part.starts_with("required"),
                    "{page}: `{key}` (... reads as a default"
                );
            }
        }
    }
    // The quickstart runs the release binary the set-up command built, never a debug one.
    for (page, body) in all_docs() {
        for part in body.split("cargo run").skip(1) {
            let line = part.lines().next().unwrap_or("");
            assert!(
                line.contains("--release"),
                "{page}: `cargo run{line}` builds a debug binary"
            );
        }
    }
    // `savepoint restore` needs FILE or --latest; a refused definition is exit 2 for both.
    assert!(text.contains("cairn savepoint restore --latest"));
    assert!(
        text.contains("exits 2 (a config error)"),
        "run's exit code for a refused definition"
    );
    assert!(text.contains("`cairn validate` refuses the same config"));
    // --reset-pipeline drops the dedup ledger too.
    assert!(text.contains("`--reset-pipeline` also drops the pipeline's dedup ledger"));
    // An unusable $TMPDIR is named.
    assert!(text.contains("point `TMPDIR` at a writable directory"));
    // The uplink's backlog lines come only past one inflight window.
    assert!(text.contains("more than one inflight window (`outbox.inflight` results"));
}

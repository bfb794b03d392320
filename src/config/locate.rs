//! Where a key sits in the TOML text, so that every problem can name a line.
//!
//! Keys are named by dotted paths with array indices: `log.segment_size`,
//! `pipeline[1].window.size`, `pipeline[0].topics[2]`. The parser's spans are byte ranges;
//! [`Lines`] turns them into 1-based line numbers.

use std::collections::HashMap;
use std::ops::Range;

use toml_edit::{Item, Table, TableLike, Value};

/// One step of a key path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Seg {
    Key(String),
    Index(usize),
}

/// `[Key("pipeline"), Index(0), Key("window")]` → `pipeline[0].window`.
pub(super) fn render(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

/// Byte offset → 1-based line and column.
pub(super) struct Lines {
    starts: Vec<usize>,
}

impl Lines {
    pub(super) fn new(text: &str) -> Lines {
        let starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Lines { starts }
    }

    pub(super) fn line(&self, offset: usize) -> usize {
        self.starts.partition_point(|&s| s <= offset)
    }

    pub(super) fn column(&self, offset: usize) -> usize {
        offset - self.starts[self.line(offset) - 1] + 1
    }
}

/// Called with each entry's path and span.
type OnEntry<'a> = dyn FnMut(&[Seg], Option<Range<usize>>) + 'a;

/// Calls `f(path, span)` for every key, array-of-tables element and array element under
/// `table`, parents before children. The span of a key is its header for `[table]` and
/// `[[array]]` elements, and `key = value` otherwise.
fn visit(table: &dyn TableLike, path: &mut Vec<Seg>, f: &mut OnEntry<'_>) {
    for (name, item) in table.iter() {
        let key_span = table.key(name).and_then(|k| k.span());
        path.push(Seg::Key(name.to_string()));
        let span = match item {
            Item::Table(t) if !t.is_dotted() => t.span().or(key_span),
            Item::Value(v) => join(key_span, v.span()),
            _ => key_span,
        };
        f(path, span);
        match item {
            Item::Table(t) => visit(t, path, f),
            Item::Value(v) => visit_value(v, path, f),
            Item::ArrayOfTables(a) => {
                for (i, t) in a.iter().enumerate() {
                    path.push(Seg::Index(i));
                    f(path, t.span());
                    visit(t, path, f);
                    path.pop();
                }
            }
            Item::None => {}
        }
        path.pop();
    }
}

fn visit_value(value: &Value, path: &mut Vec<Seg>, f: &mut OnEntry<'_>) {
    match value {
        Value::InlineTable(t) => visit(t, path, f),
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                path.push(Seg::Index(i));
                f(path, v.span());
                visit_value(v, path, f);
                path.pop();
            }
        }
        _ => {}
    }
}

fn join(a: Option<Range<usize>>, b: Option<Range<usize>>) -> Option<Range<usize>> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.start.min(b.start)..a.end.max(b.end)),
        (a, b) => a.or(b),
    }
}

/// Every key path in the document with the line it starts on.
pub(super) fn index(root: &Table, lines: &Lines) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    visit(root, &mut Vec::new(), &mut |path, span| {
        if let Some(span) = span {
            out.insert(render(path), lines.line(span.start));
        }
    });
    out
}

/// The innermost key path whose span contains `offset`, with that span's start.
pub(super) fn innermost(root: &Table, offset: usize) -> Option<(Vec<Seg>, usize)> {
    let mut best: Option<(Vec<Seg>, usize)> = None;
    visit(root, &mut Vec::new(), &mut |path, span| {
        if let Some(span) = span {
            let inside = span.contains(&offset) || span.start == offset;
            if inside && best.as_ref().is_none_or(|(b, _)| path.len() > b.len()) {
                best = Some((path.to_vec(), span.start));
            }
        }
    });
    best
}

/// Remove the key named by the last [`Seg::Key`] of `path`; false if there is none.
pub(super) fn remove(root: &mut Table, path: &[Seg]) -> bool {
    let end = path
        .iter()
        .rposition(|s| matches!(s, Seg::Key(_)))
        .map_or(0, |i| i + 1);
    remove_in(root, &path[..end])
}

fn remove_in(table: &mut dyn TableLike, path: &[Seg]) -> bool {
    let Some((Seg::Key(name), rest)) = path.split_first() else {
        return false;
    };
    if rest.is_empty() {
        return table.remove(name).is_some();
    }
    let Some(child) = table.get_mut(name) else {
        return false;
    };
    match (child, &rest[0]) {
        (Item::ArrayOfTables(a), Seg::Index(i)) => {
            a.get_mut(*i).is_some_and(|t| remove_in(t, &rest[1..]))
        }
        (Item::Value(Value::Array(a)), Seg::Index(i)) => a
            .get_mut(*i)
            .and_then(Value::as_inline_table_mut)
            .is_some_and(|t| remove_in(t, &rest[1..])),
        (child, Seg::Key(_)) => child
            .as_table_like_mut()
            .is_some_and(|t| remove_in(t, rest)),
        _ => false,
    }
}

//! `cairn verify`: check the log, and the store against it, without changing anything
//! (unless `--repair`, which only moves damaged log segments aside).

use serde_json::json;

use super::failure::Failure;
use crate::config::Config;
use crate::store::Store;

pub(crate) fn run(cfg: &Config, repair: bool, as_json: bool) -> Result<(), Failure> {
    let dir = cfg.log_dir();
    let mut problems: Vec<String> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    if repair {
        let r = crate::log::repair_dir(&dir, crate::fsio::real()).map_err(Failure::runtime)?;
        for s in &r.repaired {
            notes.push(format!(
                "repaired {}: kept {} records ({} bytes); moved the original to {}; dropped {} known-good records and {} unreadable bytes after the damage",
                s.segment.display(), s.kept_records, s.kept_bytes, s.moved_to.display(), s.dropped_good_records, s.dropped_unknown_bytes
            ));
        }
        for g in &r.acknowledged_gaps {
            notes.push(format!(
                "accepted missing offsets [{}, {}) after {}",
                g.from,
                g.to,
                g.after.display()
            ));
        }
        for u in &r.unrepaired {
            problems.push(format!(
                "cannot repair {}: {}",
                u.segment.display(),
                u.reason
            ));
        }
    }
    let report = crate::log::verify_dir(&dir).map_err(Failure::runtime)?;
    for c in &report.corruption {
        problems.push(format!(
            "log corruption in {} at byte {}{}: {} ({} good records and {} unknown bytes after it); run `cairn verify --repair` to move it aside",
            c.segment.display(),
            c.byte_pos,
            c.offset.map(|o| format!(" (offset {o})")).unwrap_or_default(),
            c.reason,
            c.good_records_after,
            c.unknown_bytes
        ));
    }
    if let Some(t) = &report.torn_tail {
        notes.push(format!(
            "torn tail in {}: {} bytes ({} records) after byte {}, never acknowledged; the next start truncates it",
            t.segment.display(),
            t.bytes,
            t.records,
            t.byte_pos
        ));
    }
    let store_line = check_store(cfg, &report, &mut problems, &mut notes);
    // The progress line (on a terminal) goes before the result is printed.
    crate::logging::progress::done();
    if as_json {
        println!(
            "{}",
            json!({"ok": problems.is_empty(), "log": {"segments": report.segments.len(), "records": report.records,
                   "first_offset": report.first_offset, "next_offset": report.next_offset},
                   "store": store_line, "problems": problems, "notes": notes})
        );
    } else {
        println!(
            "log: {} segments, {} records, offsets [{}, {})",
            report.segments.len(),
            report.records,
            report.first_offset,
            report.next_offset
        );
        for n in &notes {
            println!("{n}");
        }
        for p in &problems {
            println!("PROBLEM: {p}");
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Failure::runtime(format!(
            "verify found {} problem(s)",
            problems.len()
        )))
    }
}

/// The store against the log: its checkpoint must lie inside what the log holds, and every
/// state entry must decode. Returns the store's summary for `--json` (`null`: none read).
fn check_store(
    cfg: &Config,
    report: &crate::log::VerifyReport,
    problems: &mut Vec<String>,
    notes: &mut Vec<String>,
) -> serde_json::Value {
    let mut store_line = json!(null);
    let store_dir = cfg.store_dir();
    if store_dir.join("db").exists() {
        match Store::open(&store_dir, cfg.storage.cache_size, crate::fsio::real()) {
            Ok(store) => match store.progress() {
                Ok(p) => {
                    if p.next_offset > report.next_offset {
                        problems.push(format!(
                            "the store's checkpoint is at offset {} but the log ends at {}: the log lost records the store already counted",
                            p.next_offset, report.next_offset
                        ));
                    }
                    if p.next_offset < report.first_offset {
                        problems.push(format!(
                            "the store's checkpoint needs offset {} but the log starts at {}: restore a newer savepoint",
                            p.next_offset, report.first_offset
                        ));
                    }
                    let mut n = 0u64;
                    // Only the progress total: a row that does not decode is reported below.
                    let total = store.state_len().unwrap_or(0) as u64;
                    for r in store.states(None) {
                        crate::logging::progress::step(
                            "reading the store's state",
                            n,
                            Some(total),
                            crate::logging::progress::Unit::Entries,
                        );
                        if let Err(e) = r {
                            problems.push(format!("store state: {e}"));
                            break;
                        }
                        n += 1;
                    }
                    store_line = json!({"checkpoint_id": p.checkpoint_id, "next_offset": p.next_offset,
                                        "records": p.records, "unmatched": p.unmatched,
                                        "keys": n, "outbox": store.outbox_len(), "dead_letters": store.dead_letter_len(),
                                        "pipelines": p.pipelines.iter().map(|pp| json!({
                                            "name": pp.name, "keys": pp.keys, "dedup_entries": pp.dedup_entries,
                                            "applied": pp.counters.applied, "duplicates": pp.counters.duplicates,
                                            "dead_letters": pp.counters.dead_letters, "outputs": pp.counters.outputs,
                                        })).collect::<Vec<_>>()});
                    notes.push(format!(
                        "store: checkpoint {} at offset {}, {n} keys, {} outbox entries, {} dead letters",
                        p.checkpoint_id,
                        p.next_offset,
                        store.outbox_len(),
                        store.dead_letter_len()
                    ));
                }
                Err(e) => problems.push(e.to_string()),
            },
            Err(e) => problems.push(e.to_string()),
        }
    } else {
        notes.push(format!("store: none yet at {}", store_dir.display()));
    }
    store_line
}

//! Opening a log: validating the options, scanning the segments, truncating a torn tail
//! and refusing corruption (the module docs say which is which).

use super::*;

impl Log {
    /// Open (creating the directory if missing) and recover. See the module docs.
    pub fn open(opts: LogOptions, sync: Durability) -> Result<(Log, Recovery), LogError> {
        validate(&opts)?;
        let dir = opts.dir.clone();
        // The new directory's entries (and its parents') must survive a crash too.
        crate::fsio::create_dir_all_durable(&dir, &sync)
            .map_err(io_err("create log directory", &dir))?;
        let listed = scan::list_segments(&dir).map_err(io_err("list log directory", &dir))?;
        let mut scans = Vec::with_capacity(listed.len());
        for (first, path) in &listed {
            scans.push(scan::scan_segment(path, *first).map_err(io_err("scan segment", path))?);
        }
        let findings = scan::classify(&dir, &scans);
        if let Some(p) = findings.problems.first() {
            return Err(LogError::Corrupt {
                segment: p.segment.clone(),
                offset: p.offset,
                byte_pos: p.byte_pos,
                reason: p.reason.clone(),
            });
        }
        for (prev, from, to) in &findings.repaired_gaps {
            crate::event!(warn, "log_gap_acknowledged", offset = from;
                "log: offsets {from}..{to} after {} were lost in an earlier repair (see {}/)",
                prev.display(),
                scan::DAMAGED_DIR
            );
        }

        let mut torn_bytes_dropped = 0;
        let mut torn_records_dropped = 0;
        let mut active = None;
        if let Some(last) = scans.last_mut() {
            let file = OpenOptions::new()
                .append(true)
                .open(&last.path)
                .map_err(io_err("open active segment", &last.path))?;
            if findings.torn_tail {
                let damage = last.damage.take().expect("torn tail has damage");
                torn_bytes_dropped = last.file_len - last.valid_end;
                torn_records_dropped = damage.torn_records;
                file.set_len(last.valid_end)
                    .map_err(io_err("truncate torn tail of", &last.path))?;
                crate::event!(warn, "log_torn_tail_dropped";
                    "log: dropped a torn tail of {torn_bytes_dropped} bytes ({torn_records_dropped} records) at byte {} of {} (offset {}): {}",
                    last.valid_end,
                    last.path.display(),
                    damage.offset,
                    damage.reason
                );
                last.file_len = last.valid_end;
            }
            // Make what we recovered durable even if it was only in the page cache (a
            // SIGKILL keeps it), so that nothing we hand out can vanish in a later crash.
            sync.sync_file(SyncKind::LogData, &file, &last.path, true)
                .map_err(io_err("fdatasync active segment", &last.path))?;
            active = Some(file);
        }
        // The last segment's entry may have been created without a directory sync by a
        // process that crashed right after; make it durable before appending to it.
        sync.sync_dir(&dir)
            .map_err(io_err("fsync log directory", &dir))?;

        let segments: Vec<Segment> = scans
            .iter()
            .map(|s| Segment {
                path: s.path.clone(),
                first_offset: s.first_offset,
                next_offset: s.next_offset(),
                bytes: s.valid_end,
                max_received_at_ms: s.max_received_at_ms,
            })
            .collect();
        let next_offset = segments.last().map_or(0, |s| s.next_offset);
        let first_offset = segments.first().map_or(next_offset, |s| s.first_offset);
        let recovery = Recovery {
            segments: segments.len(),
            records: scans.iter().map(|s| s.records).sum(),
            torn_bytes_dropped,
            torn_records_dropped,
            first_offset,
            next_offset,
        };
        let disk_bytes = segments.iter().map(|s| s.bytes).sum();
        let log = Log {
            opts,
            sync,
            segments,
            active,
            pending: Vec::new(),
            pending_records: 0,
            pending_bytes: 0,
            disk_bytes,
            next_offset,
            durable_next: next_offset,
            failed: false,
        };
        Ok((log, recovery))
    }
}

fn validate(opts: &LogOptions) -> Result<(), LogError> {
    if opts.segment_size == 0 {
        return Err(LogError::InvalidOptions("segment_size must be > 0".into()));
    }
    if opts.max_size == 0 {
        return Err(LogError::InvalidOptions("max_size must be > 0".into()));
    }
    if opts.max_payload > frame::MAX_PAYLOAD_LIMIT {
        return Err(LogError::InvalidOptions(format!(
            "max_payload {} exceeds the frame limit {}",
            opts.max_payload,
            frame::MAX_PAYLOAD_LIMIT
        )));
    }
    Ok(())
}

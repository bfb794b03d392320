//! FUSE passthrough that records, per file and per directory, what is not yet synced, and can
//! forget it on command (see `journal` for the model).
//!
//! Invariants:
//! - the backing directory holds the newest (page-cache) state of every visible entry;
//! - a removed or replaced entry is parked as `ATTIC/<ino>` while some directory log could
//!   bring it back, and deleted once none can;
//! - for every inode, durable contents = backing contents with `saved` restored, cut to
//!   `durable_size`; durable entries = backing entries with the directory's log undone;
//! - while `frozen` (between `cut` and `thaw`) every request fails with EIO, and nothing in
//!   the backing directory changes.
//!
//! Why ~1,100 lines: the whole FUSE filesystem in one place, because its durability model
//! is one state machine over every operation.

use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    FileAttr, FileType, Filesystem, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
};
use log::{debug, warn};

use crate::journal::{
    self, CutMode, DirLog, DirOp, Entries, Fate, FileLog, FileOp, Rng, choose, durable_entries,
};

/// Hidden directory at the backing root holding parked entries.
pub const ATTIC: &str = ".powercut-attic";

/// Zero TTL: after a cut the kernel must ask us again for every name and size, or it would
/// keep serving the pre-cut view from its caches.
const TTL: Duration = Duration::ZERO;

const ROOT: u64 = fuser::FUSE_ROOT_ID;

/// Bound on the memory held for unsynced data (redo data plus saved pre-images). Beyond it
/// writes fail with ENOSPC: a program that never fsyncs would otherwise grow us forever.
const HELD_BYTES_MAX: u64 = 1 << 30;

pub struct Core {
    backing: PathBuf,
    root_st_ino: u64,
    /// FUSE inode → path relative to `backing` ("" for the root). Refreshed on every lookup.
    paths: HashMap<u64, PathBuf>,
    handles: HashMap<u64, File>,
    next_fh: u64,
    files: HashMap<u64, FileLog>,
    dirs: HashMap<u64, DirLog>,
    next_seq: u64,
    syncs: u64,
    frozen: bool,
    /// Sum of `FileLog::held_bytes` over `files`, checked against `HELD_BYTES_MAX`.
    held_bytes: u64,
}

pub type Shared = Arc<Mutex<Core>>;

fn errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl Core {
    pub fn new(backing: &Path) -> io::Result<Core> {
        let backing = backing.canonicalize()?;
        let attic = backing.join(ATTIC);
        // Leftovers of an earlier run were never durable entries: start clean.
        if attic.exists() {
            fs::remove_dir_all(&attic)?;
        }
        fs::create_dir(&attic)?;
        let root_st_ino = fs::metadata(&backing)?.ino();
        let mut paths = HashMap::new();
        paths.insert(ROOT, PathBuf::new());
        Ok(Core {
            backing,
            root_st_ino,
            paths,
            handles: HashMap::new(),
            next_fh: 1,
            files: HashMap::new(),
            dirs: HashMap::new(),
            next_seq: 0,
            syncs: 0,
            frozen: false,
            held_bytes: 0,
        })
    }

    /// Backing inode numbers are our inode numbers, so hard links and renames keep their
    /// identity for free; only the root is swapped with FUSE's fixed id 1.
    fn fuse_ino(&self, st_ino: u64) -> u64 {
        if st_ino == self.root_st_ino {
            ROOT
        } else if st_ino == ROOT {
            self.root_st_ino
        } else {
            st_ino
        }
    }

    fn abs(&self, rel: &Path) -> PathBuf {
        self.backing.join(rel)
    }

    fn rel(&self, ino: u64) -> io::Result<PathBuf> {
        self.paths
            .get(&ino)
            .cloned()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))
    }

    fn child(&self, parent: u64, name: &OsStr) -> io::Result<PathBuf> {
        if parent == ROOT && name == ATTIC {
            return Err(io::Error::from_raw_os_error(libc::ENOENT));
        }
        Ok(self.rel(parent)?.join(name))
    }

    fn attic_rel(ino: u64) -> PathBuf {
        Path::new(ATTIC).join(ino.to_string())
    }

    fn seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    fn attr(&self, md: &fs::Metadata) -> FileAttr {
        let ft = md.file_type();
        let kind = if ft.is_dir() {
            FileType::Directory
        } else if ft.is_symlink() {
            FileType::Symlink
        } else {
            FileType::RegularFile
        };
        let time = |s: i64, ns: i64| {
            if s >= 0 {
                UNIX_EPOCH + Duration::new(s as u64, ns as u32)
            } else {
                UNIX_EPOCH
            }
        };
        FileAttr {
            ino: self.fuse_ino(md.ino()),
            size: md.size(),
            blocks: md.blocks(),
            atime: time(md.atime(), md.atime_nsec()),
            mtime: time(md.mtime(), md.mtime_nsec()),
            ctime: time(md.ctime(), md.ctime_nsec()),
            crtime: UNIX_EPOCH,
            kind,
            perm: (md.mode() & 0o7777) as u16,
            nlink: md.nlink() as u32,
            uid: md.uid(),
            gid: md.gid(),
            rdev: md.rdev() as u32,
            blksize: md.blksize() as u32,
            flags: 0,
        }
    }

    /// Stats `rel` and remembers it as the path of the inode found there.
    fn stat_rel(&mut self, rel: PathBuf) -> io::Result<FileAttr> {
        let md = fs::symlink_metadata(self.abs(&rel))?;
        let attr = self.attr(&md);
        self.paths.insert(attr.ino, rel);
        Ok(attr)
    }

    fn log_dir(&mut self, dir: u64, op: DirOp) {
        let seq = self.seq();
        self.dirs
            .entry(dir)
            .or_insert_with(|| DirLog {
                seq,
                ops: Vec::new(),
            })
            .ops
            .push(op);
    }

    /// Log entry for a file about to change; its durable size is the size before the first
    /// unsynced change.
    fn file_log(&mut self, ino: u64, file: &File) -> io::Result<&mut FileLog> {
        if !self.files.contains_key(&ino) {
            let size = file.metadata()?.len();
            let seq = self.seq();
            self.files.insert(ino, FileLog::new(seq, size));
        }
        Ok(self.files.get_mut(&ino).expect("inserted above"))
    }

    /// The file is synced (or gone): its unsynced history is durable (or irrelevant).
    fn forget_file(&mut self, ino: u64) {
        if let Some(log) = self.files.remove(&ino) {
            self.held_bytes -= log.held_bytes();
        }
    }

    /// Saves the durable bytes of `[start, end)` that are about to be overwritten.
    fn preserve(&mut self, ino: u64, file: &File, start: u64, end: u64) -> io::Result<()> {
        let log = self.file_log(ino, file)?;
        let mut added = 0;
        for (a, b) in log.unsaved_ranges(start, end) {
            let mut buf = vec![0; (b - a) as usize];
            file.read_exact_at(&mut buf, a)?;
            added += buf.len() as u64;
            log.saved.insert(a, buf);
        }
        self.held_bytes += added;
        Ok(())
    }

    fn write_logged(&mut self, ino: u64, file: &File, offset: u64, data: &[u8]) -> io::Result<()> {
        if self.held_bytes + 2 * data.len() as u64 > HELD_BYTES_MAX {
            warn!("over {HELD_BYTES_MAX} unsynced bytes held: failing the write with ENOSPC");
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.preserve(ino, file, offset, offset + data.len() as u64)?;
        file.write_all_at(data, offset)?;
        let log = self.file_log(ino, file)?;
        log.ops.push(FileOp::Write {
            offset,
            data: data.to_vec(),
        });
        self.held_bytes += data.len() as u64;
        Ok(())
    }

    fn set_len_logged(&mut self, ino: u64, file: &File, size: u64) -> io::Result<()> {
        let current = file.metadata()?.len();
        self.preserve(ino, file, size, current)?;
        file.set_len(size)?;
        self.file_log(ino, file)?.ops.push(FileOp::SetLen(size));
        Ok(())
    }

    /// Moves the entry at `rel` (inode `ino`) to the attic instead of deleting it, so a cut
    /// can bring it back.
    fn park(&mut self, rel: &Path, ino: u64) -> io::Result<()> {
        let target = Self::attic_rel(ino);
        if fs::symlink_metadata(self.abs(&target)).is_ok() {
            // Another hard link of the same inode is parked already: one copy is enough.
            return fs::remove_file(self.abs(rel));
        }
        self.move_entry(rel, &target)
    }

    /// Renames in the backing dir and rewrites the remembered paths below `from`.
    fn move_entry(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(self.abs(from), self.abs(to))?;
        for path in self.paths.values_mut() {
            if let Ok(rest) = path.strip_prefix(from) {
                // `join("")` would add a trailing slash, which makes a file path ENOTDIR.
                *path = if rest.as_os_str().is_empty() {
                    to.to_path_buf()
                } else {
                    to.join(rest)
                };
            }
        }
        Ok(())
    }

    fn entries(&self, dir: u64) -> io::Result<Entries> {
        let rel = self.rel(dir)?;
        let mut out = Entries::new();
        for entry in fs::read_dir(self.abs(&rel))? {
            let entry = entry?;
            let name = entry.file_name();
            if dir == ROOT && name == ATTIC {
                continue;
            }
            out.insert(name, self.fuse_ino(entry.metadata()?.ino()));
        }
        Ok(out)
    }

    /// Deletes parked entries no directory log can bring back any more.
    fn collect_attic(&mut self) {
        let referenced: HashSet<u64> = self
            .dirs
            .values()
            .flat_map(|d| d.ops.iter().flat_map(DirOp::referenced))
            .collect();
        let Ok(list) = fs::read_dir(self.backing.join(ATTIC)) else {
            return;
        };
        for entry in list.flatten() {
            let Some(ino) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u64>().ok())
            else {
                continue;
            };
            if referenced.contains(&ino) {
                continue;
            }
            let path = entry.path();
            let res = if path.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            if let Err(e) = res {
                warn!("attic: cannot delete {}: {e}", path.display());
            }
            self.forget_file(ino);
            self.dirs.remove(&ino);
        }
    }

    pub fn status(&self) -> String {
        let bytes: u64 = self.files.values().map(FileLog::unsynced_bytes).sum();
        let dirops: usize = self.dirs.values().map(|d| d.ops.len()).sum();
        format!(
            "ok files={} bytes={} held={} dirs={} dirops={} syncs={} frozen={}",
            self.files.len(),
            bytes,
            self.held_bytes,
            self.dirs.len(),
            dirops,
            self.syncs,
            self.frozen
        )
    }

    pub fn thaw(&mut self) -> String {
        self.frozen = false;
        "ok thawed".to_string()
    }

    /// Simulates the power cut: rewrites the backing dir to a state the disk could hold, makes
    /// it the new durable image, and freezes the file system until `thaw`.
    pub fn cut(&mut self, mode: CutMode, seed: u64, tear: bool) -> String {
        if self.frozen {
            return "err already cut; send thaw first".to_string();
        }
        self.frozen = true;
        let mut rng = Rng::new(seed);
        let mut report = CutReport::default();

        // Files first, while every remembered path is still where the kernel last saw it.
        self.held_bytes = 0;
        let mut files: Vec<(u64, FileLog)> = self.files.drain().collect();
        files.sort_by_key(|(_, log)| log.seq);
        for (ino, log) in &files {
            let lens: Vec<Option<usize>> = log
                .ops
                .iter()
                .map(|op| match op {
                    FileOp::Write { data, .. } => Some(data.len()),
                    FileOp::SetLen(_) => None,
                })
                .collect();
            let fates = choose(mode, tear, &lens, &mut rng);
            report.count(&fates);
            if let Err(e) = self.rebuild_file(*ino, log, &fates) {
                warn!("cut: cannot rebuild inode {ino}: {e}");
                report.errors += 1;
            }
        }

        let mut dirs: Vec<(u64, DirLog)> = self.dirs.drain().collect();
        dirs.sort_by_key(|(_, log)| log.seq);
        let mut targets: Vec<(u64, Entries)> = Vec::new();
        for (ino, log) in &dirs {
            let fates = choose(mode, false, &vec![None; log.ops.len()], &mut rng);
            report.dir_kept += fates.iter().filter(|f| **f == Fate::Keep).count();
            report.dir_dropped += fates.iter().filter(|f| **f == Fate::Drop).count();
            match self.entries(*ino) {
                Ok(current) => {
                    let durable = durable_entries(&current, &log.ops);
                    targets.push((*ino, journal::replay_entries(&durable, &log.ops, &fates)));
                }
                Err(e) => {
                    warn!("cut: cannot list directory inode {ino}: {e}");
                    report.errors += 1;
                }
            }
        }
        report.errors += self.materialize(&targets);
        self.collect_attic();
        report.line()
    }

    fn rebuild_file(&mut self, ino: u64, log: &FileLog, fates: &[Fate]) -> io::Result<()> {
        let rel = self.rel(ino)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.abs(&rel))?;
        if self.fuse_ino(file.metadata()?.ino()) != ino {
            return Err(io::Error::other("remembered path now names another inode"));
        }
        file.set_len(log.durable_size)?;
        for (off, bytes) in &log.saved {
            file.write_all_at(bytes, *off)?;
        }
        for (op, fate) in log.ops.iter().zip(fates) {
            match (op, fate) {
                (_, Fate::Drop) => {}
                (FileOp::Write { offset, data }, Fate::Keep) => file.write_all_at(data, *offset)?,
                (FileOp::Write { offset, data }, Fate::Torn(n)) => {
                    file.write_all_at(&data[..*n], *offset)?
                }
                (FileOp::SetLen(size), _) => file.set_len(*size)?,
            }
        }
        Ok(())
    }

    /// Makes each listed directory hold exactly its target entries. Returns an error count.
    fn materialize(&mut self, targets: &[(u64, Entries)]) -> usize {
        let mut errors = 0;
        // Park everything that must leave, so every inode that must appear somewhere is either
        // in the attic or in a directory that keeps it.
        for (dir, target) in targets {
            let current = match self.entries(*dir) {
                Ok(c) => c,
                Err(e) => {
                    warn!("cut: cannot list directory inode {dir}: {e}");
                    errors += 1;
                    continue;
                }
            };
            for (name, ino) in current {
                if target.get(&name) == Some(&ino) {
                    continue;
                }
                let res = self.rel(*dir).and_then(|d| self.park(&d.join(&name), ino));
                if let Err(e) = res {
                    warn!("cut: cannot park {name:?} of directory inode {dir}: {e}");
                    errors += 1;
                }
            }
        }
        for (dir, target) in targets {
            for (name, ino) in target {
                if let Err(e) = self.place(*dir, name, *ino) {
                    warn!("cut: cannot restore {name:?} in directory inode {dir}: {e}");
                    errors += 1;
                }
            }
        }
        errors
    }

    fn place(&mut self, dir: u64, name: &OsStr, ino: u64) -> io::Result<()> {
        let dest = self.rel(dir)?.join(name);
        if let Ok(md) = fs::symlink_metadata(self.abs(&dest)) {
            if self.fuse_ino(md.ino()) == ino {
                return Ok(());
            }
            return Err(io::Error::other("name taken by another inode"));
        }
        let src = self.rel(ino)?;
        let md = fs::symlink_metadata(self.abs(&src))?;
        if self.fuse_ino(md.ino()) != ino {
            return Err(io::Error::other("inode lost"));
        }
        if src.starts_with(ATTIC) {
            self.move_entry(&src, &dest)
        } else if md.is_dir() {
            // A directory cannot have two names; the one it has already wins.
            Err(io::Error::other("directory already placed elsewhere"))
        } else {
            // Two directories disagree about a cross-directory rename: both names survive,
            // as two links to one inode.
            fs::hard_link(self.abs(&src), self.abs(&dest))
        }
    }
}

#[derive(Default)]
struct CutReport {
    kept: usize,
    dropped: usize,
    torn: usize,
    dir_kept: usize,
    dir_dropped: usize,
    errors: usize,
}

impl CutReport {
    fn count(&mut self, fates: &[Fate]) {
        for fate in fates {
            match fate {
                Fate::Keep => self.kept += 1,
                Fate::Drop => self.dropped += 1,
                Fate::Torn(_) => self.torn += 1,
            }
        }
    }

    fn line(&self) -> String {
        format!(
            "ok cut kept={} dropped={} torn={} dirops_kept={} dirops_dropped={} errors={}",
            self.kept, self.dropped, self.torn, self.dir_kept, self.dir_dropped, self.errors
        )
    }
}

pub struct PowercutFs {
    core: Shared,
}

impl PowercutFs {
    pub fn new(core: Shared) -> Self {
        PowercutFs { core }
    }

    /// The core, or EIO while the power is "off".
    fn live(&self) -> Result<MutexGuard<'_, Core>, i32> {
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        if core.frozen {
            Err(libc::EIO)
        } else {
            Ok(core)
        }
    }
}

macro_rules! live {
    ($self:ident, $reply:ident) => {
        match $self.live() {
            Ok(core) => core,
            Err(e) => return $reply.error(e),
        }
    };
}

macro_rules! tri {
    ($e:expr, $reply:ident) => {
        match $e {
            Ok(v) => v,
            Err(e) => {
                debug!("{}: {e}", stringify!($e));
                return $reply.error(errno(&e));
            }
        }
    };
}

fn chown(path: &Path, uid: Option<u32>, gid: Option<u32>) -> io::Result<()> {
    let c = cstr(path)?;
    let uid = uid.unwrap_or(u32::MAX);
    let gid = gid.unwrap_or(u32::MAX);
    // SAFETY: `c` is a valid NUL-terminated path; -1 (u32::MAX) leaves an id unchanged.
    check(unsafe { libc::lchown(c.as_ptr(), uid, gid) })
}

fn system_time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

impl Filesystem for PowercutFs {
    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let mut core = live!(self, reply);
        let rel = tri!(core.child(parent, name), reply);
        let attr = tri!(core.stat_rel(rel), reply);
        reply.entry(&TTL, &attr, 0);
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, fh: Option<u64>, reply: ReplyAttr) {
        let core = live!(self, reply);
        // An open handle still works after its name was parked or deleted.
        let md = match fh.and_then(|fh| core.handles.get(&fh)) {
            Some(file) => file.metadata(),
            None => core
                .rel(ino)
                .and_then(|rel| fs::symlink_metadata(core.abs(&rel))),
        };
        let md = tri!(md, reply);
        reply.attr(&TTL, &core.attr(&md));
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        let mut core = live!(self, reply);
        let path = core.abs(&tri!(core.rel(ino), reply));
        if let Some(mode) = mode {
            tri!(
                fs::set_permissions(&path, fs::Permissions::from_mode(mode & 0o7777)),
                reply
            );
        }
        if uid.is_some() || gid.is_some() {
            tri!(chown(&path, uid, gid), reply);
        }
        if let Some(size) = size {
            let file = match fh.and_then(|fh| core.handles.get(&fh)) {
                Some(f) => tri!(f.try_clone(), reply),
                None => tri!(OpenOptions::new().read(true).write(true).open(&path), reply),
            };
            tri!(core.set_len_logged(ino, &file, size), reply);
        }
        if atime.is_some() || mtime.is_some() {
            let mut times = fs::FileTimes::new();
            if let Some(t) = atime {
                times = times.set_accessed(system_time(t));
            }
            if let Some(t) = mtime {
                times = times.set_modified(system_time(t));
            }
            let file = tri!(File::open(&path), reply);
            tri!(file.set_times(times), reply);
        }
        let md = tri!(fs::symlink_metadata(&path), reply);
        reply.attr(&TTL, &core.attr(&md));
    }

    fn readlink(&mut self, _req: &Request<'_>, ino: u64, reply: ReplyData) {
        let core = live!(self, reply);
        let rel = tri!(core.rel(ino), reply);
        let target = tri!(fs::read_link(core.abs(&rel)), reply);
        reply.data(target.as_os_str().as_bytes());
    }

    fn mknod(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            return reply.error(libc::EPERM);
        }
        let mut core = live!(self, reply);
        let rel = tri!(core.child(parent, name), reply);
        let path = core.abs(&rel);
        let mut opts = OpenOptions::new();
        opts.write(true)
            .create_new(true)
            .mode(mode & !umask & 0o7777);
        tri!(opts.open(&path), reply);
        tri!(chown(&path, Some(req.uid()), Some(req.gid())), reply);
        let attr = tri!(core.stat_rel(rel), reply);
        core.log_dir(
            parent,
            DirOp::Link {
                name: name.to_owned(),
                ino: attr.ino,
                replaced: None,
            },
        );
        reply.entry(&TTL, &attr, 0);
    }

    fn mkdir(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut core = live!(self, reply);
        let rel = tri!(core.child(parent, name), reply);
        let path = core.abs(&rel);
        tri!(fs::create_dir(&path), reply);
        tri!(
            fs::set_permissions(&path, fs::Permissions::from_mode(mode & !umask & 0o7777)),
            reply
        );
        tri!(chown(&path, Some(req.uid()), Some(req.gid())), reply);
        let attr = tri!(core.stat_rel(rel), reply);
        core.log_dir(
            parent,
            DirOp::Link {
                name: name.to_owned(),
                ino: attr.ino,
                replaced: None,
            },
        );
        reply.entry(&TTL, &attr, 0);
    }

    fn unlink(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        let mut core = live!(self, reply);
        let rel = tri!(core.child(parent, name), reply);
        let md = tri!(fs::symlink_metadata(core.abs(&rel)), reply);
        if md.is_dir() {
            return reply.error(libc::EISDIR);
        }
        let ino = core.fuse_ino(md.ino());
        tri!(core.park(&rel, ino), reply);
        core.log_dir(
            parent,
            DirOp::Unlink {
                name: name.to_owned(),
                ino,
            },
        );
        reply.ok();
    }

    fn rmdir(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        let mut core = live!(self, reply);
        let rel = tri!(core.child(parent, name), reply);
        let path = core.abs(&rel);
        let md = tri!(fs::symlink_metadata(&path), reply);
        if !md.is_dir() {
            return reply.error(libc::ENOTDIR);
        }
        if tri!(fs::read_dir(&path), reply).next().is_some() {
            return reply.error(libc::ENOTEMPTY);
        }
        let ino = core.fuse_ino(md.ino());
        tri!(core.park(&rel, ino), reply);
        core.log_dir(
            parent,
            DirOp::Unlink {
                name: name.to_owned(),
                ino,
            },
        );
        reply.ok();
    }

    fn symlink(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let mut core = live!(self, reply);
        let rel = tri!(core.child(parent, link_name), reply);
        tri!(std::os::unix::fs::symlink(target, core.abs(&rel)), reply);
        let attr = tri!(core.stat_rel(rel), reply);
        let op = DirOp::Link {
            name: link_name.to_owned(),
            ino: attr.ino,
            replaced: None,
        };
        core.log_dir(parent, op);
        reply.entry(&TTL, &attr, 0);
    }

    fn rename(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
        reply: ReplyEmpty,
    ) {
        if flags != 0 {
            // RENAME_NOREPLACE / RENAME_EXCHANGE are not modelled.
            return reply.error(libc::EINVAL);
        }
        let mut core = live!(self, reply);
        let from = tri!(core.child(parent, name), reply);
        let to = tri!(core.child(newparent, newname), reply);
        let src = tri!(fs::symlink_metadata(core.abs(&from)), reply);
        let ino = core.fuse_ino(src.ino());
        let mut replaced = None;
        if let Ok(dst) = fs::symlink_metadata(core.abs(&to)) {
            let old = core.fuse_ino(dst.ino());
            if old == ino {
                return reply.ok();
            }
            match (src.is_dir(), dst.is_dir()) {
                (true, false) => return reply.error(libc::ENOTDIR),
                (false, true) => return reply.error(libc::EISDIR),
                (true, true) => {
                    if tri!(fs::read_dir(core.abs(&to)), reply).next().is_some() {
                        return reply.error(libc::ENOTEMPTY);
                    }
                }
                (false, false) => {}
            }
            if src.is_dir() && to.starts_with(&from) {
                return reply.error(libc::EINVAL);
            }
            tri!(core.park(&to, old), reply);
            replaced = Some(old);
        }
        tri!(core.move_entry(&from, &to), reply);
        if parent == newparent {
            let op = DirOp::Rename {
                from: name.to_owned(),
                to: newname.to_owned(),
                ino,
                replaced,
            };
            core.log_dir(parent, op);
        } else {
            core.log_dir(
                parent,
                DirOp::Unlink {
                    name: name.to_owned(),
                    ino,
                },
            );
            core.log_dir(
                newparent,
                DirOp::Link {
                    name: newname.to_owned(),
                    ino,
                    replaced,
                },
            );
        }
        reply.ok();
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        let mut core = live!(self, reply);
        let rel = tri!(core.rel(ino), reply);
        // Always read-write: saving pre-images needs to read, and the kernel already enforces
        // the caller's access mode. O_APPEND is resolved by the kernel into offsets.
        let file = tri!(
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(core.abs(&rel)),
            reply
        );
        let fh = core.next_fh;
        core.next_fh += 1;
        core.handles.insert(fh, file);
        reply.opened(fh, 0);
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        let core = live!(self, reply);
        let Some(file) = core.handles.get(&fh) else {
            return reply.error(libc::EBADF);
        };
        let mut buf = vec![0; size as usize];
        let mut filled = 0;
        while filled < buf.len() {
            match file.read_at(&mut buf[filled..], offset as u64 + filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return reply.error(errno(&e)),
            }
        }
        reply.data(&buf[..filled]);
    }

    fn write(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        let mut core = live!(self, reply);
        let Some(file) = core.handles.get(&fh) else {
            return reply.error(libc::EBADF);
        };
        let file = tri!(file.try_clone(), reply);
        tri!(core.write_logged(ino, &file, offset as u64, data), reply);
        reply.written(data.len() as u32);
    }

    fn flush(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _lock: u64, reply: ReplyEmpty) {
        // close() is not a sync point: nothing to do, but a cut still shows as EIO.
        let _core = live!(self, reply);
        reply.ok();
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // Even while frozen: the caller's descriptor is gone either way.
        self.core
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .handles
            .remove(&fh);
        reply.ok();
    }

    fn fsync(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let mut core = live!(self, reply);
        // fdatasync counts as fsync: it must persist the size whenever the size changed, and
        // we do not model timestamps. The backing dir itself is not synced: it is a simulation.
        core.forget_file(ino);
        core.syncs += 1;
        reply.ok();
    }

    fn opendir(&mut self, _req: &Request<'_>, _ino: u64, _flags: i32, reply: ReplyOpen) {
        let _core = live!(self, reply);
        reply.opened(0, 0);
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        let core = live!(self, reply);
        let entries = tri!(core.entries(ino), reply);
        let dir_abs = core.abs(&tri!(core.rel(ino), reply));
        let mut list: Vec<(u64, FileType, OsString)> = vec![
            (ino, FileType::Directory, ".".into()),
            (ino, FileType::Directory, "..".into()),
        ];
        for (name, child) in entries {
            let kind = match fs::symlink_metadata(dir_abs.join(&name)) {
                Ok(md) if md.is_dir() => FileType::Directory,
                Ok(md) if md.file_type().is_symlink() => FileType::Symlink,
                _ => FileType::RegularFile,
            };
            list.push((child, kind, name));
        }
        for (i, (child, kind, name)) in list.iter().enumerate().skip(offset as usize) {
            if reply.add(*child, (i + 1) as i64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, _ds: bool, reply: ReplyEmpty) {
        let mut core = live!(self, reply);
        core.dirs.remove(&ino);
        core.syncs += 1;
        core.collect_attic();
        reply.ok();
    }

    fn statfs(&mut self, _req: &Request<'_>, _ino: u64, reply: ReplyStatfs) {
        let core = live!(self, reply);
        let path = tri!(cstr(&core.backing), reply);
        // SAFETY: statvfs is plain old data; zeroed is a valid value to be overwritten.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: valid path and a valid out-pointer.
        tri!(
            check(unsafe { libc::statvfs(path.as_ptr(), &mut st) }),
            reply
        );
        reply.statfs(
            st.f_blocks,
            st.f_bfree,
            st.f_bavail,
            st.f_files,
            st.f_ffree,
            st.f_bsize as u32,
            st.f_namemax as u32,
            st.f_frsize as u32,
        );
    }

    fn access(&mut self, _req: &Request<'_>, ino: u64, _mask: i32, reply: ReplyEmpty) {
        // default_permissions makes the kernel check modes; we only confirm existence.
        let core = live!(self, reply);
        let rel = tri!(core.rel(ino), reply);
        tri!(fs::symlink_metadata(core.abs(&rel)), reply);
        reply.ok();
    }

    fn create(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut core = live!(self, reply);
        let rel = tri!(core.child(parent, name), reply);
        let path = core.abs(&rel);
        let existed = fs::symlink_metadata(&path).is_ok();
        if existed && flags & libc::O_EXCL != 0 {
            return reply.error(libc::EEXIST);
        }
        let mut opts = OpenOptions::new();
        opts.read(true)
            .write(true)
            .create(true)
            .mode(mode & !umask & 0o7777);
        let file = tri!(opts.open(&path), reply);
        if !existed {
            tri!(chown(&path, Some(req.uid()), Some(req.gid())), reply);
        }
        let attr = tri!(core.stat_rel(rel), reply);
        if !existed {
            core.log_dir(
                parent,
                DirOp::Link {
                    name: name.to_owned(),
                    ino: attr.ino,
                    replaced: None,
                },
            );
        }
        if existed && flags & libc::O_TRUNC != 0 {
            tri!(core.set_len_logged(attr.ino, &file, 0), reply);
        }
        let fh = core.next_fh;
        core.next_fh += 1;
        core.handles.insert(fh, file);
        reply.created(&TTL, &attr, 0, fh, 0);
    }

    fn fallocate(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        fh: u64,
        offset: i64,
        length: i64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mut core = live!(self, reply);
        let Some(file) = core.handles.get(&fh) else {
            return reply.error(libc::EBADF);
        };
        let file = tri!(file.try_clone(), reply);
        match mode {
            0 => {
                let end = (offset + length) as u64;
                let size = tri!(file.metadata(), reply).len();
                if end > size {
                    // Only the size is visible: model it as an extending truncate.
                    tri!(core.set_len_logged(ino, &file, end), reply);
                }
                reply.ok();
            }
            // Reserves blocks only; contents and size are unchanged, nothing to forget.
            libc::FALLOC_FL_KEEP_SIZE => {
                // SAFETY: valid fd for the duration of the call.
                let rc = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset, length) };
                tri!(check(rc), reply);
                reply.ok();
            }
            _ => reply.error(libc::EOPNOTSUPP),
        }
    }
}

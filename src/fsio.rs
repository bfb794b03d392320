//! The durability seam: every fsync, fdatasync and directory fsync in Cairn goes through a
//! [`Durability`] value, so that a test can count, fail or drop them (and issue 5's
//! failpoints can hook them) without touching the code that calls them.

use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What a sync call is for; lets a test fail or drop one kind only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncKind {
    /// `fdatasync` of a log segment after appends.
    LogData,
    /// `fsync` of a directory after an entry was created, renamed or removed.
    Dir,
    /// `fsync` of a store file after `sled::Db::flush()`.
    Store,
    /// `fsync` of any other file (savepoints, repaired segments).
    File,
}

/// Where durability calls go. The production value is [`RealSync`].
pub trait SyncSeam: Send + Sync + std::fmt::Debug {
    /// Make the file's data (and, unless `data_only`, its metadata) durable.
    fn sync_file(
        &self,
        kind: SyncKind,
        file: &File,
        path: &Path,
        data_only: bool,
    ) -> io::Result<()>;
    /// Make the directory's entries durable.
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
}

pub(crate) type Durability = Arc<dyn SyncSeam>;

/// The real thing: `fdatasync`/`fsync` on the file, `fsync` on an opened directory.
#[derive(Debug, Default)]
pub(crate) struct RealSync;

impl SyncSeam for RealSync {
    fn sync_file(
        &self,
        _kind: SyncKind,
        file: &File,
        _path: &Path,
        data_only: bool,
    ) -> io::Result<()> {
        if data_only {
            file.sync_data()
        } else {
            file.sync_all()
        }
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }
}

pub fn real() -> Durability {
    Arc::new(RealSync)
}

/// A seam for tests: performs real syncs (unless told to drop them), counts them, and can
/// be told to fail the next ones with an I/O error.
#[derive(Debug, Default)]
pub struct TestSync {
    pub file_syncs: AtomicU64,
    pub dir_syncs: AtomicU64,
    pub fail: AtomicBool,
    pub drop_syncs: AtomicBool,
}

impl TestSync {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
    pub fn file_syncs(&self) -> u64 {
        self.file_syncs.load(Ordering::SeqCst)
    }
    pub fn dir_syncs(&self) -> u64 {
        self.dir_syncs.load(Ordering::SeqCst)
    }
    fn check(&self) -> io::Result<()> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected fsync failure"));
        }
        Ok(())
    }
}

impl SyncSeam for TestSync {
    fn sync_file(
        &self,
        kind: SyncKind,
        file: &File,
        path: &Path,
        data_only: bool,
    ) -> io::Result<()> {
        self.check()?;
        self.file_syncs.fetch_add(1, Ordering::SeqCst);
        if self.drop_syncs.load(Ordering::SeqCst) {
            return Ok(());
        }
        RealSync.sync_file(kind, file, path, data_only)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.check()?;
        self.dir_syncs.fetch_add(1, Ordering::SeqCst);
        if self.drop_syncs.load(Ordering::SeqCst) {
            return Ok(());
        }
        RealSync.sync_dir(path)
    }
}

/// `create_dir_all`, made durable: every directory it creates has its entry fsynced in its
/// parent, up to the first ancestor that already existed. (A new directory whose entry is
/// not synced can vanish in a power cut with everything below it.)
pub(crate) fn create_dir_all_durable(path: &Path, sync: &Durability) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut cur = path;
    while !cur.exists() {
        missing.push(cur.to_path_buf());
        match cur.parent() {
            Some(p) if !p.as_os_str().is_empty() => cur = p,
            _ => break,
        }
    }
    for dir in missing.iter().rev() {
        match std::fs::create_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => std::path::PathBuf::from("."),
        };
        sync.sync_dir(&parent)?;
    }
    Ok(())
}

/// Create `path` as a new file of this user only (mode 0600), never through whatever is
/// already there: `O_CREAT | O_EXCL` fails on any existing name, a symbolic link included,
/// and `O_NOFOLLOW` says so twice. A temporary file opened with `File::create` follows a
/// link planted under its name and truncates the link's target (issue 27).
pub(crate) fn create_new_private(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Replace `path` with `bytes` so that a crash at any instant leaves either the old file
/// or the new one, whole: write a sibling `.tmp`, fsync it, rename it over `path`, fsync
/// the directory (without the last sync the rename itself may not survive a power cut).
/// A `.tmp` already there (a crash's, or a link planted under its name) is removed first,
/// the name itself and never what it points to, and the new one made with
/// [`create_new_private`].
pub(crate) fn replace_file_durable(path: &Path, bytes: &[u8], sync: &Durability) -> io::Result<()> {
    use std::io::Write;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut file = create_new_private(&tmp)?;
    file.write_all(bytes)?;
    sync.sync_file(SyncKind::File, &file, &tmp, false)?;
    drop(file);
    std::fs::rename(&tmp, path)?;
    sync.sync_dir(&dir)
}

/// Remove `path` (if it exists) and make the removal durable.
pub(crate) fn remove_file_durable(path: &Path, sync: &Durability) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => sync.sync_dir(p),
        _ => sync.sync_dir(Path::new(".")),
    }
}

/// Create the data directory if it is missing: mode 0700 (it holds every input and result;
/// the umask may only narrow that), its parents as [`create_dir_all_durable`] does, and its
/// entry fsynced. An existing directory is left as it is: under systemd the unit's
/// `StateDirectory=` made it with the mode the unit asks for.
pub(crate) fn create_data_dir(path: &Path, sync: &Durability) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if path.exists() {
        return Ok(());
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    create_dir_all_durable(&parent, sync)?;
    match std::fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(e),
    }
    sync.sync_dir(&parent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_data_dir_is_0700_and_an_existing_one_keeps_its_mode() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let sync = TestSync::new();
        let durable: Durability = sync.clone();
        let dir = tmp.path().join("a/b/data");
        create_data_dir(&dir, &durable).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(
            sync.dir_syncs(),
            3,
            "a, b and data each synced in its parent"
        );
        let shared = tmp.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
        create_data_dir(&shared, &durable).unwrap();
        assert_eq!(mode(&shared), 0o755);
    }

    /// Issue 27: the temporary file followed a symbolic link planted under its name, so
    /// whoever could plant one could have any file this user may write truncated.
    #[test]
    fn replace_file_durable_never_writes_through_a_link_planted_at_its_temporary_name() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let victim = root.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let path = root.path().join("generations");
        std::os::unix::fs::symlink(&victim, root.path().join("generations.tmp")).unwrap();
        replace_file_durable(&path, b"new", &real()).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // And the helper itself refuses any existing name, a link included.
        std::os::unix::fs::symlink(&victim, root.path().join("link")).unwrap();
        assert!(create_new_private(&root.path().join("link")).is_err());
        assert!(create_new_private(&victim).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    #[test]
    fn create_dir_all_durable_syncs_the_parent_of_every_created_level() {
        let root = tempfile::tempdir().unwrap();
        let seam = TestSync::new();
        let durable: Durability = seam.clone();
        let deep = root.path().join("a/b/c");
        create_dir_all_durable(&deep, &durable).unwrap();
        assert!(deep.is_dir());
        assert_eq!(seam.dir_syncs(), 3, "root, a and b each got a new entry");
        create_dir_all_durable(&deep, &durable).unwrap();
        assert_eq!(seam.dir_syncs(), 3, "nothing new, nothing synced");
    }

    #[test]
    fn replace_file_durable_syncs_the_file_then_the_directory_and_leaves_no_tmp() {
        let root = tempfile::tempdir().unwrap();
        let seam = TestSync::new();
        let durable: Durability = seam.clone();
        let path = root.path().join("f");
        replace_file_durable(&path, b"one", &durable).unwrap();
        replace_file_durable(&path, b"two", &durable).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert!(!root.path().join("f.tmp").exists());
        assert_eq!((seam.file_syncs(), seam.dir_syncs()), (2, 2));
        seam.fail.store(true, Ordering::SeqCst);
        assert!(replace_file_durable(&path, b"three", &durable).is_err());
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"two",
            "a failed sync never renames"
        );
        seam.fail.store(false, Ordering::SeqCst);
        remove_file_durable(&path, &durable).unwrap();
        remove_file_durable(&path, &durable).unwrap();
        assert!(!path.exists());
        assert_eq!(seam.dir_syncs(), 3, "a missing file needs no sync");
    }
}

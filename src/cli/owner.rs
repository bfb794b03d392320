//! Who a command runs as, and whether the data directory is safe to use (issue 27).
//!
//! **Root on someone else's data directory runs as that owner.** An operator's `sudo cairn
//! savepoint create` (or `verify --repair`, `inspect`, `validate`: sled writes on every open)
//! used to leave root-owned files in `/var/lib/cairn`, after which the service, running as
//! `cairn`, could not start. Of the three ways out (refuse, chown what was created, run as the
//! owner), running as the owner is the one that is right by construction: every file the
//! command makes, sled's own included, is the owner's, with nothing to chown afterwards and
//! nothing forgotten, and the command can do no more than the service could. So a command
//! run as root on a data directory owned by another user switches to that user (its groups,
//! then its group, then its user id) before it touches anything, and says so.
//!
//! **The data directory is checked before it is used.** It must belong to the user the
//! command runs as, and be writable by nobody else: another user who can write it can
//! replace the log, the store or a savepoint under the agent. Each entry directly inside it
//! must belong to that user too (but `lost+found`, when the directory is a file system of its
//! own): a root-owned `store/` left by an earlier command is reported with the `chown` that
//! repairs it, instead of a permission error at the first write. A missing directory is
//! fine: Cairn creates it with mode 0700.

use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use super::failure::Failure;
use crate::config::Config;
use crate::text::Shown;

/// The effective user id of this process.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// A user's name and primary group from the password database, if it has an entry.
fn passwd_entry(uid: u32) -> Option<(String, u32)> {
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: an all-zero `passwd` is a valid value of a plain C struct of pointers and ints.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: getpwuid_r writes only into `pwd` and `buf` (whose length it is given), which
    // outlive the call, and sets `found` to `&pwd` or null.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut found) };
    if rc != 0 || found.is_null() || pwd.pw_name.is_null() {
        return None;
    }
    // SAFETY: on success `pw_name` points to a NUL-terminated string inside `buf`.
    let name = unsafe { CStr::from_ptr(pwd.pw_name) }
        .to_string_lossy()
        .into_owned();
    Some((name, pwd.pw_gid))
}

/// `user NAME (uid N)`, or `uid N` for an id without a name.
fn user(uid: u32) -> String {
    match passwd_entry(uid) {
        Some((name, _)) => format!("user {} (uid {uid})", Shown(&name)),
        None => format!("uid {uid}"),
    }
}

/// The user this command runs as, for messages.
pub(crate) fn current_user() -> String {
    user(euid())
}

/// How to run a command as `uid`, for messages.
fn run_as_hint(uid: u32) -> String {
    match passwd_entry(uid) {
        Some((name, _)) => format!("`sudo -u {} cairn ...`", Shown(&name)),
        None => format!("`sudo -u '#{uid}' cairn ...`"),
    }
}

/// Switch this process to `uid`: its supplementary groups (none without a password entry),
/// its primary group (`fallback_gid` without one), then the user id; and check that root
/// cannot be taken back.
fn switch_to(uid: u32, fallback_gid: u32) -> io::Result<()> {
    let entry = passwd_entry(uid);
    let gid = entry.as_ref().map_or(fallback_gid, |(_, g)| *g);
    // SAFETY: plain system calls on this process's credentials; the name is a valid C
    // string that outlives the call. They apply to every thread (glibc), and the command
    // has started none yet.
    unsafe {
        let groups = match &entry {
            Some((name, _)) => {
                let c = CString::new(name.as_str()).map_err(io::Error::other)?;
                libc::initgroups(c.as_ptr(), gid)
            }
            None => libc::setgroups(0, std::ptr::null()),
        };
        if groups != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0 {
            return Err(io::Error::last_os_error());
        }
        if libc::setuid(0) == 0 || libc::geteuid() != uid || libc::getegid() != gid {
            return Err(io::Error::other("the switch did not take"));
        }
    }
    Ok(())
}

/// Run as the owner of the data directory when root runs a command on one that belongs to
/// another user (see the module docs). Nothing to do for other users, or without a data
/// directory yet.
pub(crate) fn become_data_dir_owner(cfg: &Config) -> Result<(), Failure> {
    if euid() != 0 {
        return Ok(());
    }
    let dir = &cfg.storage.data_dir;
    let shown = Shown(&dir.display().to_string()).to_string();
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Failure::runtime(format!("data_dir {shown}: {e}"))),
    };
    if meta.uid() == 0 {
        return Ok(());
    }
    switch_to(meta.uid(), meta.gid()).map_err(|e| {
        Failure::runtime(format!(
            "data_dir {shown} belongs to {}, and this command runs as root: it cannot switch \
             to that user ({e}); run it as that user, {}",
            user(meta.uid()),
            run_as_hint(meta.uid())
        ))
    })?;
    crate::event!(info, "running_as_owner";
        "running as {}, the owner of {shown}, so that what this command writes there stays \
         theirs",
        current_user()
    );
    Ok(())
}

/// What is wrong with the data directory for the user this command runs as, if anything
/// (see the module docs). A missing directory is not a problem.
pub(crate) fn data_dir_problem(dir: &Path) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(dir).ok()?;
    let me = euid();
    let shown = Shown(&dir.display().to_string()).to_string();
    if !meta.is_dir() {
        return Some(format!("data_dir {shown} is not a directory"));
    }
    if meta.uid() != me {
        return Some(format!(
            "data_dir {shown} belongs to {}, not to {}, which this command runs as: run it \
             as that user, {}",
            user(meta.uid()),
            current_user(),
            run_as_hint(meta.uid())
        ));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        let who = if mode & 0o002 != 0 {
            "everyone"
        } else {
            "its group"
        };
        return Some(format!(
            "data_dir {shown} is writable by {who} (mode {mode:04o}): another user could \
             replace the log, the store or a savepoint under the agent; `chmod 700 {shown}` \
             (Cairn creates it so)"
        ));
    }
    let entries = std::fs::read_dir(dir).ok()?;
    for entry in entries.flatten() {
        let Ok(m) = entry.metadata() else {
            continue;
        };
        // A data directory that is a file system of its own has mkfs's root-owned one.
        if entry.file_name() == "lost+found" {
            continue;
        }
        if m.uid() != me {
            // `NAME:` is the user and its login group.
            let owner = passwd_entry(me).map_or(me.to_string(), |(n, _)| format!("{}:", Shown(&n)));
            return Some(format!(
                "{} belongs to {}, not to {}, the owner of data_dir: a command run as another \
                 user left it, and the agent cannot write it; give it back with `chown -R \
                 {owner} {shown}`",
                Shown(&entry.path().display().to_string()),
                user(m.uid()),
                current_user(),
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_data_dir_writable_by_others_or_holding_a_stranger_is_a_problem() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("data");
        assert_eq!(data_dir_problem(&dir), None, "missing: created 0700 later");
        std::fs::create_dir(&dir).unwrap();
        let chmod =
            |m: u32| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(m)).unwrap();
        for (mode, says) in [
            (0o700, None),
            (0o750, None),
            (0o770, Some("writable by its group (mode 0770)")),
            (0o757, Some("writable by everyone (mode 0757)")),
            (0o1777, Some("writable by everyone (mode 1777)")),
        ] {
            chmod(mode);
            let problem = data_dir_problem(&dir);
            match says {
                None => assert_eq!(problem, None, "{mode:o}"),
                Some(s) => assert!(
                    problem.as_deref().is_some_and(|p| p.contains(s)),
                    "{problem:?}"
                ),
            }
        }
        chmod(0o700);
        std::fs::write(dir.join("generations"), "").unwrap();
        assert_eq!(data_dir_problem(&dir), None);
        let file = tmp.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(
            data_dir_problem(&file)
                .unwrap()
                .contains("is not a directory")
        );
    }
}

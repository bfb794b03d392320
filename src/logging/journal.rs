//! The journal's native protocol (systemd.io `JOURNAL_NATIVE_PROTOCOL`), client side: one
//! journal entry per datagram on the `AF_UNIX`/`SOCK_DGRAM` socket journald listens on.
//!
//! An entry is a list of fields. A field whose value has no newline is `NAME=value\n`; any
//! other is `NAME\n`, the value's length as a 64-bit little-endian integer, the value, `\n`.
//! Field names are uppercase letters, digits and `_`, not starting with `_` (those are the
//! fields journald adds itself and trusts, `_PID` and the like) and at most 64 bytes
//! (`systemd.journal-fields(7)`).
//!
//! A datagram has a size limit (the socket's send buffer, about 208 KiB by default): an
//! entry the kernel refuses with `EMSGSIZE` (or `ENOBUFS`) goes the way the protocol gives for
//! large entries, written into a `memfd`, sealed against any change, and sent as the one file
//! descriptor of an empty datagram (`SCM_RIGHTS`). journald reads the entry from it.
//!
//! Why our own ~150 lines and not a crate (`systemd-journal-logger`, `tracing-journald`):
//! those are whole loggers, where we need only the sending (our logger keeps env_logger's
//! filters and its stderr format for everywhere else), and they bring `rustix` or more,
//! where `libc` is already here for the free-space guard.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};

/// Where journald listens.
pub(crate) const SOCKET: &str = "/run/systemd/journal/socket";

/// Longest field name the journal accepts.
const MAX_NAME: usize = 64;

/// A connection to journald's native socket.
#[derive(Debug)]
pub(crate) struct Journal {
    socket: UnixDatagram,
    path: PathBuf,
}

impl Journal {
    /// Connect to the socket at `path`. Fails when there is none, or nobody reads it.
    pub(crate) fn connect(path: &Path) -> io::Result<Journal> {
        let socket = UnixDatagram::unbound()?;
        socket.connect(path)?;
        Ok(Journal {
            socket,
            path: path.to_path_buf(),
        })
    }

    /// Send one entry. A journald that restarted since is reconnected to once.
    pub(crate) fn send(&self, fields: &[(&str, &[u8])]) -> io::Result<()> {
        let entry = encode(fields)?;
        match self.send_entry(&entry) {
            Err(e) if reconnectable(&e) => {
                self.socket.connect(&self.path)?;
                self.send_entry(&entry)
            }
            other => other,
        }
    }

    fn send_entry(&self, entry: &[u8]) -> io::Result<()> {
        match self.socket.send(entry) {
            Ok(_) => Ok(()),
            Err(e) if too_large(&e) => self.send_memfd(entry),
            Err(e) => Err(e),
        }
    }

    /// The protocol's way for an entry over the datagram limit: a sealed memfd holding it,
    /// passed as the only file descriptor of an empty datagram.
    fn send_memfd(&self, entry: &[u8]) -> io::Result<()> {
        let memfd = sealed_memfd(entry)?;
        send_fd(&self.socket, memfd.as_raw_fd())
    }
}

/// Whether the kernel refused the datagram for its size.
fn too_large(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMSGSIZE) | Some(libc::ENOBUFS))
}

/// Whether journald went away under the connected socket (it restarts, the socket is new).
fn reconnectable(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ECONNREFUSED) | Some(libc::ENOTCONN) | Some(libc::ENOENT)
    )
}

/// Whether `name` may name a field we send.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with('_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

/// The entry's bytes; an invalid field name is an error (it is a bug on our side: journald
/// would drop the whole entry).
pub(crate) fn encode(fields: &[(&str, &[u8])]) -> io::Result<Vec<u8>> {
    let size = fields.iter().map(|(n, v)| n.len() + v.len() + 10).sum();
    let mut out = Vec::with_capacity(size);
    for (name, value) in fields {
        if !valid_name(name) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("not a journal field name: {name:?}"),
            ));
        }
        out.extend_from_slice(name.as_bytes());
        if value.contains(&b'\n') {
            out.push(b'\n');
            out.extend_from_slice(&(value.len() as u64).to_le_bytes());
        } else {
            out.push(b'=');
        }
        out.extend_from_slice(value);
        out.push(b'\n');
    }
    Ok(out)
}

/// A memfd holding `data`, sealed so that nobody can change it once journald has it.
fn sealed_memfd(data: &[u8]) -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name and flags; the result is checked before use.
    let fd = unsafe {
        libc::memfd_create(
            c"cairn-journal-entry".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut file = std::fs::File::from(owned);
    file.write_all(data)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own, with an integer argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(OwnedFd::from(file))
}

/// An empty datagram carrying `fd` (`SCM_RIGHTS`) on the connected `socket`.
fn send_fd(socket: &UnixDatagram, fd: libc::c_int) -> io::Result<()> {
    const FD_BYTES: u32 = std::mem::size_of::<libc::c_int>() as u32;
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let space = unsafe { libc::CMSG_SPACE(FD_BYTES) } as usize;
    // u64 words keep the buffer aligned for `cmsghdr`.
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: an all-zero msghdr is valid (no name, no iovecs, no control) before we fill it.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `control`, which has room for one header and one descriptor
    // (CMSG_SPACE above); CMSG_FIRSTHDR is therefore non-null, and CMSG_DATA points inside
    // the buffer, with room for the descriptor written unaligned.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&msg);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(FD_BYTES) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<libc::c_int>(), fd);
    }
    // SAFETY: `msg` and the buffer it points to live across the call; the socket is ours.
    let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_value_is_name_equals_value_and_one_with_a_newline_is_length_prefixed() {
        let entry = encode(&[("MESSAGE", b"two\nlines"), ("PRIORITY", b"4")]).unwrap();
        let mut want = b"MESSAGE\n".to_vec();
        want.extend_from_slice(&9u64.to_le_bytes());
        want.extend_from_slice(b"two\nlines\nPRIORITY=4\n");
        assert_eq!(entry, want);
    }

    #[test]
    fn field_names_are_what_journald_accepts() {
        for ok in ["MESSAGE", "CAIRN_EVENT", "A1", &"X".repeat(64)] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "_PID", "1A", "message", "CAIRN-EVENT", &"X".repeat(65)] {
            assert!(!valid_name(bad), "{bad}");
            assert!(encode(&[(bad, b"v")]).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_entry_over_the_datagram_limit_goes_through_a_sealed_memfd() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("socket");
        let server = UnixDatagram::bind(&path).unwrap();
        let journal = Journal::connect(&path).unwrap();
        // Small: the entry is the datagram.
        journal.send(&[("MESSAGE", b"hi")]).unwrap();
        let mut buf = vec![0u8; 64];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"MESSAGE=hi\n");
        // Large: the datagram is empty and carries a descriptor whose file is the entry.
        let big = vec![b'x'; 4 << 20];
        journal.send(&[("MESSAGE", &big)]).unwrap();
        let (n, fd) = recv_fd(&server);
        assert_eq!(n, 0, "a datagram with a descriptor has no payload");
        let fd = fd.expect("a descriptor");
        let mut file = std::fs::File::from(fd);
        // journald maps the file from its start; our write left the offset at its end.
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(0)).unwrap();
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut file, &mut got).unwrap();
        assert_eq!(got.len(), "MESSAGE=".len() + big.len() + 1);
        assert!(got.starts_with(b"MESSAGE=xxx"));
        // SAFETY: fcntl F_GET_SEALS on a descriptor we own.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        assert_eq!(
            seals,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL
        );
    }

    #[test]
    fn a_journal_that_restarted_is_reconnected_to() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("socket");
        let first = UnixDatagram::bind(&path).unwrap();
        let journal = Journal::connect(&path).unwrap();
        drop(first);
        std::fs::remove_file(&path).unwrap();
        let second = UnixDatagram::bind(&path).unwrap();
        journal.send(&[("MESSAGE", b"again")]).unwrap();
        let mut buf = vec![0u8; 64];
        let n = second.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"MESSAGE=again\n");
    }

    /// One datagram and the descriptor it carries, if any.
    fn recv_fd(socket: &UnixDatagram) -> (usize, Option<OwnedFd>) {
        let mut data = [0u8; 16];
        let mut iov = libc::iovec {
            iov_base: data.as_mut_ptr().cast(),
            iov_len: data.len(),
        };
        let mut control = [0u64; 8];
        // SAFETY: zeroed msghdr, then pointed at live buffers; recvmsg fills them.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        // SAFETY: as above; the header pointer is checked for null before it is read.
        unsafe {
            let n = libc::recvmsg(socket.as_raw_fd(), &mut msg, 0);
            assert!(n >= 0, "{}", io::Error::last_os_error());
            let header = libc::CMSG_FIRSTHDR(&msg);
            if header.is_null() || (*header).cmsg_type != libc::SCM_RIGHTS {
                return (n as usize, None);
            }
            let fd = std::ptr::read_unaligned(libc::CMSG_DATA(header).cast::<libc::c_int>());
            (n as usize, Some(OwnedFd::from_raw_fd(fd)))
        }
    }
}

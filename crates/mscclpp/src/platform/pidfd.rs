//! Process file descriptors (Linux `pidfd_open(2)`, `pidfd_getfd(2)`): watching a peer process
//! of this host for its exit, and taking a copy of one of its file descriptors.
#![allow(unsafe_code)]

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use nix::libc;

use crate::error::{Error, ErrorKind, Result};

/// A process of this host, pinned by a pidfd: its pid can no longer name another process.
pub(crate) struct PidFd {
    fd: OwnedFd,
    pid: u32,
}

impl std::fmt::Debug for PidFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PidFd(pid {})", self.pid)
    }
}

/// The start time of process `pid` (field 22 of `/proc/<pid>/stat`, clock ticks since boot):
/// with the pid, it names one process even across pid reuse.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl PidFd {
    /// Opens a pidfd for `pid`, checking that it is still the process that started at
    /// `start` (ticks since boot, as [`start_time`] reads it) when `start` is given.
    ///
    /// # Errors
    /// `Remote` when the process is gone (or the pid now names another process); `System` when
    /// the kernel has no `pidfd_open` (before Linux 5.3) or refuses it.
    pub(crate) fn open(pid: u32, start: Option<u64>) -> Result<PidFd> {
        let gone = || Error::remote(format!("process {pid} has exited"));
        let raw_pid = libc::pid_t::try_from(pid).map_err(|_| Error::invalid_usage(format!("bad pid {pid}")))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; no memory
        // is passed.
        let r = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ESRCH) {
                return Err(gone());
            }
            return Err(Error::io(format!("pidfd_open({pid})"), e));
        }
        // SAFETY: the kernel returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(r as i32) };
        let p = PidFd { fd, pid };
        // The pidfd pins the pid now: if the start time still matches, it is the process meant.
        if let Some(want) = start
            && start_time(pid) != Some(want)
        {
            return Err(gone());
        }
        Ok(p)
    }

    /// Waits up to `timeout` for the process to exit; `Ok(true)` once it has.
    pub(crate) fn wait_exit(&self, timeout: Duration) -> Result<bool> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX)) {
            Ok(0) => Ok(false),
            Ok(_) => Ok(true),
            Err(nix::errno::Errno::EINTR) => Ok(false),
            Err(e) => Err(Error::io(format!("polling the pidfd of process {}", self.pid), e.into())),
        }
    }

    /// A copy, in this process, of the process's file descriptor `target` (`pidfd_getfd(2)`).
    ///
    /// # Errors
    /// `System` naming why: `EPERM` when this process may not ptrace the owner (another user,
    /// `kernel.yama.ptrace_scope` above 0 without `CAP_SYS_PTRACE`, or a seccomp filter), `EBADF`
    /// when the owner has no such descriptor (any more), `ENOSYS` before Linux 5.6.
    pub(crate) fn get_fd(&self, target: i32) -> Result<OwnedFd> {
        // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in the target and flags, and
        // returns a new descriptor of ours or -1; no memory is passed.
        let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.fd.as_raw_fd(), target, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            let hint = match e.raw_os_error() {
                Some(libc::EPERM) => {
                    " (this process may not ptrace the owner: run both as one user with \
                     kernel.yama.ptrace_scope=0, or give CAP_SYS_PTRACE; a container's seccomp filter may \
                     also refuse pidfd_getfd)"
                }
                Some(libc::ENOSYS) => " (pidfd_getfd needs Linux 5.6 or later)",
                Some(libc::EBADF) => " (the owner no longer has that descriptor: was the memory deregistered?)",
                _ => "",
            };
            return Err(Error::new(
                ErrorKind::System,
                format!("pidfd_getfd(fd {target} of process {}) failed: {e}{hint}", self.pid),
            ));
        }
        // SAFETY: the kernel returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_a_child_exit() {
        // Long enough never to end on its own before the "still running" check, however loaded
        // the machine; killed below.
        let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let pid = child.id();
        let start = start_time(pid);
        assert!(start.is_some());
        let p = PidFd::open(pid, start).unwrap();
        assert_eq!(format!("{p:?}"), format!("PidFd(pid {pid})"));
        assert!(!p.wait_exit(Duration::from_millis(1)).unwrap(), "still running");
        child.kill().unwrap();
        assert!(p.wait_exit(Duration::from_secs(20)).unwrap(), "exited");
        child.wait().unwrap();
        // Reaped: the pid names nothing (or another process, which the start time tells apart).
        assert!(PidFd::open(pid, start).is_err());
    }

    #[test]
    fn a_wrong_start_time_is_another_process() {
        let me = std::process::id();
        let start = start_time(me).unwrap();
        PidFd::open(me, Some(start)).unwrap();
        let e = PidFd::open(me, Some(start + 1)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Remote, "{e}");
        assert!(e.to_string().contains("has exited"), "{e}");
    }

    #[test]
    fn takes_a_copy_of_a_descriptor() {
        let me = PidFd::open(std::process::id(), None).unwrap();
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        match me.get_fd(f.as_raw_fd()) {
            Ok(copy) => assert_ne!(copy.as_raw_fd(), f.as_raw_fd()),
            // Sandboxes may refuse it; the error must say why.
            Err(e) => assert!(e.to_string().contains("pidfd_getfd"), "{e}"),
        }
        let e = me.get_fd(987_654).unwrap_err();
        assert!(e.to_string().contains("987654"), "{e}");
    }
}

//! Host and process identity, as MSCCL++ uses them to tell same-process, same-host and remote
//! peers apart, and the OS randomness the job secrets come from.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// 64-bit FNV-1a: stable across runs and machines (unlike `std`'s hasher), so two processes
/// compute the same hash of the same text.
pub(crate) fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // separate parts so ("ab","c") and ("a","bc") differ
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn compute_host_hash() -> u64 {
    let env_id = crate::env::env().ok().and_then(|e| e.host_id.clone());
    if let Some(id) = env_id {
        return fnv1a64(&[b"hostid", id.as_bytes()]);
    }
    let host = nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    fnv1a64(&[host.as_bytes(), boot.trim().as_bytes()])
}

/// The rank [`TcpBootstrap`](crate::TcpBootstrap) gave this process (the last one initialized),
/// `usize::MAX` before; log lines and `MSCCLPP_LOG_FILE`'s `%r` show it.
static PROCESS_RANK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

/// This process's rank in its job, once a [`TcpBootstrap`](crate::TcpBootstrap) has been
/// initialized (the latest one when there are several); `None` before.
pub fn process_rank() -> Option<usize> {
    match PROCESS_RANK.load(std::sync::atomic::Ordering::Relaxed) {
        usize::MAX => None,
        r => Some(r),
    }
}

/// Records this process's rank for [`process_rank`] (called by the bootstrap).
pub(crate) fn set_process_rank(rank: usize) {
    PROCESS_RANK.store(rank, std::sync::atomic::Ordering::Relaxed);
}

/// A hash that is equal for two processes exactly when they run on the same host (the same
/// hostname and boot), or that `MSCCLPP_HOSTID` sets.
pub fn host_hash() -> u64 {
    static H: OnceLock<u64> = OnceLock::new();
    *H.get_or_init(compute_host_hash)
}

/// A hash that is equal for two handles exactly when they come from the same process: the pid
/// together with the pid namespace, so that containers sharing pids differ.
///
/// Cached per pid, so a process that forks gets its own value.
pub fn process_hash() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    // (pid << 32 | valid) and the hash; recomputed when the pid changes (after fork).
    static PID: AtomicU64 = AtomicU64::new(0);
    static HASH: AtomicU64 = AtomicU64::new(0);
    let pid = std::process::id();
    let tag = (u64::from(pid) << 32) | 1;
    if PID.load(Ordering::Acquire) == tag {
        return HASH.load(Ordering::Acquire);
    }
    let h = process_hash_of(pid);
    HASH.store(h, Ordering::Release);
    PID.store(tag, Ordering::Release);
    h
}

/// The [`process_hash`] that process `pid` of this process's pid namespace has: equal to a
/// peer's process hash exactly when the peer is that pid in this namespace.
pub(crate) fn process_hash_of(pid: u32) -> u64 {
    let ns = std::fs::read_link("/proc/self/ns/pid").map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    fnv1a64(&[pid.to_string().as_bytes(), ns.as_bytes()])
}

/// Fills `buf` from the operating system's random source.
pub(crate) fn os_random(buf: &mut [u8]) -> Result<()> {
    getrandom::fill(buf).map_err(|e| Error::new(crate::ErrorKind::System, format!("OS random source failed: {e}")))
}

/// A random `u64` from the OS.
pub(crate) fn random_u64() -> Result<u64> {
    let mut b = [0u8; 8];
    os_random(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_stable_and_distinct() {
        assert_eq!(host_hash(), host_hash());
        assert_eq!(process_hash(), process_hash());
        assert_ne!(fnv1a64(&[b"ab", b"c"]), fnv1a64(&[b"a", b"bc"]));
        let h = std::thread::spawn(host_hash).join().unwrap();
        assert_eq!(h, host_hash());
    }

    #[test]
    fn random_differs() {
        assert_ne!(random_u64().unwrap(), random_u64().unwrap());
    }
}

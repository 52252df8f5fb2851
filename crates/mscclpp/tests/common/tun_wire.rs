//! A wire with latency between two network namespaces, in userspace: for kernels without
//! `sch_netem` (the Firecracker VM kernel CI and this machine run has none).
//!
//! Each namespace gets a TUN device (`IFF_TUN | IFF_NO_PI`: IP packets, no link layer, no ARP)
//! with its own address on one subnet; one relay thread reads the packets each side sends, holds
//! each until its arrival time plus the delay (and, with a rate, after the packets before it have
//! been "serialised" at that rate), and writes it into the other side, in the order it was read.
//! A packet is never released early: the delay is a lower bound on every packet's trip, the rate
//! an upper bound on the bytes per second. Each direction's queue is bounded; what overflows is
//! dropped and counted (TCP retransmits it). Dropping the [`Wire`] stops the thread and closes
//! the devices' file descriptors, which deletes the devices (they are not persistent).
#![allow(dead_code)]

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::libc;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

/// How the wire behaves.
#[derive(Clone, Debug)]
pub struct WireConfig {
    /// Added to every packet's trip, each way.
    pub delay: Duration,
    /// Bits per second each way (`None` or 0: as fast as the relay goes).
    pub rate_bits: Option<u64>,
    /// Packets each direction may hold; more are dropped (and counted).
    pub queue_packets: usize,
    /// The devices' MTU.
    pub mtu: u32,
}

impl Default for WireConfig {
    fn default() -> Self {
        WireConfig { delay: Duration::from_millis(20), rate_bits: None, queue_packets: 1000, mtu: 1500 }
    }
}

/// One direction's counters.
#[derive(Default)]
struct Counters {
    packets: AtomicU64,
    bytes: AtomicU64,
    dropped: AtomicU64,
    write_errors: AtomicU64,
    max_packet: AtomicU64,
    max_queue: AtomicU64,
}

/// A snapshot of one direction's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirStats {
    /// Packets delivered to the other side.
    pub packets: u64,
    /// Their bytes (IP headers included).
    pub bytes: u64,
    /// Packets dropped because the queue was full.
    pub dropped: u64,
    /// Packets the other side's device refused.
    pub write_errors: u64,
    /// The largest packet read (at most the MTU).
    pub max_packet: u64,
    /// The most packets the queue held at once.
    pub max_queue: u64,
}

impl std::fmt::Display for DirStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} packets, {} B (largest {} B), {} dropped on a full queue (at most {} queued), {} write errors",
            self.packets, self.bytes, self.max_packet, self.dropped, self.max_queue, self.write_errors
        )
    }
}

/// A delayed link between TUN devices in two network namespaces; see the module docs.
pub struct Wire {
    stop: Arc<AtomicBool>,
    counters: Arc<[Counters; 2]>,
    failure: Arc<Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
}

/// Runs `f` on a thread that has entered network namespace `ns` (`setns` changes only the
/// calling thread): sockets and TUN devices it creates belong to `ns`, wherever they are used.
pub fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    let ns = ns.to_string();
    let name = ns.clone();
    std::thread::spawn(move || {
        let nsf = File::open(format!("/run/netns/{ns}")).map_err(|e| format!("/run/netns/{ns}: {e}"))?;
        nix::sched::setns(nsf.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("setns into {ns}: {e}"))?;
        f().map_err(|e| format!("in {ns}: {e}"))
    })
    .join()
    .map_err(|_| format!("the thread working in namespace {name} panicked"))?
}

/// Creates TUN device `ifname` (IPv4 only: IPv6 off, so only the test's packets cross) in
/// namespace `ns`, and returns its file (non-blocking).
fn open_tun_in(ns: &str, ifname: &str) -> Result<File, String> {
    if ifname.len() >= libc::IFNAMSIZ {
        return Err(format!("interface name {ifname:?} is too long"));
    }
    let ifname = ifname.to_string();
    in_netns(ns, move || {
        let tun = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|e| format!("/dev/net/tun: {e}"))?;
        // SAFETY: `ifreq` is plain data (a name and a union of integers and addresses), for
        // which all zero bytes are a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in req.ifr_name.iter_mut().zip(ifname.bytes()) {
            *d = s as libc::c_char;
        }
        req.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
        // SAFETY: TUNSETIFF reads and writes one `ifreq`, which `req` is and outlives the call;
        // the descriptor is open (owned by `tun`).
        let rc = unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req as *mut libc::ifreq) };
        if rc < 0 {
            return Err(format!("TUNSETIFF {ifname}: {}", std::io::Error::last_os_error()));
        }
        // /proc/sys/net is the opening thread's namespace's. No IPv6 in the kernel: nothing to do.
        let v6 = format!("/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6");
        if std::path::Path::new(&v6).exists() {
            std::fs::write(&v6, "1").map_err(|e| format!("{v6}: {e}"))?;
        }
        Ok(tun)
    })
}

/// Runs a command, or returns its stderr as the error.
fn run(args: &[&str]) -> Result<(), String> {
    let o = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim()))
    }
}

impl Wire {
    /// Creates device `ifname` in namespaces `ns[0]` and `ns[1]`, gives them `addrs` (with their
    /// prefix, e.g. `10.79.0.1/24`), brings them up and starts the relay.
    pub fn new(ns: [&str; 2], ifname: &str, addrs: [&str; 2], cfg: WireConfig) -> Result<Wire, String> {
        let fds = [open_tun_in(ns[0], ifname)?, open_tun_in(ns[1], ifname)?];
        for i in 0..2 {
            run(&["ip", "-n", ns[i], "link", "set", ifname, "mtu", &cfg.mtu.to_string()])?;
            run(&["ip", "-n", ns[i], "addr", "add", addrs[i], "dev", ifname])?;
            run(&["ip", "-n", ns[i], "link", "set", ifname, "up"])?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let counters: Arc<[Counters; 2]> = Arc::new(Default::default());
        let failure = Arc::new(Mutex::new(None));
        let thread = std::thread::Builder::new()
            .name("tun-wire".into())
            .spawn({
                let (stop, counters, failure) = (stop.clone(), counters.clone(), failure.clone());
                move || {
                    if let Err(e) = relay(fds, cfg, &stop, &counters) {
                        *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    }
                }
            })
            .map_err(|e| format!("starting the relay thread: {e}"))?;
        Ok(Wire { stop, counters, failure, thread: Some(thread) })
    }

    /// Why the relay stopped before it was dropped, if it did.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The counters of direction 0 -> 1 and 1 -> 0.
    pub fn stats(&self) -> [DirStats; 2] {
        self.counters.each_ref().map(|c| DirStats {
            packets: c.packets.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            write_errors: c.write_errors.load(Ordering::Relaxed),
            max_packet: c.max_packet.load(Ordering::Relaxed),
            max_queue: c.max_queue.load(Ordering::Relaxed),
        })
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            // The relay polls at least every 20 ms; its end closes both devices.
            let _ = t.join();
        }
    }
}

/// A packet waiting for its release time.
struct Held {
    at: Instant,
    data: Vec<u8>,
}

/// The relay: packets read from `fds[d]` go, delayed, to `fds[1 - d]`, until `stop` or an error
/// polling or reading a device.
fn relay(mut fds: [File; 2], cfg: WireConfig, stop: &AtomicBool, counters: &[Counters; 2]) -> Result<(), String> {
    let mut queues: [VecDeque<Held>; 2] = Default::default();
    // When each direction's "serialiser" is free again (with a rate).
    let mut busy_until = [Instant::now(); 2];
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        // Release what is due, in order.
        let now = Instant::now();
        for d in 0..2 {
            while queues[d].front().is_some_and(|h| h.at <= now) {
                let Some(h) = queues[d].pop_front() else { break };
                // One write is one packet: the device takes all of it or none.
                match fds[1 - d].write(&h.data) {
                    Ok(n) if n == h.data.len() => {
                        counters[d].packets.fetch_add(1, Ordering::Relaxed);
                        counters[d].bytes.fetch_add(h.data.len() as u64, Ordering::Relaxed);
                    }
                    _ => {
                        counters[d].write_errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        // Sleep until the next release or a packet to read (rounded up to whole milliseconds,
        // so a release is never early; at most 20 ms, to notice `stop`).
        let next = queues.iter().filter_map(|q| q.front().map(|h| h.at)).min();
        let wait = next.map_or(Duration::from_millis(20), |t| t.saturating_duration_since(Instant::now()));
        let ms = wait.as_micros().div_ceil(1000).min(20) as u16;
        {
            let mut pfds =
                [PollFd::new(fds[0].as_fd(), PollFlags::POLLIN), PollFd::new(fds[1].as_fd(), PollFlags::POLLIN)];
            match poll(&mut pfds, PollTimeout::from(ms)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(format!("poll on the TUN devices: {e}")),
            }
        }
        // Read what is there (a bounded batch per side, so neither starves the other).
        for d in 0..2 {
            for _ in 0..256 {
                let n = match fds[d].read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => break,
                    Err(e) => return Err(format!("reading TUN device {d}: {e}")),
                };
                let now = Instant::now();
                counters[d].max_packet.fetch_max(n as u64, Ordering::Relaxed);
                if queues[d].len() >= cfg.queue_packets {
                    counters[d].dropped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                // Serialised after the packets before it (a rate), then `delay` on the wire.
                let sent = match cfg.rate_bits {
                    Some(r) if r > 0 => {
                        let start = busy_until[d].max(now);
                        busy_until[d] =
                            start + Duration::from_nanos((n as u64 * 8).saturating_mul(1_000_000_000).div_ceil(r));
                        busy_until[d]
                    }
                    _ => now,
                };
                queues[d].push_back(Held { at: sent + cfg.delay, data: buf[..n].to_vec() });
                counters[d].max_queue.fetch_max(queues[d].len() as u64, Ordering::Relaxed);
            }
        }
    }
    Ok(())
}

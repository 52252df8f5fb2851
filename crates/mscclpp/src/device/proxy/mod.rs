//! The proxy: a host thread that executes the triggers kernels push into a [`Fifo`].
//!
//! A kernel pushes `put`/`signal`/`flush`/`atomicAdd` requests (see [`trigger`](super::trigger));
//! the proxy thread pops them in order and runs them on the connections of the semaphores they
//! name: `put` is [`Connection::write`] between two registered memories, `signal` is the
//! semaphore's `update_and_sync` (outbound token + 1), `atomicAdd` is
//! [`Connection::atomic_add`], and `flush` records the connection's current sequence number
//! ([`Connection::request_progress`]) and returns at once.
//!
//! # Signals are coalesced
//! A popped `signal` is owed, not sent at once: when the batch of triggers the proxy popped
//! together ends (or before a flush of that connection), each semaphore with owed signals gets
//! one token write of outbound + n. The promise of a signal (every put before it on the
//! connection has landed) holds, since the write follows every put of the batch; n signals cost
//! what one does, so signal-only traffic is no longer one connection operation per trigger
//! (MSCCL++'s proxy writes the token for every signal). A lone signal goes out at the next
//! step of the loop, nanoseconds later.
//!
//! Under load each batch still pays one token write per semaphore it signalled: with many
//! semaphores (a signal to each of 8 peers) those writes, a driver call each, bound the rate.
//! [`ProxyConfig::signal_coalesce`] lets owed signals wait across batches while the FIFO keeps
//! delivering (until it runs dry, [`COALESCE_MAX_TRIGGERS`] triggers have passed, or the time
//! given has): fewer token writes, more latency for a signal under load. On by default, 20 us:
//! on the H200, signals to 8 CUDA IPC peers from 132 / 4224 / 33792 GPU producers went from
//! 1.98 / 3.95 / 3.97 M/s to 15.5 / 7.8 / 7.8 M/s, puts and puts with signals unchanged, and a
//! lone signal (the FIFO runs dry after it) is paid as before.
//!
//! A producer that keeps the FIFO running dry every few triggers (one GPU thread pushing
//! signals) makes the proxy pay a token write (a driver call, about 0.7 us on a CUDA IPC
//! connection) for every few signals, keeping it busy nearly all the time.
//! [`ProxyConfig::signal_pay_interval`] paces those dry-step payments while signals keep coming:
//! a round of token writes waits until that long after the previous round. A signal after a
//! quiet spell longer than that is paid at the step it is popped; under a stream of signals one
//! waits at most that long more. Flushes pay their connection's owed signals at once, whatever
//! the pace. With 2 us on an H100, one GPU thread's signals to 4 or 8 CUDA IPC peers left the
//! proxy idle 79-94% of the time instead of 0-6%, at the same rate (0.7-0.9 M/s, the rate one
//! thread pushes): time free for other connections' work. It is off by default: signals that
//! several blocks push a little apart (blocks finishing a step at different times) would each
//! wait up to the interval after the first was paid, on a collective's critical path, and no
//! rate measured went up with it.
//!
//! # Signals under back pressure
//! An Ethernet receiver lands every write that came before a token into GPU memory before it
//! makes the token visible, one copy per contiguous run of bytes. With many producers writing
//! slots out of order, a token every few dozen writes made the receivers copy nearly every
//! write on its own (132 GPU producers' 4 KiB puts with signals: 684 copies per 1000 writes in
//! session 32, their rate unchanged while the host thread's rose sevenfold). While an Ethernet
//! connection is backlogged (at least half its write-queue bound in flight), a token paid now
//! waits behind that half queue anyway, so [`ProxyConfig::signal_backlog_hold`] lets its owed
//! signals wait for a quarter of the bound more puts (512 on an Ethernet connection's default
//! 2048), up to the time given: one landing round per quarter queue instead of per few dozen
//! writes. Off by default until it is measured on a GPU (built in session 33, whose GPU calls
//! found no machine); [`SUGGESTED_SIGNAL_BACKLOG_HOLD`] is the value to try. A dry FIFO or a flush pays them at once; the connection draining below half, at the
//! next payment round. CUDA IPC and IB connections never hold (their tokens cost no landing
//! round, and their in-flight counts are only refreshed when polled). MSCCL++'s proxy writes a
//! token for every signal.
//!
//! # Flushes
//! Each connection has one `flushDonePos` word in mapped pinned host memory (shared by every
//! channel on that connection, as in MSCCL++). A flush at FIFO position `p` is recorded as
//! `(p, s)` with `s` the connection's issued sequence number; between triggers the proxy polls
//! [`Connection::progress`] and, once `completed >= s`, stores `p + 1` into the word (release).
//! A kernel flushing at position `p` waits until the word exceeds `p`. So a flush never blocks
//! other channels' requests, and, because its target is a fixed sequence number rather than
//! "nothing outstanding", it completes under continuous traffic too.
//!
//! # Back pressure
//! With [`ProxyConfig::max_write_queue_size`], the proxy keeps at most that many operations in
//! flight per connection: before issuing more it polls that connection's progress (publishing
//! other connections' flushes meanwhile). Connections also bound their own queues.
//!
//! # Errors
//! The first error (a trigger that does not decode or names an unknown semaphore or memory, a
//! refused request, a transport failure, a peer gone) is kept. It is published to the device at
//! once: the FIFO's error word becomes [`PROXY_FAILED`] and every `flushDonePos` word
//! `u64::MAX`, so `wait_for`/`flush_for` in kernels return false and `flush` returns. The proxy
//! then keeps popping triggers without executing them, so producers never wait on a full FIFO.
//! [`ProxyService::status`] and [`ProxyService::stop`] return the error.
//!
//! # CUDA IPC atomics
//! An `atomicAdd` trigger on a CUDA IPC connection is refused (a recorded error): a proxy can
//! only add through a kernel, and that kernel cannot be scheduled while the pushing kernel
//! occupies the GPU (or costs milliseconds from another context). Kernels add to a peer's memory
//! over CUDA IPC directly, with `atom`/`red` `.sys` on the mapped pointer (MemoryChannel's
//! atomics). Over Ethernet and IB, `atomicAdd` runs on the connection.
//!
//! # Threads and CUDA
//! The proxy thread binds to the GPU's NUMA node, makes the device's context current and sets
//! relaxed stream-capture mode, so a graph capture in another thread is never disturbed; it uses
//! only the connections' non-blocking streams and launches no kernels. It checks its stop flag
//! every 1000 iterations. User code must not launch work on the legacy default stream while a
//! kernel served by a proxy spins (that work waits for the kernel, which waits for the proxy).
//!
//! # Structure, and your own handler
//! The loop ([`runner`]: FIFO polling, batched pops, idle back-off, stop, first error) is apart
//! from what a trigger means ([`ProxyHandler`]). [`ProxyService`] runs the loop with the built-in
//! handler described above (`handler`: registries, flushes by sequence number, back pressure);
//! [`Proxy::start`] runs it with a handler of your own, on any [`Fifo`] (MSCCL++ lets users
//! run their own proxy function the same way). Your handler gets the same guarantees: triggers
//! in order, one thread, the first error (or panic) published to kernels and returned by
//! [`Proxy::stop`].
//!
//! C++ MSCCL++: `ProxyService` (with `Proxy` and `BaseProxyService`).
//!
//! [`Fifo`]: super::fifo::Fifo
//! [`Connection::write`]: crate::Connection::write
//! [`Connection::atomic_add`]: crate::Connection::atomic_add
//! [`Connection::progress`]: crate::Connection::progress
//! [`Connection::request_progress`]: crate::Connection::request_progress

mod handler;
pub mod runner;
mod service;

pub use runner::{HandlerResult, Proxy, ProxyHandler, ProxyOptions, TriggerContext};
pub use service::{ProxySemaphore, ProxyService};

use std::time::Duration;

use super::fifo::DEFAULT_FIFO_SIZE;

const LOG: &str = "mscclpp::proxy";

/// The FIFO error word's value once the proxy has failed (see the module documentation).
pub const PROXY_FAILED: u64 = 1;
/// The FIFO error word's value once the proxy has stopped cleanly.
pub const PROXY_STOPPED: u64 = 2;

/// A memory's ID in one [`ProxyService`] (what triggers carry, at most 511).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemoryId(pub u32);

/// A semaphore's ID in one [`ProxyService`] (what triggers carry, at most 1023).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SemaphoreId(pub u32);

/// How a [`ProxyService`] runs.
///
/// Start from [`Default`] and change what you need, with the setters or the fields (the struct is
/// `#[non_exhaustive]`: later versions may add settings without breaking your code).
///
/// ```
/// use std::time::Duration;
/// use mscclpp::device::ProxyConfig;
/// let cfg = ProxyConfig::default().fifo_size(64).idle_backoff(true);
/// assert_eq!((cfg.fifo_size, cfg.max_write_queue_size, cfg.idle_backoff), (64, None, true));
/// // Dry-FIFO pacing of signal payments and the backlog hold are off unless asked for.
/// assert_eq!((cfg.signal_pay_interval, cfg.signal_backlog_hold), (Duration::ZERO, Duration::ZERO));
/// let paced = cfg.signal_pay_interval(Duration::from_micros(2));
/// assert_eq!(paced.signal_pay_interval, Duration::from_micros(2));
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ProxyConfig {
    /// FIFO slots, a power of two (default 512, as MSCCL++).
    pub fifo_size: u32,
    /// Most operations in flight per connection before the proxy waits for completions
    /// (`None`: only the connection's own bound applies; MSCCL++ uses the CQ size for IB).
    pub max_write_queue_size: Option<usize>,
    /// Spin, then yield, then sleep (up to 50 us) while the FIFO stays empty, instead of
    /// spinning a core. Adds wake-up latency after idle periods; off by default.
    pub idle_backoff: bool,
    /// How long owed signals may wait for more triggers while the FIFO keeps delivering them
    /// (default [`DEFAULT_SIGNAL_COALESCE`]; zero pays them after every batch of popped triggers; see "Signals are
    /// coalesced" above). Above zero, a full batch leaves them owed until the FIFO runs dry,
    /// [`COALESCE_MAX_TRIGGERS`] triggers have been handled, or this long has passed since the
    /// oldest was owed: fewer token writes when many semaphores are signalled under load, up to
    /// this much more latency for a signal under load (none when the FIFO runs dry).
    pub signal_coalesce: Duration,
    /// The least time between two rounds of token writes that a dry FIFO starts (default zero:
    /// every dry step pays; applies with `signal_coalesce` above zero). A round a dry FIFO would
    /// start sooner waits, the proxy polling the FIFO meanwhile: a signal popped after a quiet
    /// spell of this length goes out at once, one in a stream waits at most this long more, and
    /// a flush pays its connection's owed signals at once whatever the pace. Worth setting (2 us
    /// measured; see "Signals are coalesced" above) when a steady stream of signals from few
    /// producers shares the proxy with other connections' work; it adds up to this much latency
    /// to signals pushed a little apart.
    pub signal_pay_interval: Duration,
    /// How long, counted from the first of them, owed signals of a backlogged Ethernet
    /// connection may wait while the FIFO keeps delivering full batches (default zero: the hold
    /// is off; [`SUGGESTED_SIGNAL_BACKLOG_HOLD`] turns it on; applies with `signal_coalesce`
    /// above zero). A connection is backlogged while at least half its write-queue bound (the
    /// smaller of the connection's and [`max_write_queue_size`](Self::max_write_queue_size)) is
    /// in flight: a token paid then queues behind that half queue anyway. Its signals are then
    /// paid at the first payment round after a quarter of the bound more puts went on the
    /// connection from this proxy, after it drained below half, or after this long; and at once
    /// when the FIFO runs dry or a flush of the connection comes. Other transports never hold.
    /// See "Signals under back pressure" above.
    pub signal_backlog_hold: Duration,
}

/// The default of [`ProxyConfig::signal_coalesce`].
pub const DEFAULT_SIGNAL_COALESCE: Duration = Duration::from_micros(20);

/// The value of [`ProxyConfig::signal_backlog_hold`] to try (it is off by default until measured
/// on a GPU): 5 ms. At the rate of 132 GPU producers' 4 KiB puts with signals to 4 Ethernet
/// peers in session 32 (about 75,000 writes a second on each connection) that is about 375
/// writes between tokens, where the Ethernet stager's model lands 100-200 copies per 1000
/// writes, against 684-815 with a token every 35.
pub const SUGGESTED_SIGNAL_BACKLOG_HOLD: Duration = Duration::from_millis(5);

/// The most triggers handled while signals stay owed under [`ProxyConfig::signal_coalesce`].
pub const COALESCE_MAX_TRIGGERS: u64 = 256;

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            fifo_size: DEFAULT_FIFO_SIZE,
            max_write_queue_size: None,
            idle_backoff: false,
            signal_coalesce: DEFAULT_SIGNAL_COALESCE,
            signal_pay_interval: Duration::ZERO,
            signal_backlog_hold: Duration::ZERO,
        }
    }
}

impl ProxyConfig {
    /// Sets [`fifo_size`](Self::fifo_size).
    pub fn fifo_size(mut self, slots: u32) -> Self {
        self.fifo_size = slots;
        self
    }
    /// Sets [`max_write_queue_size`](Self::max_write_queue_size).
    pub fn max_write_queue_size(mut self, ops: Option<usize>) -> Self {
        self.max_write_queue_size = ops;
        self
    }
    /// Sets [`idle_backoff`](Self::idle_backoff).
    pub fn idle_backoff(mut self, on: bool) -> Self {
        self.idle_backoff = on;
        self
    }
    /// Sets [`signal_coalesce`](Self::signal_coalesce).
    pub fn signal_coalesce(mut self, d: Duration) -> Self {
        self.signal_coalesce = d;
        self
    }
    /// Sets [`signal_pay_interval`](Self::signal_pay_interval).
    pub fn signal_pay_interval(mut self, d: Duration) -> Self {
        self.signal_pay_interval = d;
        self
    }
    /// Sets [`signal_backlog_hold`](Self::signal_backlog_hold).
    pub fn signal_backlog_hold(mut self, d: Duration) -> Self {
        self.signal_backlog_hold = d;
        self
    }
}

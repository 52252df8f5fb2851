//! Model checks (loom) of the two lock-free protocols between kernels and the host, written in
//! Rust atomics with the orderings of the PTX in `include/mscclpp_rs/device.cuh` (and of the
//! CPU producer in `src/device/fifo.rs`, which follows it):
//!
//! * the FIFO: producers reserve a position (`atom.relaxed.gpu.add` on head, or the
//!   compare-and-swap of `push_for`), wait while the ring is full (acquire loads of `tail`,
//!   `red.release.gpu.max` into `tailCache`; in `wait_popped` only the head of the line reads
//!   `tail`, and the waiters behind it learn of the pop by acquire loads of `tailCache`; a
//!   `FifoExclusiveProducer` counts positions itself, acquires `tail` when its count reaches the
//!   free slots it knows of, and only adds to `head`), and write the trigger with the lap-parity bit (one
//!   16-byte `st.release.sys`: here `fst` first, then a release store of `snd`); the proxy
//!   acquire-loads `snd`, checks the parity of `tail`'s lap, reads `fst`, and publishes the pop
//!   with a release store of `tail`;
//! * the semaphores' consume step (`detail::poll_inbound` and `detail::wait_inbound`): a signal
//!   is a release add on the inbound token after the signaller's writes; a wait takes the next
//!   count with a relaxed fetch-add of `expected` and acquire-loads `inbound` until it reaches
//!   it; a poll acquire-loads `inbound`, and claims a count with a relaxed compare-and-swap.
//!
//! Each model takes its orderings as parameters. The faithful ones must pass every interleaving
//! loom explores; for each ordering that matters there is a test that weakens it (to
//! `Relaxed`) and expects loom to find the failing interleaving: a data race on the payload (a
//! read not ordered after the write it needs, or a slot rewritten before the proxy's read of it
//! was ordered before), or a wrong value. So weakening an ordering here, or in the protocol they
//! model, shows up as a failing test.
//!
//! Payloads the protocol orders (the trigger's first word, the data a signal publishes) are
//! `loom::cell::UnsafeCell`s: loom tracks every access and fails the model when two of them are
//! not ordered by happens-before, whether or not they overlap in the interleaving at hand. The
//! real FIFO writes `fst` as a (relaxed) atomic; modelling it as plain data asks for more: that
//! every read of it is ordered after the write and before the next lap's.
//!
//! Bounds: rings of one or two slots, two to four triggers, two signals; three preemptions for
//! the two-thread models, two for the three-thread ones, whose spin loops give up after a few
//! rounds (see [`SPINS`]).
//!
//! A finding: with several producers, `push` and `push_for` may find `tailCache` raised by
//! another producer and write their slot after a plain (not acquiring) load of it; the rewrite
//! is then ordered after the proxy's read of the previous lap only by the control dependency,
//! which loom, like the C++ and PTX models, does not count. On GPUs that is enough (a store is
//! not made visible before the branch guarding it resolves), so the header keeps MSCCL++'s plain
//! load and says so at `push`; `fifo_tail_cache_fast_path_is_ordered_by_control_only` shows
//! loom's counterexample and that an acquire load closes it (the CPU producer in `fifo.rs` uses
//! one). Not modelled: `wait_inbound_for`'s give-back on timeout (documented as exact for one
//! waiter).
//!
//! Runs as ordinary tests (`cargo test --release --test ordering_models`, well under a second):
//! loom needs no `--cfg loom` to run a model (that cfg only swaps a crate's own atomics, and
//! these models use loom's directly).

use std::panic::{AssertUnwindSafe, catch_unwind};

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering, Ordering::*};
use loom::thread;

/// Explores interleavings with up to `preemptions` preemptions (crossbeam's loom runs use two
/// or three), with room for the spin loops' branches.
fn check_with(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(preemptions);
    b.max_branches = 100_000;
    b.check(f);
}

fn check(f: impl Fn() + Sync + Send + 'static) {
    check_with(3, f)
}

/// Runs a model that must fail and returns loom's reason (the panic's message; the default hook
/// also prints it, with the failing interleaving's location: that is the counterexample).
fn failure(f: impl Fn() + Sync + Send + 'static) -> String {
    match catch_unwind(AssertUnwindSafe(|| check(f))) {
        Ok(()) => panic!("the model passed, but its weakened ordering should have let loom find a failure"),
        Err(p) => p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default(),
    }
}

/// Loom's verdict on a payload accessed without happens-before.
const RACE: &str = "Causality violation";

fn assert_race(reason: String) {
    assert!(reason.contains(RACE), "expected a data race on the payload, loom said: {reason}");
}

// ------------------------------------------------------------------------------------------
// The FIFO
// ------------------------------------------------------------------------------------------

/// The orderings of the FIFO's protocol.
#[derive(Clone, Copy, Debug)]
struct FifoOrders {
    /// The producer's store of `snd` (bit 63: lap parity), after `fst`: the release half of
    /// `st.global.release.sys.v2.u64`.
    snd_store: Ordering,
    /// The proxy's load of `snd` in `Fifo::poll_at`.
    snd_load: Ordering,
    /// The proxy's store of `tail` in `Fifo::pop`/`pop_to`.
    tail_store: Ordering,
    /// The producer's load of `tail` while the ring is full (`ld.acquire.sys`).
    tail_load: Ordering,
    /// `push`'s and `push_for`'s first look at `tailCache` (a plain load in the header).
    tail_cache_load: Ordering,
    /// `wait_popped`'s loads of `tailCache` (`ld.acquire.gpu`): a waiter that is not the head
    /// of the line never reads `tail` and learns of the pop only through them.
    tail_cache_wait_load: Ordering,
    /// The head of the line's raise of `tailCache` (`red.release.gpu.max`).
    tail_cache_raise: Ordering,
}

const FIFO: FifoOrders = FifoOrders {
    snd_store: Release,
    snd_load: Acquire,
    tail_store: Release,
    tail_load: Acquire,
    tail_cache_load: Relaxed,
    tail_cache_wait_load: Acquire,
    tail_cache_raise: Release,
};

/// A ring of `SIZE` slots in the model.
struct Ring<const SIZE: usize> {
    fst: [UnsafeCell<u64>; SIZE],
    snd: [AtomicU64; SIZE],
    head: AtomicU64,
    tail: AtomicU64,
    tail_cache: AtomicU64,
    o: FifoOrders,
    /// Rounds a spin loop may take before giving up (see [`SPINS`]).
    spins: usize,
}

/// How many rounds the spin loops of the three-thread models take before giving up (a
/// timeout): unbounded spinning with loads that may read stale values multiplies loom's
/// branches beyond reach. A model that gives up checks what it got so far; the two-thread
/// models spin without limit and check everything.
const SPINS: usize = 2;

const PARITY: u64 = 1 << 63;

impl<const SIZE: usize> Ring<SIZE> {
    fn new(o: FifoOrders, spins: usize) -> Self {
        Ring {
            fst: std::array::from_fn(|_| UnsafeCell::new(0)),
            snd: std::array::from_fn(|_| AtomicU64::new(0)),
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            tail_cache: AtomicU64::new(0),
            o,
            spins,
        }
    }

    fn shift() -> u32 {
        SIZE.trailing_zeros()
    }

    /// `FifoDeviceHandle::push`: reserve, wait while full, write (`None`: gave up waiting, the
    /// reserved slot stays unwritten, as after a trap).
    fn push(&self, fst: u64, snd: u64) -> Option<u64> {
        let size = SIZE as u64;
        // Relaxed (atom.relaxed.gpu.add): only reserves a number; what the slot may hold is
        // decided by `tail`, and the proxy learns of the trigger from `snd`.
        let pos = self.head.fetch_add(1, Relaxed);
        // Plain load of tailCache in the header (see the module note and
        // `fifo_tail_cache_fast_path_is_ordered_by_control_only`).
        if pos >= size + self.tail_cache.load(self.o.tail_cache_load) {
            let mut round = 0;
            loop {
                // Acquire: pairs with the proxy's Release store of `tail`: its read of the
                // slot's previous trigger happens before this producer rewrites the slot.
                let t = self.tail.load(self.o.tail_load);
                if pos < size + t {
                    // red.release.gpu.max: later readers of tailCache that acquire it see the pop.
                    self.tail_cache.fetch_max(t, Release);
                    break;
                }
                round += 1;
                if round == self.spins {
                    return None;
                }
                thread::yield_now();
            }
        }
        self.write(pos, fst, snd);
        Some(pos)
    }

    /// `FifoDeviceHandle::push` with the header's `wait_popped`: while full, only the head of the
    /// line (the waiter for `p == tailCache`) reads `tail` and raises `tailCache`; the others
    /// read only `tailCache` (the header's stand-ins, who read `tail` after a stagger of
    /// stillness, are one of the behaviours left out: a clock that never reaches the stagger).
    /// `None`: gave up waiting, as in `push`.
    fn push_head_of_line(&self, fst: u64, snd: u64) -> Option<u64> {
        let size = SIZE as u64;
        // Relaxed (atom.relaxed.gpu.add), as in `push`.
        let pos = self.head.fetch_add(1, Relaxed);
        if pos >= size + self.tail_cache.load(self.o.tail_cache_load) {
            let p = pos - size;
            let mut round = 0;
            loop {
                // ld.acquire.gpu: pairs with the head's red.release.gpu.max below (in another
                // waiter, which had acquired `tail`): the pop happens before this rewrite.
                let t = self.tail_cache.load(self.o.tail_cache_wait_load);
                if p < t {
                    break;
                }
                if p == t {
                    // Acquire: pairs with the proxy's Release store of `tail`.
                    let h = self.tail.load(self.o.tail_load);
                    if h > t {
                        self.tail_cache.fetch_max(h, self.o.tail_cache_raise);
                        if p < h {
                            break;
                        }
                        continue;
                    }
                }
                round += 1;
                if round == self.spins {
                    return None;
                }
                thread::yield_now();
            }
        }
        self.write(pos, fst, snd);
        Some(pos)
    }

    /// `FifoDeviceHandle::push_for`: reserve only a free slot (compare-and-swap of head);
    /// `None` when it gave up (nothing reserved).
    fn push_for(&self, fst: u64, snd: u64) -> Option<u64> {
        let size = SIZE as u64;
        let mut h = self.head.load(Relaxed);
        let mut round = 0;
        loop {
            // Plain load of the hint in the header, as in `push`.
            if h >= size + self.tail_cache.load(self.o.tail_cache_load) {
                // Acquire: as in `push`.
                let t = self.tail.load(self.o.tail_load);
                self.tail_cache.fetch_max(t, Release);
                if h >= size + t {
                    round += 1;
                    if round == self.spins {
                        return None;
                    }
                    thread::yield_now();
                    h = self.head.load(Relaxed);
                    continue;
                }
            }
            // Relaxed (atom.relaxed.gpu.cas): claims the number only, as `push`'s fetch-add.
            match self.head.compare_exchange(h, h + 1, Relaxed, Relaxed) {
                Ok(_) => break,
                Err(seen) => h = seen,
            }
        }
        self.write(h, fst, snd);
        Some(h)
    }

    /// `FifoExclusiveProducer`'s construction: the count from `head`, the free bound from
    /// `tailCache` (`ld.acquire.gpu`).
    fn sole(&self) -> Sole {
        // Relaxed (ld.relaxed.gpu): a count; earlier pushes are ordered before by the contract.
        let next = self.head.load(Relaxed);
        let free = SIZE as u64 + self.tail_cache.load(self.o.tail_cache_wait_load);
        Sole { next, free }
    }

    /// `FifoExclusiveProducer::push`: no reservation; while the count reaches the known free
    /// bound, read `tail` (acquire) and raise `tailCache`; write; add one to `head` without
    /// reading it (`red.relaxed.gpu.add`). `None`: gave up waiting, nothing written or counted.
    fn push_exclusive(&self, s: &mut Sole, fst: u64, snd: u64) -> Option<u64> {
        let size = SIZE as u64;
        let mut round = 0;
        while s.next >= s.free {
            // Acquire: pairs with the proxy's Release store of `tail`, as in `push`.
            let t = self.tail.load(self.o.tail_load);
            self.tail_cache.fetch_max(t, self.o.tail_cache_raise);
            s.free = size + t;
            if s.next < s.free {
                break;
            }
            round += 1;
            if round == self.spins {
                return None;
            }
            thread::yield_now();
        }
        let pos = s.next;
        self.write(pos, fst, snd);
        self.head.fetch_add(1, Relaxed);
        s.next += 1;
        Some(pos)
    }

    fn write(&self, pos: u64, fst: u64, snd: u64) {
        let i = pos as usize % SIZE;
        let parity = ((pos >> Self::shift()) & 1) ^ 1;
        // SAFETY: loom checks that this write is ordered after every earlier access to the cell
        // (the proxy's read of the previous lap) and fails the model otherwise; the pointer is
        // the cell's own.
        self.fst[i].with_mut(|p| unsafe { *p = fst });
        // Release: pairs with the proxy's Acquire load of `snd` in `poll_at`: `fst` is visible
        // once the parity is.
        self.snd[i].store((snd & !PARITY) | (parity << 63), self.o.snd_store);
    }

    /// `Fifo::poll_at(tail)` then `Fifo::pop` (one consumer); `None` when it gave up.
    fn pop(&self) -> Option<(u64, u64, u64)> {
        // Relaxed: only the consumer writes tail.
        let t = self.tail.load(Relaxed);
        let i = t as usize % SIZE;
        let parity = ((t >> Self::shift()) & 1) ^ 1;
        let mut round = 0;
        loop {
            // Acquire: pairs with the producer's Release store of `snd` in `write`.
            let snd = self.snd[i].load(self.o.snd_load);
            if snd >> 63 == parity {
                // SAFETY: loom checks that this read is ordered after the producer's write of
                // this lap (through `snd`) and fails the model otherwise.
                let fst = self.fst[i].with(|p| unsafe { *p });
                // Release: pairs with the producers' Acquire loads of `tail`: this read of the
                // slot happens before the slot is written again.
                self.tail.store(t + 1, self.o.tail_store);
                return Some((t, fst, snd & !PARITY));
            }
            round += 1;
            if round == self.spins {
                return None;
            }
            thread::yield_now();
        }
    }
}

/// A `FifoExclusiveProducer`'s state: its count and the free bound it knows.
struct Sole {
    next: u64,
    free: u64,
}

/// One producer on a one-slot ring: a push through the handle, then a `FifoExclusiveProducer`
/// made after it pushes two, then the handle again. Every push waits for the previous pop; the
/// proxy sees the four once, whole, in order, and the last handle push takes position 3 (the
/// producer's adds kept `head` right).
fn fifo_exclusive_producer(o: FifoOrders) {
    check(move || {
        let ring = Arc::new(Ring::<1>::new(o, usize::MAX));
        let p = {
            let ring = ring.clone();
            thread::spawn(move || {
                assert_eq!(ring.push(100, 0), Some(0));
                let mut s = ring.sole();
                assert_eq!(s.next, 1, "the producer starts after the handle's push");
                for k in 1..3u64 {
                    assert_eq!(ring.push_exclusive(&mut s, 100 + k, k), Some(k));
                }
                assert_eq!(ring.push(103, 3), Some(3), "the handle's push after the producer's");
            })
        };
        for k in 0..4u64 {
            assert_eq!(ring.pop(), Some((k, 100 + k, k)), "trigger {k}");
        }
        p.join().unwrap();
    });
}

#[test]
fn fifo_exclusive_producer_holds() {
    fifo_exclusive_producer(FIFO);
}

/// Its wait for a free slot must acquire `tail`: relaxed, the slot's rewrite is not ordered after
/// the proxy's read of the previous lap.
#[test]
fn fifo_exclusive_producer_relaxed_tail_load_is_caught() {
    assert_race(failure(|| fifo_exclusive_producer(FifoOrders { tail_load: Relaxed, ..FIFO })));
}

/// One producer, a one-slot ring, three triggers: every push after the first waits for the
/// previous pop (wrap at every trigger; the parity alternates 1, 0, 1). The proxy sees each
/// trigger once, whole, at its position.
fn fifo_one_slot_wraps(o: FifoOrders) {
    check(move || {
        let ring = Arc::new(Ring::<1>::new(o, usize::MAX));
        let p = {
            let ring = ring.clone();
            thread::spawn(move || {
                for k in 0..3u64 {
                    assert_eq!(ring.push(100 + k, k), Some(k));
                }
            })
        };
        for k in 0..3u64 {
            assert_eq!(ring.pop(), Some((k, 100 + k, k)), "trigger {k}");
        }
        p.join().unwrap();
    });
}

/// Two producers (one `push`, one `push_for`) and the proxy on a one-slot ring, one trigger
/// each: whichever comes second waits for the first to be popped (by the fetch-add's wait or the
/// compare-and-swap's); both are delivered once, whole, at their positions.
fn fifo_two_producers(o: FifoOrders) {
    check_with(2, move || {
        let ring = Arc::new(Ring::<1>::new(o, SPINS));
        let producers: Vec<_> = (0..2u64)
            .map(|id| {
                let ring = ring.clone();
                thread::spawn(move || {
                    let v = 7 + id;
                    if id == 0 { ring.push(v, v) } else { ring.push_for(v, v) }
                })
            })
            .collect();
        let mut got = Vec::new();
        while let Some((t, fst, snd)) = ring.pop() {
            assert_eq!(t, got.len() as u64);
            assert_eq!(fst, snd, "torn or stale trigger at {t}");
            got.push(snd);
            if got.len() == 2 {
                break;
            }
        }
        for (id, p) in producers.into_iter().enumerate() {
            if let Some(pos) = p.join().unwrap()
                && let Some(&v) = got.get(pos as usize)
            {
                assert_eq!(v, 7 + id as u64, "producer {id}'s trigger at its position {pos}");
            }
        }
    });
}

/// Two producers that push twice each (`push`, `push_for`) through a two-slot ring: the case
/// the other models leave out, where a producer finds `tailCache` raised by the other and
/// writes its slot without acquiring anything (positions 0 and 3 from one producer, 1 and 2 from
/// the other, and the proxy has popped 0 and 1).
fn fifo_two_laps_two_producers(o: FifoOrders) {
    check_with(2, move || {
        let ring = Arc::new(Ring::<2>::new(o, SPINS));
        let producers: Vec<_> = (0..2u64)
            .map(|id| {
                let ring = ring.clone();
                thread::spawn(move || {
                    for k in 0..2u64 {
                        let v = id << 8 | k;
                        let r = if id == 0 { ring.push(v, v) } else { ring.push_for(v, v) };
                        if r.is_none() {
                            return;
                        }
                    }
                })
            })
            .collect();
        let mut next = [0u64; 2];
        for pos in 0..4u64 {
            let Some((t, fst, snd)) = ring.pop() else { break };
            assert_eq!(t, pos);
            assert_eq!(fst, snd, "torn or stale trigger at {pos}");
            let (id, k) = ((snd >> 8) as usize, snd & 0xff);
            assert_eq!(k, next[id], "producer {id}: out of order or twice");
            next[id] += 1;
        }
        for p in producers {
            p.join().unwrap();
        }
    });
}

/// The head-of-line wait: a two-slot ring holding positions 0 and 1, two producers waiting for
/// slots (positions 2 and 3) and the proxy popping all four. When the proxy pops both before
/// either waiter looks, the waiter for position 0 (the head) reads `tail` = 2 and raises
/// `tailCache` past position 1, and the other waiter rewrites slot 1 having read only
/// `tailCache`: that rewrite must still be ordered after the proxy's read of slot 1's first lap
/// (through the head's release and its acquire of `tailCache`).
fn fifo_head_of_line_wait(o: FifoOrders) {
    check_with(2, move || {
        let ring = Arc::new(Ring::<2>::new(o, SPINS));
        // Positions 0 and 1, pushed before anyone else runs (no wait: the ring is empty).
        for v in 0..2u64 {
            assert_eq!(ring.push_head_of_line(v, v), Some(v));
        }
        let producers: Vec<_> = (0..2u64)
            .map(|id| {
                let ring = ring.clone();
                thread::spawn(move || ring.push_head_of_line(10 + id, 10 + id))
            })
            .collect();
        let mut got = Vec::new();
        for pos in 0..4u64 {
            let Some((t, fst, snd)) = ring.pop() else { break };
            assert_eq!(t, pos);
            assert_eq!(fst, snd, "torn or stale trigger at {pos}");
            got.push(snd);
        }
        for p in producers {
            if let Some(pos) = p.join().unwrap()
                && let Some(&v) = got.get(pos as usize)
            {
                assert!(v >= 10, "position {pos} holds a stale first-lap trigger {v}");
            }
        }
    });
}

/// The first look at `tailCache` acquires here: with the header's plain load, a producer that
/// finds the cache already raised skips the wait and is ordered by its control dependency only
/// (`fifo_tail_cache_fast_path_is_ordered_by_control_only`), which loom does not count.
const HEAD_OF_LINE: FifoOrders = FifoOrders { tail_cache_load: Acquire, ..FIFO };

#[test]
fn fifo_head_of_line_wait_holds() {
    fifo_head_of_line_wait(HEAD_OF_LINE);
}

/// Each half of the hand-over from the head to the waiters behind it matters: a relaxed raise
/// or a relaxed load of `tailCache` lets a waiter rewrite its slot unordered after the proxy's
/// read of it.
#[test]
fn fifo_head_of_line_relaxed_tail_cache_is_caught() {
    assert_race(failure(|| fifo_head_of_line_wait(FifoOrders { tail_cache_wait_load: Relaxed, ..HEAD_OF_LINE })));
    assert_race(failure(|| fifo_head_of_line_wait(FifoOrders { tail_cache_raise: Relaxed, ..HEAD_OF_LINE })));
}

#[test]
fn fifo_push_pop_and_wrap_hold() {
    fifo_one_slot_wraps(FIFO);
}

#[test]
fn fifo_two_producers_hold() {
    fifo_two_producers(FIFO);
}

/// The finding behind the header's note at `push`: with the first load of `tailCache` in `push`
/// and `push_for` relaxed (the header's plain load), loom finds the slot rewritten without happens-before from
/// the proxy's read of the previous lap (a write-after-read only load buffering could break,
/// which GPUs do not do: the store waits for the branch on the load). With that load acquiring,
/// the protocol holds.
#[test]
fn fifo_tail_cache_fast_path_is_ordered_by_control_only() {
    assert_race(failure(|| fifo_two_laps_two_producers(FIFO)));
    fifo_two_laps_two_producers(FifoOrders { tail_cache_load: Acquire, ..FIFO });
}

#[test]
fn fifo_relaxed_trigger_store_is_caught() {
    assert_race(failure(|| fifo_one_slot_wraps(FifoOrders { snd_store: Relaxed, ..FIFO })));
}

#[test]
fn fifo_relaxed_trigger_load_is_caught() {
    assert_race(failure(|| fifo_one_slot_wraps(FifoOrders { snd_load: Relaxed, ..FIFO })));
}

#[test]
fn fifo_relaxed_tail_store_is_caught() {
    assert_race(failure(|| fifo_one_slot_wraps(FifoOrders { tail_store: Relaxed, ..FIFO })));
}

#[test]
fn fifo_relaxed_tail_load_is_caught() {
    assert_race(failure(|| fifo_one_slot_wraps(FifoOrders { tail_load: Relaxed, ..FIFO })));
}

// ------------------------------------------------------------------------------------------
// The batched push
// ------------------------------------------------------------------------------------------

/// `FifoDeviceHandle::push_batch`'s orderings. Its triggers are stored relaxed (one 16-byte
/// `st.relaxed.sys` each, modelled as one atomic word: value and lap parity), after one release
/// fence; what the fence must order is the data the kernel wrote before the call (a put's source),
/// which the proxy reads once it has popped a trigger.
#[derive(Clone, Copy, Debug)]
struct BatchOrders {
    /// `fence.acq_rel.sys` before the stores (`None`: no fence).
    fence: Option<Ordering>,
    /// Each trigger's store (`st.global.relaxed.sys.v2.u64`).
    store: Ordering,
    /// The proxy's load of a slot in `Fifo::poll_at`.
    load: Ordering,
    /// One reservation per trigger after the fence (`push_relaxed` calls after the caller's one
    /// `__threadfence_system()`), instead of one for the batch after it (`push_batch`).
    per_trigger: bool,
    /// With `per_trigger`: positions counted by the thread, `head` only added to
    /// (`FifoExclusiveProducer::push_relaxed`), not reserved by a fetch-add.
    exclusive: bool,
}

const BATCH: BatchOrders =
    BatchOrders { fence: Some(Release), store: Relaxed, load: Acquire, per_trigger: false, exclusive: false };
/// `push_relaxed`: the caller's `fence.sc.sys` after its writes, then relaxed pushes.
const RELAXED_PUSHES: BatchOrders = BatchOrders { fence: Some(SeqCst), per_trigger: true, ..BATCH };
/// `FifoExclusiveProducer::push_relaxed`: the same, without the fetch-add.
const EXCLUSIVE_PUSHES: BatchOrders = BatchOrders { exclusive: true, ..RELAXED_PUSHES };

/// One producer writes a payload, then pushes two triggers with one batched push, twice, through
/// a two-slot ring (the second batch waits, slot by slot, for the first one's pops); the proxy
/// pops all four and reads, for each, the payload written before its batch: loom fails the model
/// unless every such read happens after the write.
fn fifo_batch(o: BatchOrders) {
    check(move || {
        const SIZE: u64 = 2;
        struct B {
            slot: [AtomicU64; 2],
            head: AtomicU64,
            tail: AtomicU64,
            payload: [UnsafeCell<u64>; 2],
        }
        let r = Arc::new(B {
            slot: std::array::from_fn(|_| AtomicU64::new(0)),
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            payload: std::array::from_fn(|_| UnsafeCell::new(0)),
        });
        let p = {
            let r = r.clone();
            thread::spawn(move || {
                for b in 0..2u64 {
                    // SAFETY: loom checks every access to the cell against the proxy's reads.
                    r.payload[b as usize].with_mut(|p| unsafe { *p = 10 + b });
                    // Relaxed (atom.relaxed.gpu.add of n), as in `push`.
                    let first = if o.per_trigger { b * 2 } else { r.head.fetch_add(2, Relaxed) };
                    if let Some(f) = o.fence {
                        loom::sync::atomic::fence(f);
                    }
                    for k in 0..2 {
                        let pos = match (o.per_trigger, o.exclusive) {
                            (true, false) => r.head.fetch_add(1, Relaxed),
                            (true, true) => {
                                // red.relaxed.gpu.add: kept up to date, never read here.
                                r.head.fetch_add(1, Relaxed);
                                first + k
                            }
                            (false, _) => first + k,
                        };
                        // Acquire: the proxy's read of the slot's previous lap happens before
                        // this store (`wait_popped`; its tailCache steps are modelled above).
                        while pos >= SIZE + r.tail.load(Acquire) {
                            thread::yield_now();
                        }
                        let parity = ((pos / SIZE) & 1) ^ 1;
                        r.slot[(pos % SIZE) as usize].store((parity << 63) | (b << 1) | k, o.store);
                    }
                }
            })
        };
        for t in 0..4u64 {
            let parity = ((t / SIZE) & 1) ^ 1;
            let v = loop {
                let v = r.slot[(t % SIZE) as usize].load(o.load);
                if v >> 63 == parity {
                    break v & !(1 << 63);
                }
                thread::yield_now();
            };
            assert_eq!(v, ((t / 2) << 1) | (t % 2), "trigger {t}");
            // SAFETY: loom checks that this read happens after the producer's write.
            let got = r.payload[(v >> 1) as usize].with(|p| unsafe { *p });
            assert_eq!(got, 10 + (v >> 1));
            // Release: pairs with the producer's acquire loads of tail.
            r.tail.store(t + 1, Release);
        }
        p.join().unwrap();
    });
}

#[test]
fn fifo_batch_holds() {
    fifo_batch(BATCH);
}

/// Without the fence (or with the proxy's load relaxed) the proxy may read a put's source
/// before the kernel's write of it lands.
#[test]
fn fifo_batch_without_fence_is_caught() {
    assert_race(failure(|| fifo_batch(BatchOrders { fence: None, ..BATCH })));
    assert_race(failure(|| fifo_batch(BatchOrders { load: Relaxed, ..BATCH })));
}

/// `push_relaxed`: one fence by the caller after writing the data of two triggers, then one
/// relaxed push for each (each its own reservation), twice through the two-slot ring: the proxy
/// reads every payload after its write.
#[test]
fn fifo_relaxed_pushes_after_one_fence_hold() {
    fifo_batch(RELAXED_PUSHES);
}

/// `FifoExclusiveProducer::push_relaxed` after the caller's one fence: the same holds without the
/// fetch-add (the fence, not the reservation, orders the data).
#[test]
fn fifo_exclusive_relaxed_pushes_after_one_fence_hold() {
    fifo_batch(EXCLUSIVE_PUSHES);
}

/// And without the fence it fails as `push_relaxed` does.
#[test]
fn fifo_exclusive_relaxed_pushes_without_the_callers_fence_are_caught() {
    assert_race(failure(|| fifo_batch(BatchOrders { fence: None, ..EXCLUSIVE_PUSHES })));
}

/// `push_relaxed` with no fence since the data was written: the proxy may read a put's source
/// before the write lands (what its doc tells the caller to avoid).
#[test]
fn fifo_relaxed_pushes_without_the_callers_fence_are_caught() {
    assert_race(failure(|| fifo_batch(BatchOrders { fence: None, ..RELAXED_PUSHES })));
}

// ------------------------------------------------------------------------------------------
// The semaphores' consume step
// ------------------------------------------------------------------------------------------

/// The orderings of a signal and of the waits' loads of the inbound token.
#[derive(Clone, Copy, Debug)]
struct SemOrders {
    /// The signal's add on the peer's token (`red.release.sys.global.add.u64`; a Host2Device
    /// semaphore's token arrives by the transport after the data, the same contract).
    signal: Ordering,
    /// `ld.acquire.sys` of `inbound` in `poll_inbound` and `wait_inbound<true>`.
    inbound_load: Ordering,
    /// Claim a count in `poll_inbound` with a compare-and-swap (MSCCL++'s poll stores
    /// `expected + 1` after comparing instead: two pollers can take one signal).
    poll_cas: bool,
}

const SEM: SemOrders = SemOrders { signal: Release, inbound_load: Acquire, poll_cas: true };

struct Sem {
    /// What signal k publishes, in `data[k - 1]`.
    data: [UnsafeCell<u64>; 2],
    inbound: AtomicU64,
    expected: AtomicU64,
    /// Signals consumed, counted by the model (each consumer adds the count it took).
    taken: [AtomicU64; 2],
    o: SemOrders,
    spins: usize,
}

impl Sem {
    fn signal(&self, k: usize) {
        // SAFETY: loom checks this write against every read of the cell and fails the model if
        // one is not ordered after it.
        self.data[k].with_mut(|p| unsafe { *p = 10 + k as u64 });
        // Release: pairs with the consumers' Acquire loads of `inbound`.
        self.inbound.fetch_add(1, self.o.signal);
    }

    /// `detail::poll_inbound`.
    fn poll(&self) -> Option<u64> {
        // Relaxed (ld.relaxed.gpu): a count only; the data is ordered by `inbound`'s load.
        let mut e = self.expected.load(Relaxed);
        // Acquire: pairs with the signal's Release add.
        let inbound = self.inbound.load(self.o.inbound_load);
        while inbound > e {
            if !self.o.poll_cas {
                self.expected.store(e + 1, Relaxed);
                return Some(e + 1);
            }
            // Relaxed (atom.relaxed.gpu.cas): claims a count; ordering comes from `inbound`.
            match self.expected.compare_exchange(e, e + 1, Relaxed, Relaxed) {
                Ok(_) => return Some(e + 1),
                Err(seen) => e = seen,
            }
        }
        None
    }

    /// `detail::wait_inbound<true>` (`None`: gave up, as a trap would; the count stays taken).
    fn wait(&self) -> Option<u64> {
        // Relaxed (atom.relaxed.gpu.add): takes the next count; ordering comes from `inbound`.
        let e = self.expected.fetch_add(1, Relaxed) + 1;
        let mut round = 0;
        // Acquire: pairs with the signal's Release add (a release sequence: reading a later
        // count also synchronizes with the earlier signals' adds).
        while self.inbound.load(self.o.inbound_load) < e {
            round += 1;
            if round == self.spins {
                return None;
            }
            thread::yield_now();
        }
        Some(e)
    }

    /// What a consumer of count `e` does: reads the data signal `e` published, and counts it.
    fn consume(&self, e: u64) {
        // SAFETY: loom checks that this read is ordered after the signal's write of the cell
        // and fails the model otherwise.
        let v = self.data[e as usize - 1].with(|p| unsafe { *p });
        assert_eq!(v, 10 + e - 1, "count {e}: the data of its signal");
        self.taken[e as usize - 1].fetch_add(1, Relaxed);
    }
}

fn sem(o: SemOrders, spins: usize) -> Arc<Sem> {
    Arc::new(Sem {
        data: [UnsafeCell::new(0), UnsafeCell::new(0)],
        inbound: AtomicU64::new(0),
        expected: AtomicU64::new(0),
        taken: [AtomicU64::new(0), AtomicU64::new(0)],
        o,
        spins,
    })
}

/// A signaller publishes two values, one signal each; one thread waits while another polls:
/// whoever consumes a count reads the data that count's signal published, and no signal is
/// taken twice. (Three threads: the spins are bounded, see [`SPINS`].)
fn semaphore_consume(o: SemOrders) {
    check_with(2, move || {
        let sem = sem(o, SPINS);
        let signaller = {
            let sem = sem.clone();
            thread::spawn(move || {
                sem.signal(0);
                sem.signal(1);
            })
        };
        let waiter = {
            let sem = sem.clone();
            thread::spawn(move || {
                if let Some(e) = sem.wait() {
                    sem.consume(e);
                }
            })
        };
        for _ in 0..SPINS {
            if let Some(e) = sem.poll() {
                sem.consume(e);
                break;
            }
            thread::yield_now();
        }
        signaller.join().unwrap();
        waiter.join().unwrap();
        for k in 0..2 {
            assert!(sem.taken[k].load(Relaxed) <= 1, "signal {} consumed twice", k + 1);
        }
    });
}

/// One signal, one waiter, spinning without limit: the waiter returns, having read the data.
fn semaphore_wait(o: SemOrders) {
    check(move || {
        let sem = sem(o, usize::MAX);
        let waiter = {
            let sem = sem.clone();
            thread::spawn(move || {
                let e = sem.wait();
                assert_eq!(e, Some(1));
                sem.consume(1);
            })
        };
        sem.signal(0);
        waiter.join().unwrap();
        assert_eq!(sem.taken[0].load(Relaxed), 1);
    });
}

/// Two pollers and two signals: each gets one (the compare-and-swap).
fn semaphore_two_pollers(o: SemOrders) {
    check(move || {
        let sem = sem(o, usize::MAX);
        sem.signal(0);
        sem.signal(1);
        let other = {
            let sem = sem.clone();
            thread::spawn(move || sem.poll())
        };
        let mine = sem.poll();
        let theirs = other.join().unwrap();
        let (Some(a), Some(b)) = (mine, theirs) else {
            panic!("a poller missed a pending signal: {mine:?} {theirs:?}")
        };
        assert_ne!(a, b, "two pollers took the same signal");
    });
}

#[test]
fn semaphore_wait_and_poll_hold() {
    semaphore_wait(SEM);
    semaphore_consume(SEM);
}

#[test]
fn semaphore_pollers_take_distinct_signals() {
    semaphore_two_pollers(SEM);
}

#[test]
fn semaphore_relaxed_signal_is_caught() {
    assert_race(failure(|| semaphore_wait(SemOrders { signal: Relaxed, ..SEM })));
    assert_race(failure(|| semaphore_consume(SemOrders { signal: Relaxed, ..SEM })));
}

#[test]
fn semaphore_relaxed_inbound_load_is_caught() {
    assert_race(failure(|| semaphore_wait(SemOrders { inbound_load: Relaxed, ..SEM })));
    assert_race(failure(|| semaphore_consume(SemOrders { inbound_load: Relaxed, ..SEM })));
}

#[test]
fn mscclpp_poll_without_cas_is_caught() {
    assert!(
        failure(|| semaphore_two_pollers(SemOrders { poll_cas: false, ..SEM }))
            .contains("two pollers took the same signal")
    );
}

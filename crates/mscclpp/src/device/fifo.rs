//! The FIFO between kernels (producers) and one proxy thread (the consumer), as MSCCL++'s.
//!
//! A ring of `size` 16-byte [`ProxyTrigger`] slots and a control page (`tail` at word 0, the
//! proxy's error word at word 1) live in mapped pinned host memory; `head` and the kernels'
//! `tailCache` live in device memory. A producer reserves position `pos` with a relaxed
//! fetch-add of `head`, waits (acquire loads of `tail`) only when `pos >= size + tailCache`, and
//! writes its trigger into slot `pos & (size - 1)` with bit 63 of `snd` set to the lap parity
//! `((pos >> log2(size)) & 1) ^ 1` (lap 0 writes 1, so a zeroed ring reads empty): one 16-byte
//! release store on the GPU. The consumer reads slot `tail & (size - 1)`: an acquire load of
//! `snd`, ready when its bit 63 equals the parity of `tail`'s lap, then a relaxed load of `fst`;
//! [`Fifo::pop`] is a release store of `tail + 1`. Slots are never cleared, so all-zero triggers
//! are legal. Head of line: the consumer stops at the lowest reserved but unwritten slot.
//!
//! Without a GPU, [`Fifo::host_backed`] puts all four areas in host memory and
//! [`HostProducer`] pushes with the CPU equivalent of the device's orderings (see its docs):
//! that is how CI tests the consumer.
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::handles::FifoDeviceHandle;
use super::trigger::{COMMIT_BIT, ProxyTrigger};
use crate::error::{Error, Result};
use crate::platform::cuda::fifo_mem::FifoMem;
use crate::sync::{Backoff, BackoffPolicy, Deadline};

/// MSCCL++'s default FIFO size (slots).
pub const DEFAULT_FIFO_SIZE: u32 = 512;
/// The largest FIFO accepted (slots; 16 MiB of mapped memory).
pub const MAX_FIFO_SIZE: u32 = 1 << 20;

/// A trigger FIFO; see the module documentation. One consumer: [`poll`](Self::poll) and
/// [`pop`](Self::pop) are meant for one thread (two consumers would see triggers twice; nothing
/// unsafe happens).
#[derive(Debug)]
pub struct Fifo {
    mem: FifoMem,
    size: u32,
    shift: u32,
    /// A proxy serves this FIFO now (one consumer at a time).
    served: std::sync::atomic::AtomicBool,
}

fn check_size(size: u32) -> Result<u32> {
    if !size.is_power_of_two() || size > MAX_FIFO_SIZE {
        return Err(Error::invalid_usage(format!(
            "a FIFO's size must be a power of two from 1 to {MAX_FIFO_SIZE}, not {size} (MSCCL++'s default is \
             {DEFAULT_FIFO_SIZE})"
        )));
    }
    Ok(size.trailing_zeros())
}

impl Fifo {
    /// A FIFO of `size` slots (a power of two; [`DEFAULT_FIFO_SIZE`] is MSCCL++'s) for kernels on
    /// GPU `device`: ring and control page in mapped pinned memory, head and tailCache in device
    /// memory, all zeroed. `ctx` is the context the proxy serving it belongs to.
    ///
    /// # Errors
    /// `InvalidUsage` for a size that is not a power of two (or is above [`MAX_FIFO_SIZE`]) or a
    /// missing GPU; `NotAvailable` without a CUDA driver; `Cuda` when an allocation fails.
    pub fn new(ctx: &crate::Context, device: u32, size: u32) -> Result<Fifo> {
        let _ = ctx;
        let shift = check_size(size)?;
        Ok(Fifo { mem: FifoMem::gpu(device, size as usize)?, size, shift, served: Default::default() })
    }

    /// A FIFO whose four areas are plain host memory, for [`HostProducer`]s (tests without a
    /// GPU). Its [`device_handle`](Self::device_handle) holds host addresses no kernel can use.
    ///
    /// # Errors
    /// `InvalidUsage` for a bad size, as [`new`](Self::new).
    #[doc(hidden)]
    pub fn host_backed(size: u32) -> Result<Fifo> {
        let shift = check_size(size)?;
        Ok(Fifo { mem: FifoMem::host(size as usize)?, size, shift, served: Default::default() })
    }

    /// Slots in the ring.
    pub fn size(&self) -> u32 {
        self.size
    }

    fn tail_word(&self) -> &AtomicU64 {
        &self.mem.control()[0]
    }

    /// The next trigger, if its producer has written it: `snd` with the commit bit cleared.
    /// Does not consume it: call [`pop`](Self::pop) once it is handled.
    pub fn poll(&self) -> Option<ProxyTrigger> {
        // Relaxed: only the consumer writes tail, so this reads its own last store.
        self.poll_at(self.tail_word().load(Ordering::Relaxed))
    }

    /// The trigger at position `t`, if its producer has written it; for a consumer that reads
    /// ahead of [`tail`](Self::tail) and pops several at once with [`pop_to`](Self::pop_to).
    /// `t` must be at least `tail` and below `tail + size` (slots beyond are not yet reserved
    /// for this lap; reading one shows a trigger of the previous lap as not ready, or, a whole
    /// lap ahead, as ready: callers never look further than the triggers they have not popped).
    pub fn poll_at(&self, t: u64) -> Option<ProxyTrigger> {
        let i = (t & u64::from(self.size - 1)) as usize;
        let ring = self.mem.ring();
        // Acquire: pairs with the producer's release store of the trigger (on the GPU the 16-byte
        // `st.global.release.sys.v2.u64` in device.cuh's `FifoDeviceHandle::write`; on the CPU
        // the Release store of `snd` in `HostProducer::write`): `fst` is visible once the parity
        // bit is. Modelled in tests/ordering_models.rs.
        let snd = ring[2 * i + 1].load(Ordering::Acquire);
        let parity = ((t >> self.shift) & 1) ^ 1;
        if snd >> 63 != parity {
            return None;
        }
        // Relaxed: ordered after the producer's write by the Acquire load of `snd` above.
        let fst = ring[2 * i].load(Ordering::Relaxed);
        Some(ProxyTrigger { fst, snd: snd & !COMMIT_BIT })
    }

    /// Consumes the trigger [`poll`](Self::poll) returned (a release store of `tail + 1`), freeing
    /// its slot for producers.
    pub fn pop(&self) {
        // Relaxed: only the consumer writes tail.
        let t = self.tail_word().load(Ordering::Relaxed);
        // Release: pairs with the producers' acquire loads of tail (device.cuh: `ld.acquire.sys`
        // in `push_for`, `poll`, `sync`, `sync_for` and `wait_popped`; here
        // `HostProducer::wait_tail_above` and `push_for`): the reads of the popped slot happen
        // before a producer rewrites it on the next lap.
        self.tail_word().store(t + 1, Ordering::Release);
    }

    /// Consumes every trigger below position `t` at once (a release store of `tail = t`): the
    /// consumer has polled and handled them all. Never moves `tail` back.
    pub fn pop_to(&self, t: u64) {
        // Relaxed: only the consumer writes tail.
        if t > self.tail_word().load(Ordering::Relaxed) {
            // Release: pairs with the producers' acquire loads of tail, as in `pop`.
            self.tail_word().store(t, Ordering::Release);
        }
    }

    /// The FIFO position of the next trigger to poll (equal to the position its producer's
    /// `push` returned).
    pub fn tail(&self) -> u64 {
        // Relaxed: exact on the consumer's thread (its own stores); a snapshot elsewhere.
        self.tail_word().load(Ordering::Relaxed)
    }

    /// Publishes the proxy's state to kernels (a release store of the error word): 0 = running
    /// fine; nonzero = the proxy failed or stopped, and kernels' time-limited waits return false.
    pub fn set_proxy_error(&self, code: u64) {
        // Release: pairs with the kernels' `ld.acquire.sys` in device.cuh's
        // `FifoDeviceHandle::proxy_error` (and the Acquire in `proxy_error` here): whoever sees
        // the code sees what the proxy wrote before it.
        self.mem.control()[1].store(code, Ordering::Release);
    }

    /// Makes a proxy this FIFO's consumer: refused while another serves it. The new proxy goes
    /// on from the earlier one's `tail`; once its thread runs, a FIFO whose earlier proxy stopped
    /// or failed has its error word put back to 0 ([`set_proxy_error`](Self::set_proxy_error)),
    /// so kernels' waits work again (not before: a proxy that fails to start leaves the word).
    pub(crate) fn claim(&self) -> Result<()> {
        // Acquire: pairs with the Release store in `release_claim`: the earlier proxy's pops and
        // error word happen before this one starts.
        if self.served.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return Err(Error::invalid_usage(
                "a proxy already serves this FIFO: it takes one consumer at a time (stop that proxy first)",
            ));
        }
        Ok(())
    }

    /// Ends a proxy's claim (see [`claim`](Self::claim)).
    pub(crate) fn release_claim(&self) {
        // Release: pairs with the Acquire in `claim`.
        self.served.store(false, Ordering::Release);
    }

    /// The proxy's published state (see [`set_proxy_error`](Self::set_proxy_error)).
    pub fn proxy_error(&self) -> u64 {
        // Acquire: pairs with the Release store in `set_proxy_error`.
        self.mem.control()[1].load(Ordering::Acquire)
    }

    /// What kernels push with.
    pub fn device_handle(&self) -> FifoDeviceHandle {
        let a = self.mem.addrs();
        FifoDeviceHandle {
            triggers: a.triggers,
            head: a.head,
            tail: a.tail,
            tail_cache: a.tail_cache,
            size: self.size as i32,
            _pad: 0,
            size_mask: u64::from(self.size - 1),
            size_shift: u64::from(self.shift),
        }
    }

    /// A CPU producer for a [`host_backed`](Self::host_backed) FIFO (`None` for a GPU one).
    #[doc(hidden)]
    pub fn host_producer(&self) -> Option<HostProducer<'_>> {
        self.mem.host_head().map(|(head, tail_cache)| HostProducer { fifo: self, head, tail_cache })
    }
}

/// A CPU producer for a host-backed [`Fifo`], for tests: it follows the device's `push` step by
/// step. The device writes a trigger with one 16-byte `st.release.sys`; the CPU equivalent here is
/// a relaxed store of `fst` then a release store of `snd` (the word carrying the commit bit), which
/// the consumer's acquire load of `snd` pairs with (MSCCL++'s ROCm path does the same). Any number
/// of threads may push through producers of one FIFO at once. One deliberate difference: the
/// first look at `tailCache` is an acquire load here and a plain load on the device (see `push`).
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct HostProducer<'a> {
    fifo: &'a Fifo,
    head: &'a AtomicU64,
    tail_cache: &'a AtomicU64,
}

impl HostProducer<'_> {
    /// The device's `push`: reserves the next position (relaxed fetch-add of head), waits while
    /// the ring is full (acquire loads of tail, for at most `timeout`), writes the trigger.
    /// Returns its position.
    ///
    /// # Errors
    /// `Timeout` when the ring stays full; the reserved slot is then never written, which stalls
    /// the consumer at it (as a trapped kernel would): tests only.
    pub fn push(&self, t: ProxyTrigger, timeout: Duration) -> Result<u64> {
        let size = u64::from(self.fifo.size);
        // Relaxed (the device's `atom.relaxed.gpu.add`): only hands out a number; the slot's
        // reuse is ordered by tail (Acquire in `wait_tail_above`) and its contents by `snd`
        // (Release in `write`).
        let pos = self.head.fetch_add(1, Ordering::Relaxed);
        // Acquire (the device has a plain load here): pairs with the Release stores of tailCache
        // in `push_for` and `wait_tail_above`, made after an Acquire load of tail: when another
        // producer raised it, the proxy's read of this slot's previous trigger happens before
        // this producer rewrites it. The device relies on the control dependency instead (see
        // device.cuh's `push`; tests/ordering_models.rs shows the difference). A stale value
        // only sends this producer to wait.
        if pos >= size + self.tail_cache.load(Ordering::Acquire) {
            self.wait_tail_above(pos - size, timeout)?;
        }
        self.write(pos, t);
        Ok(pos)
    }

    /// The device's `push_for`: reserves a position (compare-and-swap of head) only once its
    /// slot is free, so giving up leaves the FIFO intact. `Ok(None)` when the ring stays full
    /// for `timeout`, or is full while the proxy error word is nonzero (the word is looked at
    /// only while waiting for a slot: a push into a free slot succeeds whatever the proxy's
    /// state, and `sync` or a flush tells whether it was handled).
    pub fn push_for(&self, t: ProxyTrigger, timeout: Duration) -> Result<Option<u64>> {
        let size = u64::from(self.fifo.size);
        let deadline = Deadline::after(timeout);
        let mut backoff = Backoff::new(BackoffPolicy::FAST);
        // Relaxed: a guess for the compare-and-swap below, which checks it.
        let mut h = self.head.load(Ordering::Relaxed);
        loop {
            // Acquire: as in `push`.
            if h >= size + self.tail_cache.load(Ordering::Acquire) {
                // Acquire: pairs with the consumer's Release store of tail in `Fifo::pop`/`pop_to`.
                let tail = self.fifo.tail_word().load(Ordering::Acquire);
                // Release: pairs with the Acquire loads of tailCache in `push` and here (the device
                // raises it with `red.release.gpu.max`). A lowered hint is still true (at least
                // `tail` popped) and only costs a read of tail.
                self.tail_cache.store(tail, Ordering::Release);
                if h >= size + tail {
                    if self.fifo.proxy_error() != 0 || deadline.expired() {
                        return Ok(None);
                    }
                    backoff.snooze(&deadline);
                    // Relaxed: a fresh guess, as above.
                    h = self.head.load(Ordering::Relaxed);
                    continue;
                }
            }
            // Relaxed (the device's `atom.relaxed.gpu.cas`): claims the number only, as `push`'s
            // fetch-add; the slot was seen free through the Acquire load of tail above (or a
            // tailCache hint, as in `push`).
            match self.head.compare_exchange(h, h + 1, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break,
                Err(seen) => h = seen,
            }
        }
        self.write(h, t);
        Ok(Some(h))
    }

    /// Waits until the consumer popped position `pos` (the device's `sync`), for at most `timeout`.
    ///
    /// # Errors
    /// `Timeout` when it does not.
    pub fn sync(&self, pos: u64, timeout: Duration) -> Result<()> {
        self.wait_tail_above(pos, timeout)
    }

    fn wait_tail_above(&self, pos: u64, timeout: Duration) -> Result<()> {
        let tail = self.fifo.tail_word();
        let mut seen = 0;
        let ok = crate::sync::poll_until(timeout, BackoffPolicy::FAST, || {
            // Acquire: pairs with the consumer's Release store of tail in `Fifo::pop`/`pop_to`.
            seen = tail.load(Ordering::Acquire);
            Ok::<_, Error>(seen > pos)
        })?;
        if !ok {
            return Err(Error::timeout(format!("FIFO position {pos} to be popped (tail {seen})"), timeout));
        }
        // Release: a hint, as in `push_for`.
        self.tail_cache.store(seen, Ordering::Release);
        Ok(())
    }

    fn write(&self, pos: u64, t: ProxyTrigger) {
        let i = (pos & u64::from(self.fifo.size - 1)) as usize;
        let parity = ((pos >> self.fifo.shift) & 1) ^ 1;
        let ring = self.fifo.mem.ring();
        // Relaxed: published by the Release store of `snd` next.
        ring[2 * i].store(t.fst, Ordering::Relaxed);
        // Release: pairs with the consumer's Acquire load of `snd` in `Fifo::poll_at` (the CPU
        // form of the device's one 16-byte release store).
        ring[2 * i + 1].store((t.snd & !COMMIT_BIT) | (parity << 63), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::ErrorKind;

    const T: Duration = Duration::from_secs(30);

    fn trig(fst: u64, snd: u64) -> ProxyTrigger {
        ProxyTrigger { fst, snd }
    }

    /// Polls until a trigger arrives (bounded), then pops it.
    fn next(f: &Fifo) -> ProxyTrigger {
        let deadline = Deadline::after(T);
        loop {
            if let Some(t) = f.poll() {
                f.pop();
                return t;
            }
            assert!(!deadline.expired(), "no trigger at tail {} within {T:?}", f.tail());
            std::thread::yield_now();
        }
    }

    #[test]
    fn sizes_must_be_powers_of_two() {
        for bad in [0, 3, 500, MAX_FIFO_SIZE * 2] {
            assert_eq!(Fifo::host_backed(bad).unwrap_err().kind(), ErrorKind::InvalidUsage, "size {bad}");
        }
        let f = Fifo::host_backed(DEFAULT_FIFO_SIZE).unwrap();
        let h = f.device_handle();
        assert_eq!((f.size(), h.size, h.size_mask, h.size_shift), (512, 512, 511, 9));
        assert_eq!(h.triggers % 16, 0);
        assert!(h.tail != h.head && h.tail != h.tail_cache && h.head != h.tail_cache);
        assert_eq!(f.poll(), None, "a zeroed ring reads empty");
    }

    #[test]
    fn one_producer_wraps_several_laps_and_positions_match_the_tail() {
        for size in [1, 2, 8] {
            let f = Fifo::host_backed(size).unwrap();
            let p = f.host_producer().unwrap();
            for i in 0..u64::from(size) * 5 {
                // snd with bit 63 set by the caller: the FIFO owns that bit and overrides it.
                let pos = p.push(trig(i, i | COMMIT_BIT), T).unwrap();
                assert_eq!(pos, i);
                assert_eq!(f.tail(), pos);
                assert_eq!(f.poll(), Some(trig(i, i)), "size {size} position {i}");
                assert_eq!(f.poll(), Some(trig(i, i)), "poll does not consume");
                f.pop();
                assert_eq!(f.poll(), None, "size {size}: nothing after {i}");
            }
        }
    }

    #[test]
    fn reading_ahead_and_popping_a_batch_over_several_laps() {
        let f = Fifo::host_backed(8).unwrap();
        let p = f.host_producer().unwrap();
        let mut next = 0u64;
        for (round, n) in [3u64, 8, 5, 8, 1, 7].into_iter().enumerate() {
            let start = f.tail();
            for _ in 0..n {
                p.push(trig(next, next), T).unwrap();
                next += 1;
            }
            for k in 0..n {
                assert_eq!(f.poll_at(start + k), Some(trig(start + k, start + k)), "round {round}, ahead {k}");
            }
            assert_eq!(f.poll_at(start + n), None, "round {round}: nothing past the last push");
            assert_eq!(f.tail(), start, "reading ahead pops nothing");
            f.pop_to(start + n);
            f.pop_to(start);
            assert_eq!(f.tail(), start + n, "pop_to never moves the tail back");
            assert_eq!(f.poll(), None);
        }
        // A full ring: the producer waits until the batch is popped.
        for _ in 0..8 {
            p.push(trig(next, next), T).unwrap();
            next += 1;
        }
        let start = f.tail();
        std::thread::scope(|s| {
            let h = s.spawn(|| p.push(trig(next, next), T).unwrap());
            // The wait is the thing under test: the push has no event that says "blocked", so
            // give it 20 ms in which it must not finish. A slow machine can only make this pass
            // without having tested much, never fail a correct FIFO.
            std::thread::sleep(Duration::from_millis(20));
            assert!(!h.is_finished(), "the ninth push waits for a free slot");
            assert!((0..8).all(|k| f.poll_at(start + k).is_some()));
            f.pop_to(start + 8);
            assert_eq!(h.join().unwrap(), start + 8);
        });
        assert_eq!(f.poll(), Some(trig(next, next)));
    }

    #[test]
    fn zero_triggers_are_delivered_each_once() {
        let f = Fifo::host_backed(4).unwrap();
        let p = f.host_producer().unwrap();
        for lap in 0..4 {
            for _ in 0..4 {
                p.push(ProxyTrigger::default(), T).unwrap();
            }
            for _ in 0..4 {
                assert_eq!(f.poll(), Some(ProxyTrigger::default()), "lap {lap}");
                f.pop();
            }
            assert_eq!(f.poll(), None, "lap {lap}");
        }
        assert_eq!(f.tail(), 16);
    }

    #[test]
    fn a_full_ring_holds_producers_back_until_the_consumer_pops() {
        let f = Fifo::host_backed(8).unwrap();
        let p = f.host_producer().unwrap();
        for i in 0..8 {
            p.push(trig(i, 0), T).unwrap();
        }
        // Full: a bounded push times out (and its reserved slot is then lost: test only).
        let g = Fifo::host_backed(2).unwrap();
        let gp = g.host_producer().unwrap();
        gp.push(trig(0, 0), T).unwrap();
        gp.push(trig(1, 0), T).unwrap();
        assert_eq!(gp.push(trig(2, 0), Duration::from_millis(20)).unwrap_err().kind(), ErrorKind::Timeout);
        // push_for gives up without reserving anything, and at once when the proxy has failed.
        assert_eq!(p.push_for(trig(99, 0), Duration::from_millis(20)).unwrap(), None);
        f.set_proxy_error(3);
        assert_eq!(f.proxy_error(), 3);
        assert_eq!(p.push_for(trig(99, 0), T).unwrap(), None);
        f.set_proxy_error(0);
        std::thread::scope(|s| {
            let blocked = s.spawn(|| p.push(trig(8, 0), T));
            let blocked_for = s.spawn(|| p.push_for(trig(9, 0), T));
            // Both wait for slots: the consumer still sees position 0's trigger, not a newer one.
            assert_eq!(f.poll(), Some(trig(0, 0)));
            f.pop();
            f.pop();
            let mut got: Vec<u64> = (2..10).map(|_| next(&f).fst).collect();
            assert_eq!(blocked.join().unwrap().unwrap() + blocked_for.join().unwrap().unwrap().unwrap(), 8 + 9);
            got.sort_unstable();
            assert_eq!(got, (2..10).collect::<Vec<_>>());
        });
        assert_eq!(f.poll(), None);
        assert_eq!(f.tail(), 10);
    }

    #[test]
    fn the_consumer_waits_at_a_reserved_but_unwritten_slot() {
        let f = Fifo::host_backed(4).unwrap();
        let p = f.host_producer().unwrap();
        // A slow producer reserves position 0 and holds it.
        let slow = p.head.fetch_add(1, Ordering::Relaxed);
        assert_eq!(slow, 0);
        p.push(trig(1, 1), T).unwrap();
        p.push(trig(2, 2), T).unwrap();
        assert_eq!(f.poll(), None, "position 0 is not written yet");
        p.write(slow, trig(0, 0));
        for i in 0..3 {
            assert_eq!(next(&f), trig(i, i));
        }
        assert_eq!(f.poll(), None);
    }

    #[test]
    fn many_producers_deliver_every_trigger_once_in_per_producer_order() {
        const PRODUCERS: u64 = 6;
        const EACH: u64 = 2000;
        let f = Fifo::host_backed(16).unwrap();
        let failed = AtomicBool::new(false);
        let mut next_seq = vec![0u64; PRODUCERS as usize];
        std::thread::scope(|s| {
            for id in 0..PRODUCERS {
                let (f, failed) = (&f, &failed);
                s.spawn(move || {
                    let p = f.host_producer().unwrap();
                    for seq in 0..EACH {
                        // Producer 0 uses push_for (the compare-and-swap reservation) for half.
                        let t = trig(seq, id << 40 | seq);
                        let ok = if id == 0 && seq % 2 == 0 {
                            p.push_for(t, T).map(|r| r.is_some()).unwrap_or(false)
                        } else {
                            p.push(t, T).is_ok()
                        };
                        if !ok {
                            failed.store(true, Ordering::Relaxed);
                            return;
                        }
                    }
                });
            }
            for _ in 0..PRODUCERS * EACH {
                let t = next(&f);
                let (id, seq) = ((t.snd >> 40) as usize, t.fst);
                assert_eq!(t.snd & ((1 << 40) - 1), seq, "torn trigger {t:?}");
                assert_eq!(seq, next_seq[id], "producer {id}: out of order or duplicated");
                next_seq[id] += 1;
            }
        });
        assert!(!failed.load(Ordering::Relaxed), "a producer timed out");
        assert_eq!(next_seq, vec![EACH; PRODUCERS as usize]);
        assert_eq!(f.poll(), None);
        assert_eq!(f.tail(), PRODUCERS * EACH);
    }
}

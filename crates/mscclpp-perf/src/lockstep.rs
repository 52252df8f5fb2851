//! Launches in lockstep for ranks that are threads of one process (issue 28).
//!
//! Ranks as threads share one CUDA context, and the driver feeds the streams of a context to the
//! GPU through a few hardware queues in which work starts in order, whatever stream it came
//! from. When one rank has queued several launches (the warmup and timed calls go in back to
//! back) before a peer queued its first, and the two streams share a queue, the peer's first
//! launch sits behind this rank's second, which waits in its stream for this rank's first, which
//! waits for the peer: nothing moves until a device wait times out. Seen on the GPU machine
//! with the two-node plan and 4 ranks as threads (3 of 10 runs, H200, session 19) although
//! `CUDA_DEVICE_MAX_CONNECTIONS` was 32: one rank's first launch started only after a peer's
//! timed out, its signals then arriving late; with one launch in flight per rank, or with ranks
//! as processes, no run stalled.
//!
//! The harness therefore issues every call (and every graph launch) in rounds: no rank queues
//! call k+1 before every rank has queued call k. Then in any shared queue all calls k come before
//! any call k+1, and the calls k complete together (one call of slack is the most that is safe).
//! A round costs the threads an atomic add and a short spin while the GPU runs the calls queued
//! ahead; it shows only where the launches are the time (eager calls at small sizes: 4 ranks
//! 9-11 -> 16-20 us per call on an H100; strict turns, one launch after another, cost more).
//! Processes (`--procs`) have a
//! context each and need no lockstep.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// A reusable barrier for the rank threads of one process, round by round; bounded by a timeout
/// and broken at once when a rank leaves with an error.
#[derive(Debug)]
pub struct Lockstep {
    ranks: u64,
    timeout: Duration,
    /// Arrivals over all rounds: round r is complete when it reaches r * ranks.
    arrived: AtomicU64,
    /// Set by a rank that stopped issuing (an error): the others stop waiting.
    broken: AtomicBool,
}

impl Lockstep {
    /// A lockstep for `ranks` threads; a round that does not complete within `timeout` fails.
    pub fn new(ranks: usize, timeout: Duration) -> Lockstep {
        Lockstep { ranks: ranks as u64, timeout, arrived: AtomicU64::new(0), broken: AtomicBool::new(false) }
    }

    /// Waits until every rank has reached its round `*round + 1` (then `*round` is that round).
    /// Every rank calls it the same number of times.
    ///
    /// # Errors
    /// When a rank broke the lockstep or the round did not complete within the timeout (the
    /// message names the round and how many ranks had arrived).
    pub fn wait(&self, rank: usize, round: &mut u64) -> Result<(), String> {
        *round += 1;
        let target = *round * self.ranks;
        // AcqRel: the rounds order nothing but the launches' host calls; Acquire/Release keep
        // the count's history simple to reason about at no measurable cost.
        self.arrived.fetch_add(1, Ordering::AcqRel);
        let mut arrived = 0;
        let done = mscclpp::bench::wait_until(self.timeout, || {
            arrived = self.arrived.load(Ordering::Acquire);
            arrived >= target || self.broken.load(Ordering::Acquire)
        });
        if self.broken.load(Ordering::Acquire) {
            return Err(format!("rank {rank}: another rank stopped issuing its calls (its error is reported too)"));
        }
        if !done {
            let here = arrived.saturating_sub(target - self.ranks);
            return Err(format!(
                "rank {rank}: launch round {round}: {here} of {} ranks were ready to issue their call {round} within {:?}",
                self.ranks, self.timeout
            ));
        }
        Ok(())
    }

    /// Releases every waiting and later `wait` with an error: this rank stops issuing calls.
    pub fn break_off(&self) {
        self.broken.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn no_rank_starts_round_k_plus_1_before_every_rank_finished_round_k() {
        const RANKS: usize = 4;
        const ROUNDS: u64 = 200;
        let ls = Lockstep::new(RANKS, Duration::from_secs(30));
        // Each rank records, after each wait, the round it is in; a rank that ran ahead would
        // see a peer's counter more than one round behind.
        let progress: Vec<AtomicU64> = (0..RANKS).map(|_| AtomicU64::new(0)).collect();
        let violations = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for rank in 0..RANKS {
                let (ls, progress, violations) = (&ls, &progress, &violations);
                s.spawn(move || {
                    let mut round = 0;
                    for _ in 0..ROUNDS {
                        ls.wait(rank, &mut round).unwrap();
                        for p in progress {
                            if p.load(Ordering::Acquire) + 1 < round {
                                violations.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        progress[rank].store(round, Ordering::Release);
                    }
                    assert_eq!(round, ROUNDS);
                });
            }
        });
        assert_eq!(violations.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_rank_that_breaks_off_releases_the_others_with_an_error() {
        let ls = Lockstep::new(3, Duration::from_secs(60));
        let t0 = std::time::Instant::now();
        let errs: Vec<String> = std::thread::scope(|s| {
            let waiters: Vec<_> = (0..2)
                .map(|rank| {
                    let ls = &ls;
                    s.spawn(move || ls.wait(rank, &mut 0).unwrap_err())
                })
                .collect();
            std::thread::sleep(Duration::from_millis(50));
            ls.break_off();
            waiters.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(t0.elapsed() < Duration::from_secs(30), "released by the break, not the timeout");
        for e in &errs {
            assert!(e.contains("another rank stopped issuing"), "{e}");
        }
        // Later rounds fail at once too.
        assert!(ls.wait(2, &mut 5).is_err());
    }

    #[test]
    fn a_missing_rank_times_out_naming_the_round_and_the_count() {
        let ls = Lockstep::new(3, Duration::from_millis(100));
        let mut round = 0;
        let e = ls.wait(1, &mut round).unwrap_err();
        assert_eq!(round, 1);
        assert!(e.contains("rank 1: launch round 1: 1 of 3 ranks were ready to issue their call 1"), "{e}");
    }
}

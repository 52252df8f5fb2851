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
//! The harness therefore issues every call (and every graph launch) in turns: rank 0's call k,
//! rank 1's call k, ..., then call k+1 of each. No rank queues call k+1 before every rank has
//! queued call k, so in any shared queue all calls k come before any call k+1, and the calls k
//! complete together (one call of slack is the most that is safe: with two, a rank's call k+1
//! can sit ahead of a peer's call k). A turn costs a thread an atomic add and a short spin, while
//! the GPU still runs the calls queued ahead; processes (`--procs`) have a
//! context each and need no lockstep.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Turns for the rank threads of one process: call k of rank r is issued after call k of ranks
/// 0..r and before call k of ranks r+1.., and every call k before any call k+1. Each turn is
/// bounded by a timeout, and the turns end at once when a rank leaves with an error.
///
/// Turns in a fixed order rather than a barrier per round: released together, the threads would
/// contend for the driver's launch path at the same instant (4 ranks: 9-11 us per eager call
/// became 16-19 us with a barrier per round on an H100), while in turns each launch finds it free.
#[derive(Debug)]
pub struct Lockstep {
    ranks: u64,
    timeout: Duration,
    /// Calls issued so far, over all ranks: rank r's call k (from 0) goes when it is k*ranks + r.
    issued: AtomicU64,
    /// Set by a rank that stopped issuing (an error): the others stop waiting.
    broken: AtomicBool,
}

impl Lockstep {
    /// Turns for `ranks` threads; a turn that does not come within `timeout` fails.
    pub fn new(ranks: usize, timeout: Duration) -> Lockstep {
        Lockstep { ranks: ranks as u64, timeout, issued: AtomicU64::new(0), broken: AtomicBool::new(false) }
    }

    /// Issues this rank's next call (`issue`) in its turn; `calls` counts this rank's calls so
    /// far (every rank makes the same number). A rank whose `issue` fails ends the turns for
    /// every rank.
    ///
    /// # Errors
    /// `issue`'s error; or, without issuing, when a rank broke off or the turn did not come
    /// within the timeout (the message names the call and whose turn it was).
    pub fn turn(&self, rank: usize, calls: &mut u64, issue: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
        let mine = *calls * self.ranks + rank as u64;
        let mut now = 0;
        let came = mscclpp::bench::wait_until(self.timeout, || {
            // Acquire: pairs with the Release add below (the previous turn's launch was issued).
            now = self.issued.load(Ordering::Acquire);
            now == mine || self.broken.load(Ordering::Acquire)
        });
        if self.broken.load(Ordering::Acquire) {
            return Err(format!("rank {rank}: another rank stopped issuing its calls (its error is reported too)"));
        }
        if !came {
            return Err(format!(
                "rank {rank}: call {}: rank {} did not issue its call {} within {:?}",
                *calls + 1,
                now % self.ranks,
                now / self.ranks + 1,
                self.timeout
            ));
        }
        let r = issue();
        if r.is_err() {
            self.break_off();
            return r;
        }
        *calls += 1;
        // Release: the next rank's turn comes after this launch was issued.
        self.issued.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// Ends the turns: every waiting and later `turn` fails. For a rank that stops issuing.
    pub fn break_off(&self) {
        self.broken.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn calls_are_issued_in_turns_rank_by_rank_and_round_by_round() {
        const RANKS: usize = 4;
        const CALLS: u64 = 300;
        let ls = Lockstep::new(RANKS, Duration::from_secs(30));
        let log = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for rank in 0..RANKS {
                let (ls, log) = (&ls, &log);
                s.spawn(move || {
                    let mut calls = 0;
                    for k in 0..CALLS {
                        ls.turn(rank, &mut calls, || {
                            log.lock().unwrap().push((k, rank));
                            Ok(())
                        })
                        .unwrap();
                    }
                    assert_eq!(calls, CALLS);
                });
            }
        });
        let log = log.into_inner().unwrap();
        let want: Vec<_> = (0..CALLS).flat_map(|k| (0..RANKS).map(move |r| (k, r))).collect();
        assert_eq!(log, want);
    }

    #[test]
    fn a_failed_call_releases_the_others_with_an_error() {
        let ls = Lockstep::new(3, Duration::from_secs(60));
        let t0 = std::time::Instant::now();
        let errs: Vec<String> = std::thread::scope(|s| {
            // Ranks 1 and 2 wait for rank 0's first call, which fails.
            let waiters: Vec<_> = (1..3)
                .map(|rank| {
                    let ls = &ls;
                    s.spawn(move || ls.turn(rank, &mut 0, || Ok(())).unwrap_err())
                })
                .collect();
            std::thread::sleep(Duration::from_millis(50));
            let e = ls.turn(0, &mut 0, || Err("launch failed".to_string())).unwrap_err();
            assert_eq!(e, "launch failed");
            waiters.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(t0.elapsed() < Duration::from_secs(30), "released by the failure, not the timeout");
        for e in &errs {
            assert!(e.contains("another rank stopped issuing"), "{e}");
        }
        let mut issued = false;
        assert!(
            ls.turn(0, &mut 1, || {
                issued = true;
                Ok(())
            })
            .is_err()
        );
        assert!(!issued, "nothing is issued once the turns ended");
    }

    #[test]
    fn a_missing_rank_times_out_naming_whose_turn_it_was() {
        let ls = Lockstep::new(3, Duration::from_millis(100));
        let mut calls = 0;
        let e = ls.turn(1, &mut calls, || Ok(())).unwrap_err();
        assert_eq!(calls, 0, "no call issued");
        assert!(e.contains("rank 1: call 1: rank 0 did not issue its call 1"), "{e}");
    }
}

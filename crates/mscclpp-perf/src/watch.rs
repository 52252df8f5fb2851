//! Where each rank thread of this process is, said when a run stops moving.
//!
//! Every wait of the library is bounded, but a run can still stall for longer than its
//! `--timeout` when waits follow each other, or when a CUDA call of one rank thread waits for
//! the whole GPU while a peer's kernel spins (issue #28's two-node runs stalled past their cap
//! once without a word). Rank threads say what they are doing ([`set`]); while ranks run as
//! threads ([`Watch`]), a watcher thread prints every rank's step and how long it has been in it
//! to stderr when no rank has moved on for the stall limit, and again at each further limit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Each rank's step and when it began (index = rank); empty while no ranks are watched.
static STEPS: Mutex<Vec<(String, Instant)>> = Mutex::new(Vec::new());

fn steps() -> MutexGuard<'static, Vec<(String, Instant)>> {
    STEPS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Rank `rank` of this process begins `what` (a no-op when ranks are not watched).
pub(crate) fn set(rank: usize, what: impl Into<String>) {
    if let Some(s) = steps().get_mut(rank) {
        *s = (what.into(), Instant::now());
    }
}

/// The stall limit for waits bounded by `timeout`: three of them, at least 10 s.
pub(crate) fn limit_for(timeout: Duration) -> Duration {
    timeout.saturating_mul(3).max(Duration::from_secs(10))
}

/// The report for `steps` at `now`: one line per rank with its step and the time in it.
fn report(steps: &[(String, Instant)], now: Instant, stalled: Duration) -> String {
    let mut s = format!(
        "mscclpp-perf: no rank has moved on for {:.0} s (a stall, or a long step); where the ranks are:",
        stalled.as_secs_f64()
    );
    for (rank, (what, since)) in steps.iter().enumerate() {
        s.push_str(&format!(
            "\n  rank {rank}: {what} (for {:.1} s)",
            now.saturating_duration_since(*since).as_secs_f64()
        ));
    }
    s
}

/// Whether to print now: the ranks have not moved on for `limit` (since `last`), and nothing was
/// said yet, or the last report came before a rank moved on, or one limit ago.
fn due(limit: Duration, said_at: Option<Instant>, last: Instant, now: Instant) -> bool {
    now.saturating_duration_since(last) >= limit
        && said_at.is_none_or(|t| t < last || now.saturating_duration_since(t) >= limit)
}

/// Watches `n` ranks while it lives (one watch at a time per process).
pub(crate) struct Watch {
    done: Arc<AtomicBool>,
    thread: std::thread::Thread,
}

impl Watch {
    /// Starts watching `n` ranks (all "starting") in a thread of `scope`, with stall limit
    /// `limit`.
    pub(crate) fn start<'s>(scope: &'s std::thread::Scope<'s, '_>, n: usize, limit: Duration) -> Watch {
        let now = Instant::now();
        {
            let mut s = steps();
            debug_assert!(s.is_empty(), "one watch at a time");
            *s = (0..n).map(|_| ("starting".to_string(), now)).collect();
        }
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        let handle = scope.spawn(move || {
            let mut said_at: Option<Instant> = None;
            while !flag.load(Ordering::Acquire) {
                // Woken at once by the drop (unpark), else every 200 ms.
                std::thread::park_timeout(Duration::from_millis(200));
                if flag.load(Ordering::Acquire) {
                    break;
                }
                let now = Instant::now();
                let text = {
                    let s = steps();
                    let Some(last) = s.iter().map(|(_, t)| *t).max() else { break };
                    due(limit, said_at, last, now).then(|| report(&s, now, now.saturating_duration_since(last)))
                };
                // Printed without the lock: a blocked stderr must not stop the ranks' `set`.
                if let Some(text) = text {
                    eprintln!("{text}");
                    said_at = Some(now);
                }
            }
        });
        Watch { done, thread: handle.thread().clone() }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
        self.thread.unpark();
        steps().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_names_every_rank_and_its_step() {
        let t0 = Instant::now();
        let steps = vec![("timed runs, 64 KiB in place".to_string(), t0), ("executor build, 64 KiB".to_string(), t0)];
        let r = report(&steps, t0 + Duration::from_millis(15_250), Duration::from_secs(15));
        assert!(r.starts_with("mscclpp-perf: no rank has moved on for 15 s (a stall, or a long step)"), "{r}");
        assert!(r.contains("\n  rank 0: timed runs, 64 KiB in place (for 15.2 s)"), "{r}");
        assert!(r.contains("\n  rank 1: executor build, 64 KiB (for 15.2 s)"), "{r}");
    }

    #[test]
    fn a_stall_is_reported_once_per_limit() {
        let (t0, lim) = (Instant::now(), Duration::from_secs(15));
        let at = |s: u64| t0 + Duration::from_secs(s);
        // Moving: nothing to say.
        assert!(!due(lim, None, t0, at(14)));
        // Stalled a limit: said once...
        assert!(due(lim, None, t0, at(15)));
        // ...not again within the next limit...
        assert!(!due(lim, Some(at(15)), t0, at(20)));
        // ...then again after it.
        assert!(due(lim, Some(at(15)), t0, at(30)));
        // A rank moved on after the report (at 16) and the ranks stalled a limit since: said.
        assert!(due(lim, Some(at(15)), at(16), at(31)));
    }

    #[test]
    fn the_limit_is_three_timeouts_and_at_least_ten_seconds() {
        assert_eq!(limit_for(Duration::from_secs(5)), Duration::from_secs(15));
        assert_eq!(limit_for(Duration::from_secs(1)), Duration::from_secs(10));
        assert_eq!(limit_for(Duration::MAX), Duration::MAX);
    }

    #[test]
    fn steps_are_kept_only_while_watched() {
        set(0, "nothing watches this");
        std::thread::scope(|sc| {
            let w = Watch::start(sc, 2, Duration::from_secs(3600));
            set(1, "building");
            assert_eq!(steps()[1].0, "building");
            assert_eq!(steps()[0].0, "starting");
            drop(w);
            assert!(steps().is_empty());
        });
    }
}

//! Shared waiting and locking helpers: one place for the lock that survives poisoning, deadlines
//! that do not overflow, and the spin -> yield -> sleep backoff every bounded wait uses.
//!
//! No wait in the library may spin a core for its whole timeout: a [`Backoff`] spins only for a
//! short first phase, then yields, then sleeps in growing steps up to a cap.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Locks a mutex, recovering the data if a panicking thread poisoned it (our critical sections
/// leave the data consistent at every step).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A point in time after which a wait gives up; `None` inside means "never" (a timeout so large
/// that `Instant + timeout` overflows, such as `Duration::MAX`).
///
/// The one way the library turns a user's timeout into a point in time: `Instant + timeout`
/// panics on overflow, so no code adds a user's duration to an instant itself. A zero timeout is
/// a deadline already passed (a wait then checks its condition once and gives up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Deadline(Option<Instant>);

impl Deadline {
    /// `timeout` from now.
    pub(crate) fn after(timeout: Duration) -> Deadline {
        Deadline::after_from(Instant::now(), timeout)
    }
    /// `timeout` from `start`.
    pub(crate) fn after_from(start: Instant, timeout: Duration) -> Deadline {
        Deadline(start.checked_add(timeout))
    }
    /// A deadline that never passes.
    pub(crate) fn never() -> Deadline {
        Deadline(None)
    }
    /// Whether the deadline has passed.
    pub(crate) fn expired(&self) -> bool {
        self.0.is_some_and(|d| Instant::now() >= d)
    }
    /// Time left (zero once passed; `Duration::MAX` for a deadline that never passes).
    pub(crate) fn remaining(&self) -> Duration {
        match self.0 {
            Some(d) => d.saturating_duration_since(Instant::now()),
            None => Duration::MAX,
        }
    }
    /// Time left, but at least `floor` (for socket timeouts and poll intervals, where zero
    /// would mean "no limit" or "do not wait at all").
    pub(crate) fn remaining_at_least(&self, floor: Duration) -> Duration {
        self.remaining().max(floor)
    }
    /// The instant, if the deadline can pass.
    pub(crate) fn instant(&self) -> Option<Instant> {
        self.0
    }
}

/// How a wait backs off: spin for `spin`, then yield until `yield_until`, then sleep, starting at
/// `sleep_min` and doubling up to `sleep_max` between polls. All durations are measured from the
/// first poll.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BackoffPolicy {
    pub(crate) spin: Duration,
    pub(crate) yield_until: Duration,
    pub(crate) sleep_min: Duration,
    pub(crate) sleep_max: Duration,
}

impl BackoffPolicy {
    /// For waits whose event usually arrives within microseconds (a flush, a queue slot): 200 us of
    /// spinning, yields until 2 ms, then sleeps of 50 us up to 1 ms.
    pub(crate) const FAST: BackoffPolicy = BackoffPolicy {
        spin: Duration::from_micros(200),
        yield_until: Duration::from_millis(2),
        sleep_min: Duration::from_micros(50),
        sleep_max: Duration::from_millis(1),
    };
    /// For retrying an attempt that failed at once (a refused connection): sleeps of 10 ms.
    pub(crate) const RETRY: BackoffPolicy = BackoffPolicy {
        spin: Duration::ZERO,
        yield_until: Duration::ZERO,
        sleep_min: Duration::from_millis(10),
        sleep_max: Duration::from_millis(10),
    };
}

/// The state of one backing-off wait; call [`Backoff::snooze`] between polls.
#[derive(Debug)]
pub(crate) struct Backoff {
    policy: BackoffPolicy,
    start: Instant,
    sleep: Duration,
}

#[allow(dead_code)] // the wait loops adopt it one by one
impl Backoff {
    pub(crate) fn new(policy: BackoffPolicy) -> Backoff {
        Backoff { policy, start: Instant::now(), sleep: policy.sleep_min }
    }

    /// Whether the wait is still in its spinning or yielding phase (waits that block on a
    /// notification afterwards, rather than sleep, poll only while this holds).
    pub(crate) fn polling(&self) -> bool {
        self.start.elapsed() < self.policy.yield_until
    }

    /// Waits a little before the next poll, never past `deadline`.
    pub(crate) fn snooze(&mut self, deadline: &Deadline) {
        let el = self.start.elapsed();
        if el < self.policy.spin {
            std::hint::spin_loop();
        } else if el < self.policy.yield_until {
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.sleep.min(deadline.remaining()));
            self.sleep = (self.sleep * 2).min(self.policy.sleep_max);
        }
    }
}

/// Polls `ready` until it returns `Ok(true)` (then `Ok(true)`), an error, or `timeout` passes
/// (then `Ok(false)`), backing off by `policy` between polls. `ready` runs at least once.
#[allow(dead_code)] // the wait loops adopt it one by one
pub(crate) fn poll_until<E>(
    timeout: Duration,
    policy: BackoffPolicy,
    mut ready: impl FnMut() -> std::result::Result<bool, E>,
) -> std::result::Result<bool, E> {
    let deadline = Deadline::after(timeout);
    let mut backoff = Backoff::new(policy);
    loop {
        if ready()? {
            return Ok(true);
        }
        if deadline.expired() {
            return Ok(false);
        }
        backoff.snooze(&deadline);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_until_times_out_without_spinning_the_whole_time() {
        let mut polls = 0u64;
        let t = Instant::now();
        let r: Result<bool, ()> = poll_until(Duration::from_millis(30), BackoffPolicy::FAST, || {
            polls += 1;
            Ok(false)
        });
        assert_eq!(r, Ok(false));
        assert!(t.elapsed() >= Duration::from_millis(30));
        // Sleeping phases poll at most every 1 ms; a spinning wait would poll millions of times.
        assert!(polls < 1_000_000, "{polls} polls in 30 ms");
    }

    #[test]
    fn poll_until_returns_ready_and_errors() {
        let mut n = 0;
        let r: Result<bool, ()> = poll_until(Duration::from_secs(5), BackoffPolicy::FAST, || {
            n += 1;
            Ok(n == 3)
        });
        assert_eq!(r, Ok(true));
        assert_eq!(poll_until(Duration::from_secs(5), BackoffPolicy::FAST, || Err::<bool, _>("bad")), Err("bad"));
        assert!(!Deadline::never().expired());
        assert!(Deadline::after(Duration::MAX).remaining() >= Duration::from_secs(1 << 40));
        assert!(Deadline::after(Duration::ZERO).expired());
    }

    /// Far timeouts mean no limit, without panicking; zero means already passed.
    #[test]
    fn deadlines_saturate() {
        let never = Deadline::after(Duration::MAX);
        assert_eq!(never, Deadline::never());
        assert_eq!(never.instant(), None);
        assert_eq!(never.remaining(), Duration::MAX);
        assert!(!never.expired());
        let t0 = Instant::now();
        assert_eq!(Deadline::after_from(t0, Duration::MAX), Deadline::never());
        assert_eq!(Deadline::after_from(t0, Duration::from_secs(u64::MAX / 2)), Deadline::never());
        let zero = Deadline::after_from(t0, Duration::ZERO);
        assert!(zero.expired());
        assert_eq!(zero.remaining(), Duration::ZERO);
        assert_eq!(zero.remaining_at_least(Duration::from_millis(1)), Duration::from_millis(1));
        let soon = Deadline::after_from(t0, Duration::from_secs(5));
        assert!(soon.instant().is_some() && soon.remaining() <= Duration::from_secs(5));
        // poll_until with no limit still returns as soon as the condition holds
        let mut n = 0;
        assert_eq!(
            poll_until(Duration::MAX, BackoffPolicy::FAST, || {
                n += 1;
                Ok::<_, ()>(n == 3)
            }),
            Ok(true)
        );
        // and with a zero limit checks once
        let mut polls = 0;
        assert_eq!(
            poll_until(Duration::ZERO, BackoffPolicy::FAST, || {
                polls += 1;
                Ok::<_, ()>(false)
            }),
            Ok(false)
        );
        assert_eq!(polls, 1);
    }
}

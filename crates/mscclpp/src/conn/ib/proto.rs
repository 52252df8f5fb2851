//! The IB transport's protocol cores, without verbs: the send accounting (what may be posted,
//! what a completion proves, what a flush waits for) and the HostNoAtomic token rebuild (32-bit
//! immediates back to 64-bit tokens). The shell in `conn/ib.rs` feeds them posts and completions
//! and does the verbs calls; the tests below drive them with random schedules.

/// The bounds a send queue works under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SendLimits {
    /// `max_write_queue_size`: work requests posted and not yet known complete (at least 1).
    pub(crate) queue: usize,
    /// The QP's `max_send_wr` (at least 1).
    pub(crate) max_send_wr: usize,
    /// The send CQ's depth: signalled work requests not yet polled (at least 1).
    pub(crate) cq_depth: u32,
    /// The most work requests one post carries (`max_wr_per_send`, at least 1).
    pub(crate) max_wr_per_send: usize,
}

impl SendLimits {
    /// Limits with every bound raised to at least 1.
    pub(crate) fn new(queue: usize, max_send_wr: usize, cq_depth: u32, max_wr_per_send: usize) -> SendLimits {
        SendLimits {
            queue: queue.max(1),
            max_send_wr: max_send_wr.max(1),
            cq_depth: cq_depth.max(1),
            max_wr_per_send: max_wr_per_send.max(1),
        }
    }

    /// The most work requests one post (one batch, its last one signalled) may carry.
    pub(crate) fn batch_max(&self) -> usize {
        self.max_wr_per_send.min(self.max_send_wr).min(self.queue)
    }
}

/// What a completion the shell polled means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Completion {
    /// Every work request up to and including `wr_id` is done.
    Done,
    /// The work request failed: the connection is broken.
    Failed,
    /// A completion that no signalled work request explains (a `wr_id` already covered or
    /// never posted): the provider misbehaves, and the connection is broken too.
    Unexpected,
}

/// The send side's accounting. Every work request gets a sequence number; only the last one of
/// each post is signalled, with its sequence number as `wr_id`. An RC queue pair completes in
/// order, so a successful completion of `s` proves every work request up to `s`, and
/// `completed` is one number.
#[derive(Clone, Debug)]
pub(crate) struct SendAccounting {
    limits: SendLimits,
    /// Sequence number of the next work request.
    posted: u64,
    /// Every work request below this completed successfully.
    completed: u64,
    /// Signalled work requests posted and not yet polled.
    signaled_out: u32,
    /// Set by the first failed or unexpected completion; nothing counts after it.
    broken: bool,
}

impl SendAccounting {
    pub(crate) fn new(limits: SendLimits) -> SendAccounting {
        SendAccounting { limits, posted: 0, completed: 0, signaled_out: 0, broken: false }
    }

    pub(crate) fn limits(&self) -> &SendLimits {
        &self.limits
    }

    /// Work requests posted and not yet known complete.
    pub(crate) fn outstanding(&self) -> u64 {
        self.posted - self.completed
    }

    /// Sequence number of the next work request (what a flush begun now waits for).
    pub(crate) fn posted(&self) -> u64 {
        self.posted
    }

    /// Signalled work requests whose completions are still in (or on their way to) the CQ.
    #[cfg(test)]
    pub(crate) fn signaled_out(&self) -> u32 {
        self.signaled_out
    }

    /// Whether a post of `n` work requests (`n <= batch_max()`) fits now: the queue bound and
    /// the send queue hold them, and the CQ has room for one more signalled completion.
    pub(crate) fn can_post(&self, n: usize) -> bool {
        let inflight = self.outstanding() as usize;
        let room = self.limits.queue.max(n).min(self.limits.max_send_wr);
        inflight + n <= room && self.signaled_out < self.limits.cq_depth
    }

    /// Records a post of `n` work requests; returns the first one's sequence number (the shell
    /// gives work request `i` of the post the `wr_id` `first + i` and signals the last).
    pub(crate) fn on_posted(&mut self, n: usize) -> u64 {
        let first = self.posted;
        if n > 0 {
            self.posted += n as u64;
            self.signaled_out += 1;
        }
        first
    }

    /// Records one polled completion of `wr_id`.
    pub(crate) fn on_completion(&mut self, wr_id: u64, success: bool) -> Completion {
        self.signaled_out = self.signaled_out.saturating_sub(1);
        if self.broken {
            return Completion::Failed;
        }
        if !success {
            self.broken = true;
            return Completion::Failed;
        }
        if wr_id < self.completed || wr_id >= self.posted {
            self.broken = true;
            return Completion::Unexpected;
        }
        self.completed = wr_id + 1;
        Completion::Done
    }

    /// Whether every work request below `target` (a [`posted`](Self::posted) taken when a
    /// flush began) has completed.
    pub(crate) fn covers(&self, target: u64) -> bool {
        self.completed >= target
    }
}

/// Rebuilds the 64-bit tokens of a HostNoAtomic connection from the low 32 bits each
/// WRITE_WITH_IMM carries. The sender grows its token by 1 to 2^32 - 1 per update
/// (`check_update` refuses the rest), and immediates arrive in order, so a low half smaller
/// than the last one means the high half grew by one.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TokenRebuild {
    high: u64,
    last_low: u32,
}

impl TokenRebuild {
    pub(crate) fn new() -> TokenRebuild {
        TokenRebuild::default()
    }

    /// The full token of the next immediate `low`.
    pub(crate) fn next(&mut self, low: u32) -> u64 {
        if low < self.last_low {
            self.high = self.high.wrapping_add(1 << 32);
        }
        self.last_low = low;
        self.high | low as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    /// A model RC queue pair: work requests complete in order; the completion of a signalled
    /// one goes into a CQ that the model checks never overflows.
    struct Model {
        acct: SendAccounting,
        /// (wr_id, signalled) posted and not yet executed, in order.
        sq: VecDeque<(u64, bool)>,
        /// Completions executed and not yet polled.
        cq: VecDeque<(u64, bool)>,
        /// Work requests whose successful completion was polled (directly or by a later one).
        proven: u64,
        error_at: Option<u64>,
    }

    #[derive(Clone, Debug)]
    enum Step {
        /// Try to post this many work requests (split into batches as the shell does).
        Post(usize),
        /// The NIC executes this many work requests.
        Execute(usize),
        /// The shell polls up to this many completions.
        Poll(usize),
        /// The next executed work request fails.
        Fail,
        /// A flush begins, then steps run; it must be covered once the model says so.
        Flush,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (1usize..20).prop_map(Step::Post),
            3 => (1usize..10).prop_map(Step::Execute),
            3 => (1usize..6).prop_map(Step::Poll),
            1 => Just(Step::Fail),
            1 => Just(Step::Flush),
        ]
    }

    fn limits() -> impl Strategy<Value = SendLimits> {
        (1usize..12, 1usize..12, 1u32..6, 1usize..8).prop_map(|(q, sq, cq, b)| SendLimits::new(q, sq, cq, b))
    }

    impl Model {
        /// An idle queue pair under `lim`.
        fn new(lim: SendLimits) -> Model {
            Model {
                acct: SendAccounting::new(lim),
                sq: VecDeque::new(),
                cq: VecDeque::new(),
                proven: 0,
                error_at: None,
            }
        }

        fn post(&mut self, n: usize) -> usize {
            let mut done = 0;
            while done < n {
                let b = (n - done).min(self.acct.limits().batch_max());
                if !self.acct.can_post(b) {
                    break;
                }
                let first = self.acct.on_posted(b);
                for i in 0..b as u64 {
                    self.sq.push_back((first + i, i + 1 == b as u64));
                }
                assert!(self.sq.len() <= self.acct.limits().max_send_wr, "posted past max_send_wr");
                done += b;
            }
            done
        }

        fn execute(&mut self, n: usize) {
            for _ in 0..n {
                let Some((id, signalled)) = self.sq.pop_front() else { return };
                let ok = self.error_at.is_none_or(|e| id < e);
                // RC: a failed WR completes (signalled or not), and everything after it is
                // flushed with errors; only signalled successes make completions.
                if signalled || !ok {
                    self.cq.push_back((id, ok));
                    // Error completions beyond the CQ are the provider's problem; success
                    // completions overflowing it would be ours.
                    if ok {
                        assert!(
                            self.cq.iter().filter(|c| c.1).count() <= self.acct.limits().cq_depth as usize,
                            "CQ overflow"
                        );
                    }
                }
            }
        }

        fn poll(&mut self, n: usize) -> bool {
            for _ in 0..n {
                let Some((id, ok)) = self.cq.pop_front() else { return true };
                let before = self.acct.outstanding();
                match self.acct.on_completion(id, ok) {
                    Completion::Done => {
                        assert!(ok);
                        assert!(id + 1 > self.proven, "counted twice: {id} after {}", self.proven);
                        self.proven = id + 1;
                        assert!(self.acct.outstanding() < before);
                    }
                    Completion::Failed => {
                        assert!(!ok || self.error_at.is_some_and(|e| id >= e));
                        return false;
                    }
                    Completion::Unexpected => panic!("unexpected completion {id} from a correct queue"),
                }
            }
            true
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Random posts, executions, polls, failures and flushes: the CQ never overflows, no
        /// post exceeds a bound, nothing is counted twice, and a flush is covered exactly when
        /// every work request posted before it completed.
        #[test]
        fn random_schedules_keep_every_bound(lim in limits(), steps in prop::collection::vec(step(), 1..200)) {
            let mut m = Model::new(lim);
            let mut flushes: Vec<u64> = Vec::new();
            let mut broken = false;
            for s in steps {
                match s {
                    Step::Post(n) => {
                        if broken { continue; }
                        m.post(n);
                    }
                    Step::Execute(n) => m.execute(n),
                    Step::Poll(n) => {
                        if !broken && !m.poll(n) {
                            broken = true;
                        }
                    }
                    Step::Fail => {
                        if m.error_at.is_none() {
                            m.error_at = Some(m.acct.posted());
                        }
                    }
                    Step::Flush => flushes.push(m.acct.posted()),
                }
                let a = &m.acct;
                prop_assert!(a.outstanding() as usize <= lim.queue.max(lim.batch_max()).min(lim.max_send_wr));
                prop_assert!(a.signaled_out() <= lim.cq_depth);
                for &t in &flushes {
                    prop_assert_eq!(a.covers(t), m.proven >= t);
                }
            }
            // Without a failure, executing and polling everything drains the accounting and
            // covers every flush.
            if !broken && m.error_at.is_none() {
                m.execute(usize::MAX >> 1);
                prop_assert!(m.poll(usize::MAX >> 1));
                prop_assert_eq!(m.acct.outstanding(), 0);
                prop_assert_eq!(m.acct.signaled_out(), 0);
                for &t in &flushes {
                    prop_assert!(m.acct.covers(t));
                }
            }
        }

        /// Whatever the bounds, a queue that keeps being drained accepts every post eventually
        /// (no bound combination deadlocks a post).
        #[test]
        fn posts_always_make_progress(lim in limits(), n in 1usize..200) {
            let mut m = Model::new(lim);
            let mut left = n;
            let mut rounds = 0;
            while left > 0 {
                left -= m.post(left);
                m.execute(1);
                prop_assert!(m.poll(1));
                rounds += 1;
                prop_assert!(rounds < 10 * n + 100, "stuck with {} left", left);
            }
        }

        /// Tokens growing by 1 .. 2^32 - 1 per update are rebuilt exactly from their low 32
        /// bits, across any number of 2^32 crossings.
        #[test]
        fn tokens_rebuild_across_wraps(deltas in prop::collection::vec(prop_oneof![
            1u64..4,
            (1u64 << 32) - 4..1u64 << 32,
            1u64..1u64 << 32,
        ], 1..300)) {
            let mut r = TokenRebuild::new();
            let mut token = 0u64;
            for d in deltas {
                token += d;
                prop_assert_eq!(r.next(token as u32), token);
            }
        }
    }

    #[test]
    fn completions_out_of_place_are_unexpected_and_break() {
        let mut a = SendAccounting::new(SendLimits::new(8, 8, 4, 4));
        let first = a.on_posted(3);
        assert_eq!(first, 0);
        assert_eq!(a.on_completion(5, true), Completion::Unexpected, "never posted");
        assert_eq!(a.on_completion(2, true), Completion::Failed, "nothing counts after a break");
        assert!(!a.covers(1));

        let mut a = SendAccounting::new(SendLimits::new(8, 8, 4, 4));
        a.on_posted(2);
        a.on_posted(2);
        assert_eq!(a.on_completion(1, true), Completion::Done);
        assert_eq!(a.on_completion(1, true), Completion::Unexpected, "counted twice");

        let mut a = SendAccounting::new(SendLimits::new(8, 8, 4, 4));
        a.on_posted(2);
        assert_eq!(a.on_completion(1, false), Completion::Failed);
        assert_eq!(a.outstanding(), 2, "a failure proves nothing");
    }

    #[test]
    fn bounds_decide_posts() {
        // Queue bound 2, send queue 8, CQ 1.
        let mut a = SendAccounting::new(SendLimits::new(2, 8, 1, 4));
        assert_eq!(a.limits().batch_max(), 2);
        assert!(a.can_post(2));
        a.on_posted(1);
        assert!(!a.can_post(1), "the CQ holds one signalled completion");
        assert_eq!(a.on_completion(0, true), Completion::Done);
        assert!(a.can_post(2));
        a.on_posted(2);
        assert!(!a.can_post(1));
        // The send queue bounds too: 3 posted of max_send_wr 3 leaves no room.
        let mut a = SendAccounting::new(SendLimits::new(8, 3, 4, 8));
        assert_eq!(a.limits().batch_max(), 3);
        a.on_posted(3);
        assert!(!a.can_post(1));
        // Zero-sized bounds act as 1.
        assert_eq!(SendLimits::new(0, 0, 0, 0), SendLimits::new(1, 1, 1, 1));
    }

    #[test]
    fn token_rebuild_crosses_2_pow_32() {
        let mut r = TokenRebuild::new();
        assert_eq!(r.next(0xffff_fffe), 0xffff_fffe);
        assert_eq!(r.next(0xffff_ffff), 0xffff_ffff);
        assert_eq!(r.next(0), 1 << 32);
        assert_eq!(r.next(5), (1 << 32) + 5);
        // The largest step that still works: 2^32 - 1.
        assert_eq!(r.next(4), (2 << 32) + 4);
        // The high half wraps with the 64-bit token.
        let mut r = TokenRebuild { high: 0xffff_ffff << 32, last_low: 7 };
        assert_eq!(r.next(3), 3);
    }
}

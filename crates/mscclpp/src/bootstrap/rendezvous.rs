//! The root's rendezvous as a plain state machine: fed "rank r joined with address A" and "time
//! passed", it says what to answer on which connection. The root thread in `tcp.rs` only accepts
//! sockets, reads hellos and writes the answers this core returns.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::proto::{AddressTable, RootAnswer, RootStatus};

/// How often ranks that have arrived hear which ranks are still missing.
pub(crate) const PROGRESS_EVERY: Duration = Duration::from_millis(300);

/// A rank's join request, as its root hello said it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Join {
    pub(crate) rank: u32,
    pub(crate) size: u32,
    pub(crate) listen: SocketAddr,
    pub(crate) host_hash: u64,
}

/// What to send: `answer` on the connection the shell knows as `conn`; `close` when that
/// connection has nothing more to hear.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Reply<C> {
    pub(crate) conn: C,
    pub(crate) answer: RootAnswer,
    pub(crate) close: bool,
}

/// The rendezvous of one job of `size` ranks. `C` names a connection for the shell.
pub(crate) struct Rendezvous<C> {
    secret: [u8; 16],
    size: usize,
    deadline: Instant,
    last_progress: Instant,
    joined: Vec<Option<(C, SocketAddr, u64)>>,
    count: usize,
    finished: bool,
}

impl<C: Copy> Rendezvous<C> {
    /// A rendezvous that gives up at `deadline`.
    pub(crate) fn new(secret: [u8; 16], size: usize, now: Instant, deadline: Instant) -> Rendezvous<C> {
        Rendezvous { secret, size, deadline, last_progress: now, joined: vec![None; size], count: 0, finished: false }
    }

    /// Whether the rendezvous is over (everyone answered, or the root gave up).
    pub(crate) fn is_finished(&self) -> bool {
        self.finished
    }

    /// When [`on_time`](Self::on_time) next has something to do.
    pub(crate) fn next_wakeup(&self) -> Instant {
        (self.last_progress + PROGRESS_EVERY).min(self.deadline)
    }

    /// The ranks that have not joined yet.
    pub(crate) fn missing(&self) -> Vec<u32> {
        self.joined.iter().enumerate().filter(|(_, j)| j.is_none()).map(|(i, _)| i as u32).collect()
    }

    fn answer(&self, conn: C, status: RootStatus, close: bool) -> Reply<C> {
        Reply { conn, answer: RootAnswer { secret: self.secret, status }, close }
    }

    fn refuse(&self, conn: C, message: String) -> Reply<C> {
        self.answer(conn, RootStatus::Failed { timeout: false, message }, true)
    }

    /// A rank asks to join on connection `conn`.
    pub(crate) fn on_join(&mut self, conn: C, j: Join, _now: Instant) -> Vec<Reply<C>> {
        if self.finished {
            return vec![self.refuse(conn, format!("rank {} joined after the rendezvous ended", j.rank))];
        }
        let rank = j.rank as usize;
        if j.size as usize != self.size {
            return vec![self.refuse(
                conn,
                format!("rank {} says the job has {} ranks, the root expects {}", j.rank, j.size, self.size),
            )];
        }
        if rank >= self.size {
            return vec![self.refuse(conn, format!("rank {} is out of range for {} ranks", j.rank, self.size))];
        }
        if self.joined[rank].is_some() {
            return vec![self.refuse(conn, format!("rank {} joined twice; refusing the second", j.rank))];
        }
        self.joined[rank] = Some((conn, j.listen, j.host_hash));
        self.count += 1;
        if self.count < self.size {
            return Vec::new();
        }
        self.finished = true;
        let table = AddressTable { entries: self.joined.iter().flatten().map(|(_, a, h)| (*a, *h)).collect() };
        self.joined.iter().flatten().map(|(c, _, _)| self.answer(*c, RootStatus::Done(table.clone()), true)).collect()
    }

    /// Time passed: progress notes every [`PROGRESS_EVERY`], and at the deadline a failure naming
    /// the missing ranks to everyone who arrived.
    pub(crate) fn on_time(&mut self, now: Instant) -> Vec<Reply<C>> {
        if self.finished {
            return Vec::new();
        }
        let missing = self.missing();
        if now >= self.deadline {
            self.finished = true;
            let list: Vec<String> = missing.iter().map(|m| m.to_string()).collect();
            let message = format!("ranks [{}] did not reach the bootstrap root", list.join(", "));
            let status = RootStatus::Failed { timeout: true, message };
            return self.joined.iter().flatten().map(|(c, _, _)| self.answer(*c, status.clone(), true)).collect();
        }
        if now.duration_since(self.last_progress) < PROGRESS_EVERY {
            return Vec::new();
        }
        self.last_progress = now;
        let status = RootStatus::Progress { missing };
        self.joined.iter().flatten().map(|(c, _, _)| self.answer(*c, status.clone(), false)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn join(rank: u32, size: u32) -> Join {
        Join { rank, size, listen: SocketAddr::from(([10, 0, 0, 1], 1000 + rank as u16)), host_hash: rank as u64 }
    }

    fn done_table(r: &Reply<usize>) -> &AddressTable {
        match &r.answer.status {
            RootStatus::Done(t) => t,
            s => panic!("expected the table, got {s:?}"),
        }
    }

    #[test]
    fn everyone_gets_the_table_when_the_last_rank_arrives() {
        let t0 = Instant::now();
        let mut rv = Rendezvous::new([1; 16], 3, t0, t0 + Duration::from_secs(5));
        assert!(rv.on_join(10, join(2, 3), t0).is_empty());
        assert!(rv.on_join(11, join(0, 3), t0).is_empty());
        assert_eq!(rv.missing(), vec![1]);
        let out = rv.on_join(12, join(1, 3), t0);
        assert!(rv.is_finished());
        let mut conns: Vec<usize> = out.iter().map(|r| r.conn).collect();
        conns.sort();
        assert_eq!(conns, vec![10, 11, 12]);
        for r in &out {
            assert_eq!(r.answer.secret, [1; 16]);
            assert!(r.close);
            let t = done_table(r);
            assert_eq!(t.entries, (0..3).map(|i| (join(i, 3).listen, i as u64)).collect::<Vec<_>>());
        }
        assert!(rv.on_time(t0 + Duration::from_secs(10)).is_empty(), "nothing after the end");
    }

    #[test]
    fn duplicates_wrong_sizes_and_strangers_are_refused_alone() {
        let t0 = Instant::now();
        let mut rv = Rendezvous::new([0; 16], 2, t0, t0 + Duration::from_secs(5));
        assert!(rv.on_join(1, join(0, 2), t0).is_empty());
        for (conn, j, what) in
            [(2, join(0, 2), "joined twice"), (3, join(1, 3), "expects 2"), (4, join(7, 2), "out of range")]
        {
            let out = rv.on_join(conn, j, t0);
            assert_eq!(out.len(), 1);
            assert_eq!(out[0].conn, conn);
            match &out[0].answer.status {
                RootStatus::Failed { timeout: false, message } => assert!(message.contains(what), "{message}"),
                s => panic!("{s:?}"),
            }
        }
        assert!(!rv.is_finished(), "a refused rank does not disturb the job");
        let out = rv.on_join(5, join(1, 2), t0);
        assert_eq!(out.len(), 2);
        assert_eq!(done_table(&out[0]).entries[0].0, join(0, 2).listen, "the first rank 0 keeps its place");
        let late = rv.on_join(6, join(1, 2), t0);
        assert!(matches!(&late[0].answer.status, RootStatus::Failed { message, .. } if message.contains("after")));
    }

    #[test]
    fn progress_then_failure_naming_the_missing_ranks() {
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(2);
        let mut rv = Rendezvous::new([0; 16], 4, t0, deadline);
        rv.on_join(0, join(0, 4), t0);
        rv.on_join(3, join(3, 4), t0);
        assert!(rv.on_time(t0 + PROGRESS_EVERY / 2).is_empty());
        assert_eq!(rv.next_wakeup(), t0 + PROGRESS_EVERY);
        let p = rv.on_time(t0 + PROGRESS_EVERY);
        assert_eq!(p.len(), 2);
        for r in &p {
            assert!(!r.close);
            assert_eq!(r.answer.status, RootStatus::Progress { missing: vec![1, 2] });
        }
        rv.on_join(2, join(2, 4), t0 + Duration::from_secs(1)); // late but in time
        let f = rv.on_time(deadline);
        assert!(rv.is_finished());
        assert_eq!(f.len(), 3);
        for r in &f {
            assert!(r.close);
            match &r.answer.status {
                RootStatus::Failed { timeout: true, message } => assert!(message.contains("[1]"), "{message}"),
                s => panic!("{s:?}"),
            }
        }
    }

    proptest! {
        /// Any arrival order, with duplicates and strangers mixed in: each genuine rank gets
        /// exactly one final answer, the same table in rank order, and every refused connection
        /// exactly one refusal.
        #[test]
        fn any_arrival_order(n in 1usize..24, seed in any::<u64>(), dups in proptest::collection::vec(0u32..24, 0..6)) {
            let mut order: Vec<u32> = (0..n as u32).collect();
            let mut x = seed | 1;
            for i in (1..order.len()).rev() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let t0 = Instant::now();
            let mut rv = Rendezvous::new([9; 16], n, t0, t0 + Duration::from_secs(60));
            let mut replies = Vec::new();
            let mut conn = 0usize;
            let mut arrived = std::collections::HashSet::new();
            for (i, r) in order.iter().enumerate() {
                if let Some(d) = dups.get(i) {
                    // a duplicate of an arrived rank, or an out-of-range rank
                    conn += 1;
                    let out = rv.on_join(1000 + conn, join(*d, n as u32), t0);
                    let expect_refusal = arrived.contains(d) || *d as usize >= n;
                    if expect_refusal {
                        prop_assert_eq!(out.len(), 1);
                        let refused = matches!(out[0].answer.status, RootStatus::Failed { timeout: false, .. });
                        prop_assert!(refused);
                    } else {
                        arrived.insert(*d);
                        replies.extend(out);
                    }
                }
                if arrived.insert(*r) {
                    conn += 1;
                    replies.extend(rv.on_join(conn, join(*r, n as u32), t0));
                }
                replies.extend(rv.on_time(t0 + PROGRESS_EVERY * (i as u32 + 1)).into_iter().filter(|r| r.close));
            }
            prop_assert!(rv.is_finished());
            let finals: Vec<&Reply<usize>> = replies.iter().filter(|r| r.close).collect();
            prop_assert_eq!(finals.len(), n);
            let mut conns: Vec<usize> = finals.iter().map(|r| r.conn).collect();
            conns.sort();
            conns.dedup();
            prop_assert_eq!(conns.len(), n);
            for r in finals {
                let t = done_table(r);
                prop_assert_eq!(t.entries.len(), n);
                for (i, (a, h)) in t.entries.iter().enumerate() {
                    prop_assert_eq!(*a, join(i as u32, n as u32).listen);
                    prop_assert_eq!(*h, i as u64);
                }
            }
        }
    }
}

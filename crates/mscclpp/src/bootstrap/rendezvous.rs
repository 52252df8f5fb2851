//! The root's rendezvous as a plain state machine: fed "rank r joined with address A", "rank r
//! asks who is missing" and "time passed", it says what to answer on which connection and what
//! to deliver to which rank. The root thread in `tcp.rs` only accepts sockets, reads hellos,
//! writes the answers and makes the deliveries this core returns.
//!
//! The root holds no connection to a rank once it has answered its join: the final answer (the
//! table, or the failure naming the missing ranks) is delivered later by connecting to the
//! rank's listener, a bounded number at a time, so the root needs a handful of file descriptors
//! whatever the job size. Every final answer shares one [`Arc`]: the root's memory is the table
//! once, not once per rank.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::proto::{AddressTable, RootAnswer, RootStatus};

/// A rank's join request, as its root hello said it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Join {
    pub(crate) rank: u32,
    pub(crate) size: u32,
    pub(crate) listen: SocketAddr,
    pub(crate) host_hash: u64,
}

/// Where an answer goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum To<C> {
    /// On the connection the shell knows as `C` (which then closes).
    Conn(C),
    /// To this rank, by connecting to its listening address.
    Rank(u32, SocketAddr),
}

/// What to send, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Reply<C> {
    pub(crate) to: To<C>,
    pub(crate) answer: Arc<RootAnswer>,
}

/// The rendezvous of one job of `size` ranks. The `C` of its replies names a connection for the
/// shell.
pub(crate) struct Rendezvous {
    secret: [u8; 16],
    size: usize,
    /// When the root gives up (`None`: never).
    deadline: Option<Instant>,
    joined: Vec<Option<(SocketAddr, u64)>>,
    count: usize,
    /// The final answer, once there is one (everyone joined, or the root gave up).
    outcome: Option<Arc<RootAnswer>>,
}

impl Rendezvous {
    /// A rendezvous that gives up at `deadline` (`None`: waits for every rank without limit).
    pub(crate) fn new(secret: [u8; 16], size: usize, deadline: Option<Instant>) -> Rendezvous {
        Rendezvous { secret, size, deadline, joined: vec![None; size], count: 0, outcome: None }
    }

    /// Whether the rendezvous is over (everyone arrived, or the root gave up).
    pub(crate) fn is_finished(&self) -> bool {
        self.outcome.is_some()
    }

    /// When [`on_time`](Self::on_time) next has something to do (`None`: never).
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        self.deadline
    }

    /// The ranks that have not joined yet.
    pub(crate) fn missing(&self) -> Vec<u32> {
        self.joined.iter().enumerate().filter(|(_, j)| j.is_none()).map(|(i, _)| i as u32).collect()
    }

    fn answer<C>(&self, to: To<C>, status: RootStatus) -> Reply<C> {
        Reply { to, answer: Arc::new(RootAnswer { secret: self.secret, status }) }
    }

    fn refuse<C>(&self, conn: C, message: String) -> Vec<Reply<C>> {
        vec![self.answer(To::Conn(conn), RootStatus::Failed { timeout: false, message })]
    }

    /// The final answer, to every rank that joined.
    fn finish<C>(&mut self, status: RootStatus) -> Vec<Reply<C>> {
        let answer = Arc::new(RootAnswer { secret: self.secret, status });
        self.outcome = Some(answer.clone());
        self.joined
            .iter()
            .enumerate()
            .filter_map(|(r, j)| j.map(|(a, _)| Reply { to: To::Rank(r as u32, a), answer: answer.clone() }))
            .collect()
    }

    /// A rank asks to join on connection `conn`: a refusal, or `Joined` on `conn` (and, from the
    /// last rank, the table to every rank).
    pub(crate) fn on_join<C>(&mut self, conn: C, j: Join) -> Vec<Reply<C>> {
        if self.outcome.is_some() {
            return self.refuse(conn, format!("rank {} joined after the rendezvous ended", j.rank));
        }
        let rank = j.rank as usize;
        if j.size as usize != self.size {
            return self.refuse(
                conn,
                format!("rank {} says the job has {} ranks, the root expects {}", j.rank, j.size, self.size),
            );
        }
        if rank >= self.size {
            return self.refuse(conn, format!("rank {} is out of range for {} ranks", j.rank, self.size));
        }
        if self.joined[rank].is_some() {
            return self.refuse(conn, format!("rank {} joined twice; refusing the second", j.rank));
        }
        self.joined[rank] = Some((j.listen, j.host_hash));
        self.count += 1;
        let mut out = vec![self.answer(To::Conn(conn), RootStatus::Joined)];
        if self.count == self.size {
            let table = AddressTable { entries: self.joined.iter().flatten().copied().collect() };
            out.extend(self.finish(RootStatus::Done(table)));
        }
        out
    }

    /// A rank asks on connection `conn` who is missing: the list, or the final answer once
    /// there is one (a rank whose delivery was lost gets it this way).
    pub(crate) fn on_query<C>(&self, conn: C) -> Reply<C> {
        match &self.outcome {
            Some(a) => Reply { to: To::Conn(conn), answer: a.clone() },
            None => self.answer(To::Conn(conn), RootStatus::Progress { missing: self.missing() }),
        }
    }

    /// Time passed: at the deadline, a failure naming the missing ranks to everyone who arrived.
    pub(crate) fn on_time<C>(&mut self, now: Instant) -> Vec<Reply<C>> {
        if self.outcome.is_some() || self.deadline.is_none_or(|d| now < d) {
            return Vec::new();
        }
        let list: Vec<String> = self.missing().iter().map(|m| m.to_string()).collect();
        let message = format!("ranks [{}] did not reach the bootstrap root", list.join(", "));
        self.finish(RootStatus::Failed { timeout: true, message })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    fn join(rank: u32, size: u32) -> Join {
        Join { rank, size, listen: SocketAddr::from(([10, 0, 0, 1], 1000 + rank as u16)), host_hash: rank as u64 }
    }

    fn done_table(r: &Reply<usize>) -> &AddressTable {
        match &r.answer.status {
            RootStatus::Done(t) => t,
            s => panic!("expected the table, got {s:?}"),
        }
    }

    fn deliveries(out: &[Reply<usize>]) -> Vec<&Reply<usize>> {
        out.iter().filter(|r| matches!(r.to, To::Rank(..))).collect()
    }

    #[test]
    fn everyone_gets_the_table_when_the_last_rank_arrives() {
        let t0 = Instant::now();
        let mut rv = Rendezvous::new([1; 16], 3, Some(t0 + Duration::from_secs(5)));
        for (conn, r) in [(10, 2), (11, 0)] {
            let out = rv.on_join(conn, join(r, 3));
            assert_eq!(out.len(), 1);
            assert_eq!(out[0].to, To::Conn(conn));
            assert_eq!(out[0].answer.status, RootStatus::Joined);
        }
        assert_eq!(rv.missing(), vec![1]);
        assert_eq!(rv.on_query(99).answer.status, RootStatus::Progress { missing: vec![1] });
        let out = rv.on_join(12, join(1, 3));
        assert!(rv.is_finished());
        assert_eq!(
            out[0],
            Reply { to: To::Conn(12), answer: Arc::new(RootAnswer { secret: [1; 16], status: RootStatus::Joined }) }
        );
        let d = deliveries(&out);
        assert_eq!(d.len(), 3);
        for (i, r) in d.iter().enumerate() {
            assert_eq!(r.to, To::Rank(i as u32, join(i as u32, 3).listen));
            assert_eq!(r.answer.secret, [1; 16]);
            assert!(Arc::ptr_eq(&r.answer, &d[0].answer), "one table shared by every delivery");
            let t = done_table(r);
            assert_eq!(t.entries, (0..3).map(|i| (join(i, 3).listen, i as u64)).collect::<Vec<_>>());
        }
        assert!(rv.on_time::<usize>(t0 + Duration::from_secs(10)).is_empty(), "nothing after the end");
        // a rank whose delivery was lost asks, and gets the table
        assert!(Arc::ptr_eq(&rv.on_query(13).answer, &d[0].answer));
    }

    /// Without a deadline (a timeout too far to be an instant) the root never gives up on its
    /// own, however late the clock says it is, and still finishes when the last rank arrives.
    #[test]
    fn no_deadline_means_no_limit() {
        let mut rv = Rendezvous::new([2; 16], 2, None);
        assert_eq!(rv.next_wakeup(), None);
        let far = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
        assert!(rv.on_time::<usize>(far).is_empty());
        assert!(!rv.is_finished());
        rv.on_join(1, join(0, 2));
        assert!(rv.on_time::<usize>(far).is_empty());
        let out = rv.on_join(2, join(1, 2));
        assert!(rv.is_finished());
        assert_eq!(deliveries(&out).len(), 2);
    }

    #[test]
    fn duplicates_wrong_sizes_and_strangers_are_refused_alone() {
        let t0 = Instant::now();
        let mut rv = Rendezvous::new([0; 16], 2, Some(t0 + Duration::from_secs(5)));
        assert_eq!(rv.on_join(1, join(0, 2)).len(), 1);
        for (conn, j, what) in
            [(2, join(0, 2), "joined twice"), (3, join(1, 3), "expects 2"), (4, join(7, 2), "out of range")]
        {
            let out = rv.on_join(conn, j);
            assert_eq!(out.len(), 1);
            assert_eq!(out[0].to, To::Conn(conn));
            match &out[0].answer.status {
                RootStatus::Failed { timeout: false, message } => assert!(message.contains(what), "{message}"),
                s => panic!("{s:?}"),
            }
        }
        assert!(!rv.is_finished(), "a refused rank does not disturb the job");
        let out = rv.on_join(5, join(1, 2));
        let d = deliveries(&out);
        assert_eq!(d.len(), 2);
        assert_eq!(done_table(d[0]).entries[0].0, join(0, 2).listen, "the first rank 0 keeps its place");
        let late = rv.on_join(6, join(1, 2));
        assert_eq!(late.len(), 1);
        assert!(matches!(&late[0].answer.status, RootStatus::Failed { message, .. } if message.contains("after")));
    }

    #[test]
    fn failure_at_the_deadline_names_the_missing_ranks() {
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(2);
        let mut rv = Rendezvous::new([0; 16], 4, Some(deadline));
        rv.on_join(0, join(0, 4));
        rv.on_join(3, join(3, 4));
        assert!(rv.on_time::<usize>(deadline - Duration::from_millis(1)).is_empty());
        assert_eq!(rv.next_wakeup(), Some(deadline));
        assert_eq!(rv.on_query(7).answer.status, RootStatus::Progress { missing: vec![1, 2] });
        rv.on_join(2, join(2, 4)); // late but in time
        let f = rv.on_time::<usize>(deadline);
        assert!(rv.is_finished());
        let to: Vec<To<usize>> = f.iter().map(|r| r.to).collect();
        assert_eq!(to, [0, 2, 3].map(|r| To::Rank(r, join(r, 4).listen)).to_vec());
        for r in &f {
            match &r.answer.status {
                RootStatus::Failed { timeout: true, message } => assert!(message.contains("[1]"), "{message}"),
                s => panic!("{s:?}"),
            }
        }
        assert_eq!(rv.on_query(8).answer, f[0].answer, "a query after the end gets the failure");
    }

    proptest! {
        /// Any arrival order, with duplicates, strangers and queries mixed in: each genuine rank
        /// gets exactly one `Joined` on its connection and exactly one delivery of the same
        /// table in rank order; every refused connection exactly one refusal.
        #[test]
        fn any_arrival_order(n in 1usize..24, seed in any::<u64>(), dups in proptest::collection::vec(0u32..24, 0..6)) {
            let mut order: Vec<u32> = (0..n as u32).collect();
            let mut x = seed | 1;
            for i in (1..order.len()).rev() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let t0 = Instant::now();
            let mut rv = Rendezvous::new([9; 16], n, Some(t0 + Duration::from_secs(60)));
            let mut replies = Vec::new();
            let mut conn = 0usize;
            let mut arrived = std::collections::HashSet::new();
            for (i, r) in order.iter().enumerate() {
                if let Some(d) = dups.get(i) {
                    // a duplicate of an arrived rank, or an out-of-range rank
                    conn += 1;
                    let out = rv.on_join(1000 + conn, join(*d, n as u32));
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
                    replies.extend(rv.on_join(conn, join(*r, n as u32)));
                }
                let q = rv.on_query(5000 + i);
                if !rv.is_finished() {
                    let missing = (0..n as u32).filter(|m| !arrived.contains(m)).collect();
                    prop_assert_eq!(&q.answer.status, &RootStatus::Progress { missing });
                }
                replies.extend(rv.on_time(t0 + Duration::from_millis(i as u64)));
            }
            prop_assert!(rv.is_finished());
            let joined: Vec<&Reply<usize>> = replies.iter().filter(|r| r.answer.status == RootStatus::Joined).collect();
            prop_assert_eq!(joined.len(), n);
            let finals = deliveries(&replies);
            prop_assert_eq!(finals.len(), n);
            let mut ranks: Vec<u32> = finals.iter().map(|r| match r.to { To::Rank(k, _) => k, To::Conn(_) => u32::MAX }).collect();
            ranks.sort();
            prop_assert_eq!(ranks, (0..n as u32).collect::<Vec<_>>());
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

//! Who sends what to whom, in which order, for every bootstrap collective: a pure module with no
//! sockets and no clock (the sans-IO core of the collectives; `collectives.rs` and the
//! [`Bootstrap`](super::Bootstrap) trait's defaults are the shells that execute the steps).
//!
//! Every collective runs on the binary tree rooted at rank 0 (a rank's parent is `(r - 1) / 2`,
//! its children `2r + 1` and `2r + 2`), except the large `all_gather`, which passes pieces around
//! the ring (`r + 1` and `r - 1`). A rank's [`Step`]s are in the order it performs them; a send
//! never waits for its receive, so a rank only blocks on [`Step::Recv`]. The tests here run
//! every schedule for many job sizes in memory and check that it ends with every rank holding
//! what it must, that every send meets its receive, and that no rank waits for ever.

/// A set of blocks (a block is one rank's piece of an `all_gather`, or for a barrier its
/// arrival) that one message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Blocks {
    /// Rank `r`'s block alone.
    One(usize),
    /// The blocks of every rank in the tree below `r`, `r` included.
    Subtree(usize),
    /// Every rank's block.
    All,
}

/// One action of one rank in a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Send `blocks` (which this rank holds by then) to `peer`.
    Send { peer: usize, blocks: Blocks },
    /// Receive `blocks` from `peer` (its matching [`Step::Send`]).
    Recv { peer: usize, blocks: Blocks },
}

#[cfg(test)]
impl Step {
    /// The rank on the other side.
    pub(crate) fn peer(&self) -> usize {
        match *self {
            Step::Send { peer, .. } | Step::Recv { peer, .. } => peer,
        }
    }
}

/// A rank's parent in the binary tree rooted at rank 0.
pub(crate) fn tree_parent(rank: usize) -> Option<usize> {
    (rank > 0).then(|| (rank - 1) / 2)
}

/// A rank's children (zero to two) in the binary tree rooted at rank 0.
pub(crate) fn tree_children(rank: usize, size: usize) -> impl Iterator<Item = usize> {
    [rank.saturating_mul(2).saturating_add(1), rank.saturating_mul(2).saturating_add(2)]
        .into_iter()
        .filter(move |c| *c < size)
}

/// The tree gather and release, used by `all_gather` (blocks are the pieces) and `barrier`
/// (blocks are arrivals, the messages empty): the subtree's blocks from each child, the
/// subtree's blocks up to the parent, every block down from the parent, every block down to
/// each child. 2 log2(n) hops; a rank talks to at most three peers.
pub(crate) fn tree_gather(rank: usize, size: usize) -> Vec<Step> {
    let mut steps: Vec<Step> =
        tree_children(rank, size).map(|c| Step::Recv { peer: c, blocks: Blocks::Subtree(c) }).collect();
    if let Some(p) = tree_parent(rank) {
        steps.push(Step::Send { peer: p, blocks: Blocks::Subtree(rank) });
        steps.push(Step::Recv { peer: p, blocks: Blocks::All });
    }
    steps.extend(tree_children(rank, size).map(|c| Step::Send { peer: c, blocks: Blocks::All }));
    steps
}

/// A broadcast of `root`'s block: up the path from `root` to rank 0 (each ancestor of `root`
/// takes it from its child on the path and passes it to its parent), then down the whole tree
/// from rank 0 (every rank but 0 takes it from its parent, ranks on the path included, and
/// passes it to its children). At most three peers per rank.
pub(crate) fn tree_broadcast(rank: usize, size: usize, root: usize) -> Vec<Step> {
    let b = Blocks::One(root);
    let mut steps = Vec::new();
    // Is `rank` on the path from `root` up to rank 0, and through which child?
    let mut child_on_path = None;
    let mut v = root;
    while v != rank && v > 0 {
        child_on_path = Some(v);
        v = (v - 1) / 2;
    }
    if v == rank {
        if let Some(c) = child_on_path {
            steps.push(Step::Recv { peer: c, blocks: b });
        }
        if let Some(p) = tree_parent(rank) {
            steps.push(Step::Send { peer: p, blocks: b });
        }
    }
    if let Some(p) = tree_parent(rank) {
        steps.push(Step::Recv { peer: p, blocks: b });
    }
    steps.extend(tree_children(rank, size).map(|c| Step::Send { peer: c, blocks: b }));
    steps
}

/// The ring `all_gather`: n-1 rounds; in round `k` each rank sends the block it got in round
/// `k-1` (its own in round 0) to the next rank and receives a new one from the previous rank.
/// Moves large data without the tree's store-and-forward; two peers per rank.
pub(crate) fn ring_gather(rank: usize, size: usize) -> Vec<Step> {
    if size < 2 {
        return Vec::new();
    }
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    (0..size - 1)
        .flat_map(|k| {
            [
                Step::Send { peer: next, blocks: Blocks::One((rank + size - k) % size) },
                Step::Recv { peer: prev, blocks: Blocks::One((rank + 2 * size - k - 1) % size) },
            ]
        })
        .collect()
}

/// The peers a rank tells of a failure: its parent and children in the tree (every
/// collective's peers) and its ring neighbours, so the news crosses the tree cut by the failed
/// rank. At most five ranks, never `rank` itself.
pub(crate) fn neighbours(rank: usize, size: usize) -> Vec<usize> {
    let mut v = Vec::with_capacity(6);
    if size > 1 {
        v.push((rank + 1) % size);
        v.push((rank + size - 1) % size);
    }
    v.extend(tree_parent(rank));
    v.extend(tree_children(rank, size));
    v.sort_unstable();
    v.dedup();
    v.retain(|p| *p != rank);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeSet, HashMap, VecDeque};

    const SIZES: &[usize] = &[1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 33, 100, 255, 257, 1000];

    /// The ranks in the tree below `r` (`r` included).
    fn subtree(r: usize, n: usize) -> BTreeSet<usize> {
        let mut out = BTreeSet::new();
        let mut todo = vec![r];
        while let Some(v) = todo.pop() {
            if v < n {
                out.insert(v);
                todo.extend(tree_children(v, n));
            }
        }
        out
    }

    fn set(b: Blocks, n: usize) -> BTreeSet<usize> {
        match b {
            Blocks::One(r) => [r].into(),
            Blocks::Subtree(r) => subtree(r, n),
            Blocks::All => (0..n).collect(),
        }
    }

    /// Runs every rank's schedule against in-memory mailboxes (one FIFO per ordered pair, as a
    /// TCP connection is), a rank advancing while its next step can run (sends always can, a
    /// receive once its message is there). Checks each send carries blocks its sender holds and
    /// each receive gets exactly the blocks it expects, and that nothing is left over or stuck.
    /// Returns what every rank holds at the end.
    fn simulate(n: usize, hold: &[BTreeSet<usize>], plan: impl Fn(usize) -> Vec<Step>) -> Vec<BTreeSet<usize>> {
        let plans: Vec<Vec<Step>> = (0..n).map(&plan).collect();
        let mut held = hold.to_vec();
        let mut at = vec![0usize; n];
        let mut boxes: HashMap<(usize, usize), VecDeque<BTreeSet<usize>>> = HashMap::new();
        // Round-robin, each rank running as far as it can; any fair order gives the same result
        // because sends never block.
        loop {
            let mut moved = false;
            for r in 0..n {
                while let Some(&step) = plans[r].get(at[r]) {
                    let peer = step.peer();
                    assert!(peer < n && peer != r, "{n} ranks: rank {r} step {step:?} names a bad peer");
                    match step {
                        Step::Send { blocks, .. } => {
                            let s = set(blocks, n);
                            assert!(s.is_subset(&held[r]), "{n} ranks: rank {r} sends {s:?} holding {:?}", held[r]);
                            boxes.entry((r, peer)).or_default().push_back(s);
                        }
                        Step::Recv { blocks, .. } => {
                            let Some(m) = boxes.get_mut(&(peer, r)).and_then(|q| q.pop_front()) else { break };
                            assert_eq!(m, set(blocks, n), "{n} ranks: rank {r} got other blocks from {peer}");
                            held[r].extend(m);
                        }
                    }
                    at[r] += 1;
                    moved = true;
                }
            }
            if at.iter().zip(&plans).all(|(a, p)| *a == p.len()) {
                break;
            }
            assert!(moved, "{n} ranks: deadlock at steps {at:?}");
        }
        assert!(boxes.values().all(VecDeque::is_empty), "{n} ranks: messages nobody received");
        held
    }

    /// Every send from `a` to `b` has a receive at `b` from `a`, in the same number.
    fn assert_paired(n: usize, plan: impl Fn(usize) -> Vec<Step>) {
        let mut sends: HashMap<(usize, usize), usize> = HashMap::new();
        let mut recvs: HashMap<(usize, usize), usize> = HashMap::new();
        for r in 0..n {
            for s in plan(r) {
                match s {
                    Step::Send { peer, .. } => *sends.entry((r, peer)).or_default() += 1,
                    Step::Recv { peer, .. } => *recvs.entry((peer, r)).or_default() += 1,
                }
            }
        }
        assert_eq!(sends, recvs, "{n} ranks: sends and receives do not pair up");
    }

    fn own_blocks(n: usize) -> Vec<BTreeSet<usize>> {
        (0..n).map(|r| [r].into()).collect()
    }

    #[test]
    fn tree_gather_gives_every_rank_every_block() {
        for &n in SIZES {
            assert_paired(n, |r| tree_gather(r, n));
            let held = simulate(n, &own_blocks(n), |r| tree_gather(r, n));
            let all: BTreeSet<usize> = (0..n).collect();
            assert!(held.iter().all(|h| *h == all), "{n} ranks: a rank misses blocks");
        }
    }

    /// As a barrier (blocks are arrivals): a rank finishes only after holding every rank's
    /// arrival, so no rank leaves before all came. Each rank talks to its tree peers only.
    #[test]
    fn tree_gather_is_a_barrier_over_tree_peers() {
        for &n in SIZES {
            for r in 0..n {
                let peers: BTreeSet<usize> = tree_gather(r, n).iter().map(Step::peer).collect();
                let tree: BTreeSet<usize> = tree_parent(r).into_iter().chain(tree_children(r, n)).collect();
                assert_eq!(peers, tree, "{n} ranks, rank {r}");
                assert!(peers.len() <= 3);
                // The last step of a rank with a parent is a send down, after the receive of
                // everything from the parent (or, at rank 0, after every child's subtree).
                let steps = tree_gather(r, n);
                let last_recv = steps.iter().rposition(|s| matches!(s, Step::Recv { .. }));
                let first_send_down = steps.iter().position(|s| matches!(s, Step::Send { blocks: Blocks::All, .. }));
                if let (Some(a), Some(b)) = (last_recv, first_send_down) {
                    assert!(a < b, "{n} ranks, rank {r}: releases a child before it is released");
                }
            }
        }
    }

    #[test]
    fn broadcast_reaches_every_rank_from_any_root() {
        for &n in SIZES {
            let roots: BTreeSet<usize> = if n <= 33 { (0..n).collect() } else { [0, 1, n / 2, n - 2, n - 1].into() };
            for &root in &roots {
                assert_paired(n, |r| tree_broadcast(r, n, root));
                let hold: Vec<BTreeSet<usize>> =
                    (0..n).map(|r| if r == root { [root].into() } else { BTreeSet::new() }).collect();
                let held = simulate(n, &hold, |r| tree_broadcast(r, n, root));
                assert!(held.iter().all(|h| *h == [root].into()), "{n} ranks, root {root}: a rank misses it");
                for r in 0..n {
                    let peers: BTreeSet<usize> = tree_broadcast(r, n, root).iter().map(Step::peer).collect();
                    let tree: BTreeSet<usize> = tree_parent(r).into_iter().chain(tree_children(r, n)).collect();
                    assert!(peers.is_subset(&tree), "{n} ranks, root {root}, rank {r}: {peers:?}");
                }
            }
        }
    }

    /// Round `k` pairs rank `r`'s send with rank `r + 1`'s receive of the same block in the
    /// same round, and every rank ends with every block.
    #[test]
    fn ring_pairs_each_round_and_gathers_everything() {
        for &n in SIZES {
            assert_paired(n, |r| ring_gather(r, n));
            let plans: Vec<Vec<Step>> = (0..n).map(|r| ring_gather(r, n)).collect();
            for (r, p) in plans.iter().enumerate() {
                assert_eq!(p.len(), 2 * (n.max(1) - 1), "{n} ranks, rank {r}");
                for (i, s) in p.iter().enumerate() {
                    if let Step::Send { peer, blocks } = *s {
                        assert_eq!(peer, (r + 1) % n);
                        assert_eq!(plans[peer][i + 1], Step::Recv { peer: r, blocks }, "{n} ranks, rank {r} step {i}");
                    }
                }
            }
            let held = simulate(n, &own_blocks(n), |r| ring_gather(r, n));
            let all: BTreeSet<usize> = (0..n).collect();
            assert!(held.iter().all(|h| *h == all), "{n} ranks: a rank misses blocks");
        }
    }

    /// The failure news reaches every rank from any reporter through `neighbours` links,
    /// whichever single rank failed (the tree and the ring together stay connected).
    #[test]
    fn neighbours_stay_connected_without_any_one_rank() {
        for &n in SIZES.iter().filter(|&&n| n <= 257) {
            for r in 0..n {
                let nb = neighbours(r, n);
                assert!(nb.len() <= 5 && !nb.contains(&r) && nb.iter().all(|p| *p < n));
                assert!(nb.iter().all(|p| neighbours(*p, n).contains(&r)), "{n} ranks: links are not symmetric");
            }
            let failed_set: Vec<usize> = if n <= 33 { (0..n).collect() } else { vec![0, 1, 2, n / 2, n - 1] };
            for failed in failed_set {
                let start = (failed + 1) % n;
                if start == failed {
                    continue;
                }
                let mut seen: BTreeSet<usize> = [start].into();
                let mut todo = vec![start];
                while let Some(v) = todo.pop() {
                    for p in neighbours(v, n) {
                        if p != failed && seen.insert(p) {
                            todo.push(p);
                        }
                    }
                }
                assert_eq!(seen.len(), n - 1, "{n} ranks without rank {failed}: the news does not reach all");
            }
        }
    }
}

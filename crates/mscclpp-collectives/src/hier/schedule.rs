//! The two-level schedule as data: who sends which bytes to whom in each phase of each round,
//! with the scratch layout the kernels use, and a CPU simulator that runs a schedule on
//! in-memory buffers. Pure: no GPU, no I/O.
//!
//! Ranks are grouped into nodes of `ranks_per_node` consecutive ranks: rank `r` is local rank
//! `l = r % L` of node `n = r / L` (`L` ranks per node, `M` nodes). The GPU kernels of
//! [`TwoLevel`](super::TwoLevel) execute exactly these steps, round by round, phase by phase
//! (the phases are separated by barriers there).
//!
//! **AllReduce**, per round of at most [`Layout::ar_round`] bytes of the buffer, split into `L`
//! chunks ([`chunk`]; 16-byte aligned boundaries):
//! 1. `Stage`: each rank copies the round of its input into its scratch (`IN`).
//! 2. `IntraReduceScatter`: local rank `l` reduces chunk `l` of every node peer's `IN` (in local
//!    rank order) into its exchange slot `X[parity][n]` (node `n`'s partial sum).
//! 3. `InterExchange`: rank `(n, l)` puts `X[parity][n]` into the same slot of every rank
//!    `(n', l)` of the other nodes (all-pairs, PortChannel through the proxy). In a call's first
//!    round the put also carries the call's signature ([`exchange_put_bytes`]).
//! 4. `InterReduce`: each rank reduces `X[parity][0..M]` in node order into `RES` and into its
//!    output's chunk `l`: every rank of the column gets the same bits (same order).
//! 5. `IntraAllGather`: each rank copies chunk `l'` from node peer `l'`'s `RES` into its output.
//!
//! **AllGather**, per round of at most [`Layout::ag_round`] bytes of each rank's segment:
//! 1. `Stage`: each rank copies the round of its input into its slot `COL[parity][n]` and into
//!    its own segment of the output.
//! 2. `InterExchange`: rank `(n, l)` puts its slot into the same slot of every `(n', l)` (with
//!    the call's signature in its first round, as for AllReduce): each rank now holds column `l`
//!    (the segments of ranks `n' * L + l`).
//! 3. `IntraAllGather`: each rank copies the other columns' slots of its own `COL` and every
//!    slot of every node peer's `COL` into the output.
//!
//! Exchange slots alternate between two halves (`parity` = round number mod 2, continued across
//! calls on the GPU) so that a peer one round ahead never overwrites a slot still being read.
//!
//! **Signatures across nodes.** In the first round of every call, the put of `InterExchange`
//! is [`exchange_put_bytes`] long: the data, padding up to [`sig_at`]`(bytes)`, and the call's
//! 8-byte signature, which the sender writes into its own slot just before the put. The
//! receiver, once the peer's signal arrived, compares the word at the same place of the slot
//! that peer wrote with its own call's signature and clears it: a cross peer that made another
//! call is named there, before any output is written (node peers compare theirs at the call's
//! first node barrier). Each slot is therefore [`SIG_ROOM`] bytes longer than the data it
//! holds ([`Layout::x_stride`], [`Layout::col_stride`]). The steps here carry those bytes too
//! (the simulator copies whatever the sender's slot holds there).

use std::fmt;
use std::ops::Range;

use mscclpp::{Error, Result};

use crate::types::Collective;

/// Nodes of `ranks_per_node` consecutive ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    nranks: usize,
    ranks_per_node: usize,
}

/// Most ranks per node, and most nodes, the kernels serve (one waiting thread per peer, shared
/// tables of that size).
pub const MAX_GROUP: usize = 64;

impl Topology {
    /// `nranks` ranks in nodes of `ranks_per_node`.
    ///
    /// # Errors
    /// `InvalidUsage` when either is zero, `nranks` is not a multiple of `ranks_per_node`, or
    /// a node or the number of nodes exceeds [`MAX_GROUP`].
    pub fn new(nranks: usize, ranks_per_node: usize) -> Result<Topology> {
        if nranks == 0 || ranks_per_node == 0 {
            return Err(Error::invalid_usage(format!(
                "two-level collectives need at least one rank and one rank per node (got {nranks} ranks, {ranks_per_node} per node)"
            )));
        }
        if !nranks.is_multiple_of(ranks_per_node) {
            return Err(Error::invalid_usage(format!(
                "{nranks} ranks cannot be grouped into nodes of {ranks_per_node} ranks: the number of ranks must be a \
                 multiple of ranks_per_node"
            )));
        }
        let nodes = nranks / ranks_per_node;
        if ranks_per_node > MAX_GROUP || nodes > MAX_GROUP {
            return Err(Error::invalid_usage(format!(
                "two-level collectives serve at most {MAX_GROUP} ranks per node and {MAX_GROUP} nodes \
                 (got {nodes} nodes of {ranks_per_node})"
            )));
        }
        Ok(Topology { nranks, ranks_per_node })
    }
    /// Number of ranks.
    pub fn nranks(&self) -> usize {
        self.nranks
    }
    /// Ranks per node (`L`).
    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }
    /// Number of nodes (`M`).
    pub fn nodes(&self) -> usize {
        self.nranks / self.ranks_per_node
    }
    /// The node of `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.ranks_per_node
    }
    /// The local rank of `rank` in its node.
    pub fn local_of(&self, rank: usize) -> usize {
        rank % self.ranks_per_node
    }
    /// The rank of local rank `local` of node `node`.
    pub fn rank(&self, node: usize, local: usize) -> usize {
        node * self.ranks_per_node + local
    }
    /// The other ranks of `rank`'s node, in local order.
    pub fn node_peers(&self, rank: usize) -> Vec<usize> {
        let n = self.node_of(rank);
        (0..self.ranks_per_node).map(|l| self.rank(n, l)).filter(|&p| p != rank).collect()
    }
    /// The ranks with `rank`'s local rank on the other nodes, in node order.
    pub fn cross_peers(&self, rank: usize) -> Vec<usize> {
        let l = self.local_of(rank);
        (0..self.nodes()).map(|n| self.rank(n, l)).filter(|&p| p != rank).collect()
    }
}

/// Rounds `x` up to a multiple of 16.
pub fn round16(x: u64) -> u64 {
    x.div_ceil(16) * 16
}

/// Bytes `[lo, hi)` of part `i` of `parts` of a `len`-byte range: parts of
/// `round16(ceil(len / parts))` bytes, the last ones shorter or empty (the kernels' formula).
pub fn chunk(len: u64, parts: usize, i: usize) -> Range<u64> {
    let cb = round16(len.div_ceil(parts.max(1) as u64));
    let lo = (i as u64 * cb).min(len);
    let hi = ((i as u64 + 1) * cb).min(len);
    lo..hi
}

/// Where things live in each rank's scratch (byte offsets), and the round sizes.
///
/// The exchange slots are [`SIG_ROOM`] bytes longer than the data they hold: a call's first
/// round puts the call's signature after its chunk ([`sig_at`], [`exchange_put_bytes`]), and a
/// chunk may fill its slot. Every rank agrees on the layout at setup, so a peer that makes
/// another call still puts at most a slot's data and signature into each slot's stride.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of the buffer one AllReduce round covers (a multiple of `16 * L`).
    pub ar_round: u64,
    /// Bytes of each rank's segment one AllGather round covers (a multiple of 16).
    pub ag_round: u64,
    /// AllReduce staging of the input round (`ar_round` bytes).
    pub in_off: u64,
    /// AllReduce result of this rank's chunk (`ar_round / L` bytes).
    pub res_off: u64,
    /// AllReduce exchange slots `X[parity][node]`, [`x_stride`](Self::x_stride) bytes apart,
    /// each holding up to `ar_round / L` bytes of data ([`x_slot`](Self::x_slot)).
    pub x_off: u64,
    /// Bytes from one AllReduce exchange slot to the next: `ar_round / L + SIG_ROOM`.
    pub x_stride: u64,
    /// AllGather exchange slots `COL[parity][node]`, [`col_stride`](Self::col_stride) bytes
    /// apart, each holding up to `ag_round` bytes of data.
    pub col_off: u64,
    /// Bytes from one AllGather exchange slot to the next: `ag_round + SIG_ROOM`.
    pub col_stride: u64,
    /// Signature slots, one 8-byte word per local rank: each node peer writes its call's
    /// signature into its word before the call's first node barrier.
    pub sig_off: u64,
    /// Total scratch bytes.
    pub total: u64,
}

/// Local ranks a node may have (the two-level kernels' group limit, `HMAX_GROUP` in hier.cu):
/// the signature area holds one word for each.
pub const MAX_LOCAL: u64 = MAX_GROUP as u64;

/// Bytes each exchange slot has beyond its data: room for the signature word after a chunk
/// that fills the slot (8 bytes), keeping every slot 16-byte aligned.
pub const SIG_ROOM: u64 = 16;

/// Where, in an exchange slot holding `bytes` of data, a call's first round puts the call's
/// signature: `bytes` rounded up to a multiple of 8.
pub fn sig_at(bytes: u64) -> u64 {
    bytes.div_ceil(8) * 8
}

/// Bytes `InterExchange` puts for a slot of `bytes` data in `round`: the data alone, or in a
/// call's first round (round 0) the data, its padding and the 8-byte signature
/// (`sig_at(bytes) + 8`, also when `bytes` is 0).
pub fn exchange_put_bytes(round: u32, bytes: u64) -> u64 {
    if round == 0 { sig_at(bytes) + 8 } else { bytes }
}

impl Layout {
    /// The layout for `topo` with AllReduce rounds of about `round_bytes` (rounded up to a
    /// multiple of `16 * L`); AllGather rounds are `ar_round / L` bytes per segment.
    ///
    /// # Errors
    /// `InvalidUsage` for a round of zero bytes or a scratch over 4 GiB (PortChannel offsets are
    /// 32-bit).
    pub fn new(topo: &Topology, round_bytes: u64) -> Result<Layout> {
        if round_bytes == 0 {
            return Err(Error::invalid_usage("the two-level round size must be at least one byte"));
        }
        let l = topo.ranks_per_node() as u64;
        let m = topo.nodes() as u64;
        // Checked: a huge round would otherwise wrap to a small layout that passes the limit.
        let sizes = (|| {
            let ar_round = round_bytes.div_ceil(16 * l).checked_mul(16 * l)?;
            let slot = ar_round / l;
            let stride = slot.checked_add(SIG_ROOM)?;
            let res_off = ar_round;
            let x_off = res_off.checked_add(slot)?;
            let col_off = x_off.checked_add(m.checked_mul(2)?.checked_mul(stride)?)?;
            let sig_off = col_off.checked_add(m.checked_mul(2)?.checked_mul(stride)?)?;
            let total = sig_off.checked_add(MAX_LOCAL * 8)?;
            Some((ar_round, slot, stride, res_off, x_off, col_off, sig_off, total))
        })();
        let Some((ar_round, slot, stride, res_off, x_off, col_off, sig_off, total)) = sizes else {
            return Err(Error::invalid_usage(format!(
                "a two-level round of {round_bytes} bytes is too large: its scratch would pass the 4 GiB that \
                 PortChannel offsets address"
            )));
        };
        let (ag_round, in_off) = (slot, 0);
        if total > u32::MAX as u64 {
            return Err(Error::invalid_usage(format!(
                "a two-level scratch of {total} bytes (rounds of {ar_round} bytes, {m} nodes) exceeds the 4 GiB that \
                 PortChannel offsets address: use smaller rounds"
            )));
        }
        Ok(Layout {
            ar_round,
            ag_round,
            in_off,
            res_off,
            x_off,
            x_stride: stride,
            col_off,
            col_stride: stride,
            sig_off,
            total,
        })
    }
    /// Bytes of data one AllReduce exchange slot holds (its stride is
    /// [`x_stride`](Self::x_stride)).
    pub fn x_slot(&self, topo: &Topology) -> u64 {
        self.ar_round / topo.ranks_per_node() as u64
    }
    /// Offset of AllReduce exchange slot `X[parity][node]`.
    pub fn x(&self, topo: &Topology, parity: u64, node: usize) -> u64 {
        self.x_off + (parity * topo.nodes() as u64 + node as u64) * self.x_stride
    }
    /// Offset of AllGather exchange slot `COL[parity][node]`.
    pub fn col(&self, topo: &Topology, parity: u64, node: usize) -> u64 {
        self.col_off + (parity * topo.nodes() as u64 + node as u64) * self.col_stride
    }
}

/// The phases of a round, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Local copies of the input into scratch (and, AllGather, into the output).
    Stage,
    /// AllReduce: node peers' chunks reduced by their owner.
    IntraReduceScatter,
    /// Exchange slots put to the same local rank of every other node (PortChannel).
    InterExchange,
    /// AllReduce: the nodes' partial sums reduced, in node order.
    InterReduce,
    /// Results copied from node peers (MemoryChannel).
    IntraAllGather,
}

/// One of a rank's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The caller's input (`send`).
    Input,
    /// The caller's output (`recv`).
    Output,
    /// The rank's scratch ([`Layout`]).
    Scratch,
}

/// What a step does at its destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `dst = src`.
    Copy,
    /// `dst = dst (op) src`, element by element.
    Reduce,
}

/// One transfer: `bytes` bytes from `src_rank`'s `src_buf` at `src_off` to `dst_rank`'s
/// `dst_buf` at `dst_off`. Steps with `src_rank == dst_rank` are local.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Step {
    /// The round (0-based).
    pub round: u32,
    /// The phase.
    pub phase: Phase,
    /// The rank whose memory is read.
    pub src_rank: usize,
    /// The buffer read.
    pub src_buf: Buf,
    /// Offset read.
    pub src_off: u64,
    /// The rank whose memory is written.
    pub dst_rank: usize,
    /// The buffer written.
    pub dst_buf: Buf,
    /// Offset written.
    pub dst_off: u64,
    /// Bytes.
    pub bytes: u64,
    /// Copy or reduce.
    pub op: Op,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "round {} {:?}: rank {} {:?}[{}..{}] -> rank {} {:?}[{}..{}] ({:?})",
            self.round,
            self.phase,
            self.src_rank,
            self.src_buf,
            self.src_off,
            self.src_off + self.bytes,
            self.dst_rank,
            self.dst_buf,
            self.dst_off,
            self.dst_off + self.bytes,
            self.op
        )
    }
}

/// One rank's part of a collective call: every step it reads or writes (in execution order),
/// with the geometry that produced them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// The collective.
    pub collective: Collective,
    /// The groups.
    pub topo: Topology,
    /// The scratch layout.
    pub layout: Layout,
    /// The rank this schedule is for.
    pub rank: usize,
    /// Bytes of each rank's input (AllReduce: the buffer; AllGather: the segment).
    pub nbytes: u64,
    /// Bytes of each rank's output.
    pub out_bytes: u64,
    /// Number of rounds.
    pub rounds: u32,
    /// The steps, in order of (round, phase).
    pub steps: Vec<Step>,
}

impl Schedule {
    /// Steps whose data leaves this rank for another.
    pub fn sends(&self) -> impl Iterator<Item = &Step> {
        self.steps.iter().filter(move |s| s.src_rank == self.rank && s.dst_rank != self.rank)
    }
    /// Steps whose data arrives here from another rank.
    pub fn receives(&self) -> impl Iterator<Item = &Step> {
        self.steps.iter().filter(move |s| s.dst_rank == self.rank && s.src_rank != self.rank)
    }
}

/// The schedule of `rank` for a `collective` of `nbytes` per rank (AllReduce: the buffer;
/// AllGather: each rank's segment) of `elem`-byte elements, with scratch `layout`.
///
/// # Errors
/// `InvalidUsage` for a rank outside the topology, an element size other than 1, 2, 4 or 8, a
/// byte count that is not a whole number of elements, or a collective other than AllReduce and
/// AllGather.
pub fn schedule(
    topo: &Topology,
    layout: &Layout,
    rank: usize,
    collective: Collective,
    nbytes: u64,
    elem: usize,
) -> Result<Schedule> {
    if rank >= topo.nranks() {
        return Err(Error::invalid_usage(format!("rank {rank} is not one of the {} ranks", topo.nranks())));
    }
    if ![1, 2, 4, 8].contains(&elem) || !nbytes.is_multiple_of(elem as u64) {
        return Err(Error::invalid_usage(format!("{nbytes} bytes are not a whole number of {elem}-byte elements")));
    }
    let (steps, rounds, out_bytes) = match collective {
        Collective::AllReduce => {
            let (s, r) = all_reduce_steps(topo, layout, rank, nbytes);
            (s, r, nbytes)
        }
        Collective::AllGather => {
            let (s, r) = all_gather_steps(topo, layout, rank, nbytes);
            (s, r, nbytes * topo.nranks() as u64)
        }
        other => {
            return Err(Error::invalid_usage(format!(
                "two-level {other} is not implemented (AllReduce and AllGather are)"
            )));
        }
    };
    Ok(Schedule { collective, topo: *topo, layout: *layout, rank, nbytes, out_bytes, rounds, steps })
}

#[allow(clippy::too_many_arguments)]
fn step(
    round: u32,
    phase: Phase,
    sr: usize,
    sb: Buf,
    so: u64,
    dr: usize,
    db: Buf,
    d_o: u64,
    bytes: u64,
    op: Op,
) -> Step {
    Step { round, phase, src_rank: sr, src_buf: sb, src_off: so, dst_rank: dr, dst_buf: db, dst_off: d_o, bytes, op }
}

/// The rounds a buffer of `nbytes` takes with rounds of `round` bytes: (index, base, length).
fn rounds_of(nbytes: u64, round: u64) -> impl Iterator<Item = (u32, u64, u64)> {
    (0..nbytes.div_ceil(round)).map(move |k| {
        let base = k * round;
        (k as u32, base, round.min(nbytes - base))
    })
}

/// Every AllReduce step of the whole job, filtered to those `rank` takes part in.
fn all_reduce_steps(topo: &Topology, lay: &Layout, rank: usize, nbytes: u64) -> (Vec<Step>, u32) {
    use Buf::*;
    let (lr, mr) = (topo.ranks_per_node(), topo.nodes());
    let mut out = Vec::new();
    let mut nrounds = 0;
    for (k, base, rb) in rounds_of(nbytes, lay.ar_round) {
        nrounds = k + 1;
        let par = u64::from(k) & 1;
        let mut all = Vec::new();
        for r in 0..topo.nranks() {
            all.push(step(k, Phase::Stage, r, Input, base, r, Scratch, lay.in_off, rb, Op::Copy));
        }
        for r in 0..topo.nranks() {
            let (n, l) = (topo.node_of(r), topo.local_of(r));
            let c = chunk(rb, lr, l);
            for lp in 0..lr {
                let op = if lp == 0 { Op::Copy } else { Op::Reduce };
                let src = topo.rank(n, lp);
                all.push(step(
                    k,
                    Phase::IntraReduceScatter,
                    src,
                    Scratch,
                    lay.in_off + c.start,
                    r,
                    Scratch,
                    lay.x(topo, par, n),
                    c.end - c.start,
                    op,
                ));
            }
        }
        for r in 0..topo.nranks() {
            let (n, l) = (topo.node_of(r), topo.local_of(r));
            let c = chunk(rb, lr, l);
            for np in (0..mr).filter(|&np| np != n) {
                let slot = lay.x(topo, par, np);
                all.push(step(
                    k,
                    Phase::InterExchange,
                    topo.rank(np, l),
                    Scratch,
                    slot,
                    r,
                    Scratch,
                    slot,
                    exchange_put_bytes(k, c.end - c.start),
                    Op::Copy,
                ));
            }
        }
        for r in 0..topo.nranks() {
            let l = topo.local_of(r);
            let c = chunk(rb, lr, l);
            for np in 0..mr {
                let op = if np == 0 { Op::Copy } else { Op::Reduce };
                all.push(step(
                    k,
                    Phase::InterReduce,
                    r,
                    Scratch,
                    lay.x(topo, par, np),
                    r,
                    Scratch,
                    lay.res_off,
                    c.end - c.start,
                    op,
                ));
            }
            all.push(step(
                k,
                Phase::InterReduce,
                r,
                Scratch,
                lay.res_off,
                r,
                Output,
                base + c.start,
                c.end - c.start,
                Op::Copy,
            ));
        }
        for r in 0..topo.nranks() {
            let n = topo.node_of(r);
            for lp in (0..lr).filter(|&lp| lp != topo.local_of(r)) {
                let c = chunk(rb, lr, lp);
                all.push(step(
                    k,
                    Phase::IntraAllGather,
                    topo.rank(n, lp),
                    Scratch,
                    lay.res_off,
                    r,
                    Output,
                    base + c.start,
                    c.end - c.start,
                    Op::Copy,
                ));
            }
        }
        out.extend(all.into_iter().filter(|s| s.src_rank == rank || s.dst_rank == rank));
    }
    (out, nrounds)
}

/// Every AllGather step of the whole job, filtered to those `rank` takes part in.
fn all_gather_steps(topo: &Topology, lay: &Layout, rank: usize, nbytes: u64) -> (Vec<Step>, u32) {
    use Buf::*;
    let (lr, mr) = (topo.ranks_per_node(), topo.nodes());
    let mut out = Vec::new();
    let mut nrounds = 0;
    for (k, base, len) in rounds_of(nbytes, lay.ag_round) {
        nrounds = k + 1;
        let par = u64::from(k) & 1;
        let mut all = Vec::new();
        for r in 0..topo.nranks() {
            let n = topo.node_of(r);
            all.push(step(k, Phase::Stage, r, Input, base, r, Scratch, lay.col(topo, par, n), len, Op::Copy));
            all.push(step(k, Phase::Stage, r, Input, base, r, Output, r as u64 * nbytes + base, len, Op::Copy));
        }
        for r in 0..topo.nranks() {
            let (n, l) = (topo.node_of(r), topo.local_of(r));
            for np in (0..mr).filter(|&np| np != n) {
                let slot = lay.col(topo, par, np);
                all.push(step(
                    k,
                    Phase::InterExchange,
                    topo.rank(np, l),
                    Scratch,
                    slot,
                    r,
                    Scratch,
                    slot,
                    exchange_put_bytes(k, len),
                    Op::Copy,
                ));
            }
        }
        for r in 0..topo.nranks() {
            let (n, l) = (topo.node_of(r), topo.local_of(r));
            for np in (0..mr).filter(|&np| np != n) {
                let owner = topo.rank(np, l) as u64;
                all.push(step(
                    k,
                    Phase::IntraAllGather,
                    r,
                    Scratch,
                    lay.col(topo, par, np),
                    r,
                    Output,
                    owner * nbytes + base,
                    len,
                    Op::Copy,
                ));
            }
            for lp in (0..lr).filter(|&lp| lp != l) {
                for np in 0..mr {
                    let owner = topo.rank(np, lp) as u64;
                    all.push(step(
                        k,
                        Phase::IntraAllGather,
                        topo.rank(n, lp),
                        Scratch,
                        lay.col(topo, par, np),
                        r,
                        Output,
                        owner * nbytes + base,
                        len,
                        Op::Copy,
                    ));
                }
            }
        }
        out.extend(all.into_iter().filter(|s| s.src_rank == rank || s.dst_rank == rank));
    }
    (out, nrounds)
}

/// The buffers of one simulated rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRank {
    /// Input bytes.
    pub input: Vec<u8>,
    /// Output bytes.
    pub output: Vec<u8>,
    /// Scratch bytes.
    pub scratch: Vec<u8>,
}

impl SimRank {
    fn buf(&self, b: Buf) -> &[u8] {
        match b {
            Buf::Input => &self.input,
            Buf::Output => &self.output,
            Buf::Scratch => &self.scratch,
        }
    }
    fn buf_mut(&mut self, b: Buf) -> &mut Vec<u8> {
        match b {
            Buf::Input => &mut self.input,
            Buf::Output => &mut self.output,
            Buf::Scratch => &mut self.scratch,
        }
    }
}

/// Runs the schedules of every rank (`schedules[r]` is rank r's) on `inputs` and returns each
/// rank's buffers. Each step is executed once, by its destination rank; phases run one after
/// the other (the barriers of the GPU); within a phase a rank's steps run in order. `reduce`
/// combines one element: `reduce(dst, src)` updates `dst` (both `elem` bytes).
///
/// Also checks what the GPU relies on: inside a phase no step reads bytes that a step of
/// another rank writes (that would be a race between ranks running concurrently), no step
/// leaves its buffer, and every cross-rank step appears in both ranks' schedules.
///
/// # Errors
/// `InvalidUsage` describing the first violated rule.
pub fn simulate(
    schedules: &[Schedule],
    inputs: &[Vec<u8>],
    elem: usize,
    reduce: &dyn Fn(&mut [u8], &[u8]),
) -> Result<Vec<SimRank>> {
    let n = schedules.len();
    if n == 0 || inputs.len() != n {
        return Err(Error::invalid_usage(format!("{} schedules for {} inputs", n, inputs.len())));
    }
    check_pairs(schedules)?;
    let s0 = &schedules[0];
    let mut ranks: Vec<SimRank> = inputs
        .iter()
        .map(|i| SimRank {
            input: i.clone(),
            output: vec![0; s0.out_bytes as usize],
            scratch: vec![0; s0.layout.total as usize],
        })
        .collect();
    for (r, (s, i)) in schedules.iter().zip(inputs).enumerate() {
        if s.rank != r || i.len() as u64 != s.nbytes || s.nbytes != s0.nbytes || s.collective != s0.collective {
            return Err(Error::invalid_usage(format!("rank {r}: its schedule or input does not match rank 0's")));
        }
    }
    // The steps each rank executes (those it receives), grouped by (round, phase).
    let mut keys: Vec<(u32, Phase)> =
        schedules.iter().flat_map(|s| s.steps.iter().map(|t| (t.round, t.phase))).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let exec: Vec<Vec<&Step>> = schedules
            .iter()
            .map(|s| s.steps.iter().filter(|t| (t.round, t.phase) == key && t.dst_rank == s.rank).collect())
            .collect();
        check_races(&exec, key)?;
        for (r, steps) in exec.iter().enumerate() {
            for t in steps {
                let (sl, dl) = (ranks[t.src_rank].buf(t.src_buf).len() as u64, ranks[r].buf(t.dst_buf).len() as u64);
                if t.src_off + t.bytes > sl || t.dst_off + t.bytes > dl {
                    return Err(Error::invalid_usage(format!(
                        "step out of bounds (source {sl}, destination {dl} bytes): {t}"
                    )));
                }
                if t.bytes % elem as u64 != 0 {
                    return Err(Error::invalid_usage(format!("step splits an element: {t}")));
                }
                let src: Vec<u8> =
                    ranks[t.src_rank].buf(t.src_buf)[t.src_off as usize..(t.src_off + t.bytes) as usize].to_vec();
                let dst = &mut ranks[r].buf_mut(t.dst_buf)[t.dst_off as usize..(t.dst_off + t.bytes) as usize];
                match t.op {
                    Op::Copy => dst.copy_from_slice(&src),
                    Op::Reduce => {
                        for (d, s) in dst.chunks_mut(elem).zip(src.chunks(elem)) {
                            reduce(d, s);
                        }
                    }
                }
            }
        }
    }
    Ok(ranks)
}

/// Every step between two ranks is in both ranks' schedules, and each rank's schedule holds
/// only steps it takes part in.
fn check_pairs(schedules: &[Schedule]) -> Result<()> {
    let sets: Vec<std::collections::HashSet<&Step>> = schedules.iter().map(|s| s.steps.iter().collect()).collect();
    for s in schedules {
        for t in &s.steps {
            if t.src_rank != s.rank && t.dst_rank != s.rank {
                return Err(Error::invalid_usage(format!("rank {} holds a step it takes no part in: {t}", s.rank)));
            }
            for other in [t.src_rank, t.dst_rank] {
                if other != s.rank && !sets.get(other).is_some_and(|o| o.contains(t)) {
                    return Err(Error::invalid_usage(format!(
                        "rank {} sends or receives a step that rank {other} does not know: {t}",
                        s.rank
                    )));
                }
            }
        }
    }
    Ok(())
}

fn overlaps(a: (usize, Buf, u64, u64), b: (usize, Buf, u64, u64)) -> bool {
    a.0 == b.0 && a.1 == b.1 && a.2 < b.3 && b.2 < a.3 && a.2 < a.3
}

/// Inside one phase, ranks run concurrently: no rank may write what another rank reads.
fn check_races(exec: &[Vec<&Step>], key: (u32, Phase)) -> Result<()> {
    for (r, steps) in exec.iter().enumerate() {
        for w in steps {
            let wr = (w.dst_rank, w.dst_buf, w.dst_off, w.dst_off + w.bytes);
            for (q, other) in exec.iter().enumerate().filter(|(q, _)| *q != r) {
                for rd in other {
                    if overlaps(wr, (rd.src_rank, rd.src_buf, rd.src_off, rd.src_off + rd.bytes)) {
                        return Err(Error::invalid_usage(format!(
                            "round {} {:?}: rank {r} writes what rank {q} reads in the same phase: {w} / {rd}",
                            key.0, key.1
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

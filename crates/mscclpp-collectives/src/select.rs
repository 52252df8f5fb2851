//! Everything about a call that needs no GPU: the scratch layout, which algorithm serves a call,
//! how many blocks and threads it launches, whether every rank's blocks fit on a shared GPU,
//! and the signature ranks compare to catch mismatched calls. Tested on CPU.

use mscclpp::{Error, Result};

use crate::comm::CallOptions;
use crate::types::{Algorithm, Collective, DataType, ReduceOp};

/// Blocks a launch may have (the barrier counters are sized for it; `MAX_BLOCKS` in the CUDA
/// source).
pub const MAX_BLOCKS: u32 = 256;
/// Ranks the staged (`simple`) algorithms serve (`MAX_RANKS_SIMPLE` in the CUDA source).
pub const MAX_RANKS_SIMPLE: usize = 64;

/// Where things are in every rank's scratch buffer (the same on every rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Ranks.
    pub nranks: usize,
    /// Barrier counters `[src rank][block]` (u64).
    pub inbox_off: u64,
    /// Signature words of the staged algorithms `[src rank]` (u64).
    pub sig_off: u64,
    /// Signature packets of the packet algorithms `[half][src rank]` (LL16).
    pub sig_pkt_off: u64,
    /// The packet area: two halves of `pkt_half` bytes.
    pub pkt_off: u64,
    /// Bytes of one packet half.
    pub pkt_half: u64,
    /// The staging area of the `simple` algorithms: two rounds' worth.
    pub simple_off: u64,
    /// Bytes a `simple` round moves per rank buffer (a multiple of 16 x ranks).
    pub simple_round: u64,
    /// Total scratch bytes.
    pub total: u64,
}

/// `x` rounded up to a multiple of `a`; `None` past `u64::MAX`.
fn up(x: u64, a: u64) -> Option<u64> {
    x.div_ceil(a).checked_mul(a)
}

/// The largest scratch [`Layout::new`] lays out (1 TiB): sizes beyond are a mistake, not a
/// request (and their arithmetic would overflow).
pub const MAX_SCRATCH: u64 = 1 << 40;

impl Layout {
    /// The layout for `nranks` ranks with packet halves of at least `packet_bytes` and `simple`
    /// rounds of about `simple_bytes` (rounded to whole 16-byte units per rank).
    ///
    /// # Errors
    /// `InvalidUsage` for zero ranks, or sizes too small to carry one unit per rank.
    pub fn new(nranks: usize, packet_bytes: u64, simple_bytes: u64) -> Result<Layout> {
        if nranks == 0 {
            return Err(Error::invalid_usage("a collective needs at least one rank"));
        }
        let r = nranks as u64;
        let unit = 16 * r;
        if simple_bytes < unit || packet_bytes < 16 * r {
            return Err(Error::invalid_usage(format!(
                "scratch too small: packet halves of {packet_bytes} bytes and simple rounds of {simple_bytes} \
                 bytes cannot serve {nranks} ranks (at least {unit} bytes each)"
            )));
        }
        let too_big = || {
            Error::invalid_usage(format!(
                "scratch too large: packet halves of {packet_bytes} bytes and simple rounds of {simple_bytes} bytes \
                 for {nranks} ranks pass the {MAX_SCRATCH}-byte limit"
            ))
        };
        let layout = (|| {
            let inbox_off = 0;
            let sig_off = up(r.checked_mul(MAX_BLOCKS as u64 * 8)?, 256)?;
            let sig_pkt_off = up(sig_off.checked_add(r.checked_mul(8)?)?, 256)?;
            let pkt_off = up(sig_pkt_off.checked_add(r.checked_mul(32)?)?, 4096)?;
            let pkt_half = up(packet_bytes, 4096)?;
            let simple_off = pkt_off.checked_add(pkt_half.checked_mul(2)?)?;
            let simple_round = simple_bytes / unit * unit;
            let total = up(simple_off.checked_add(simple_round.checked_mul(2)?)?, 4096)?;
            Some(Layout { nranks, inbox_off, sig_off, sig_pkt_off, pkt_off, pkt_half, simple_off, simple_round, total })
        })()
        .ok_or_else(too_big)?;
        if layout.total > MAX_SCRATCH {
            return Err(too_big());
        }
        Ok(layout)
    }

    /// Bytes of one packet half a packet algorithm needs for a call moving `nbytes` (the bytes
    /// of one rank's buffer for AllReduce and Broadcast, of one rank's segment for AllGather and
    /// ReduceScatter).
    pub fn packet_need(&self, coll: Collective, algo: Algorithm, nbytes: u64) -> u64 {
        let r = self.nranks as u64;
        let units = nbytes.div_ceil(8);
        match (coll, algo) {
            (Collective::AllReduce, Algorithm::AllPair) => r * units * 16,
            (Collective::AllReduce, _) => 2 * r * units.div_ceil(r) * 16,
            (Collective::Broadcast, _) => units * 16,
            _ => r * units * 16,
        }
    }

    /// Whether a packet algorithm fits a call of `nbytes`.
    pub fn packet_fits(&self, coll: Collective, algo: Algorithm, nbytes: u64) -> bool {
        // The packet kernels index packets with 32-bit arithmetic: at most 2^31 16-byte
        // packets per half (32 GiB), whatever scratch a configuration asks for.
        let need = self.packet_need(coll, algo, nbytes);
        need <= self.pkt_half && need / 16 < 1 << 31
    }
}

/// How one call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Blocks per rank.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
}

/// What the selector needs to know besides the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The most blocks one rank's launch may have so that every rank sharing its GPU is
    /// resident at once (from the SM count, the kernels' occupancy and the ranks per GPU).
    pub max_blocks: u32,
    /// AllReduce messages up to this many bytes use `allpair` (MSCCL++: 16 KiB on Hopper).
    pub allpair_max: u64,
    /// Messages up to this many bytes (AllReduce buffer; AllGather/ReduceScatter total) use
    /// packets, when they fit the packet area.
    pub packet_max: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { max_blocks: 128, allpair_max: 16 << 10, packet_max: 1 << 20 }
    }
}

/// The default plan for a call: the algorithm by size and rank count (`allpair` for small
/// AllReduce, LL `packet` up to `packet_max`, else `simple`), and blocks/threads by size, capped
/// by `limits.max_blocks`. `nbytes` as in [`Layout::packet_need`].
pub fn select(coll: Collective, nbytes: u64, layout: &Layout, limits: &Limits) -> Plan {
    let r = layout.nranks as u64;
    let total = match coll {
        Collective::AllGather | Collective::ReduceScatter => nbytes.saturating_mul(r),
        _ => nbytes,
    };
    let algorithm = if coll == Collective::AllReduce
        && total <= limits.allpair_max
        && layout.packet_fits(coll, Algorithm::AllPair, nbytes)
    {
        Algorithm::AllPair
    } else if total <= limits.packet_max && layout.packet_fits(coll, Algorithm::Packet, nbytes) {
        Algorithm::Packet
    } else {
        Algorithm::Simple
    };
    let (blocks, threads) = shape(coll, algorithm, nbytes, layout, limits.max_blocks);
    Plan { algorithm, blocks, threads }
}

/// The plan of one call: the tuned plan (`tuned`, AllReduce only) or the default [`select`]ion,
/// then [`CallOptions`]' algorithm, blocks and threads; a staged plan beyond
/// [`MAX_RANKS_SIMPLE`] ranks falls back to packets where they fit.
///
/// # Errors
/// `InvalidUsage` for an algorithm that does not implement `coll` or whose packets do not fit,
/// a thread count outside 32..=512 or not a multiple of 32 (or below the rank count for the
/// staged algorithm), and a call only the staged algorithm could serve with too many ranks.
pub fn plan(
    coll: Collective,
    nbytes: u64,
    layout: &Layout,
    limits: &Limits,
    tuned: Option<Plan>,
    opts: &CallOptions,
) -> Result<Plan> {
    let nranks = layout.nranks;
    let mut plan = select(coll, nbytes, layout, limits);
    let tuned = tuned
        .filter(|_| coll == Collective::AllReduce && opts.algorithm.is_none())
        .filter(|p| !p.algorithm.is_packet() || layout.packet_fits(coll, p.algorithm, nbytes));
    if let Some(p) = tuned {
        plan = Plan { blocks: p.blocks.min(limits.max_blocks), ..p };
    }
    if let Some(a) = opts.algorithm {
        if !a.serves(coll) {
            return Err(Error::invalid_usage(format!("the {a} algorithm does not implement {coll}")));
        }
        if a.is_packet() && !layout.packet_fits(coll, a, nbytes) {
            return Err(Error::invalid_usage(format!(
                "{coll} of {nbytes} bytes by {a} needs {} bytes of packet scratch; this communicator has {} \
                 (Config::packet_bytes)",
                layout.packet_need(coll, a, nbytes),
                layout.pkt_half
            )));
        }
        let (b, t) = shape(coll, a, nbytes, layout, limits.max_blocks);
        plan = Plan { algorithm: a, blocks: b, threads: t };
    }
    if plan.algorithm == Algorithm::Simple && nranks > MAX_RANKS_SIMPLE && opts.algorithm.is_none() {
        // Fall back to packets where they fit (the staged kernels keep one pointer per rank in
        // shared memory).
        if layout.packet_fits(coll, Algorithm::Packet, nbytes) {
            let (b, t) = shape(coll, Algorithm::Packet, nbytes, layout, limits.max_blocks);
            plan = Plan { algorithm: Algorithm::Packet, blocks: b, threads: t };
        }
    }
    if plan.algorithm == Algorithm::Simple && nranks > MAX_RANKS_SIMPLE {
        return Err(Error::invalid_usage(format!(
            "{coll} of {nbytes} bytes needs the staged algorithm, which serves at most {MAX_RANKS_SIMPLE} ranks \
             (this communicator has {nranks}), and does not fit the packet scratch (Config::packet_bytes)"
        )));
    }
    if let Some(b) = opts.blocks {
        plan.blocks = b.clamp(1, limits.max_blocks);
    }
    if let Some(t) = opts.threads {
        if !(32..=512).contains(&t) || !t.is_multiple_of(32) {
            return Err(Error::invalid_usage(format!(
                "threads per block must be a multiple of 32 in 32..=512, not {t}"
            )));
        }
        if plan.algorithm == Algorithm::Simple && (t as usize) < nranks {
            return Err(Error::invalid_usage(format!(
                "the staged algorithm needs at least {nranks} threads per block"
            )));
        }
        plan.threads = t;
    }
    Ok(plan)
}

/// Blocks and threads for `algo` on a call of `nbytes`, at most `max_blocks` blocks.
pub fn shape(coll: Collective, algo: Algorithm, nbytes: u64, layout: &Layout, max_blocks: u32) -> (u32, u32) {
    let r = layout.nranks as u64;
    let units = nbytes.div_ceil(8).max(1);
    let cap = max_blocks.clamp(1, MAX_BLOCKS) as u64;
    match algo {
        Algorithm::Simple => {
            let moved = match coll {
                Collective::AllGather | Collective::ReduceScatter => nbytes.saturating_mul(r),
                _ => nbytes,
            };
            (moved.div_ceil(32 << 10).clamp(1, cap) as u32, 512)
        }
        _ => {
            // Per thread: one unit of the widest loop of the algorithm.
            let work = match (coll, algo) {
                (Collective::AllReduce, Algorithm::Packet) => (r - 1).max(1) * units.div_ceil(r),
                (Collective::AllGather | Collective::ReduceScatter, _) => (r - 1).max(1) * units,
                _ => units,
            };
            let threads = if work <= 256 { (work.div_ceil(32) * 32).max(64) } else { 512 };
            (work.div_ceil(threads).clamp(1, cap.min(32)) as u32, threads as u32)
        }
    }
}

/// The most blocks one rank may launch so that the `ranks_on_gpu` ranks sharing a GPU of
/// `sm_count` SMs, each holding `per_sm` such blocks, are all resident at once.
///
/// # Errors
/// `InvalidUsage` when not even one block per rank fits (more ranks on the GPU than it can hold
/// blocks).
pub fn residency_cap(sm_count: u32, per_sm: u32, ranks_on_gpu: usize) -> Result<u32> {
    let slots = sm_count as u64 * per_sm as u64;
    let cap = slots / ranks_on_gpu.max(1) as u64;
    if cap == 0 {
        return Err(Error::invalid_usage(format!(
            "{ranks_on_gpu} ranks share one GPU that holds {slots} blocks of the collective kernels at once: \
             kernels that wait on each other must all be resident, so use fewer ranks per GPU"
        )));
    }
    Ok(cap.min(MAX_BLOCKS as u64) as u32)
}

/// The most blocks a launch may have to be a programmatic dependent launch (0: none may): half
/// of `residency_cap` (the blocks per rank that fit with every rank sharing the GPU), since a
/// rank's next kernel, scheduled early, waits on the GPU beside its current one and must not take
/// the room a peer's current kernel needs (a kernel releases its successor only after its own
/// wait, so a rank never has more than these two on the GPU); none where the GPU or driver
/// cannot (`supported`, `mscclpp::gpu::programmatic_launch_supported`) or `enabled` is off.
pub fn programmatic_blocks(supported: bool, enabled: bool, residency_cap: u32) -> u32 {
    if enabled && supported { residency_cap / 2 } else { 0 }
}

/// FNV-1a over `words`, each as its 8 little-endian bytes: the digest behind the call
/// signatures (here and the two-level ones) and the tuning table's.
pub(crate) fn fnv1a_words(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in words {
        for b in v.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The call signature every rank sends its peers and compares with theirs: a call that differs
/// between ranks (collective, algorithm, type, operation, size, shape, root) fails with an error
/// naming the peer instead of reading garbage.
#[allow(clippy::too_many_arguments)]
pub fn signature(
    coll: Collective,
    plan: &Plan,
    dtype: Option<DataType>,
    op: Option<ReduceOp>,
    acc32: bool,
    nbytes: u64,
    root: usize,
) -> u64 {
    // FNV-1a over the fields, then a final mix so nearby calls differ in every bit.
    let mut h = fnv1a_words([
        coll.code(),
        plan.algorithm.code(),
        dtype.map_or(99, |d| d.code()),
        op.map_or(99, |o| o.code()),
        acc32 as u64,
        nbytes,
        plan.blocks as u64,
        plan.threads as u64,
        root as u64,
    ]);
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    // Never 0: a zeroed slot must not match.
    h | 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_regions_do_not_overlap() {
        for r in [1usize, 2, 3, 4, 7, 8, 16, 64] {
            let l = Layout::new(r, 4 << 20, 32 << 20).unwrap();
            assert!(l.inbox_off + r as u64 * MAX_BLOCKS as u64 * 8 <= l.sig_off);
            assert!(l.sig_off + r as u64 * 8 <= l.sig_pkt_off);
            assert!(l.sig_pkt_off + 2 * r as u64 * 16 <= l.pkt_off);
            assert_eq!(l.pkt_off % 4096, 0);
            assert!(l.pkt_off + 2 * l.pkt_half <= l.simple_off);
            assert!(l.simple_off + 2 * l.simple_round <= l.total);
            assert_eq!(l.simple_round % (16 * r as u64), 0, "{r} ranks");
            assert!(l.simple_round <= 32 << 20 && l.simple_round > (32 << 20) - 16 * r as u64);
        }
        assert!(Layout::new(0, 1 << 20, 1 << 20).is_err());
        assert!(Layout::new(8, 1 << 20, 64).unwrap_err().message().contains("scratch too small"));
        // Sizes whose arithmetic would wrap (packet halves of 2^63 bytes used to give a layout
        // whose staging area overlapped the packets) or pass the limit are refused.
        for (p, s) in [(1u64 << 63, 1 << 20), (u64::MAX, 1 << 20), (1 << 20, u64::MAX), (MAX_SCRATCH, 1 << 20)] {
            let e = Layout::new(8, p, s).unwrap_err();
            assert!(e.message().contains("scratch too large"), "{p} {s}: {e}");
        }
        assert!(Layout::new(8, MAX_SCRATCH / 4, MAX_SCRATCH / 8).is_ok());
    }

    #[test]
    fn packet_need_counts_every_slot() {
        let l = Layout::new(4, 1 << 20, 1 << 20).unwrap();
        // 1000 bytes: 125 units; allpair: 4 slots of 125 packets.
        assert_eq!(l.packet_need(Collective::AllReduce, Algorithm::AllPair, 1000), 4 * 125 * 16);
        // packet: 2 x 4 slots of ceil(125 / 4) = 32 packets.
        assert_eq!(l.packet_need(Collective::AllReduce, Algorithm::Packet, 1000), 8 * 32 * 16);
        // A tail that is not a whole unit still takes a packet.
        assert_eq!(l.packet_need(Collective::Broadcast, Algorithm::Packet, 9), 2 * 16);
        assert_eq!(l.packet_need(Collective::AllGather, Algorithm::Packet, 9), 4 * 2 * 16);
    }

    #[test]
    fn selector_picks_by_size_and_falls_back_when_packets_do_not_fit() {
        let l = Layout::new(8, 4 << 20, 32 << 20).unwrap();
        let lim = Limits::default();
        assert_eq!(select(Collective::AllReduce, 1024, &l, &lim).algorithm, Algorithm::AllPair);
        assert_eq!(select(Collective::AllReduce, 256 << 10, &l, &lim).algorithm, Algorithm::Packet);
        assert_eq!(select(Collective::AllReduce, 64 << 20, &l, &lim).algorithm, Algorithm::Simple);
        // AllGather's size is the total.
        assert_eq!(select(Collective::AllGather, 1 << 10, &l, &lim).algorithm, Algorithm::Packet);
        assert_eq!(select(Collective::AllGather, 1 << 20, &l, &lim).algorithm, Algorithm::Simple);
        // A small packet area pushes calls to `simple`.
        let tiny = Layout::new(8, 4096, 32 << 20).unwrap();
        assert_eq!(select(Collective::AllReduce, 64 << 10, &tiny, &lim).algorithm, Algorithm::Simple);
        for c in [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::Broadcast] {
            for n in [2u64, 6, 8, 1000, 1 << 16, 1 << 22, 1 << 30] {
                let p = select(c, n, &l, &lim);
                assert!(p.algorithm.serves(c));
                assert!(p.blocks >= 1 && p.blocks <= lim.max_blocks);
                assert!(p.threads >= 64 && p.threads <= 512 && p.threads.is_multiple_of(32));
                assert!(p.threads as usize >= l.nranks);
                if p.algorithm.is_packet() {
                    assert!(l.packet_fits(c, p.algorithm, n));
                }
            }
        }
    }

    #[test]
    fn plans_follow_options_tuning_and_fall_back_past_the_staged_rank_limit() {
        let l = Layout::new(8, 8 << 20, 32 << 20).unwrap();
        let lim = Limits::default();
        let none = CallOptions::default();
        // Tuning applies to AllReduce only, and never to a call naming its algorithm.
        let t = Plan { algorithm: Algorithm::Packet, blocks: 3, threads: 128 };
        assert_eq!(plan(Collective::AllReduce, 4096, &l, &lim, Some(t), &none).unwrap(), t);
        assert_ne!(plan(Collective::AllGather, 4096, &l, &lim, Some(t), &none).unwrap(), t);
        let forced = CallOptions::algorithm(Algorithm::Simple);
        assert_eq!(plan(Collective::AllReduce, 4096, &l, &lim, Some(t), &forced).unwrap().algorithm, Algorithm::Simple);
        // A tuned plan that does not fit this size's packets is not used.
        let big = plan(Collective::AllReduce, 64 << 20, &l, &lim, Some(t), &none).unwrap();
        assert_eq!(big.algorithm, Algorithm::Simple);
        // Options: shape, bad threads, algorithms that cannot serve.
        let p = plan(Collective::AllReduce, 4096, &l, &lim, None, &CallOptions::default().shape(1000, 256)).unwrap();
        assert_eq!((p.blocks, p.threads), (lim.max_blocks, 256));
        for bad in [16, 33, 1024] {
            let e =
                plan(Collective::AllReduce, 4096, &l, &lim, None, &CallOptions::default().shape(1, bad)).unwrap_err();
            assert!(e.message().contains("multiple of 32"), "{e}");
        }
        let e =
            plan(Collective::AllGather, 4096, &l, &lim, None, &CallOptions::algorithm(Algorithm::AllPair)).unwrap_err();
        assert!(e.message().contains("does not implement"), "{e}");
        let e = plan(Collective::AllReduce, 1 << 30, &l, &lim, None, &CallOptions::algorithm(Algorithm::Packet))
            .unwrap_err();
        assert!(e.message().contains("packet scratch"), "{e}");
        // Past 64 ranks a staged-size call falls back to packets where they fit, else is refused.
        let wide = Layout::new(80, 64 << 20, 32 << 20).unwrap();
        let p = plan(Collective::AllReduce, 2 << 20, &wide, &lim, None, &none).unwrap();
        assert_eq!(p.algorithm, Algorithm::Packet);
        let e = plan(Collective::AllReduce, 1 << 30, &wide, &lim, None, &none).unwrap_err();
        assert!(e.message().contains("at most 64 ranks"), "{e}");
    }

    #[test]
    fn residency_caps_blocks_per_rank() {
        assert_eq!(residency_cap(132, 2, 1).unwrap(), MAX_BLOCKS);
        assert_eq!(residency_cap(132, 2, 2).unwrap(), 132);
        assert_eq!(residency_cap(132, 1, 8).unwrap(), 16);
        let e = residency_cap(2, 1, 8).unwrap_err();
        assert!(e.message().contains("8 ranks share one GPU"), "{e}");
        let l = Layout::new(8, 4 << 20, 32 << 20).unwrap();
        let lim = Limits { max_blocks: 16, ..Limits::default() };
        assert!(select(Collective::AllReduce, 1 << 30, &l, &lim).blocks <= 16);
    }

    #[test]
    fn programmatic_launches_leave_room_for_every_rank() {
        // Two launches of every rank sharing the GPU fit at once: the cap is halved.
        assert_eq!(programmatic_blocks(true, true, residency_cap(132, 1, 2).unwrap()), 33);
        assert_eq!(programmatic_blocks(true, true, 16), 8);
        // One block per rank fits: no room for an early second one.
        assert_eq!(programmatic_blocks(true, true, 1), 0);
        // Off, or a GPU or driver without programmatic dependent launch.
        assert_eq!(programmatic_blocks(true, false, 64), 0);
        assert_eq!(programmatic_blocks(false, true, 64), 0);
    }

    #[test]
    fn signatures_differ_when_any_field_does() {
        let p = Plan { algorithm: Algorithm::Packet, blocks: 4, threads: 512 };
        let base = signature(Collective::AllReduce, &p, Some(DataType::F32), Some(ReduceOp::Sum), false, 4096, 0);
        let others = [
            signature(Collective::ReduceScatter, &p, Some(DataType::F32), Some(ReduceOp::Sum), false, 4096, 0),
            signature(Collective::AllReduce, &p, Some(DataType::Bf16), Some(ReduceOp::Sum), false, 4096, 0),
            signature(Collective::AllReduce, &p, Some(DataType::F32), Some(ReduceOp::Max), false, 4096, 0),
            signature(Collective::AllReduce, &p, Some(DataType::F32), Some(ReduceOp::Sum), true, 4096, 0),
            signature(Collective::AllReduce, &p, Some(DataType::F32), Some(ReduceOp::Sum), false, 4100, 0),
            signature(
                Collective::AllReduce,
                &Plan { blocks: 5, ..p },
                Some(DataType::F32),
                Some(ReduceOp::Sum),
                false,
                4096,
                0,
            ),
        ];
        for o in others {
            assert_ne!(o, base);
            assert_ne!(o, 0);
        }
    }
}

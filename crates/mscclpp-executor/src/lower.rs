//! From a plan, one rank and a call's sizes to what the interpreter kernel runs: the byte layout
//! of chunks and scratch ([`Layout`], MSCCL++'s `execution_plan.cc` rules), the resources to
//! build ([`channel_links`], [`buffer_sends`]) and the operation list ([`lower`]). No GPU needed:
//! peer addresses and proxy memory ids come in as [`Bindings`].

use std::collections::HashMap;

use crate::device::*;
use crate::model::*;

/// Why a plan cannot run for a rank and message size.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LowerError {
    /// The rank is not one of the plan's.
    #[error("rank {rank} is not in the plan ({ranks} ranks)")]
    Rank {
        /// The rank asked for.
        rank: usize,
        /// The plan's ranks.
        ranks: usize,
    },
    /// The message sizes do not fit the plan (alignment, chunk counts, size range).
    #[error("send {send} bytes, receive {recv} bytes: {reason}")]
    Size {
        /// Send buffer bytes.
        send: u64,
        /// Receive buffer bytes.
        recv: u64,
        /// What is wrong.
        reason: String,
    },
    /// A field of the plan cannot be executed as given.
    #[error("{path}: {reason}")]
    Invalid {
        /// The JSON path of the field.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

impl LowerError {
    /// The JSON path of the offending field, when the error is about one.
    pub fn path(&self) -> Option<&str> {
        match self {
            LowerError::Invalid { path, .. } => Some(path),
            _ => None,
        }
    }
}

fn invalid(path: impl Into<String>, reason: impl Into<String>) -> LowerError {
    LowerError::Invalid { path: path.into(), reason: reason.into() }
}

/// Byte sizes of one rank's chunks and scratch for one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of one chunk (every buffer's chunks have this size).
    pub chunk_bytes: u64,
    /// MSCCL++'s upper bound of a chunk (pipelines count iterations with it).
    pub upper_chunk_bytes: u64,
    /// Scratch bytes to allocate (both halves with a double scratch buffer).
    pub scratch_bytes: u64,
    /// Bytes of one scratch half with a double scratch buffer, else 0.
    pub scratch_half: u64,
    /// The send size.
    pub send_bytes: u64,
    /// The receive size.
    pub recv_bytes: u64,
}

impl Layout {
    /// The layout of `rank` for a call of `send` input and `recv` output bytes, refused as
    /// MSCCL++ refuses it: sizes must be multiples of `buffer_alignment` whose alignment units
    /// split evenly into the chunks, the input and output chunks must be the same size, and the
    /// message (the output for allgather) must be within `[min_message_size, max_message_size]`.
    pub fn new(plan: &Plan, rank: usize, send: u64, recv: u64) -> Result<Layout, LowerError> {
        let gpu = plan.gpus.get(rank).ok_or(LowerError::Rank { rank, ranks: plan.gpus.len() })?;
        let size_err = |reason: String| LowerError::Size { send, recv, reason };
        let align = plan.buffer_alignment.max(1);
        let (ic, oc) = (gpu.input_chunks, gpu.output_chunks);
        if !send.is_multiple_of(align) || !recv.is_multiple_of(align) {
            return Err(size_err(format!("not multiples of the plan's buffer_alignment {align}")));
        }
        for (what, bytes, chunks) in [("input", send, ic), ("output", recv, oc)] {
            if chunks != 0 && !(bytes / align).is_multiple_of(chunks) {
                return Err(size_err(format!(
                    "the {what} does not split into {chunks} chunks of whole {align}-byte units"
                )));
            }
        }
        let chunk_bytes = match (ic, oc) {
            (0, 0) => return Err(size_err(format!("gpus[{rank}] has neither input nor output chunks"))),
            (i, 0) => send / i,
            (0, o) => recv / o,
            (i, o) => {
                if send / i != recv / o {
                    return Err(size_err(format!(
                        "input chunks ({} bytes each) and output chunks ({} bytes each) differ",
                        send / i,
                        recv / o
                    )));
                }
                send / i
            }
        };
        let message = if plan.collective == "allgather" { recv } else { send };
        if message < plan.min_message_size || message > plan.max_message_size {
            return Err(size_err(format!(
                "the message ({message} bytes) is outside the plan's range [{}, {}]",
                plan.min_message_size, plan.max_message_size
            )));
        }
        let upper = match (ic, oc) {
            (i, _) if i != 0 => (send / align).div_ceil(i) * align,
            (_, o) => (recv / align).div_ceil(o.max(1)) * align,
        };
        let per_chunk = if ic != 0 { send.div_ceil(ic) } else { recv.div_ceil(oc.max(1)) };
        let factor = if plan.protocol == Protocol::LL { 2 } else { 1 };
        let single = per_chunk
            .checked_mul(gpu.scratch_chunks)
            .and_then(|x| x.checked_mul(factor))
            .ok_or_else(|| size_err("the scratch size overflows".into()))?;
        let single = single.div_ceil(align) * align;
        let (scratch_bytes, scratch_half) =
            if plan.use_double_scratch_buffer { (2 * single, single) } else { (single, 0) };
        Ok(Layout {
            chunk_bytes,
            upper_chunk_bytes: upper,
            scratch_bytes,
            scratch_half,
            send_bytes: send,
            recv_bytes: recv,
        })
    }
}

/// What [`lower`] needs from the built resources, indexed by the rank's `remote_buffers`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bindings {
    /// The mapped address of each remote buffer accessed through memory channels (0 if none).
    pub remote_base: Vec<u64>,
    /// The proxy memory id of each remote buffer accessed through port channels.
    pub remote_mem: Vec<u32>,
    /// The proxy memory ids of this rank's input, output and scratch.
    pub local_mem: [u32; 3],
}

/// The kernel's program for one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lowered {
    /// Every block's operations, block after block (pipeline bodies follow their pipeline).
    pub ops: Vec<DevOp>,
    /// (first op, op count) per block, flattened.
    pub blocks: Vec<u32>,
    /// Initial values of the device semaphores.
    pub semaphores: Vec<u32>,
}

/// What the executor uploads for a [`Lowered`] program: the operation slots (block `b`'s at
/// `b * stride ..`, padded with no-ops, every slot carrying its block's count in `block_ops`) and
/// the initial state buffer (`ExecState`, barrier counters, semaphores, per-block LL flags).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceImage {
    /// `nblocks * stride` operation slots (at least one block's worth).
    pub slots: Vec<DevOp>,
    /// Slots per block (`ExecArgs::ops_stride`).
    pub stride: usize,
    /// Thread blocks of the program.
    pub nblocks: usize,
    /// The state buffer's initial bytes.
    pub state: Vec<u8>,
    /// Byte offset of the barrier counters in `state` (`ExecArgs::barriers`).
    pub barriers_off: usize,
    /// Byte offset of the device semaphores (`ExecArgs::sems`).
    pub sems_off: usize,
    /// Byte offset of the per-block LL flags (`ExecArgs::flags`).
    pub flags_off: usize,
}

impl Lowered {
    /// The slots and state the executor copies to the GPU for this program.
    pub fn device_image(&self) -> DeviceImage {
        let nblocks = self.blocks.len() / 2;
        let stride = (0..nblocks).map(|b| self.blocks[2 * b + 1] as usize).max().unwrap_or(0).max(1);
        let mut slots = vec![DevOp::default(); nblocks.max(1) * stride];
        for b in 0..nblocks {
            let (first, count) = (self.blocks[2 * b] as usize, self.blocks[2 * b + 1] as usize);
            for (k, op) in self.ops.iter().skip(first).take(count).enumerate() {
                slots[b * stride + k] = *op;
            }
            for slot in &mut slots[b * stride..(b + 1) * stride] {
                slot.block_ops = count as u32;
            }
        }
        // ExecState (its first word 1), barrier counters, semaphores, flags (each 1).
        let barriers_off = size_of::<ExecState>();
        let sems_off = barriers_off + 4 * MAX_DEVICE_SYNCERS as usize;
        let flags_off = sems_off + 4 * self.semaphores.len();
        let mut state = vec![0u8; flags_off + 4 * nblocks.max(1)];
        state[..4].copy_from_slice(&1u32.to_le_bytes());
        for f in state[flags_off..].chunks_exact_mut(4) {
            f.copy_from_slice(&1u32.to_le_bytes());
        }
        for (i, v) in self.semaphores.iter().enumerate() {
            state[sems_off + 4 * i..sems_off + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        DeviceImage { slots, stride, nblocks, state, barriers_off, sems_off, flags_off }
    }
}

/// A channel of the rank, with what pairs it with the peer's: channel `pair` of `channel_type`
/// between this rank and `peer` (the `pair`-th such channel on each side).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelLink {
    /// Memory or port.
    pub channel_type: ChannelType,
    /// The rank-level index among the rank's channels of that type.
    pub index: usize,
    /// The peer.
    pub peer: usize,
    /// How many channels of this type to `peer` come before this one.
    pub pair: usize,
}

/// The most channels of one type between two ranks (their connection tags carry the pair in 12
/// bits; MSCCL++'s plans have one per thread block or fewer).
pub const MAX_PAIRS: usize = 4096;

/// The rank's channels in order (memory first, then port, each in `connected_to` order), each
/// checked to have its partner on the peer (else setup would wait for a connection that never
/// comes).
pub fn channel_links(plan: &Plan, rank: usize) -> Result<Vec<ChannelLink>, LowerError> {
    let gpu = plan.gpus.get(rank).ok_or(LowerError::Rank { rank, ranks: plan.gpus.len() })?;
    let mut out = Vec::new();
    for t in [ChannelType::Memory, ChannelType::Port] {
        let mut seen: HashMap<usize, usize> = HashMap::new();
        for index in 0..gpu.channel_count(t) {
            let peer = gpu.channel_peer(t, index).unwrap_or(usize::MAX);
            let pair = *seen.get(&peer).unwrap_or(&0);
            seen.insert(peer, pair + 1);
            if pair >= MAX_PAIRS {
                return Err(invalid(
                    format!("gpus[{rank}].channels"),
                    format!("more than {MAX_PAIRS} {} channels to rank {peer}", t.name()),
                ));
            }
            let theirs = plan
                .gpus
                .get(peer)
                .map_or(0, |g| (0..g.channel_count(t)).filter(|&k| g.channel_peer(t, k) == Some(rank)).count());
            if pair >= theirs {
                return Err(invalid(
                    format!("gpus[{rank}].channels"),
                    format!(
                        "{} channel {} of {} to rank {peer} has no partner: rank {peer} has {theirs} {} channel(s) to rank {rank}",
                        t.name(),
                        pair + 1,
                        (0..gpu.channel_count(t)).filter(|&k| gpu.channel_peer(t, k) == Some(peer)).count(),
                        t.name()
                    ),
                ));
            }
            out.push(ChannelLink { channel_type: t, index, peer, pair });
        }
    }
    Ok(out)
}

/// The buffers of `rank` its peers access: (peer, buffer), each once, in peer order.
pub fn buffer_sends(plan: &Plan, rank: usize) -> Vec<(usize, BufferType)> {
    let mut out = Vec::new();
    for (q, g) in plan.gpus.iter().enumerate() {
        if q == rank {
            continue;
        }
        for rb in &g.remote_buffers {
            if rb.rank == rank && !out.contains(&(q, rb.buffer_type)) {
                out.push((q, rb.buffer_type));
            }
        }
    }
    out
}

/// The peers' buffers `rank` accesses: (owner, buffer), each once, in first-use order.
pub fn buffer_recvs(plan: &Plan, rank: usize) -> Vec<(usize, BufferType)> {
    let mut out = Vec::new();
    if let Some(g) = plan.gpus.get(rank) {
        for rb in &g.remote_buffers {
            if !out.contains(&(rb.rank, rb.buffer_type)) {
                out.push((rb.rank, rb.buffer_type));
            }
        }
    }
    out
}

fn btype_code(t: BufferType) -> u32 {
    match t {
        BufferType::Input => BUF_INPUT,
        BufferType::Output => BUF_OUTPUT,
        BufferType::Scratch => BUF_SCRATCH,
    }
}

/// MSCCL++'s `calcOffset`: the start of slice `index` of `slices` of `size` bytes, in whole
/// alignment units.
fn slice_offset(size: u64, index: u64, slices: u64, align: u64) -> u64 {
    let n = size / align;
    let slices = slices.max(1);
    (index * (n / slices) + index.min(n % slices)) * align
}

/// The remote buffer (rank-level index) that `id` names in block `tb` for channel type `t`.
fn remote_index(tb: &ThreadBlock, t: ChannelType, id: usize) -> Option<usize> {
    tb.remote_buffer_refs
        .iter()
        .filter(|x| x.access_channel_type == t)
        .flat_map(|x| x.remote_buffer_ids.iter().copied())
        .nth(id)
}

/// Which `dst_buff` entries of an op are packets, and which `src_buff` entries are packets read
/// from this rank's scratch.
fn packet_dsts(k: OpKind) -> std::ops::RangeFrom<usize> {
    match k {
        OpKind::PutPackets | OpKind::ReadPutPackets | OpKind::CopyPackets => 0..,
        OpKind::ReduceSendPackets | OpKind::ReduceCopyPackets | OpKind::ReduceCopySendPackets => 1..,
        _ => usize::MAX..,
    }
}
fn packet_srcs(k: OpKind) -> std::ops::Range<usize> {
    match k {
        OpKind::UnpackPackets | OpKind::ReadPutPackets => 0..1,
        OpKind::ReducePackets
        | OpKind::ReduceSendPackets
        | OpKind::ReduceCopyPackets
        | OpKind::ReduceCopySendPackets => 1..usize::MAX,
        _ => 0..0,
    }
}

/// Which rank writes packets into each scratch chunk of `rank` (for error reports).
fn packet_writers(plan: &Plan, rank: usize) -> HashMap<u64, usize> {
    let mut w = HashMap::new();
    for (q, g) in plan.gpus.iter().enumerate() {
        for tb in &g.threadblocks {
            for op in tb.ops.iter().flat_map(|o| std::iter::once(o).chain(o.ops.iter())) {
                for r in op.dst_buff.iter().skip(packet_dsts(op.kind).start) {
                    let (owner, t) = match r.loc {
                        BufferLoc::Local(t) => (q, t),
                        BufferLoc::Remote(id) => {
                            let ct = op.channel_type.unwrap_or(ChannelType::Memory);
                            match remote_index(tb, ct, id).and_then(|i| g.remote_buffers.get(i)) {
                                Some(rb) => (rb.rank, rb.buffer_type),
                                None => continue,
                            }
                        }
                    };
                    if owner == rank && t == BufferType::Scratch {
                        for c in r.index..r.index.saturating_add(r.size).min(r.index.saturating_add(1 << 16)) {
                            w.insert(c, q);
                        }
                    }
                }
            }
        }
    }
    w
}

/// Where packet and plain data share bytes of a rank's scratch: MSCCL++ places a packet range
/// of scratch chunk `i` at byte `2 * i * chunk` (packets take twice the data's bytes) and a
/// plain range at `i * chunk`, so a plan that uses chunk indexes for both can make one op's
/// plain data land on another's packets (whose flags then never match: the reader waits until
/// the timeout). Returns one line per overlap, naming the owner rank and the two ops (for a
/// plan whose ops on those bytes run in separate phases this may be deliberate).
pub fn scratch_overlaps(plan: &Plan) -> Vec<String> {
    // (owner, start, end in half-chunk units, packet, who)
    let mut uses: Vec<(usize, u64, u64, bool, String)> = Vec::new();
    for (q, g) in plan.gpus.iter().enumerate() {
        for (bi, tb) in g.threadblocks.iter().enumerate() {
            for (oi, op) in tb.ops.iter().enumerate() {
                for (ii, o) in std::iter::once(op).chain(op.ops.iter()).enumerate() {
                    let who = if ii == 0 {
                        format!("gpus[{q}].threadblocks[{bi}].ops[{oi}] ({})", o.kind.name())
                    } else {
                        format!("gpus[{q}].threadblocks[{bi}].ops[{oi}].ops[{}] ({})", ii - 1, o.kind.name())
                    };
                    let (pd, ps) = (packet_dsts(o.kind), packet_srcs(o.kind));
                    let refs = o
                        .src_buff
                        .iter()
                        .enumerate()
                        .map(|(i, r)| (r, ps.contains(&i)))
                        .chain(o.dst_buff.iter().enumerate().map(|(i, r)| (r, i >= pd.start)));
                    for (r, packet) in refs {
                        let (owner, t) = match r.loc {
                            BufferLoc::Local(t) => (q, if packet { BufferType::Scratch } else { t }),
                            BufferLoc::Remote(id) => {
                                let ct = o.channel_type.unwrap_or(ChannelType::Memory);
                                match remote_index(tb, ct, id).and_then(|i| g.remote_buffers.get(i)) {
                                    Some(rb) => (rb.rank, rb.buffer_type),
                                    None => continue,
                                }
                            }
                        };
                        if t != BufferType::Scratch || r.size == 0 {
                            continue;
                        }
                        let (a, b) = (r.index.saturating_mul(2), r.index.saturating_add(r.size).saturating_mul(2));
                        let (a, b) = if packet { (a.saturating_mul(2), b.saturating_mul(2)) } else { (a, b) };
                        uses.push((owner, a, b, packet, who.clone()));
                    }
                }
            }
        }
    }
    let mut out = Vec::new();
    for (i, x) in uses.iter().enumerate() {
        for y in &uses[i + 1..] {
            if x.0 == y.0 && x.3 != y.3 && x.1 < y.2 && y.1 < x.2 {
                let (p, d) = if x.3 { (x, y) } else { (y, x) };
                out.push(format!("rank {}'s scratch: packets of {} overlap plain data of {}", x.0, p.4, d.4));
            }
        }
    }
    out
}

/// Lowers `rank`'s part of `plan` without resources, for what looks at the program rather than
/// runs it (kernel sources, compile checks, the CPU tests): `chunk_bytes` per input and output
/// chunk, and placeholder bindings (every remote buffer mapped at `0x1000`, proxy memory 3).
pub fn lower_unbound(plan: &Plan, rank: usize, chunk_bytes: u64) -> Result<Lowered, LowerError> {
    let g = plan.gpus.get(rank).ok_or(LowerError::Rank { rank, ranks: plan.gpus.len() })?;
    let (send, recv) = (chunk_bytes * g.input_chunks.max(1), chunk_bytes * g.output_chunks.max(1));
    let layout = Layout::new(plan, rank, send, recv)?;
    let b = Bindings {
        remote_base: vec![0x1000; g.remote_buffers.len()],
        remote_mem: vec![3; g.remote_buffers.len()],
        local_mem: [0, 1, 2],
    };
    lower(plan, rank, &layout, &b)
}

/// Lowers `rank`'s part of `plan` for a call laid out as `layout`, with peer resources `b`.
pub fn lower(plan: &Plan, rank: usize, layout: &Layout, b: &Bindings) -> Result<Lowered, LowerError> {
    let gpu = plan.gpus.get(rank).ok_or(LowerError::Rank { rank, ranks: plan.gpus.len() })?;
    let writers = packet_writers(plan, rank);
    let mut ops = Vec::new();
    let mut blocks = Vec::new();
    for (bi, tb) in gpu.threadblocks.iter().enumerate() {
        let first = ops.len();
        for (oi, op) in tb.ops.iter().enumerate() {
            let path = format!("gpus[{rank}].threadblocks[{bi}].ops[{oi}]");
            ops.push(lower_op(plan, gpu, tb, op, &path, layout, b, &writers)?);
            for (ii, inner) in op.ops.iter().enumerate() {
                let p = format!("{path}.ops[{ii}]");
                ops.push(lower_op(plan, gpu, tb, inner, &p, layout, b, &writers)?);
            }
        }
        blocks.push(first as u32);
        blocks.push((ops.len() - first) as u32);
    }
    Ok(Lowered { ops, blocks, semaphores: gpu.semaphores.iter().map(|s| s.init_value).collect() })
}

#[allow(clippy::too_many_arguments)]
fn lower_op(
    plan: &Plan,
    gpu: &Gpu,
    tb: &ThreadBlock,
    op: &Op,
    path: &str,
    layout: &Layout,
    b: &Bindings,
    writers: &HashMap<u64, usize>,
) -> Result<DevOp, LowerError> {
    let align = plan.buffer_alignment.max(1);
    let mut d = DevOp { kind: op_code(op.kind), ..DevOp::default() };
    let ct = op.channel_type.unwrap_or(ChannelType::None);
    d.ctype = match ct {
        ChannelType::None => 0,
        ChannelType::Memory => 1,
        ChannelType::Port => 2,
        ChannelType::Switch => {
            return Err(invalid(
                format!("{path}.channel_type"),
                "switch channels cannot run here (NVLink multicast is off)",
            ));
        }
    };
    if matches!(op.kind, OpKind::MultiLoadReduceStore | OpKind::MultiStore | OpKind::MultiStorePackets) {
        return Err(invalid(
            format!("{path}.name"),
            format!("{} needs NVLink multicast, which is off", op.kind.name()),
        ));
    }
    if op.channel_ids.len() > d.chans.len() {
        return Err(invalid(format!("{path}.channel_ids"), "more channels than one operation may use"));
    }
    for (i, &id) in op.channel_ids.iter().enumerate() {
        let gi = tb
            .channels
            .iter()
            .filter(|c| c.channel_type == ct)
            .flat_map(|c| c.channel_ids.iter().copied())
            .nth(id)
            .ok_or_else(|| invalid(format!("{path}.channel_ids[{i}]"), "not a channel of the thread block"))?;
        let peer = gpu
            .channel_peer(ct, gi)
            .ok_or_else(|| invalid(format!("{path}.channel_ids[{i}]"), "not a channel of the rank"))?;
        d.chans[i] = gi as u32;
        d.chan_peer[i] = peer as u32;
    }
    d.n_chan = op.channel_ids.len() as u32;
    let (tb_id, tbg) = op.tbg_info.map_or((0, 1), |t| (t.tb_id, t.tbg_size.max(1)));
    let chunk = layout.chunk_bytes;
    let pkt_srcs = packet_srcs(op.kind);
    let pkt_dsts = packet_dsts(op.kind);
    let buf =
        |r: &BufferRef, field: &str, i: usize, packet_src: bool, packet_dst: bool| -> Result<DevBuf, LowerError> {
            let p = format!("{path}.{field}[{i}]");
            let size = r.size.checked_mul(chunk).ok_or_else(|| invalid(&p, "size overflows"))?;
            let off = r.index.checked_mul(chunk).ok_or_else(|| invalid(&p, "index overflows"))?;
            let off = off + slice_offset(size, tb_id, tbg, align);
            let size = slice_offset(size, tb_id + 1, tbg, align) - slice_offset(size, tb_id, tbg, align);
            let mut out = DevBuf { off, size, peer: NO_PEER, ..DevBuf::default() };
            match r.loc {
                BufferLoc::Local(t) => {
                    out.kind = KIND_LOCAL;
                    out.btype = btype_code(t);
                    out.mem_id = b.local_mem[out.btype as usize];
                    let t_eff = if packet_src { BufferType::Scratch } else { t };
                    let limit = match t_eff {
                        BufferType::Input => layout.send_bytes,
                        BufferType::Output => layout.recv_bytes,
                        BufferType::Scratch => {
                            if plan.use_double_scratch_buffer {
                                layout.scratch_half
                            } else {
                                layout.scratch_bytes
                            }
                        }
                    };
                    let end = off + size;
                    let need = if t_eff == BufferType::Scratch && (packet_src || packet_dst) { 2 * end } else { end };
                    if need > limit {
                        return Err(invalid(&p, format!("ends past the {} buffer ({limit} bytes)", t_eff.code())));
                    }
                    if packet_src {
                        out.btype = BUF_SCRATCH;
                        out.peer = writers.get(&r.index).map_or(NO_PEER, |&w| w as u32);
                    }
                }
                BufferLoc::Remote(id) => {
                    let gi = remote_index(tb, ct, id)
                        .ok_or_else(|| invalid(format!("{p}.buffer_id"), "not a remote buffer of the thread block"))?;
                    let rb = gpu
                        .remote_buffers
                        .get(gi)
                        .ok_or_else(|| invalid(format!("{p}.buffer_id"), "not a remote buffer of the rank"))?;
                    out.btype = btype_code(rb.buffer_type);
                    out.peer = rb.rank as u32;
                    if ct == ChannelType::Port {
                        out.kind = KIND_PORT;
                        out.mem_id = b.remote_mem.get(gi).copied().unwrap_or(u32::MAX);
                    } else {
                        out.kind = KIND_MEMORY;
                        out.base = b.remote_base.get(gi).copied().unwrap_or(0);
                        if out.base == 0 {
                            return Err(invalid(
                                format!("{p}.buffer_id"),
                                format!(
                                    "rank {}'s {} buffer is not reachable through a memory channel",
                                    rb.rank,
                                    rb.buffer_type.code()
                                ),
                            ));
                        }
                    }
                }
            }
            if (packet_src || packet_dst) && !out.size.is_multiple_of(8) {
                return Err(invalid(&p, format!("{} bytes of packets: not a multiple of 8", out.size)));
            }
            if out.kind == KIND_PORT || (ct == ChannelType::Port && out.kind == KIND_LOCAL) {
                let end = (out.off + out.size) * 2 + layout.scratch_half;
                if end > u64::from(u32::MAX) {
                    return Err(invalid(
                        &p,
                        "a port channel moves at most 4 GiB offsets (the trigger's 32-bit fields)",
                    ));
                }
            }
            Ok(out)
        };
    if op.src_buff.len() > d.src.len() || op.dst_buff.len() > d.dst.len() {
        return Err(invalid(path, "more buffers than one operation may use"));
    }
    for (i, r) in op.src_buff.iter().enumerate() {
        d.src[i] = buf(r, "src_buff", i, pkt_srcs.contains(&i), false)?;
    }
    for (i, r) in op.dst_buff.iter().enumerate() {
        d.dst[i] = buf(r, "dst_buff", i, false, i >= pkt_dsts.start)?;
    }
    d.n_src = op.src_buff.len() as u32;
    d.n_dst = op.dst_buff.len() as u32;
    if op.kind.moves_data() && (d.n_src == 0 || d.n_dst == 0) {
        return Err(invalid(path, "a data operation needs src_buff and dst_buff"));
    }
    let reduces = matches!(
        op.kind,
        OpKind::Reduce
            | OpKind::ReduceSend
            | OpKind::ReadReduce
            | OpKind::ReadReduceSend
            | OpKind::ReducePackets
            | OpKind::ReduceSendPackets
            | OpKind::ReduceCopyPackets
            | OpKind::ReduceCopySendPackets
    );
    if reduces && d.src[..d.n_src as usize].iter().any(|s| !s.size.is_multiple_of(4)) {
        return Err(invalid(format!("{path}.src_buff"), "reductions need whole 4-byte words"));
    }
    if reduces && op.kind != OpKind::ReadReduce && op.kind != OpKind::ReadReduceSend {
        // Local reductions read local sources only (MSCCL++ semantics); remote sources need rre.
        if d.src[..d.n_src as usize].iter().any(|s| s.kind != KIND_LOCAL) {
            return Err(invalid(
                format!("{path}.src_buff"),
                "this reduction reads local buffers only (use rre for peers')",
            ));
        }
    }
    d.reduce_op = match op.reduce_op.unwrap_or(ReduceOp::Sum) {
        ReduceOp::Sum => 0,
        ReduceOp::Min => 1,
        ReduceOp::Max => 2,
    };
    if op.kind == OpKind::Barrier {
        d.barrier_id = op.barrier_id.unwrap_or(0) as u32;
        d.n_blocks = op.num_threadblocks.unwrap_or(1).clamp(1, u64::from(u32::MAX)) as u32;
    }
    if op.semaphore_ids.len() > d.sems.len() {
        return Err(invalid(format!("{path}.semaphore_ids"), "more semaphores than one operation may use"));
    }
    for (i, &s) in op.semaphore_ids.iter().enumerate() {
        d.sems[i] = s as u32;
    }
    d.n_sems = op.semaphore_ids.len() as u32;
    if op.kind == OpKind::Pipeline {
        let ctx =
            op.iter_context.ok_or_else(|| invalid(format!("{path}.iter_context"), "a pipeline needs iter_context"))?;
        if ctx.unit_size == 0 {
            return Err(invalid(format!("{path}.iter_context.unit_size"), "must be positive"));
        }
        if op.ops.iter().any(|o| o.kind == OpKind::Pipeline) {
            return Err(invalid(format!("{path}.ops"), "pipelines do not nest"));
        }
        d.unit_size = ctx.unit_size;
        let total = ctx.num_chunks.saturating_mul(layout.upper_chunk_bytes);
        d.n_iter = u32::try_from(total.div_ceil(ctx.unit_size))
            .map_err(|_| invalid(format!("{path}.iter_context"), "too many iterations"))?;
        d.n_body = op.ops.len() as u32;
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{self, Algorithm};

    fn fake_bindings(plan: &Plan, rank: usize) -> Bindings {
        let g = &plan.gpus[rank];
        Bindings {
            remote_base: (0..g.remote_buffers.len()).map(|i| 0x1000_0000 * (i as u64 + 1)).collect(),
            remote_mem: (0..g.remote_buffers.len()).map(|i| 3 + i as u32).collect(),
            local_mem: [0, 1, 2],
        }
    }

    #[test]
    fn layouts_follow_mscclpp_rules() {
        let p = generate::plan(Algorithm::AllPairAllReduce, 4, Protocol::LL, false).unwrap();
        let l = Layout::new(&p, 1, 4096, 4096).unwrap();
        assert_eq!(l.chunk_bytes, 1024);
        assert_eq!(l.scratch_bytes, 1024 * 8 * 2 * if p.use_double_scratch_buffer { 2 } else { 1 });
        assert!(matches!(Layout::new(&p, 1, 4095, 4095), Err(LowerError::Size { .. })));
        assert!(matches!(Layout::new(&p, 1, 4096 + 16, 4096 + 16), Err(LowerError::Size { .. })));
        assert!(matches!(Layout::new(&p, 1, 4096, 8192), Err(LowerError::Size { .. })));
        assert!(matches!(Layout::new(&p, 9, 4096, 4096), Err(LowerError::Rank { rank: 9, .. })));
        let ag = generate::plan(Algorithm::AllGather, 4, Protocol::Simple, false).unwrap();
        let l = Layout::new(&ag, 0, 256, 1024).unwrap();
        assert_eq!(l.chunk_bytes, 256);
    }

    #[test]
    fn every_generated_plan_lowers_for_every_rank() {
        for n in [2, 4, 8] {
            for plan in generate::all(n) {
                let g0 = &plan.gpus[0];
                let (send, recv) = (64 * g0.input_chunks.max(1), 64 * g0.output_chunks.max(1));
                for r in 0..n {
                    let l = Layout::new(&plan, r, send, recv).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
                    let low =
                        lower(&plan, r, &l, &fake_bindings(&plan, r)).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
                    assert_eq!(low.blocks.len(), 2 * plan.gpus[r].threadblocks.len());
                    let total: u32 = low.blocks.chunks(2).map(|c| c[1]).sum();
                    assert_eq!(total as usize, low.ops.len());
                    channel_links(&plan, r).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
                }
            }
        }
    }

    #[test]
    fn buffers_resolve_to_bytes_peers_and_packet_writers() {
        let p = generate::plan(Algorithm::AllPairAllReduce, 2, Protocol::LL, false).unwrap();
        let l = Layout::new(&p, 0, 2048, 2048).unwrap();
        let low = lower(&p, 0, &l, &fake_bindings(&p, 0)).unwrap();
        // Block 0: ppkt of input chunk 1 into rank 1's scratch slot 0.
        let put = &low.ops[0];
        assert_eq!(put.kind, op_code(OpKind::PutPackets));
        assert_eq!((put.src[0].kind, put.src[0].off, put.src[0].size), (KIND_LOCAL, 1024, 1024));
        assert_eq!(
            (put.dst[0].kind, put.dst[0].btype, put.dst[0].off, put.dst[0].peer),
            (KIND_MEMORY, BUF_SCRATCH, 0, 1)
        );
        assert_eq!(put.dst[0].base, 0x1000_0000);
        // respkt: the packet source (scratch slot 1) is written by rank 1.
        let res = &low.ops[1];
        assert_eq!(res.kind, op_code(OpKind::ReduceSendPackets));
        assert_eq!((res.src[1].btype, res.src[1].off, res.src[1].peer), (BUF_SCRATCH, 1024, 1));
    }

    #[test]
    fn device_images_pad_blocks_and_start_flags_at_one() {
        let p = generate::one_hop_allreduce(2, false, 3, 256).unwrap();
        let l = Layout::new(&p, 1, 3 * 64, 3 * 64).unwrap();
        let mut low = lower(&p, 1, &l, &fake_bindings(&p, 1)).unwrap();
        // Give block 1 a third op: every block gets three slots, the others padded with no-ops.
        let extra = low.ops[2];
        low.ops.insert(4, extra);
        low.blocks = vec![0, 2, 2, 3, 5, 2];
        let img = low.device_image();
        assert_eq!((img.stride, img.nblocks, img.slots.len()), (3, 3, 9));
        assert_eq!(img.slots[3..6], [low.ops[2], low.ops[3], low.ops[4]].map(|o| DevOp { block_ops: 3, ..o }));
        assert_eq!(img.slots[2], DevOp { block_ops: 2, ..DevOp::default() });
        assert!(img.slots[6..9].iter().all(|o| o.block_ops == 2));
        assert_eq!(img.barriers_off, 16);
        assert_eq!(img.sems_off, 16 + 4 * MAX_DEVICE_SYNCERS as usize);
        assert_eq!(img.flags_off, img.sems_off + 4 * low.semaphores.len());
        assert_eq!(img.state.len(), img.flags_off + 4 * 3);
        assert_eq!(img.state[..4], 1u32.to_le_bytes());
        assert!(img.state[img.flags_off..].chunks(4).all(|f| f == 1u32.to_le_bytes()));
    }

    #[test]
    fn thread_block_groups_split_on_alignment_units() {
        assert_eq!(slice_offset(1024, 0, 3, 16), 0);
        assert_eq!(slice_offset(1024, 1, 3, 16), 352);
        assert_eq!(slice_offset(1024, 2, 3, 16), 688);
        assert_eq!(slice_offset(1024, 3, 3, 16), 1024);
    }

    #[test]
    fn unpaired_channels_are_refused_with_the_path() {
        let mut p = generate::plan(Algorithm::AllGather, 2, Protocol::Simple, false).unwrap();
        p.gpus[0].channels.push(Channel { channel_type: ChannelType::Memory, connected_to: vec![1] });
        let e = channel_links(&p, 0).unwrap_err();
        assert_eq!(e.path(), Some("gpus[0].channels"));
        assert!(e.to_string().contains("no partner"), "{e}");
    }

    #[test]
    fn generated_plans_keep_packets_and_plain_data_apart_in_scratch() {
        for n in [2, 4, 6, 8] {
            for plan in generate::all(n) {
                let o = scratch_overlaps(&plan);
                assert!(o.is_empty(), "{}:\n{}", plan.name, o.join("\n"));
            }
        }
        // The check sees the mistake it is for: a plain put onto a peer's packet slot.
        let mut p = generate::plan(Algorithm::AllPairAllReduce, 2, Protocol::LL, false).unwrap();
        let put = p.gpus[0].threadblocks[0].ops[0].clone();
        let mut plain = put.clone();
        plain.kind = OpKind::Put;
        plain.dst_buff[0].index = 1;
        p.gpus[0].threadblocks[0].ops.push(plain);
        assert!(!scratch_overlaps(&p).is_empty());
    }

    /// Per launch of `rank`'s lowered program: how many signals it sends and waits it does on
    /// each (channel type, peer, pair) — the pair names the connection and semaphore both sides
    /// build (see [`channel_links`]).
    fn sync_counts(plan: &Plan, rank: usize) -> HashMap<(u32, usize, usize, bool), u64> {
        let g0 = &plan.gpus[0];
        let (send, recv) = (64 * g0.input_chunks.max(1), 64 * g0.output_chunks.max(1));
        let l = Layout::new(plan, rank, send, recv).unwrap();
        let low = lower(plan, rank, &l, &fake_bindings(plan, rank)).unwrap();
        let links = channel_links(plan, rank).unwrap();
        let link = |ctype: u32, gi: u32| {
            let t = if ctype == 1 { ChannelType::Memory } else { ChannelType::Port };
            let x = links.iter().find(|x| x.channel_type == t && x.index == gi as usize).unwrap();
            (x.peer, x.pair)
        };
        let code = |k: OpKind| op_code(k);
        let mut out = HashMap::new();
        for b in low.blocks.chunks(2) {
            let ops = &low.ops[b[0] as usize..(b[0] + b[1]) as usize];
            let mut i = 0;
            while i < ops.len() {
                let pipeline = ops[i].kind == code(OpKind::Pipeline);
                let (body, times) = if pipeline {
                    let n = ops[i].n_body as usize;
                    (&ops[i + 1..i + 1 + n], u64::from(ops[i].n_iter))
                } else {
                    (&ops[i..i + 1], 1)
                };
                for o in body {
                    if o.ctype == 0 {
                        continue;
                    }
                    let signals =
                        [OpKind::Signal, OpKind::RelaxedSignal, OpKind::PutWithSignal, OpKind::PutWithSignalAndFlush]
                            .iter()
                            .any(|&k| code(k) == o.kind);
                    let waits = [OpKind::Wait, OpKind::RelaxedWait].iter().any(|&k| code(k) == o.kind);
                    // A port put with signal signals once per destination (on channel i, or the
                    // first); everything else once per channel.
                    let per: Vec<u32> = if o.ctype == 2
                        && signals
                        && o.kind != code(OpKind::Signal)
                        && o.kind != code(OpKind::RelaxedSignal)
                    {
                        (0..o.n_dst).map(|t| o.chans[if t < o.n_chan { t as usize } else { 0 }]).collect()
                    } else {
                        o.chans[..o.n_chan as usize].to_vec()
                    };
                    if signals || waits {
                        for gi in per {
                            let (peer, pair) = link(o.ctype, gi);
                            *out.entry((o.ctype, peer, pair, signals)).or_insert(0) += times;
                        }
                    }
                }
                i += body.len() + usize::from(pipeline);
            }
        }
        out
    }

    /// Every signal a rank sends per launch is waited for by the peer on the same connection
    /// (and the other way round); else the first mismatch.
    fn check_pairing(plan: &Plan) -> Result<(), String> {
        let n = plan.gpus.len();
        let counts: Vec<_> = (0..n).map(|r| sync_counts(plan, r)).collect();
        for a in 0..n {
            for (&(ct, b, pair, signal), &k) in &counts[a] {
                let theirs = counts[b].get(&(ct, a, pair, !signal)).copied().unwrap_or(0);
                if k != theirs {
                    return Err(format!(
                        "{}: rank {a} {} {k} time(s) on {} channel pair {pair} to rank {b}, which {} {theirs}",
                        plan.name,
                        if signal { "signals" } else { "waits" },
                        if ct == 1 { "memory" } else { "port" },
                        if signal { "waits" } else { "signals" },
                    ));
                }
            }
        }
        Ok(())
    }

    #[test]
    fn every_signal_lands_on_the_semaphore_its_peer_waits_on() {
        for n in [2, 4, 6, 8] {
            for plan in generate::all(n) {
                check_pairing(&plan).unwrap();
            }
        }
        // A wait dropped from one side is caught.
        let mut p = generate::plan(Algorithm::HierarchicalAllReduce, 4, Protocol::LL, false).unwrap();
        let ops = &mut p.gpus[3].threadblocks[1].ops;
        let w = ops.iter().position(|o| o.kind == OpKind::Wait).unwrap();
        ops.remove(w);
        let e = check_pairing(&p).unwrap_err();
        assert!(e.contains("port channel pair 0"), "{e}");
    }

    #[test]
    fn sends_and_receives_match_across_ranks() {
        for plan in generate::all(4) {
            for r in 0..4 {
                for (peer, t) in buffer_sends(&plan, r) {
                    assert!(buffer_recvs(&plan, peer).contains(&(r, t)), "{}", plan.name);
                }
                for (owner, t) in buffer_recvs(&plan, r) {
                    assert!(buffer_sends(&plan, owner).contains(&(r, t)), "{}", plan.name);
                }
            }
        }
    }
}

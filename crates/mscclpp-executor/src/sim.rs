//! A CPU reference interpreter for plans, at chunk granularity: each chunk of each buffer holds
//! one `i64`, every rank's thread blocks run as coroutines that block where MSCCL++'s kernel
//! blocks (`wait` on signals, `barrier`, `sem_acquire`, LL packets not yet arrived), and the
//! result is every rank's buffers. It checks that a plan computes what its collective should
//! (the GPU executor's results must match it), and finds deadlocks.
//!
//! Semantics follow MSCCL++'s `execution_kernel.hpp`: the first `src_buff` of a reduction is
//! plain local data and the rest are added to it (for packet reductions, the rest are LL packets
//! in this rank's scratch); the first `dst_buff` is local and the rest are remote copies of the
//! result (for `recpkt`/`recspkt` the second is a local packet copy). Channel `k` from rank A to
//! rank B (the k-th of that type to B in A's `channels`) pairs with channel `k` from B to A: a
//! `signal` on one is consumed by a `wait` on the other. In-place plans alias the smaller of the
//! input and output buffers into the larger one at `rank * size` (in place AllGather's input is
//! its output chunk `rank`). Thread-block groups (`tbg_info`) are done by their block 0; a
//! `pipeline` runs its body once.
//!
//! [`simulate_launches`] runs a plan several times back to back with a rank allowed to fall
//! behind the others (one rank per seed runs only when nothing else can, or one step in 16), so
//! that a rank already in the next launch can overwrite a buffer a slower peer still reads:
//! the races between launches that a single run cannot show.

use std::collections::HashMap;

use crate::model::*;

/// Why a plan could not be interpreted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// Every unfinished thread block is blocked.
    #[error("deadlock: every unfinished thread block is blocked ({0})")]
    Deadlock(String),
    /// An operation the interpreter does not model (the NVLS ones, refused at load anyway).
    #[error("{0}: not modelled by the interpreter")]
    Unsupported(String),
    /// The plan's buffers hold more chunks than the interpreter takes on (it keeps one value per
    /// chunk): more than [`MAX_CHUNKS`] over all ranks.
    #[error("{0} chunks over all ranks: the interpreter takes at most {MAX_CHUNKS}")]
    TooLarge(u128),
    /// The plan does not pass validation (only possible for a plan built by hand).
    #[error("invalid plan: {0}")]
    Invalid(String),
}

/// The most chunks (input, output and scratch, over all ranks) [`simulate`] takes on.
pub const MAX_CHUNKS: u128 = 1 << 22;

/// Every rank's buffers after a run: `[rank][chunk]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffers {
    /// Input buffers (in place: the aliased view, as the plan sees it).
    pub input: Vec<Vec<i64>>,
    /// Output buffers (in place: the aliased view).
    pub output: Vec<Vec<i64>>,
    /// Scratch buffers.
    pub scratch: Vec<Vec<i64>>,
}

/// Where a buffer chunk lives: (rank, canonical buffer, chunk).
type Slot = (usize, BufferType, usize);

/// One rank's input, output and scratch chunks at the end of a launch.
type Snapshot = (Vec<i64>, Vec<i64>, Vec<i64>);

struct Sim<'a> {
    plan: &'a Plan,
    data: HashMap<Slot, i64>,
    /// LL packets written, by slot and launch (a packet carries its launch's flag).
    packets: HashMap<(Slot, usize), bool>,
    /// Scratch chunks per rank, when the plan alternates scratch halves between launches.
    halves: Option<Vec<usize>>,
    /// Signals pending at (receiver, sender, channel type, pair index).
    signals: HashMap<(usize, usize, ChannelType, usize), u64>,
    /// Barrier arrivals per (rank, barrier id).
    arrivals: HashMap<(usize, u64), u64>,
    semaphores: Vec<Vec<u64>>,
}

/// One thread block's flattened program (pipeline bodies inlined) and progress.
struct Block<'a> {
    rank: usize,
    /// Which launch of the plan (0 for a single run).
    launch: usize,
    tb: &'a ThreadBlock,
    ops: Vec<&'a Op>,
    pc: usize,
    /// The barrier count this block waits for, once it has arrived.
    barrier_target: Option<u64>,
}

/// Runs `plan` on `input` (`[rank][chunk]`, each rank's `input_chunks` values) and returns
/// every rank's buffers. Output and scratch start at 0. Each block runs until it blocks, in
/// rank and block order.
pub fn simulate(plan: &Plan, input: &[Vec<i64>]) -> Result<Buffers, SimError> {
    let mut out = run(plan, std::slice::from_ref(&input.to_vec()), None)?;
    Ok(out.pop().unwrap_or_else(|| Buffers { input: Vec::new(), output: Vec::new(), scratch: Vec::new() }))
}

/// As [`simulate`], but one operation at a time, of a block chosen by a generator seeded with
/// `seed`: another interleaving per seed. A plan whose result depends on the seed has a race
/// (a buffer read before the write it needs is synchronized, or overwritten while in use).
pub fn simulate_interleaved(plan: &Plan, input: &[Vec<i64>], seed: u64) -> Result<Buffers, SimError> {
    let mut out = run(plan, std::slice::from_ref(&input.to_vec()), Some(seed))?;
    Ok(out.pop().unwrap_or_else(|| Buffers { input: Vec::new(), output: Vec::new(), scratch: Vec::new() }))
}

/// Runs `plan` `inputs.len()` times back to back, as a stream runs launches: a rank starts
/// launch `l + 1` (its input buffer then holds `inputs[l + 1]`) as soon as its own blocks of
/// launch `l` have finished, while other ranks may still be in launch `l`; signals, barrier
/// counts and semaphores carry over, LL packets match their own launch only, and a plan with
/// `use_double_scratch_buffer` alternates scratch halves. Operations run one at a time in an
/// order drawn from `seed`. Returns each launch's buffers, every rank's taken when that rank
/// finished the launch. A result that differs from a single run's is a race between launches
/// (a buffer of one launch overwritten by the next while still in use).
pub fn simulate_launches(plan: &Plan, inputs: &[Vec<Vec<i64>>], seed: u64) -> Result<Vec<Buffers>, SimError> {
    run(plan, inputs, Some(seed))
}

fn run(plan: &Plan, inputs: &[Vec<Vec<i64>>], seed: Option<u64>) -> Result<Vec<Buffers>, SimError> {
    // Plans from `Plan::from_*` are valid already; one built by hand is checked here, so that
    // every index below is in range.
    crate::validate::validate(plan).map_err(|e| SimError::Invalid(e.to_string()))?;
    let chunks: u128 = plan
        .gpus
        .iter()
        .map(|g| u128::from(g.input_chunks) + u128::from(g.output_chunks) + u128::from(g.scratch_chunks))
        .sum();
    if chunks > MAX_CHUNKS {
        return Err(SimError::TooLarge(chunks));
    }
    let mut sim = Sim {
        plan,
        data: HashMap::new(),
        packets: HashMap::new(),
        halves: plan.use_double_scratch_buffer.then(|| plan.gpus.iter().map(|g| g.scratch_chunks as usize).collect()),
        signals: HashMap::new(),
        arrivals: HashMap::new(),
        semaphores: plan.gpus.iter().map(|g| g.semaphores.iter().map(|s| u64::from(s.init_value)).collect()).collect(),
    };
    let launches = inputs.len().max(1);
    let nranks = plan.gpus.len();
    let mut blocks: Vec<Block<'_>> = Vec::new();
    for l in 0..launches {
        for (r, gpu) in plan.gpus.iter().enumerate() {
            for tb in &gpu.threadblocks {
                let ops = tb.ops.iter().flat_map(|o| std::iter::once(o).chain(o.ops.iter())).collect();
                blocks.push(Block { rank: r, launch: l, tb, ops, pc: 0, barrier_target: None });
            }
        }
    }
    // Per (launch, rank): blocks not finished; whether it started (its input written).
    let mut left = vec![vec![0usize; nranks]; launches];
    for b in &blocks {
        left[b.launch][b.rank] += 1;
    }
    let mut started = vec![vec![false; nranks]; launches];
    let mut snaps: Vec<Vec<Option<Snapshot>>> = vec![vec![None; nranks]; launches];
    let runnable = |left: &Vec<Vec<usize>>, b: &Block<'_>| {
        b.pc < b.ops.len() && (b.launch == 0 || left[b.launch - 1][b.rank] == 0)
    };
    let mut rng = seed.map(|s| s ^ 0x9e37_79b9_7f4a_7c15);
    loop {
        let mut progress = false;
        // A rank whose previous launch is over starts the next: its input as given.
        for l in 0..launches {
            for r in 0..nranks {
                if !started[l][r] && (l == 0 || left[l - 1][r] == 0) {
                    started[l][r] = true;
                    let gpu = &plan.gpus[r];
                    for c in 0..gpu.input_chunks as usize {
                        let v = inputs.get(l).and_then(|i| i.get(r)).and_then(|x| x.get(c)).copied().unwrap_or(0);
                        let slot = sim.slot(r, BufferType::Input, c);
                        sim.data.insert(slot, v);
                    }
                }
            }
        }
        if let Some(state) = rng.as_mut() {
            // xorshift64*: pick a start, step the first runnable block from there.
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            let open: Vec<usize> = (0..blocks.len()).filter(|&i| runnable(&left, &blocks[i])).collect();
            if open.is_empty() && blocks.iter().all(|b| b.pc == b.ops.len()) {
                break;
            }
            let start = if open.is_empty() { 0 } else { (*state % open.len() as u64) as usize };
            // One rank (chosen by the seed) runs only when nothing else can, or one step in 16:
            // a slow rank, so that others run ahead of it into the next launch.
            let slow = seed.map_or(usize::MAX, |s| (s as usize) % nranks.max(1));
            let lucky = (*state >> 40) % 16 == 0;
            let order: Vec<usize> = (0..open.len())
                .map(|k| open[(start + k) % open.len()])
                .filter(|&i| lucky || blocks[i].rank != slow || launches == 1)
                .chain((0..open.len()).map(|k| open[(start + k) % open.len()]).filter(|&i| blocks[i].rank == slow))
                .collect();
            for i in order {
                let b = &mut blocks[i];
                if sim.step(b)? {
                    b.pc += 1;
                    progress = true;
                    if b.pc == b.ops.len() {
                        let (l, r) = (b.launch, b.rank);
                        left[l][r] -= 1;
                        if left[l][r] == 0 {
                            snaps[l][r] = Some(sim.snapshot(r));
                        }
                    }
                    break;
                }
            }
        } else {
            let mut unfinished = 0;
            for b in blocks.iter_mut() {
                if !runnable(&left, b) {
                    if b.pc < b.ops.len() {
                        unfinished += 1;
                    }
                    continue;
                }
                while b.pc < b.ops.len() {
                    if sim.step(b)? {
                        b.pc += 1;
                        progress = true;
                    } else {
                        break;
                    }
                }
                if b.pc < b.ops.len() {
                    unfinished += 1;
                } else {
                    let (l, r) = (b.launch, b.rank);
                    left[l][r] -= 1;
                    if left[l][r] == 0 {
                        snaps[l][r] = Some(sim.snapshot(r));
                    }
                }
            }
            if unfinished == 0 {
                break;
            }
        }
        if !progress {
            let blocked: Vec<String> = blocks
                .iter()
                .filter(|b| b.pc < b.ops.len())
                .take(4)
                .map(|b| format!("gpus[{}].threadblocks[{}] at {}", b.rank, b.tb.id, b.ops[b.pc].kind.name()))
                .collect();
            return Err(SimError::Deadlock(blocked.join("; ")));
        }
    }
    Ok(snaps
        .into_iter()
        .map(|per_rank| {
            let mut out = Buffers { input: Vec::new(), output: Vec::new(), scratch: Vec::new() };
            for (i, o, sc) in per_rank.into_iter().map(Option::unwrap_or_default) {
                out.input.push(i);
                out.output.push(o);
                out.scratch.push(sc);
            }
            out
        })
        .collect())
}

impl Sim<'_> {
    /// Rank `r`'s input, output and scratch (the first half) as they are now.
    fn snapshot(&self, r: usize) -> Snapshot {
        let g = &self.plan.gpus[r];
        let view = |t: BufferType, n: u64| -> Vec<i64> {
            (0..n as usize).map(|c| self.data.get(&self.slot(r, t, c)).copied().unwrap_or(0)).collect()
        };
        (
            view(BufferType::Input, g.input_chunks),
            view(BufferType::Output, g.output_chunks),
            view(BufferType::Scratch, g.scratch_chunks),
        )
    }
}

impl Sim<'_> {
    /// The canonical slot of a chunk: in place, the smaller of input and output is a window of
    /// the larger at `rank * size`.
    fn slot(&self, rank: usize, t: BufferType, c: usize) -> Slot {
        let Some(g) = self.plan.gpus.get(rank) else { return (rank, t, c) };
        if !self.plan.inplace || t == BufferType::Scratch {
            return (rank, t, c);
        }
        let (i, o) = (g.input_chunks as usize, g.output_chunks as usize);
        match t {
            BufferType::Output if o <= i => (rank, BufferType::Input, if o < i { rank * o + c } else { c }),
            BufferType::Input if i < o => (rank, BufferType::Output, rank * i + c),
            _ => (rank, t, c),
        }
    }

    /// Resolves a buffer reference of `op` run by block `b` to (rank, buffer type, first chunk).
    fn resolve(&self, b: &Block<'_>, op: &Op, r: &BufferRef) -> (usize, BufferType, usize) {
        let (rank, t, c) = self.resolve_plain(b, op, r);
        // With two scratch halves, launch l uses half l % 2 (its own and its peers', as the
        // kernel adds its own half's offset to every scratch address).
        match &self.halves {
            Some(h) if t == BufferType::Scratch && b.launch % 2 == 1 => {
                (rank, t, c + h.get(rank).copied().unwrap_or(0))
            }
            _ => (rank, t, c),
        }
    }

    fn resolve_plain(&self, b: &Block<'_>, op: &Op, r: &BufferRef) -> (usize, BufferType, usize) {
        match r.loc {
            BufferLoc::Local(t) => (b.rank, t, r.index as usize),
            BufferLoc::Remote(id) => {
                let ct = op.channel_type.unwrap_or(ChannelType::Memory);
                let gid =
                    b.tb.remote_buffer_refs
                        .iter()
                        .filter(|x| x.access_channel_type == ct)
                        .flat_map(|x| x.remote_buffer_ids.iter().copied())
                        .nth(id)
                        .unwrap_or(0);
                let rb = &self.plan.gpus[b.rank].remote_buffers[gid];
                (rb.rank, rb.buffer_type, r.index as usize)
            }
        }
    }

    fn read(&self, at: (usize, BufferType, usize), j: usize) -> i64 {
        self.data.get(&self.slot(at.0, at.1, at.2 + j)).copied().unwrap_or(0)
    }

    /// Writes chunk `j` of `at`; a packet carries the writing block's launch.
    fn write(&mut self, at: (usize, BufferType, usize), j: usize, v: i64, packet: Option<usize>) {
        let s = self.slot(at.0, at.1, at.2 + j);
        self.data.insert(s, v);
        if let Some(launch) = packet {
            self.packets.insert((s, launch), true);
        }
    }

    /// Whether the packets of `at` written by `launch` have all arrived.
    fn packets_ready(&self, at: (usize, BufferType, usize), size: usize, launch: usize) -> bool {
        (0..size).all(|j| self.packets.get(&(self.slot(at.0, at.1, at.2 + j), launch)).copied().unwrap_or(false))
    }

    /// (peer, pair index) of block `b`'s `i`-th channel of type `t` (thread-block numbering).
    fn channel(&self, b: &Block<'_>, t: ChannelType, i: usize) -> (usize, usize) {
        let gpu = &self.plan.gpus[b.rank];
        let gi =
            b.tb.channels.iter().filter(|c| c.channel_type == t).flat_map(|c| c.channel_ids.iter().copied()).nth(i);
        let gi = gi.unwrap_or(0);
        let peer = gpu.channel_peer(t, gi).unwrap_or(0);
        let pair = (0..gi).filter(|&k| gpu.channel_peer(t, k) == Some(peer)).count();
        (peer, pair)
    }

    fn signal(&mut self, b: &Block<'_>, op: &Op) {
        let t = op.channel_type.unwrap_or(ChannelType::Memory);
        for &i in &op.channel_ids {
            let (peer, pair) = self.channel(b, t, i);
            *self.signals.entry((peer, b.rank, t, pair)).or_insert(0) += 1;
        }
    }

    /// Executes `b`'s current op if it can run now; `false` when it is blocked.
    fn step(&mut self, b: &mut Block<'_>) -> Result<bool, SimError> {
        let op = b.ops[b.pc];
        let size = op.src_buff.first().or(op.dst_buff.first()).map_or(0, |x| x.size as usize);
        let src: Vec<_> = op.src_buff.iter().map(|x| self.resolve(b, op, x)).collect();
        let dst: Vec<_> = op.dst_buff.iter().map(|x| self.resolve(b, op, x)).collect();
        let combine = |a: i64, v: i64| match op.reduce_op.unwrap_or(ReduceOp::Sum) {
            ReduceOp::Sum => a.wrapping_add(v),
            ReduceOp::Min => a.min(v),
            ReduceOp::Max => a.max(v),
        };
        if op.tbg_info.is_some_and(|t| t.tb_id != 0) && op.kind.moves_data() {
            return Ok(true);
        }
        match op.kind {
            OpKind::Nop | OpKind::Flush | OpKind::Pipeline => {}
            OpKind::Barrier => {
                let key = (b.rank, op.barrier_id.unwrap_or(0));
                let n = op.num_threadblocks.unwrap_or(1).max(1);
                let target = match b.barrier_target {
                    Some(t) => t,
                    None => {
                        let count = self.arrivals.entry(key).or_insert(0);
                        *count += 1;
                        let t = (*count - 1) / n * n + n;
                        b.barrier_target = Some(t);
                        t
                    }
                };
                if self.arrivals.get(&key).copied().unwrap_or(0) < target {
                    return Ok(false);
                }
                b.barrier_target = None;
            }
            OpKind::Signal | OpKind::RelaxedSignal => self.signal(b, op),
            OpKind::Wait | OpKind::RelaxedWait => {
                let t = op.channel_type.unwrap_or(ChannelType::Memory);
                let keys: Vec<_> = op
                    .channel_ids
                    .iter()
                    .map(|&i| {
                        let (peer, pair) = self.channel(b, t, i);
                        (b.rank, peer, t, pair)
                    })
                    .collect();
                let mut need: HashMap<_, u64> = HashMap::new();
                for k in &keys {
                    *need.entry(*k).or_insert(0) += 1;
                }
                if need.iter().any(|(k, n)| self.signals.get(k).copied().unwrap_or(0) < *n) {
                    return Ok(false);
                }
                for (k, n) in need {
                    *self.signals.entry(k).or_insert(0) -= n;
                }
            }
            OpKind::SemAcquire => {
                let sems = &mut self.semaphores[b.rank];
                if op.semaphore_ids.iter().any(|&s| sems[s] == 0) {
                    return Ok(false);
                }
                op.semaphore_ids.iter().for_each(|&s| sems[s] -= 1);
            }
            OpKind::SemRelease => op.semaphore_ids.iter().for_each(|&s| self.semaphores[b.rank][s] += 1),
            OpKind::Copy | OpKind::Put | OpKind::Get | OpKind::PutWithSignal | OpKind::PutWithSignalAndFlush => {
                for (i, &d) in dst.iter().enumerate() {
                    let s = src[i.min(src.len() - 1)];
                    for j in 0..size {
                        let v = self.read(s, j);
                        self.write(d, j, v, None);
                    }
                }
                if matches!(op.kind, OpKind::PutWithSignal | OpKind::PutWithSignalAndFlush) {
                    self.signal(b, op);
                }
            }
            OpKind::PutPackets | OpKind::CopyPackets => {
                for (i, &d) in dst.iter().enumerate() {
                    let s = src[i.min(src.len() - 1)];
                    for j in 0..size {
                        let v = self.read(s, j);
                        self.write(d, j, v, Some(b.launch));
                    }
                }
            }
            OpKind::ReadPutPackets | OpKind::UnpackPackets => {
                if !self.packets_ready(src[0], size, b.launch) {
                    return Ok(false);
                }
                let packet = op.kind == OpKind::ReadPutPackets;
                for &d in &dst {
                    for j in 0..size {
                        let v = self.read(src[0], j);
                        self.write(d, j, v, packet.then_some(b.launch));
                    }
                }
            }
            OpKind::Reduce | OpKind::ReduceSend | OpKind::ReadReduce | OpKind::ReadReduceSend => {
                let vals: Vec<i64> = (0..size)
                    .map(|j| src[1..].iter().fold(self.read(src[0], j), |a, &s| combine(a, self.read(s, j))))
                    .collect();
                for &d in &dst {
                    for (j, &v) in vals.iter().enumerate() {
                        self.write(d, j, v, None);
                    }
                }
            }
            OpKind::ReducePackets
            | OpKind::ReduceCopyPackets
            | OpKind::ReduceSendPackets
            | OpKind::ReduceCopySendPackets => {
                // The sources after the first are packets in this rank's scratch.
                let pkt_src: Vec<_> = src[1..].iter().map(|&(_, _, c)| (b.rank, BufferType::Scratch, c)).collect();
                if !pkt_src.iter().all(|&s| self.packets_ready(s, size, b.launch)) {
                    return Ok(false);
                }
                let vals: Vec<i64> = (0..size)
                    .map(|j| pkt_src.iter().fold(self.read(src[0], j), |a, &s| combine(a, self.read(s, j))))
                    .collect();
                for (i, &d) in dst.iter().enumerate() {
                    for (j, &v) in vals.iter().enumerate() {
                        self.write(d, j, v, (i > 0).then_some(b.launch));
                    }
                }
            }
            OpKind::MultiLoadReduceStore | OpKind::MultiStore | OpKind::MultiStorePackets => {
                return Err(SimError::Unsupported(op.kind.name().to_owned()));
            }
        }
        Ok(true)
    }
}

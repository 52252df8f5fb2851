//! Plans written here, in MSCCL++'s schema: ring and all-pair AllReduce, AllGather,
//! ReduceScatter and a two-node hierarchical AllReduce, each in Simple and LL, in and out of
//! place. They are this project's own (none is copied from MSCCL++) and serve as test inputs
//! for loading now and for execution later.
//!
//! Conventions, as MSCCL++'s executor reads them: a rank's channels are numbered per type in
//! `connected_to` order; a thread block lists the channels and remote buffers it uses and its
//! ops index those lists; buffer ranges are in chunks (`input_chunks` etc.). Synchronization
//! follows MSCCL++'s DSL: Simple protocol puts are followed by `signal` and the receiver's
//! `wait`; LL packets carry their own flags, so readers of scratch (`upkt`, `repkt`) need no
//! signal.

use crate::model::*;

/// Which plan to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// AllReduce: every rank exchanges with every other rank directly (one thread block per peer).
    AllPairAllReduce,
    /// AllReduce in one hop, LL only (the plan form of `mscclpp-collectives`' built-in `allpair`
    /// kernel): every rank writes its whole input as packets into every peer's scratch, then
    /// reduces its input with the packets that arrived. Split over
    /// [`ONE_HOP_DEFAULT_BLOCKS`] thread blocks; [`one_hop_allreduce`] picks the split.
    OneHopAllReduce,
    /// AllReduce around a ring: reduce-scatter then all-gather, `ranks - 1` steps each.
    RingAllReduce,
    /// AllGather, all-pair.
    AllGather,
    /// ReduceScatter, all-pair.
    ReduceScatter,
    /// AllReduce over two nodes: reduce-scatter inside a node over memory channels, exchange the
    /// owned chunk with the same-position rank of the other node over port channels, all-gather
    /// inside the node. `ranks` must be even (two nodes of `ranks / 2`).
    HierarchicalAllReduce,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: &'static [Algorithm] = &[
        Algorithm::AllPairAllReduce,
        Algorithm::OneHopAllReduce,
        Algorithm::RingAllReduce,
        Algorithm::AllGather,
        Algorithm::ReduceScatter,
        Algorithm::HierarchicalAllReduce,
    ];

    /// A short name, used in plan names.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::AllPairAllReduce => "allpair_allreduce",
            Algorithm::OneHopAllReduce => "onehop_allreduce",
            Algorithm::RingAllReduce => "ring_allreduce",
            Algorithm::AllGather => "allpair_allgather",
            Algorithm::ReduceScatter => "allpair_reducescatter",
            Algorithm::HierarchicalAllReduce => "two_node_allreduce",
        }
    }

    /// The plan's `collective`.
    pub fn collective(self) -> &'static str {
        match self {
            Algorithm::AllGather => "allgather",
            Algorithm::ReduceScatter => "reducescatter",
            _ => "allreduce",
        }
    }
}

/// Thread blocks of [`Algorithm::OneHopAllReduce`] as [`plan`] writes it.
pub const ONE_HOP_DEFAULT_BLOCKS: usize = 2;

/// Writes the plan for `algorithm` over `ranks` ranks. `None` when the shape cannot be served:
/// fewer than 2 ranks, more than 8 (a node's worth; beyond it the ring's Simple plan would pass
/// MSCCL++'s 64 operations per thread block), fewer than 4 or an odd count for the two-node
/// plan, or the Simple protocol for the one-hop plan.
pub fn plan(algorithm: Algorithm, ranks: usize, protocol: Protocol, inplace: bool) -> Option<Plan> {
    if algorithm == Algorithm::OneHopAllReduce {
        if protocol != Protocol::LL {
            return None;
        }
        return one_hop_allreduce(ranks, inplace, ONE_HOP_DEFAULT_BLOCKS, DEFAULT_THREADS_PER_BLOCK);
    }
    build(algorithm, ranks, protocol, inplace, 1, DEFAULT_THREADS_PER_BLOCK)
}

/// The one-hop LL AllReduce ([`Algorithm::OneHopAllReduce`]) split over `blocks` thread blocks
/// of `threads` threads: the input in `blocks` chunks, block `b` sends chunk `b` as packets to
/// every peer's scratch slot `rank * blocks + b` and reduces chunk `b` from its own input and the
/// peers' packets. The same data movement as `mscclpp-collectives`' `allpair` kernel on `blocks`
/// blocks, so the two can be timed side by side (`mscclpp-perf allreduce --plan` against
/// `--algo allpair`). `None` for fewer than 2 or more than 8 ranks, no blocks, more than 64
/// blocks, or `threads` outside 32..=1024.
///
/// ```
/// use mscclpp_executor::generate;
/// let p = generate::one_hop_allreduce(2, false, 4, 256).unwrap();
/// assert_eq!(p.name, "onehop_allreduce_2_ll_4x256_oop");
/// assert_eq!(p.gpus[0].threadblocks.len(), 4);
/// ```
pub fn one_hop_allreduce(ranks: usize, inplace: bool, blocks: usize, threads: u32) -> Option<Plan> {
    if !(1..=64).contains(&blocks) || !(32..=1024).contains(&threads) {
        return None;
    }
    let mut p = build(Algorithm::OneHopAllReduce, ranks, Protocol::LL, inplace, blocks, threads)?;
    if (blocks, threads) != (ONE_HOP_DEFAULT_BLOCKS, DEFAULT_THREADS_PER_BLOCK) {
        p.name = format!("onehop_allreduce_{ranks}_ll_{blocks}x{threads}_{}", if inplace { "ip" } else { "oop" });
    }
    Some(p)
}

fn build(
    algorithm: Algorithm,
    ranks: usize,
    protocol: Protocol,
    inplace: bool,
    blocks: usize,
    threads: u32,
) -> Option<Plan> {
    if !(2..=8).contains(&ranks)
        || (algorithm == Algorithm::HierarchicalAllReduce && (!ranks.is_multiple_of(2) || ranks < 4))
        || (algorithm == Algorithm::OneHopAllReduce && protocol != Protocol::LL)
    {
        return None;
    }
    let gpus = (0..ranks)
        .map(|r| {
            let mut g = Builder::new(r, ranks);
            match algorithm {
                Algorithm::AllPairAllReduce => g.allpair_allreduce(protocol, inplace),
                Algorithm::OneHopAllReduce => g.one_hop_allreduce(inplace, blocks),
                Algorithm::RingAllReduce => g.ring_allreduce(protocol, inplace),
                Algorithm::AllGather => g.allgather(protocol, inplace),
                Algorithm::ReduceScatter => g.reducescatter(protocol, inplace),
                Algorithm::HierarchicalAllReduce => g.hierarchical(protocol, inplace),
            }
            g.gpu
        })
        .collect();
    let p = match protocol {
        Protocol::Simple => "simple",
        Protocol::LL => "ll",
    };
    Some(Plan {
        name: format!("{}_{ranks}_{p}_{}", algorithm.name(), if inplace { "ip" } else { "oop" }),
        collective: algorithm.collective().into(),
        protocol,
        inplace,
        reuse_resources: false,
        // LL packets of one launch may still be read while a peer's next launch writes: with two
        // scratch halves (picked by the flag's parity) consecutive launches never share one.
        // The two-node plan needs them with Simple too: nothing orders a rank's cross-node put of
        // launch i+1 after the other node's reduction of that scratch chunk in launch i (the
        // putter only waits for the other node's put of launch i, which comes before that
        // reduction), so back-to-back launches could overwrite data still being read. With two
        // halves, reaching the same half again (launch i+2) needs the other node's put of launch
        // i+1, which that rank issues only after finishing launch i.
        use_double_scratch_buffer: protocol == Protocol::LL || algorithm == Algorithm::HierarchicalAllReduce,
        buffer_alignment: DEFAULT_BUFFER_ALIGNMENT,
        min_message_size: 0,
        max_message_size: u64::MAX,
        num_threads_per_block: threads,
        gpus,
    })
}

/// Every generated plan of this module for `ranks` ranks (the ones the shape allows).
pub fn all(ranks: usize) -> Vec<Plan> {
    let mut out = Vec::new();
    for &a in Algorithm::ALL {
        for protocol in [Protocol::Simple, Protocol::LL] {
            for inplace in [true, false] {
                out.extend(plan(a, ranks, protocol, inplace));
            }
        }
    }
    out
}

fn local(t: BufferType, index: usize, size: usize) -> BufferRef {
    BufferRef { loc: BufferLoc::Local(t), index: index as u64, size: size as u64 }
}

fn remote(id: usize, index: usize, size: usize) -> BufferRef {
    BufferRef { loc: BufferLoc::Remote(id), index: index as u64, size: size as u64 }
}

fn op(kind: OpKind) -> Op {
    Op { kind, ..Op::default() }
}

fn with_channels(mut o: Op, t: ChannelType, ids: Vec<usize>) -> Op {
    o.channel_type = Some(t);
    o.channel_ids = ids;
    o
}

fn data(kind: OpKind, src: Vec<BufferRef>, dst: Vec<BufferRef>) -> Op {
    Op { kind, src_buff: src, dst_buff: dst, ..Op::default() }
}

fn reduce(kind: OpKind, src: Vec<BufferRef>, dst: Vec<BufferRef>) -> Op {
    Op { reduce_op: Some(ReduceOp::Sum), ..data(kind, src, dst) }
}

/// Builds one rank's [`Gpu`].
struct Builder {
    rank: usize,
    world: usize,
    gpu: Gpu,
}

impl Builder {
    fn new(rank: usize, world: usize) -> Builder {
        let gpu = Gpu {
            id: rank,
            input_chunks: 0,
            output_chunks: 0,
            scratch_chunks: 0,
            threadblocks: Vec::new(),
            channels: Vec::new(),
            remote_buffers: Vec::new(),
            semaphores: Vec::new(),
        };
        Builder { rank, world, gpu }
    }

    fn peers(&self) -> Vec<usize> {
        (0..self.world).filter(|&p| p != self.rank).collect()
    }

    fn chunks(&mut self, input: usize, output: usize, scratch: usize) {
        self.gpu.input_chunks = input as u64;
        self.gpu.output_chunks = output as u64;
        self.gpu.scratch_chunks = scratch as u64;
    }

    /// Adds channels of type `t` to `peers`; returns the rank-level id of the first.
    fn channels(&mut self, t: ChannelType, peers: &[usize]) -> usize {
        let first = self.gpu.channel_count(t);
        self.gpu.channels.push(Channel { channel_type: t, connected_to: peers.to_vec() });
        first
    }

    /// Adds a remote buffer; returns its rank-level id.
    fn remote_buffer(&mut self, rank: usize, t: BufferType, access: ChannelType) -> usize {
        self.gpu.remote_buffers.push(RemoteBuffer { rank, buffer_type: t, access_channel_types: vec![access] });
        self.gpu.remote_buffers.len() - 1
    }

    /// Adds a thread block using rank-level channels `chans` and remote buffers `bufs` (all of
    /// type `t`): its ops index them 0.. in the order given.
    fn block(&mut self, t: ChannelType, chans: Vec<usize>, bufs: Vec<usize>, ops: Vec<Op>) {
        let id = self.gpu.threadblocks.len();
        let channels = if chans.is_empty() {
            Vec::new()
        } else {
            vec![ThreadBlockChannels { channel_type: t, channel_ids: chans, buff: None }]
        };
        let remote_buffer_refs = if bufs.is_empty() {
            Vec::new()
        } else {
            vec![RemoteBufferRefs { access_channel_type: t, remote_buffer_ids: bufs }]
        };
        self.gpu.threadblocks.push(ThreadBlock { id, ops, channels, remote_buffer_refs });
    }

    /// The buffer the result lands in.
    fn out(inplace: bool) -> BufferType {
        if inplace { BufferType::Input } else { BufferType::Output }
    }

    fn barrier(&self, id: u64, blocks: usize) -> Op {
        Op { barrier_id: Some(id), num_threadblocks: Some(blocks as u64), ..op(OpKind::Barrier) }
    }

    /// AllReduce, all-pair: input split in `world` chunks, chunk `r` owned by rank `r`.
    /// Simple: block per peer puts the peer's chunk into its scratch slot `rank`, signals,
    /// waits; a barrier; block 0 reduces the owned chunk; the blocks put it into every peer's
    /// result buffer; signal and wait. LL: the same with packets; the second phase lands in
    /// scratch slots `world + rank` and is unpacked.
    fn allpair_allreduce(&mut self, protocol: Protocol, inplace: bool) {
        let (n, r, peers) = (self.world, self.rank, self.peers());
        let out = Self::out(inplace);
        let m = ChannelType::Memory;
        self.chunks(n, n, if protocol == Protocol::LL { 2 * n } else { n });
        let first = self.channels(m, &peers);
        let scratch: Vec<usize> = peers.iter().map(|&p| self.remote_buffer(p, BufferType::Scratch, m)).collect();
        let results: Vec<usize> = peers.iter().map(|&p| self.remote_buffer(p, out, m)).collect();
        let mut sources = vec![local(BufferType::Input, r, 1)];
        sources.extend(peers.iter().map(|&p| local(BufferType::Scratch, p, 1)));
        let dst = vec![local(out, r, 1)];
        for (k, &p) in peers.iter().enumerate() {
            let mut ops = Vec::new();
            let (bufs, chans) = match protocol {
                Protocol::Simple => {
                    ops.push(with_channels(
                        data(OpKind::Put, vec![local(BufferType::Input, p, 1)], vec![remote(0, r, 1)]),
                        m,
                        vec![0],
                    ));
                    ops.push(with_channels(op(OpKind::Signal), m, vec![0]));
                    ops.push(with_channels(op(OpKind::Wait), m, vec![0]));
                    ops.push(self.barrier(0, n - 1));
                    if k == 0 {
                        ops.push(reduce(OpKind::Reduce, sources.clone(), dst.clone()));
                    }
                    ops.push(self.barrier(1, n - 1));
                    ops.push(with_channels(data(OpKind::Put, dst.clone(), vec![remote(1, r, 1)]), m, vec![0]));
                    ops.push(with_channels(op(OpKind::Signal), m, vec![0]));
                    ops.push(with_channels(op(OpKind::Wait), m, vec![0]));
                    (vec![scratch[k], results[k]], vec![first + k])
                }
                Protocol::LL => {
                    let mut put = data(OpKind::PutPackets, vec![local(BufferType::Input, p, 1)], vec![remote(0, r, 1)]);
                    put.channel_type = Some(m);
                    ops.push(put);
                    if k == 0 {
                        // Reduce the owned chunk from packets, then send it as packets to every peer.
                        let mut dsts = dst.clone();
                        dsts.extend((0..peers.len()).map(|j| remote(j, n + r, 1)));
                        let mut res = reduce(OpKind::ReduceSendPackets, sources.clone(), dsts);
                        res.channel_type = Some(m);
                        ops.push(res);
                    }
                    ops.push(data(
                        OpKind::UnpackPackets,
                        vec![local(BufferType::Scratch, n + p, 1)],
                        vec![local(out, p, 1)],
                    ));
                    let bufs = if k == 0 { scratch.clone() } else { vec![scratch[k]] };
                    (bufs, Vec::new())
                }
            };
            self.block(m, chans, bufs, ops);
        }
    }

    /// AllReduce in one hop with LL packets over `blocks` thread blocks (see
    /// [`one_hop_allreduce`]).
    fn one_hop_allreduce(&mut self, inplace: bool, blocks: usize) {
        let (n, r, peers) = (self.world, self.rank, self.peers());
        let out = Self::out(inplace);
        let m = ChannelType::Memory;
        self.chunks(blocks, blocks, n * blocks);
        self.channels(m, &peers);
        let scratch: Vec<usize> = peers.iter().map(|&p| self.remote_buffer(p, BufferType::Scratch, m)).collect();
        for b in 0..blocks {
            let mut put = data(
                OpKind::PutPackets,
                vec![local(BufferType::Input, b, 1)],
                (0..peers.len()).map(|k| remote(k, r * blocks + b, 1)).collect(),
            );
            put.channel_type = Some(m);
            let mut sources = vec![local(BufferType::Input, b, 1)];
            sources.extend(peers.iter().map(|&p| local(BufferType::Scratch, p * blocks + b, 1)));
            let red = reduce(OpKind::ReducePackets, sources, vec![local(out, b, 1)]);
            self.block(m, Vec::new(), scratch.clone(), vec![put, red]);
        }
    }

    /// AllReduce on a ring, one thread block; channel 0 to the next rank, 1 from the previous
    /// (with two ranks, channel 0 both ways).
    fn ring_allreduce(&mut self, protocol: Protocol, inplace: bool) {
        let (n, r) = (self.world, self.rank);
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let out = Self::out(inplace);
        let m = ChannelType::Memory;
        let ll = protocol == Protocol::LL;
        self.chunks(n, n, if ll { 2 * n } else { n });
        // Channel k from A to B pairs with channel k from B to A; with two ranks, one channel
        // serves both directions (a second would pair with the peer's "next" channel).
        let to_next = self.channels(m, &[next]);
        let chans = if n == 2 { vec![to_next] } else { vec![to_next, self.channels(m, &[prev])] };
        let from = chans.len() - 1;
        let next_scratch = self.remote_buffer(next, BufferType::Scratch, m);
        let next_out = self.remote_buffer(next, out, m);
        let mut ops = Vec::new();
        let sync = |ops: &mut Vec<Op>| {
            ops.push(with_channels(op(OpKind::Signal), m, vec![0]));
            ops.push(with_channels(op(OpKind::Wait), m, vec![from]));
        };
        // Reduce-scatter: at step s, send chunk (r - s) and fold in chunk (r - s - 1).
        for s in 0..n - 1 {
            let send = (r + n - s) % n;
            let recv = (r + 2 * n - s - 1) % n;
            let src = if s == 0 { BufferType::Input } else { out };
            if ll {
                let mut put = data(OpKind::PutPackets, vec![local(src, send, 1)], vec![remote(0, send, 1)]);
                put.channel_type = Some(m);
                ops.push(put);
                ops.push(reduce(
                    OpKind::ReducePackets,
                    vec![local(BufferType::Input, recv, 1), local(BufferType::Scratch, recv, 1)],
                    vec![local(out, recv, 1)],
                ));
            } else {
                ops.push(with_channels(
                    data(OpKind::Put, vec![local(src, send, 1)], vec![remote(0, send, 1)]),
                    m,
                    vec![0],
                ));
                sync(&mut ops);
                ops.push(reduce(
                    OpKind::Reduce,
                    vec![local(BufferType::Input, recv, 1), local(BufferType::Scratch, recv, 1)],
                    vec![local(out, recv, 1)],
                ));
                sync(&mut ops);
            }
        }
        // All-gather: at step s, forward chunk (r + 1 - s), fully reduced.
        for s in 0..n - 1 {
            let send = (r + 1 + n - s) % n;
            let recv = (r + n - s) % n;
            if ll {
                let mut put = data(OpKind::PutPackets, vec![local(out, send, 1)], vec![remote(0, n + send, 1)]);
                put.channel_type = Some(m);
                ops.push(put);
                ops.push(data(
                    OpKind::UnpackPackets,
                    vec![local(BufferType::Scratch, n + recv, 1)],
                    vec![local(out, recv, 1)],
                ));
            } else {
                ops.push(with_channels(
                    data(OpKind::Put, vec![local(out, send, 1)], vec![remote(1, send, 1)]),
                    m,
                    vec![0],
                ));
                sync(&mut ops);
            }
        }
        let bufs = if ll { vec![next_scratch] } else { vec![next_scratch, next_out] };
        self.block(m, chans, bufs, ops);
    }

    /// AllGather, all-pair: input 1 chunk, output `world` chunks; rank `r`'s input lands in
    /// everyone's output chunk `r`. In place, the input is output chunk `r`.
    fn allgather(&mut self, protocol: Protocol, inplace: bool) {
        let (n, r, peers) = (self.world, self.rank, self.peers());
        let m = ChannelType::Memory;
        let ll = protocol == Protocol::LL;
        self.chunks(1, n, if ll { n } else { 0 });
        let first = self.channels(m, &peers);
        let mine = if inplace { local(BufferType::Output, r, 1) } else { local(BufferType::Input, 0, 1) };
        for (k, &p) in peers.iter().enumerate() {
            let mut ops = Vec::new();
            if !inplace && k == 0 {
                ops.push(data(
                    OpKind::Copy,
                    vec![local(BufferType::Input, 0, 1)],
                    vec![local(BufferType::Output, r, 1)],
                ));
            }
            if ll {
                let buf = self.remote_buffer(p, BufferType::Scratch, m);
                let mut put = data(OpKind::PutPackets, vec![mine.clone()], vec![remote(0, r, 1)]);
                put.channel_type = Some(m);
                ops.push(put);
                ops.push(data(
                    OpKind::UnpackPackets,
                    vec![local(BufferType::Scratch, p, 1)],
                    vec![local(BufferType::Output, p, 1)],
                ));
                self.block(m, Vec::new(), vec![buf], ops);
            } else {
                let buf = self.remote_buffer(p, BufferType::Output, m);
                // Entry handshake: the peer's output is written only once the peer is in this
                // launch too (a rank that ran ahead into the next launch overwrote a peer's
                // output before that peer had finished the previous one).
                ops.push(with_channels(op(OpKind::Signal), m, vec![0]));
                ops.push(with_channels(op(OpKind::Wait), m, vec![0]));
                ops.push(with_channels(data(OpKind::Put, vec![mine.clone()], vec![remote(0, r, 1)]), m, vec![0]));
                ops.push(with_channels(op(OpKind::Signal), m, vec![0]));
                ops.push(with_channels(op(OpKind::Wait), m, vec![0]));
                self.block(m, vec![first + k], vec![buf], ops);
            }
        }
    }

    /// ReduceScatter, all-pair: input `world` chunks, output 1; rank `r` ends with the sum of
    /// everyone's chunk `r` (in place: in its input chunk `r`).
    fn reducescatter(&mut self, protocol: Protocol, inplace: bool) {
        let (n, r, peers) = (self.world, self.rank, self.peers());
        let m = ChannelType::Memory;
        let ll = protocol == Protocol::LL;
        self.chunks(n, 1, n);
        let first = self.channels(m, &peers);
        let dst = if inplace { local(BufferType::Input, r, 1) } else { local(BufferType::Output, 0, 1) };
        let mut sources = vec![local(BufferType::Input, r, 1)];
        sources.extend(peers.iter().map(|&p| local(BufferType::Scratch, p, 1)));
        for (k, &p) in peers.iter().enumerate() {
            let buf = self.remote_buffer(p, BufferType::Scratch, m);
            let mut ops = Vec::new();
            if ll {
                let mut put = data(OpKind::PutPackets, vec![local(BufferType::Input, p, 1)], vec![remote(0, r, 1)]);
                put.channel_type = Some(m);
                ops.push(put);
                if k == 0 {
                    ops.push(reduce(OpKind::ReducePackets, sources.clone(), vec![dst.clone()]));
                }
                self.block(m, Vec::new(), vec![buf], ops);
            } else {
                // Entry handshake: the peer's scratch is written only once the peer is in this
                // launch too, past its reduction of the previous launch's scratch.
                ops.push(with_channels(op(OpKind::Signal), m, vec![0]));
                ops.push(with_channels(op(OpKind::Wait), m, vec![0]));
                ops.push(with_channels(
                    data(OpKind::Put, vec![local(BufferType::Input, p, 1)], vec![remote(0, r, 1)]),
                    m,
                    vec![0],
                ));
                ops.push(with_channels(op(OpKind::Signal), m, vec![0]));
                ops.push(with_channels(op(OpKind::Wait), m, vec![0]));
                ops.push(self.barrier(0, n - 1));
                if k == 0 {
                    ops.push(reduce(OpKind::Reduce, sources.clone(), vec![dst.clone()]));
                }
                self.block(m, vec![first + k], vec![buf], ops);
            }
        }
    }

    /// Two nodes of `g = world / 2` ranks; rank `r` is position `r % g` of node `r / g`. Input
    /// in `g` chunks; chunk `l` is owned by position `l`. (1) Inside the node, all-pair
    /// reduce-scatter over memory channels into scratch slots; (2) the owned, node-reduced chunk
    /// goes to the other node's rank of the same position over a port channel (`pws`, then
    /// `flush`), which reduces it in; (3) inside the node, all-gather of the owned chunk.
    fn hierarchical(&mut self, protocol: Protocol, inplace: bool) {
        let g = self.world / 2;
        let (r, node, pos) = (self.rank, self.rank / g, self.rank % g);
        let other = (1 - node) * g + pos;
        let locals: Vec<usize> = (node * g..node * g + g).filter(|&p| p != r).collect();
        let out = Self::out(inplace);
        let (m, port) = (ChannelType::Memory, ChannelType::Port);
        let ll = protocol == Protocol::LL;
        // Scratch: g slots for the node phase, 1 for the other node's chunk. With LL the node
        // phases' packets take two chunks of bytes each (packet slot i sits at byte 2 i chunk):
        // slots 0..g cover bytes of chunks 0..2g and the second phase's slots g+1..2g+1 those
        // of 2g+2..4g+2, so the other node's chunk (plain data) goes to chunk 2g+1: apart from
        // every packet in bytes, and from every packet slot's index too.
        self.chunks(g, g, if ll { 2 * g + 2 } else { g + 1 });
        let cross = if ll { 2 * g + 1 } else { g };
        let first = self.channels(m, &locals);
        let port_chan = self.channels(port, &[other]);
        let scratch: Vec<usize> = locals.iter().map(|&p| self.remote_buffer(p, BufferType::Scratch, m)).collect();
        let results: Vec<usize> = locals.iter().map(|&p| self.remote_buffer(p, out, m)).collect();
        let other_scratch = self.remote_buffer(other, BufferType::Scratch, port);
        let mut sources = vec![local(BufferType::Input, pos, 1)];
        sources.extend(locals.iter().map(|&p| local(BufferType::Scratch, p % g, 1)));
        let owned = local(out, pos, 1);
        let nblocks = locals.len() + 1;
        // Blocks 0..g-1: node phases with one peer each.
        for (k, &p) in locals.iter().enumerate() {
            let lp = p % g;
            let mut ops = Vec::new();
            if ll {
                let mut put = data(OpKind::PutPackets, vec![local(BufferType::Input, lp, 1)], vec![remote(0, pos, 1)]);
                put.channel_type = Some(m);
                ops.push(put);
                ops.push(self.barrier(0, nblocks));
                ops.push(self.barrier(1, nblocks));
                let mut put = data(OpKind::PutPackets, vec![owned.clone()], vec![remote(0, g + 1 + pos, 1)]);
                put.channel_type = Some(m);
                ops.push(put);
                ops.push(data(
                    OpKind::UnpackPackets,
                    vec![local(BufferType::Scratch, g + 1 + lp, 1)],
                    vec![local(out, lp, 1)],
                ));
                self.block(m, Vec::new(), vec![scratch[k]], ops);
            } else {
                ops.push(with_channels(
                    data(OpKind::Put, vec![local(BufferType::Input, lp, 1)], vec![remote(0, pos, 1)]),
                    m,
                    vec![0],
                ));
                ops.push(with_channels(op(OpKind::Signal), m, vec![0]));
                ops.push(with_channels(op(OpKind::Wait), m, vec![0]));
                ops.push(self.barrier(0, nblocks));
                ops.push(self.barrier(1, nblocks));
                ops.push(with_channels(data(OpKind::Put, vec![owned.clone()], vec![remote(1, pos, 1)]), m, vec![0]));
                ops.push(with_channels(op(OpKind::Signal), m, vec![0]));
                ops.push(with_channels(op(OpKind::Wait), m, vec![0]));
                self.block(m, vec![first + k], vec![scratch[k], results[k]], ops);
            }
        }
        // The last block: reduce inside the node, exchange with the other node, reduce again.
        let reduce_kind = if ll { OpKind::ReducePackets } else { OpKind::Reduce };
        let mut ops = vec![self.barrier(0, nblocks), reduce(reduce_kind, sources, vec![owned.clone()])];
        ops.push(with_channels(
            data(OpKind::PutWithSignalAndFlush, vec![owned.clone()], vec![remote(0, cross, 1)]),
            port,
            vec![0],
        ));
        ops.push(with_channels(op(OpKind::Wait), port, vec![0]));
        ops.push(reduce(OpKind::Reduce, vec![owned.clone(), local(BufferType::Scratch, cross, 1)], vec![owned]));
        ops.push(self.barrier(1, nblocks));
        self.block(port, vec![port_chan], vec![other_scratch], ops);
    }
}

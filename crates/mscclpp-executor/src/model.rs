//! The plan as Rust types, field for field as MSCCL++ writes it (`python/mscclpp/language`,
//! read by `src/core/executor/execution_plan.cc`). Serializing a [`Plan`] gives JSON in the same
//! schema, so generated plans are loadable by MSCCL++ too.

use serde::Serialize;

/// MSCCL++'s default `num_threads_per_block` when a plan leaves it out.
pub const DEFAULT_THREADS_PER_BLOCK: u32 = 1024;
/// MSCCL++'s default `buffer_alignment` when a plan leaves it out.
pub const DEFAULT_BUFFER_ALIGNMENT: u64 = 16;
/// Channels of one type a thread block may use (MSCCL++'s `MAX_CHANNEL`).
pub const MAX_CHANNEL: usize = 16;
/// Channels one operation may use (MSCCL++'s `MAX_CHANNEL_PER_OPERATION`).
pub const MAX_CHANNEL_PER_OPERATION: usize = 8;
/// Source or destination buffers of one operation (`MAX_LOCAL_BUFFER_PER_OPERATION +
/// MAX_CHANNEL_PER_OPERATION`).
pub const MAX_BUFFERS_PER_OPERATION: usize = 2 + MAX_CHANNEL_PER_OPERATION;
/// Operations of one thread block, pipeline bodies included (MSCCL++'s `MAX_OPERATION`).
pub const MAX_OPERATION: usize = 64;
/// Device barriers (`barrier_id`s) of one plan (MSCCL++'s `MAX_DEVICE_SYNCERS`).
pub const MAX_DEVICE_SYNCERS: u64 = 16;
/// Semaphores one operation may name (MSCCL++'s `MAX_DEVICE_SEMAPHORES`).
pub const MAX_DEVICE_SEMAPHORES: usize = 16;

/// An execution plan: what every rank's thread blocks do, as MSCCL++'s DSL writes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Plan {
    /// `name`: the plan's name.
    pub name: String,
    /// `collective`: `allreduce`, `allgather`, `reducescatter`, `alltoall`, ... (free text in
    /// MSCCL++; the executor only special-cases `allgather` for message-size checks).
    pub collective: String,
    /// `protocol`: `Simple` or `LL`.
    pub protocol: Protocol,
    /// `inplace`: the output buffer is the input buffer.
    pub inplace: bool,
    /// `reuse_resources` (default false).
    pub reuse_resources: bool,
    /// `use_double_scratch_buffer` (default false).
    pub use_double_scratch_buffer: bool,
    /// `buffer_alignment` in bytes (default 16).
    pub buffer_alignment: u64,
    /// `min_message_size` in bytes (default 0).
    pub min_message_size: u64,
    /// `max_message_size` in bytes (default `u64::MAX`).
    pub max_message_size: u64,
    /// `num_threads_per_block` (default 1024).
    pub num_threads_per_block: u32,
    /// `gpus`: one entry per rank; entry `i` has `id` `i`.
    pub gpus: Vec<Gpu>,
}

/// `protocol`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Protocol {
    /// `"Simple"`: plain stores, with signals for synchronization.
    Simple,
    /// `"LL"`: low-latency packets (data and flag together); scratch is twice as large.
    LL,
}

/// A buffer of a rank: `"i"`, `"o"`, `"s"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum BufferType {
    /// `"i"`: the input buffer.
    #[serde(rename = "i")]
    Input,
    /// `"o"`: the output buffer.
    #[serde(rename = "o")]
    Output,
    /// `"s"`: the scratch buffer the executor allocates.
    #[serde(rename = "s")]
    Scratch,
}

impl BufferType {
    /// The name in the JSON (`i`, `o`, `s`).
    pub fn code(self) -> &'static str {
        match self {
            BufferType::Input => "i",
            BufferType::Output => "o",
            BufferType::Scratch => "s",
        }
    }
}

/// `channel_type`: `"memory"`, `"port"`, `"switch"`, `"none"`. Switch channels parse but a plan
/// using one is refused ([`crate::PlanError::SwitchChannel`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChannelType {
    /// `"none"`: no channel (local operations).
    None,
    /// `"memory"`: a MemoryChannel (peer GPU memory mapped, NVLink/PCIe).
    Memory,
    /// `"port"`: a PortChannel (through the host proxy: IB, Ethernet, CUDA IPC).
    Port,
    /// `"switch"`: an NVLS SwitchChannel (NVLink multicast).
    Switch,
}

impl ChannelType {
    /// The name in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            ChannelType::None => "none",
            ChannelType::Memory => "memory",
            ChannelType::Port => "port",
            ChannelType::Switch => "switch",
        }
    }
}

/// `reduce_op`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    /// `"sum"`.
    Sum,
    /// `"min"`.
    Min,
    /// `"max"`.
    Max,
}

macro_rules! op_kinds {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// An operation's `name`: MSCCL++'s `OperationType`, in its order, with the names its
        /// executor accepts.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
        #[non_exhaustive]
        pub enum OpKind {
            $($(#[$doc])* #[serde(rename = $name)] $variant,)*
        }

        impl OpKind {
            /// Every kind, in MSCCL++'s `OperationType` order.
            pub const ALL: &'static [OpKind] = &[$(OpKind::$variant,)*];

            /// The name in the JSON.
            pub fn name(self) -> &'static str {
                match self { $(OpKind::$variant => $name,)* }
            }

            /// The kind named `name`, if MSCCL++'s executor knows it.
            pub fn from_name(name: &str) -> Option<OpKind> {
                match name { $($name => Some(OpKind::$variant),)* _ => None }
            }
        }
    };
}

op_kinds! {
    /// `nop`: a thread-block-wide sync point.
    #[default]
    Nop = "nop",
    /// `barrier`: a device-wide barrier across `num_threadblocks` thread blocks.
    Barrier = "barrier",
    /// `put`: write local data to a peer's buffer.
    Put = "put",
    /// `ppkt`: write local data to a peer's scratch as LL packets.
    PutPackets = "ppkt",
    /// `rppkt`: forward packets from scratch to a peer.
    ReadPutPackets = "rppkt",
    /// `pws`: put, then signal.
    PutWithSignal = "pws",
    /// `pwsf`: put, signal, then flush.
    PutWithSignalAndFlush = "pwsf",
    /// `get`: read a peer's buffer into a local one.
    Get = "get",
    /// `copy`: local copy.
    Copy = "copy",
    /// `cpkt`: local copy into packets.
    CopyPackets = "cpkt",
    /// `upkt`: unpack packets into plain data.
    UnpackPackets = "upkt",
    /// `signal`: signal peers over channels.
    Signal = "signal",
    /// `wait`: wait for peers' signals.
    Wait = "wait",
    /// `flush`: wait until a PortChannel's puts are done.
    Flush = "flush",
    /// `re`: reduce local buffers.
    Reduce = "re",
    /// `repkt`: reduce packets into a local buffer.
    ReducePackets = "repkt",
    /// `recpkt`: reduce packets, also keeping a packet copy.
    ReduceCopyPackets = "recpkt",
    /// `res`: reduce, then send the result to peers.
    ReduceSend = "res",
    /// `respkt`: reduce packets, then send the result as packets.
    ReduceSendPackets = "respkt",
    /// `recspkt`: reduce packets, keep a copy, send as packets.
    ReduceCopySendPackets = "recspkt",
    /// `rre`: read peers' buffers and reduce.
    ReadReduce = "rre",
    /// `rres`: read peers' buffers, reduce, send.
    ReadReduceSend = "rres",
    /// `glres`: NVLS multimem load-reduce-store.
    MultiLoadReduceStore = "glres",
    /// `rlxsignal`: signal without memory ordering.
    RelaxedSignal = "rlxsignal",
    /// `rlxwait`: wait without memory ordering.
    RelaxedWait = "rlxwait",
    /// `pipeline`: repeat the inner `ops` over `iter_context`'s units.
    Pipeline = "pipeline",
    /// `sem_release`: release device semaphores.
    SemRelease = "sem_release",
    /// `sem_acquire`: acquire device semaphores.
    SemAcquire = "sem_acquire",
    /// `gstore`: NVLS multimem store.
    MultiStore = "gstore",
    /// `gstorepkt`: NVLS multimem store of packets.
    MultiStorePackets = "gstorepkt",
}

impl OpKind {
    /// Kinds that move or combine data: they need `src_buff` and `dst_buff`.
    pub fn moves_data(self) -> bool {
        !matches!(
            self,
            OpKind::Nop
                | OpKind::Barrier
                | OpKind::Signal
                | OpKind::Wait
                | OpKind::Flush
                | OpKind::RelaxedSignal
                | OpKind::RelaxedWait
                | OpKind::Pipeline
                | OpKind::SemRelease
                | OpKind::SemAcquire
        )
    }

    /// Kinds that synchronize over channels: they need `channel_ids` and `channel_type`.
    pub fn needs_channels(self) -> bool {
        matches!(self, OpKind::Signal | OpKind::Wait | OpKind::Flush | OpKind::RelaxedSignal | OpKind::RelaxedWait)
    }
}

/// One rank's part of the plan (an entry of `gpus`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Gpu {
    /// `id`: the rank; equal to the entry's position.
    pub id: usize,
    /// `input_chunks`: the input buffer is split into this many chunks.
    pub input_chunks: u64,
    /// `output_chunks`: the output buffer is split into this many chunks.
    pub output_chunks: u64,
    /// `scratch_chunks`: chunk-sized slots of scratch.
    pub scratch_chunks: u64,
    /// `threadblocks`: entry `j` has `id` `j`.
    pub threadblocks: Vec<ThreadBlock>,
    /// `channels`: the rank's channels; each `connected_to` peer is one channel, numbered per
    /// type in order (that number is what thread blocks' `channel_ids` name).
    pub channels: Vec<Channel>,
    /// `remote_buffers`: peers' buffers this rank reaches, numbered in order.
    pub remote_buffers: Vec<RemoteBuffer>,
    /// `semaphores`: device semaphores, numbered in order.
    pub semaphores: Vec<Semaphore>,
}

impl Gpu {
    /// Chunks of the buffer `t`.
    pub fn chunks(&self, t: BufferType) -> u64 {
        match t {
            BufferType::Input => self.input_chunks,
            BufferType::Output => self.output_chunks,
            BufferType::Scratch => self.scratch_chunks,
        }
    }

    /// How many channels of type `t` the rank has (one per `connected_to` entry).
    pub fn channel_count(&self, t: ChannelType) -> usize {
        self.channels.iter().filter(|c| c.channel_type == t).map(|c| c.connected_to.len()).sum()
    }

    /// The peer of the rank's `index`-th channel of type `t`.
    pub fn channel_peer(&self, t: ChannelType, index: usize) -> Option<usize> {
        self.channels.iter().filter(|c| c.channel_type == t).flat_map(|c| c.connected_to.iter().copied()).nth(index)
    }
}

/// An entry of a rank's `channels`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Channel {
    /// `channel_type`: `memory` or `port`.
    pub channel_type: ChannelType,
    /// `connected_to`: one channel per entry, to that peer rank.
    pub connected_to: Vec<usize>,
}

/// An entry of a rank's `remote_buffers`: a buffer of rank `rank` this rank accesses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RemoteBuffer {
    /// `rank`: the rank that owns the buffer.
    pub rank: usize,
    /// `type`: which of its buffers.
    #[serde(rename = "type")]
    pub buffer_type: BufferType,
    /// `access_channel_types`: through which kinds of channel.
    pub access_channel_types: Vec<ChannelType>,
}

/// An entry of a rank's `semaphores`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Semaphore {
    /// `init_value`.
    pub init_value: u32,
}

/// An entry of a rank's `threadblocks`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ThreadBlock {
    /// `id`: equal to the entry's position.
    pub id: usize,
    /// `ops`: what the block does, in order.
    pub ops: Vec<Op>,
    /// `channels`: the rank's channels this block uses; an op's `channel_ids` index the
    /// concatenation, per type, of these `channel_ids`.
    pub channels: Vec<ThreadBlockChannels>,
    /// `remote_buffer_refs`: the rank's remote buffers this block uses; an op's `buffer_id`
    /// indexes the concatenation, per access type, of these `remote_buffer_ids`.
    pub remote_buffer_refs: Vec<RemoteBufferRefs>,
}

/// An entry of a thread block's `channels`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ThreadBlockChannels {
    /// `channel_type`.
    pub channel_type: ChannelType,
    /// `channel_ids`: indexes into the rank's channels of this type.
    pub channel_ids: Vec<usize>,
    /// `buff` (older plans): the buffer the channels are for; informational.
    #[serde(rename = "buff", skip_serializing_if = "Option::is_none")]
    pub buff: Option<BufferType>,
}

/// An entry of a thread block's `remote_buffer_refs`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RemoteBufferRefs {
    /// `access_channel_type`.
    pub access_channel_type: ChannelType,
    /// `remote_buffer_ids`: indexes into the rank's `remote_buffers`.
    pub remote_buffer_ids: Vec<usize>,
}

/// An operation (an entry of a thread block's `ops`, or of a pipeline's `ops`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Op {
    /// `name`.
    #[serde(rename = "name")]
    pub kind: OpKind,
    /// `src_buff`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub src_buff: Vec<BufferRef>,
    /// `dst_buff`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dst_buff: Vec<BufferRef>,
    /// `channel_ids`: indexes into the thread block's channels of `channel_type`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub channel_ids: Vec<usize>,
    /// `channel_type`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub channel_type: Option<ChannelType>,
    /// `reduce_op`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reduce_op: Option<ReduceOp>,
    /// `tbg_info`: this block's share when a thread-block group splits the op.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tbg_info: Option<TbgInfo>,
    /// `barrier_id` (barrier).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub barrier_id: Option<u64>,
    /// `num_threadblocks` (barrier): how many blocks meet at the barrier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_threadblocks: Option<u64>,
    /// `semaphore_ids` (sem_acquire, sem_release): indexes into the rank's `semaphores`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub semaphore_ids: Vec<usize>,
    /// `iter_context` (pipeline).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iter_context: Option<IterContext>,
    /// `ops` (pipeline): the body, run once per unit.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<Op>,
}

/// A buffer range an operation reads or writes: `index` and `size` in chunks of the buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BufferRef {
    /// Which buffer: local (`type`) or remote (`buffer_id`).
    #[serde(flatten)]
    pub loc: BufferLoc,
    /// `index`: the first chunk.
    pub index: u64,
    /// `size`: how many chunks.
    pub size: u64,
}

/// Where a [`BufferRef`] points.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum BufferLoc {
    /// `"type"`: one of this rank's buffers.
    #[serde(rename = "type")]
    Local(BufferType),
    /// `"buffer_id"`: a peer buffer, the index into the thread block's `remote_buffer_refs` of the
    /// op's `channel_type`.
    #[serde(rename = "buffer_id")]
    Remote(usize),
}

/// `tbg_info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TbgInfo {
    /// `tb_id`: this block's place in the group.
    pub tb_id: u64,
    /// `tbg_size`: blocks in the group.
    pub tbg_size: u64,
}

/// `iter_context` of a pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct IterContext {
    /// `unit_size` in bytes: one iteration's share.
    pub unit_size: u64,
    /// `num_chunks`: chunks the pipeline covers.
    pub num_chunks: u64,
}

//! What a plan does, counted: [`Plan::summary`].

use std::collections::BTreeMap;
use std::fmt;

use crate::model::*;

/// Counts that describe a plan: what `mscclpp-perf ... --plan FILE --dry-run` prints.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Summary {
    /// The plan's `name`.
    pub name: String,
    /// The plan's `collective`.
    pub collective: String,
    /// The plan's `protocol`.
    pub protocol: Protocol,
    /// The plan's `inplace`.
    pub inplace: bool,
    /// Ranks (entries of `gpus`).
    pub ranks: usize,
    /// Thread blocks of each rank, by rank.
    pub threadblocks_per_rank: Vec<usize>,
    /// Operations of all ranks by kind (pipeline bodies counted, the pipeline op too).
    pub ops_by_kind: BTreeMap<OpKind, usize>,
    /// Channels of all ranks by type (one per `connected_to` entry).
    pub channels_by_type: BTreeMap<ChannelType, usize>,
    /// `(input_chunks, output_chunks, scratch_chunks)` of each rank, by rank.
    pub chunks_per_rank: Vec<(u64, u64, u64)>,
    /// Remote buffers of all ranks.
    pub remote_buffers: usize,
    /// `(min_message_size, max_message_size)`.
    pub message_sizes: (u64, u64),
}

impl Plan {
    /// Counts ranks, thread blocks, operations by kind, channels by type and buffer chunks.
    pub fn summary(&self) -> Summary {
        let mut ops_by_kind = BTreeMap::new();
        let mut channels_by_type = BTreeMap::new();
        for gpu in &self.gpus {
            for ch in &gpu.channels {
                *channels_by_type.entry(ch.channel_type).or_insert(0) += ch.connected_to.len();
            }
            for op in gpu.threadblocks.iter().flat_map(|tb| &tb.ops) {
                for o in std::iter::once(op).chain(&op.ops) {
                    *ops_by_kind.entry(o.kind).or_insert(0) += 1;
                }
            }
        }
        Summary {
            name: self.name.clone(),
            collective: self.collective.clone(),
            protocol: self.protocol,
            inplace: self.inplace,
            ranks: self.gpus.len(),
            threadblocks_per_rank: self.gpus.iter().map(|g| g.threadblocks.len()).collect(),
            ops_by_kind,
            channels_by_type,
            chunks_per_rank: self.gpus.iter().map(|g| (g.input_chunks, g.output_chunks, g.scratch_chunks)).collect(),
            remote_buffers: self.gpus.iter().map(|g| g.remote_buffers.len()).sum(),
            message_sizes: (self.min_message_size, self.max_message_size),
        }
    }

    /// The scratch bytes MSCCL++ allocates on `rank` for messages of `input_bytes` and
    /// `output_bytes` (its `calScratchBufferSize`: one chunk per scratch chunk, twice that for
    /// LL, twice again with `use_double_scratch_buffer`, rounded up to the alignment; 64 MiB
    /// when resources are reused). `None` for a rank outside the plan.
    pub fn scratch_bytes(&self, rank: usize, input_bytes: u64, output_bytes: u64) -> Option<u64> {
        let gpu = self.gpus.get(rank)?;
        if self.reuse_resources && gpu.scratch_chunks > 0 {
            return Some(1 << 26);
        }
        let per_chunk = if gpu.input_chunks != 0 {
            input_bytes.div_ceil(gpu.input_chunks)
        } else {
            output_bytes.div_ceil(gpu.output_chunks.max(1))
        };
        let mut size = per_chunk.saturating_mul(gpu.scratch_chunks);
        if self.protocol == Protocol::LL {
            size = size.saturating_mul(2);
        }
        if self.use_double_scratch_buffer {
            size = size.saturating_mul(2);
        }
        let a = self.buffer_alignment.max(1);
        Some(size.div_ceil(a).saturating_mul(a))
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let protocol = match self.protocol {
            Protocol::Simple => "Simple",
            Protocol::LL => "LL",
        };
        writeln!(
            f,
            "plan: {} ({}, {protocol}, {})",
            self.name,
            self.collective,
            if self.inplace { "in place" } else { "out of place" }
        )?;
        writeln!(f, "ranks: {}", self.ranks)?;
        let tbs: Vec<String> = self.threadblocks_per_rank.iter().map(usize::to_string).collect();
        writeln!(f, "thread blocks per rank: {}", tbs.join(" "))?;
        let ops: Vec<String> = self.ops_by_kind.iter().map(|(k, n)| format!("{} {n}", k.name())).collect();
        writeln!(f, "operations: {} ({})", self.ops_by_kind.values().sum::<usize>(), ops.join(", "))?;
        let chans: Vec<String> = self.channels_by_type.iter().map(|(k, n)| format!("{} {n}", k.name())).collect();
        writeln!(f, "channels: {} ({})", self.channels_by_type.values().sum::<usize>(), chans.join(", "))?;
        writeln!(f, "remote buffers: {}", self.remote_buffers)?;
        for (r, (i, o, s)) in self.chunks_per_rank.iter().enumerate() {
            writeln!(f, "rank {r} chunks: input {i}, output {o}, scratch {s}")?;
        }
        let (lo, hi) = self.message_sizes;
        if hi == u64::MAX {
            write!(f, "message sizes: {lo} B and up")
        } else {
            write!(f, "message sizes: {lo}..={hi} B")
        }
    }
}

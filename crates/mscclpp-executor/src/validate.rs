//! Cross-reference checks on a parsed [`Plan`]: every id, index and range in bounds, the fields
//! each operation kind needs present, and MSCCL++'s fixed limits respected.

use crate::error::PlanError;
use crate::model::*;

type Result<T> = std::result::Result<T, PlanError>;

pub(crate) fn validate(plan: &Plan) -> Result<()> {
    if plan.gpus.is_empty() {
        return Err(PlanError::invalid("gpus", "a plan needs at least one GPU"));
    }
    if plan.buffer_alignment == 0 {
        return Err(PlanError::invalid("buffer_alignment", "must be at least 1"));
    }
    if plan.min_message_size > plan.max_message_size {
        return Err(PlanError::invalid(
            "max_message_size",
            format!("{} is below min_message_size {}", plan.max_message_size, plan.min_message_size),
        ));
    }
    if !(1..=1024).contains(&plan.num_threads_per_block) {
        return Err(PlanError::invalid(
            "num_threads_per_block",
            format!("{} is not within 1..=1024", plan.num_threads_per_block),
        ));
    }
    let world = plan.gpus.len();
    for (g, gpu) in plan.gpus.iter().enumerate() {
        let p = format!("gpus[{g}]");
        if gpu.id != g {
            return Err(PlanError::invalid(
                &format!("{p}.id"),
                format!("is {}, but this is entry {g} of gpus", gpu.id),
            ));
        }
        // input_chunks and output_chunks both 0 load (MSCCL++'s DSL writes such plans for
        // synchronization-only programs); MSCCL++ refuses them only when sizing a run.
        for (c, ch) in gpu.channels.iter().enumerate() {
            for (k, &peer) in ch.connected_to.iter().enumerate() {
                peer_in_world(peer, g, world, &format!("{p}.channels[{c}].connected_to[{k}]"))?;
            }
        }
        for (r, rb) in gpu.remote_buffers.iter().enumerate() {
            let rp = format!("{p}.remote_buffers[{r}]");
            peer_in_world(rb.rank, g, world, &format!("{rp}.rank"))?;
            if rb.access_channel_types.is_empty() {
                return Err(PlanError::invalid(&format!("{rp}.access_channel_types"), "is empty"));
            }
        }
        for (t, tb) in gpu.threadblocks.iter().enumerate() {
            threadblock(plan, gpu, tb, t, &format!("{p}.threadblocks[{t}]"))?;
        }
    }
    Ok(())
}

fn peer_in_world(peer: usize, me: usize, world: usize, path: &str) -> Result<()> {
    if peer >= world {
        return Err(PlanError::invalid(path, format!("rank {peer} is outside the world of {world} ranks")));
    }
    if peer == me {
        return Err(PlanError::invalid(path, format!("rank {peer} is this GPU itself")));
    }
    Ok(())
}

/// What a thread block's ops index: its channels and remote buffers, per type.
struct TbView<'a> {
    gpu: &'a Gpu,
    tb: &'a ThreadBlock,
}

impl TbView<'_> {
    fn channels(&self, t: ChannelType) -> usize {
        self.tb.channels.iter().filter(|c| c.channel_type == t).map(|c| c.channel_ids.len()).sum()
    }

    fn remote_buffer(&self, t: ChannelType, id: usize) -> Option<&RemoteBuffer> {
        let gid = self
            .tb
            .remote_buffer_refs
            .iter()
            .filter(|r| r.access_channel_type == t)
            .flat_map(|r| r.remote_buffer_ids.iter().copied())
            .nth(id)?;
        self.gpu.remote_buffers.get(gid)
    }

    fn remote_buffers(&self, t: ChannelType) -> usize {
        self.tb
            .remote_buffer_refs
            .iter()
            .filter(|r| r.access_channel_type == t)
            .map(|r| r.remote_buffer_ids.len())
            .sum()
    }
}

fn threadblock(plan: &Plan, gpu: &Gpu, tb: &ThreadBlock, t: usize, p: &str) -> Result<()> {
    if tb.id != t {
        return Err(PlanError::invalid(
            &format!("{p}.id"),
            format!("is {}, but this is entry {t} of threadblocks", tb.id),
        ));
    }
    for (c, ch) in tb.channels.iter().enumerate() {
        let have = gpu.channel_count(ch.channel_type);
        for (k, &id) in ch.channel_ids.iter().enumerate() {
            if id >= have {
                return Err(PlanError::invalid(
                    &format!("{p}.channels[{c}].channel_ids[{k}]"),
                    format!("channel {id}, but the GPU has {have} {} channels", ch.channel_type.name()),
                ));
            }
        }
    }
    for (r, refs) in tb.remote_buffer_refs.iter().enumerate() {
        for (k, &id) in refs.remote_buffer_ids.iter().enumerate() {
            let path = format!("{p}.remote_buffer_refs[{r}].remote_buffer_ids[{k}]");
            let Some(rb) = gpu.remote_buffers.get(id) else {
                return Err(PlanError::invalid(
                    &path,
                    format!("remote buffer {id}, but the GPU has {}", gpu.remote_buffers.len()),
                ));
            };
            if !rb.access_channel_types.contains(&refs.access_channel_type) {
                return Err(PlanError::invalid(
                    &path,
                    format!("remote buffer {id} is not accessible over {} channels", refs.access_channel_type.name()),
                ));
            }
        }
    }
    let view = TbView { gpu, tb };
    for ct in [ChannelType::Memory, ChannelType::Port] {
        if view.channels(ct) > MAX_CHANNEL {
            return Err(PlanError::invalid(
                &format!("{p}.channels"),
                format!("more than {MAX_CHANNEL} {} channels in one thread block", ct.name()),
            ));
        }
        if view.remote_buffers(ct) > MAX_CHANNEL {
            return Err(PlanError::invalid(
                &format!("{p}.remote_buffer_refs"),
                format!("more than {MAX_CHANNEL} remote buffers over {} channels in one thread block", ct.name()),
            ));
        }
    }
    let flat: usize = tb.ops.iter().map(|o| 1 + o.ops.len()).sum();
    if flat > MAX_OPERATION {
        return Err(PlanError::invalid(
            &format!("{p}.ops"),
            format!("{flat} operations (pipeline bodies included); MSCCL++ allows {MAX_OPERATION} per thread block"),
        ));
    }
    for (o, op_) in tb.ops.iter().enumerate() {
        let op_p = format!("{p}.ops[{o}]");
        op(plan, &view, op_, &op_p)?;
        for (i, inner) in op_.ops.iter().enumerate() {
            op(plan, &view, inner, &format!("{op_p}.ops[{i}]"))?;
        }
    }
    Ok(())
}

fn op(plan: &Plan, view: &TbView<'_>, op: &Op, p: &str) -> Result<()> {
    let missing = |key: &str| PlanError::Missing { path: format!("{p}.{key}") };
    if !op.channel_ids.is_empty() {
        let Some(ct) = op.channel_type else { return Err(missing("channel_type")) };
        if ct == ChannelType::None {
            return Err(PlanError::invalid(&format!("{p}.channel_type"), "\"none\" with channel_ids"));
        }
        if op.channel_ids.len() > MAX_CHANNEL_PER_OPERATION {
            return Err(PlanError::invalid(
                &format!("{p}.channel_ids"),
                format!("{} channels; MSCCL++ allows {MAX_CHANNEL_PER_OPERATION} per operation", op.channel_ids.len()),
            ));
        }
        let have = view.channels(ct);
        for (k, &id) in op.channel_ids.iter().enumerate() {
            if id >= have {
                return Err(PlanError::invalid(
                    &format!("{p}.channel_ids[{k}]"),
                    format!("channel {id}, but the thread block has {have} {} channels", ct.name()),
                ));
            }
        }
    }
    if op.kind.needs_channels() && op.channel_ids.is_empty() {
        return Err(missing("channel_ids"));
    }
    // Over port channels, MSCCL++'s kernel issues destination i's put on channel_ids[i].
    let port_put = matches!(
        op.kind,
        OpKind::Put
            | OpKind::PutWithSignal
            | OpKind::PutWithSignalAndFlush
            | OpKind::PutPackets
            | OpKind::ReadPutPackets
    );
    if port_put && op.channel_type == Some(ChannelType::Port) && op.channel_ids.len() < op.dst_buff.len() {
        if op.channel_ids.is_empty() {
            return Err(missing("channel_ids"));
        }
        return Err(PlanError::invalid(
            &format!("{p}.channel_ids"),
            format!(
                "{} port channels for {} destinations: a put over port channels needs one per destination",
                op.channel_ids.len(),
                op.dst_buff.len()
            ),
        ));
    }
    if op.kind.moves_data() {
        if op.src_buff.is_empty() {
            return Err(missing("src_buff"));
        }
        if op.dst_buff.is_empty() {
            return Err(missing("dst_buff"));
        }
    }
    for (key, refs) in [("src_buff", &op.src_buff), ("dst_buff", &op.dst_buff)] {
        if refs.len() > MAX_BUFFERS_PER_OPERATION {
            return Err(PlanError::invalid(
                &format!("{p}.{key}"),
                format!("{} buffers; MSCCL++ allows {MAX_BUFFERS_PER_OPERATION} per operation", refs.len()),
            ));
        }
        for (i, b) in refs.iter().enumerate() {
            buffer_ref(plan, view, op, b, &format!("{p}.{key}[{i}]"))?;
        }
    }
    if let Some(tbg) = op.tbg_info {
        if tbg.tbg_size == 0 {
            return Err(PlanError::invalid(&format!("{p}.tbg_info.tbg_size"), "must be at least 1"));
        }
        if tbg.tb_id >= tbg.tbg_size {
            return Err(PlanError::invalid(
                &format!("{p}.tbg_info.tb_id"),
                format!("{} is not below tbg_size {}", tbg.tb_id, tbg.tbg_size),
            ));
        }
    }
    match op.kind {
        OpKind::Barrier => {
            let id = op.barrier_id.ok_or_else(|| missing("barrier_id"))?;
            if id >= MAX_DEVICE_SYNCERS {
                return Err(PlanError::invalid(
                    &format!("{p}.barrier_id"),
                    format!("{id}; MSCCL++ has {MAX_DEVICE_SYNCERS} device barriers"),
                ));
            }
            let n = op.num_threadblocks.ok_or_else(|| missing("num_threadblocks"))?;
            let have = view.gpu.threadblocks.len() as u64;
            if n == 0 || n > have {
                return Err(PlanError::invalid(
                    &format!("{p}.num_threadblocks"),
                    format!("{n}, but the GPU has {have} thread blocks"),
                ));
            }
        }
        OpKind::SemAcquire | OpKind::SemRelease => {
            if op.semaphore_ids.is_empty() {
                return Err(missing("semaphore_ids"));
            }
            if op.semaphore_ids.len() > MAX_DEVICE_SEMAPHORES {
                return Err(PlanError::invalid(
                    &format!("{p}.semaphore_ids"),
                    format!("more than {MAX_DEVICE_SEMAPHORES} semaphores"),
                ));
            }
            let have = view.gpu.semaphores.len();
            for (k, &id) in op.semaphore_ids.iter().enumerate() {
                if id >= have {
                    return Err(PlanError::invalid(
                        &format!("{p}.semaphore_ids[{k}]"),
                        format!("semaphore {id}, but the GPU has {have}"),
                    ));
                }
            }
        }
        OpKind::Pipeline => {
            let ic = op.iter_context.ok_or_else(|| missing("iter_context"))?;
            if ic.unit_size == 0 {
                return Err(PlanError::invalid(&format!("{p}.iter_context.unit_size"), "must be at least 1"));
            }
            if op.ops.is_empty() {
                return Err(PlanError::invalid(&format!("{p}.ops"), "a pipeline needs a body"));
            }
        }
        _ => {}
    }
    Ok(())
}

fn buffer_ref(plan: &Plan, view: &TbView<'_>, op: &Op, b: &BufferRef, p: &str) -> Result<()> {
    let (owner, t, what) = match b.loc {
        BufferLoc::Local(t) => (view.gpu, t, "this GPU's"),
        BufferLoc::Remote(id) => {
            let ct = match op.channel_type {
                Some(ct @ (ChannelType::Memory | ChannelType::Port)) => ct,
                Some(_) => {
                    return Err(PlanError::invalid(
                        &format!("{p}.buffer_id"),
                        "a remote buffer needs the operation's channel_type to be memory or port",
                    ));
                }
                None => {
                    return Err(PlanError::Missing { path: format!("{}.channel_type", op_path(p)) });
                }
            };
            let Some(rb) = view.remote_buffer(ct, id) else {
                return Err(PlanError::invalid(
                    &format!("{p}.buffer_id"),
                    format!(
                        "remote buffer {id}, but the thread block has {} over {} channels",
                        view.remote_buffers(ct),
                        ct.name()
                    ),
                ));
            };
            // In range by validate(): remote ranks were checked before thread blocks.
            let Some(owner) = plan.gpus.get(rb.rank) else {
                return Err(PlanError::invalid(&format!("{p}.buffer_id"), "remote buffer of a rank outside the world"));
            };
            (owner, rb.buffer_type, "the remote")
        }
    };
    let chunks = owner.chunks(t);
    if b.index >= chunks && !(b.size == 0 && b.index == chunks) {
        return Err(PlanError::invalid(
            &format!("{p}.index"),
            format!("chunk {}, but {what} {} buffer has {chunks} chunks", b.index, t.code()),
        ));
    }
    if b.index.checked_add(b.size).is_none_or(|end| end > chunks) {
        return Err(PlanError::invalid(
            &format!("{p}.size"),
            format!("index {} + size {} is past the {chunks} chunks of {what} {} buffer", b.index, b.size, t.code()),
        ));
    }
    Ok(())
}

/// `gpus[0]...ops[3]` from `gpus[0]...ops[3].src_buff[0]`.
fn op_path(buffer_path: &str) -> &str {
    buffer_path.rsplit_once('.').map_or(buffer_path, |(head, _)| head)
}

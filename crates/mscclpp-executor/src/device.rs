//! The interpreter kernel's ABI: the `#[repr(C)]` structs the host fills or reads ([`DevBuf`],
//! [`DevOp`], [`ExecState`], [`ExecArgs`]) and the CUDA source, whose definitions of the same structs are
//! generated here from the Rust field lists, each field's offset checked by a `static_assert`
//! against Rust's `offset_of!` (so NVRTC refuses a source whose layout drifted).
//!
//! One kernel per packet type (`mscclpp_exec_ll16`, `mscclpp_exec_ll8`) runs every rank's plan:
//! block `b` runs the operations `blocks[b]` names, in order, with a `__syncthreads()` after
//! each.

use std::mem::{offset_of, size_of};

use crate::model::{MAX_BUFFERS_PER_OPERATION, MAX_CHANNEL_PER_OPERATION, MAX_DEVICE_SEMAPHORES, OpKind};

/// `DevBuf::kind`: one of this rank's buffers (input, output, scratch), at `off` from its start.
pub const KIND_LOCAL: u32 = 0;
/// `DevBuf::kind`: a peer's buffer mapped here (CUDA IPC), at `base + off`.
pub const KIND_MEMORY: u32 = 1;
/// `DevBuf::kind`: a peer's buffer reached through the proxy, memory `mem_id`, at `off`.
pub const KIND_PORT: u32 = 2;

/// `DevBuf::btype` / buffer index: input.
pub const BUF_INPUT: u32 = 0;
/// Output.
pub const BUF_OUTPUT: u32 = 1;
/// Scratch.
pub const BUF_SCRATCH: u32 = 2;

/// `DevBuf::peer` when no single peer is known.
pub const NO_PEER: u32 = 0xffff;

/// One buffer range of an operation, resolved on the host.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevBuf {
    /// [`KIND_MEMORY`]: the mapped address of the peer's buffer; else 0.
    pub base: u64,
    /// Bytes from the buffer's start (for packets: of the data; packets sit at twice that).
    pub off: u64,
    /// Bytes of data.
    pub size: u64,
    /// [`KIND_LOCAL`], [`KIND_MEMORY`] or [`KIND_PORT`].
    pub kind: u32,
    /// Which buffer ([`BUF_INPUT`], [`BUF_OUTPUT`], [`BUF_SCRATCH`]): the scratch offset of the
    /// current half applies to scratch.
    pub btype: u32,
    /// The proxy's memory id (a port destination, or a local source of a port operation).
    pub mem_id: u32,
    /// The rank that writes this range (packets) or owns it, for error reports; [`NO_PEER`].
    pub peer: u32,
}

/// One operation, resolved on the host.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevOp {
    /// The index of its [`OpKind`] in [`OpKind::ALL`].
    pub kind: u32,
    /// 0 none, 1 memory, 2 port.
    pub ctype: u32,
    /// Channels used (`chans`).
    pub n_chan: u32,
    /// Sources used (`src`).
    pub n_src: u32,
    /// Destinations used (`dst`).
    pub n_dst: u32,
    /// 0 sum, 1 min, 2 max.
    pub reduce_op: u32,
    /// Barrier: its id.
    pub barrier_id: u32,
    /// Barrier: blocks that meet.
    pub n_blocks: u32,
    /// Semaphores used (`sems`).
    pub n_sems: u32,
    /// Pipeline: operations of the body (they follow this one).
    pub n_body: u32,
    /// Pipeline: iterations.
    pub n_iter: u32,
    /// How many operations its thread block has (set on every op of the block; the kernel reads
    /// it from the block's first slot).
    pub block_ops: u32,
    /// Pipeline: bytes per iteration.
    pub unit_size: u64,
    /// The rank-level channel index of each channel (into the memory or port channel table).
    pub chans: [u32; MAX_CHANNEL_PER_OPERATION],
    /// The peer rank of each channel.
    pub chan_peer: [u32; MAX_CHANNEL_PER_OPERATION],
    /// Device semaphore indexes.
    pub sems: [u32; MAX_DEVICE_SEMAPHORES],
    /// Sources.
    pub src: [DevBuf; MAX_BUFFERS_PER_OPERATION],
    /// Destinations.
    pub dst: [DevBuf; MAX_BUFFERS_PER_OPERATION],
}

impl Default for DevOp {
    fn default() -> Self {
        DevOp {
            kind: 0,
            ctype: 0,
            n_chan: 0,
            n_src: 0,
            n_dst: 0,
            reduce_op: 0,
            barrier_id: 0,
            n_blocks: 0,
            n_sems: 0,
            n_body: 0,
            n_iter: 0,
            block_ops: 0,
            unit_size: 0,
            chans: [0; MAX_CHANNEL_PER_OPERATION],
            chan_peer: [NO_PEER; MAX_CHANNEL_PER_OPERATION],
            sems: [0; MAX_DEVICE_SEMAPHORES],
            src: [DevBuf::default(); MAX_BUFFERS_PER_OPERATION],
            dst: [DevBuf::default(); MAX_BUFFERS_PER_OPERATION],
        }
    }
}

/// A rank's state words in device memory (`ExecArgs::state`, at the start of the state buffer),
/// which the kernels read and write and the host reads for its reports.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecState {
    /// Unused (was the shared LL flag, now per block: `ExecArgs::flags`); set to 1 at the start.
    pub unused0: u32,
    /// Nonzero once any wait of this rank failed.
    pub failed: u32,
    /// The LL flag of the last launch whose block 0 started ([`crate::Executor::diagnostics`]).
    pub started: u32,
    /// Nonzero once the error word was written.
    pub reported: u32,
}

/// The kernel's argument block (passed by value): every field a `u64`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecArgs {
    /// The input buffer.
    pub input: u64,
    /// The output buffer.
    pub output: u64,
    /// The scratch buffer.
    pub scratch: u64,
    /// Bytes of one scratch half with a double scratch buffer; 0 otherwise.
    pub scratch_half: u64,
    /// `DevOp[]`, every block's operations.
    pub ops: u64,
    /// Operation slots per block: block `b`'s operations start at `ops + b * ops_stride` (unused
    /// slots are no-ops), so a block finds them without a table lookup.
    pub ops_stride: u64,
    /// `BaseMemoryChannelDeviceHandle[]` by rank-level memory channel index.
    pub mem_chans: u64,
    /// `BasePortChannelDeviceHandle[]` by rank-level port channel index.
    pub port_chans: u64,
    /// [`ExecState`].
    pub state: u64,
    /// `u32[MAX_DEVICE_SYNCERS]` barrier counters.
    pub barriers: u64,
    /// `u32[]` device semaphores.
    pub sems: u64,
    /// The error word (page-locked host memory).
    pub err: u64,
    /// The abort word (page-locked host memory).
    pub abort: u64,
    /// Device wait limit from the kernel's start, in nanoseconds.
    pub timeout_ns: u64,
    /// Element type: 0 i32, 1 u32, 2 f32, 3 f16, 4 bf16.
    pub dtype: u64,
    /// `u32[blocks]`: each block's LL flag (all equal: every block advances its own once per
    /// launch, so none waits on a shared counter at its end).
    pub flags: u64,
}

/// A field of a generated struct: (CUDA type, name, array length or 0, Rust offset).
type Field = (&'static str, &'static str, usize, usize);

fn devbuf_fields() -> Vec<Field> {
    vec![
        ("u64", "base", 0, offset_of!(DevBuf, base)),
        ("u64", "off", 0, offset_of!(DevBuf, off)),
        ("u64", "size", 0, offset_of!(DevBuf, size)),
        ("u32", "kind", 0, offset_of!(DevBuf, kind)),
        ("u32", "btype", 0, offset_of!(DevBuf, btype)),
        ("u32", "mem_id", 0, offset_of!(DevBuf, mem_id)),
        ("u32", "peer", 0, offset_of!(DevBuf, peer)),
    ]
}

fn devop_fields() -> Vec<Field> {
    vec![
        ("u32", "kind", 0, offset_of!(DevOp, kind)),
        ("u32", "ctype", 0, offset_of!(DevOp, ctype)),
        ("u32", "n_chan", 0, offset_of!(DevOp, n_chan)),
        ("u32", "n_src", 0, offset_of!(DevOp, n_src)),
        ("u32", "n_dst", 0, offset_of!(DevOp, n_dst)),
        ("u32", "reduce_op", 0, offset_of!(DevOp, reduce_op)),
        ("u32", "barrier_id", 0, offset_of!(DevOp, barrier_id)),
        ("u32", "n_blocks", 0, offset_of!(DevOp, n_blocks)),
        ("u32", "n_sems", 0, offset_of!(DevOp, n_sems)),
        ("u32", "n_body", 0, offset_of!(DevOp, n_body)),
        ("u32", "n_iter", 0, offset_of!(DevOp, n_iter)),
        ("u32", "block_ops", 0, offset_of!(DevOp, block_ops)),
        ("u64", "unit_size", 0, offset_of!(DevOp, unit_size)),
        ("u32", "chans", MAX_CHANNEL_PER_OPERATION, offset_of!(DevOp, chans)),
        ("u32", "chan_peer", MAX_CHANNEL_PER_OPERATION, offset_of!(DevOp, chan_peer)),
        ("u32", "sems", MAX_DEVICE_SEMAPHORES, offset_of!(DevOp, sems)),
        ("DevBuf", "src", MAX_BUFFERS_PER_OPERATION, offset_of!(DevOp, src)),
        ("DevBuf", "dst", MAX_BUFFERS_PER_OPERATION, offset_of!(DevOp, dst)),
    ]
}

fn state_fields() -> Vec<Field> {
    vec![
        ("u32", "unused0", 0, offset_of!(ExecState, unused0)),
        ("u32", "failed", 0, offset_of!(ExecState, failed)),
        ("u32", "started", 0, offset_of!(ExecState, started)),
        ("u32", "reported", 0, offset_of!(ExecState, reported)),
    ]
}

fn args_fields() -> Vec<Field> {
    vec![
        ("u64", "input", 0, offset_of!(ExecArgs, input)),
        ("u64", "output", 0, offset_of!(ExecArgs, output)),
        ("u64", "scratch", 0, offset_of!(ExecArgs, scratch)),
        ("u64", "scratch_half", 0, offset_of!(ExecArgs, scratch_half)),
        ("u64", "ops", 0, offset_of!(ExecArgs, ops)),
        ("u64", "ops_stride", 0, offset_of!(ExecArgs, ops_stride)),
        ("u64", "mem_chans", 0, offset_of!(ExecArgs, mem_chans)),
        ("u64", "port_chans", 0, offset_of!(ExecArgs, port_chans)),
        ("u64", "state", 0, offset_of!(ExecArgs, state)),
        ("u64", "barriers", 0, offset_of!(ExecArgs, barriers)),
        ("u64", "sems", 0, offset_of!(ExecArgs, sems)),
        ("u64", "err", 0, offset_of!(ExecArgs, err)),
        ("u64", "abort", 0, offset_of!(ExecArgs, abort)),
        ("u64", "timeout_ns", 0, offset_of!(ExecArgs, timeout_ns)),
        ("u64", "dtype", 0, offset_of!(ExecArgs, dtype)),
        ("u64", "flags", 0, offset_of!(ExecArgs, flags)),
    ]
}

fn ctype_size(t: &str) -> usize {
    match t {
        "u32" => 4,
        "u64" => 8,
        _ => size_of::<DevBuf>(),
    }
}

fn emit_struct(out: &mut String, name: &str, size: usize, fields: &[Field]) {
    out.push_str(&format!("struct {name} {{\n"));
    for (t, f, n, _) in fields {
        if *n == 0 {
            out.push_str(&format!("  {t} {f};\n"));
        } else {
            out.push_str(&format!("  {t} {f}[{n}];\n"));
        }
    }
    out.push_str("};\n");
    // Only the size is asserted in CUDA: the NVRTC of CUDA 13.0 has no `__builtin_offsetof`
    // (13.5's has). The offsets are checked on the Rust side ([`layout_problems`]): the fields
    // are contiguous, in the same order and of the same C types, so C puts each where Rust does.
    out.push_str(&format!("static_assert(sizeof({name}) == {size}, \"{name} size differs from Rust\");\n"));
    out.push('\n');
}

/// The operation kinds as CUDA constants (`OP_put` ...), in [`OpKind::ALL`] order.
fn op_constants() -> String {
    let mut s = String::new();
    for (i, k) in OpKind::ALL.iter().enumerate() {
        s.push_str(&format!("#define OP_{} {i}u\n", k.name()));
    }
    s
}

/// The index of `k` in [`OpKind::ALL`] (what `DevOp::kind` holds).
pub fn op_code(k: OpKind) -> u32 {
    OpKind::ALL.iter().position(|&x| x == k).unwrap_or(0) as u32
}

const KERNEL: &str = include_str!("kernel.cu");

/// Names of the kernel entries, by packet type.
pub const KERNEL_LL16: &str = "mscclpp_exec_ll16";
/// The LL8 entry.
pub const KERNEL_LL8: &str = "mscclpp_exec_ll8";

/// The structs shared with the CUDA source, in the order it defines them: name, Rust size,
/// fields (what `source` generates and the layout checks compare).
fn shared_structs() -> [(&'static str, usize, Vec<Field>); 4] {
    [
        ("DevBuf", size_of::<DevBuf>(), devbuf_fields()),
        ("DevOp", size_of::<DevOp>(), devop_fields()),
        ("ExecState", size_of::<ExecState>(), state_fields()),
        ("ExecArgs", size_of::<ExecArgs>(), args_fields()),
    ]
}

/// The whole CUDA source: the device header, the generated structs and constants, the kernel.
pub fn source() -> String {
    let mut s = String::from("#include \"mscclpp_rs/device.cuh\"\n\nusing namespace mscclpp;\n\n");
    s.push_str(&op_constants());
    s.push('\n');
    for (name, size, fields) in shared_structs() {
        emit_struct(&mut s, name, size, &fields);
    }
    s.push_str(KERNEL);
    s
}

/// Every struct's field list covers the struct exactly (contiguous, no gap, no overlap): what the
/// layout test checks, exposed so the test can name the failing field.
pub fn layout_problems() -> Vec<String> {
    let mut bad = Vec::new();
    for (name, size, fields) in shared_structs() {
        let mut at = 0;
        for (t, f, n, off) in &fields {
            if *off != at {
                bad.push(format!("{name}.{f}: Rust offset {off}, the generated struct puts it at {at}"));
            }
            at = off + ctype_size(t) * (*n).max(1);
        }
        if at != size {
            bad.push(format!("{name}: fields end at {at}, the Rust struct has {size} bytes"));
        }
    }
    bad
}

/// The raw bytes of `ops` (what is copied to the GPU).
pub fn ops_bytes(ops: &[DevOp]) -> Vec<u8> {
    let mut v = Vec::with_capacity(std::mem::size_of_val(ops));
    for op in ops {
        for x in [
            op.kind,
            op.ctype,
            op.n_chan,
            op.n_src,
            op.n_dst,
            op.reduce_op,
            op.barrier_id,
            op.n_blocks,
            op.n_sems,
            op.n_body,
            op.n_iter,
            op.block_ops,
        ] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.extend_from_slice(&op.unit_size.to_le_bytes());
        for x in op.chans.iter().chain(op.chan_peer.iter()).chain(op.sems.iter()) {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for b in op.src.iter().chain(op.dst.iter()) {
            for x in [b.base, b.off, b.size] {
                v.extend_from_slice(&x.to_le_bytes());
            }
            for x in [b.kind, b.btype, b.mem_id, b.peer] {
                v.extend_from_slice(&x.to_le_bytes());
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_structs_match_the_rust_layout() {
        assert_eq!(layout_problems(), Vec::<String>::new());
        assert_eq!(size_of::<DevBuf>(), 40);
        assert_eq!(size_of::<ExecArgs>(), args_fields().len() * 8);
        let src = source();
        // Every field appears in the generated CUDA struct, in order, with its C type; the size
        // is asserted there.
        for (name, size, fields) in shared_structs() {
            let body = src.split(&format!("struct {name} {{\n")).nth(1).and_then(|b| b.split("};").next()).unwrap();
            let lines: Vec<&str> = body.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
            assert_eq!(lines.len(), fields.len(), "{name}");
            for ((t, f, n, _), line) in fields.iter().zip(&lines) {
                let want = if *n == 0 { format!("{t} {f};") } else { format!("{t} {f}[{n}];") };
                assert_eq!(*line, want, "{name}");
            }
            assert!(src.contains(&format!("static_assert(sizeof({name}) == {size},")), "{name}");
        }
        // The kernel reads every argument.
        for (_, f, _, _) in args_fields() {
            let read = KERNEL.contains(&format!("a.{f}")) || KERNEL.contains(&format!("a->{f}"));
            assert!(read, "the kernel never reads ExecArgs.{f}");
        }
        // Every operation kind the executor runs is handled by name.
        for k in OpKind::ALL {
            if !matches!(k, OpKind::MultiLoadReduceStore | OpKind::MultiStore | OpKind::MultiStorePackets) {
                assert!(KERNEL.contains(&format!("OP_{}", k.name())), "the kernel does not handle {}", k.name());
            }
        }
    }

    #[test]
    fn ops_bytes_follow_the_struct_layout() {
        let mut op = DevOp { kind: 7, unit_size: 0x1122, ..DevOp::default() };
        op.dst[9].peer = 0xabcd;
        op.src[0].base = 0x55;
        let b = ops_bytes(&[op, op]);
        assert_eq!(b.len(), 2 * size_of::<DevOp>());
        assert_eq!(b[offset_of!(DevOp, kind)], 7);
        assert_eq!(b[offset_of!(DevOp, unit_size)], 0x22);
        assert_eq!(b[offset_of!(DevOp, src) + offset_of!(DevBuf, base)], 0x55);
        let last = offset_of!(DevOp, dst) + 9 * size_of::<DevBuf>() + offset_of!(DevBuf, peer);
        assert_eq!(&b[last..last + 2], &[0xcd, 0xab]);
        assert_eq!(b[size_of::<DevOp>() + offset_of!(DevOp, kind)], 7);
    }
}

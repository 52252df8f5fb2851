//! Kernels generated per plan: the interpreter's operation code, with each operation's shape
//! fixed at compile time.
//!
//! The interpreter (`mscclpp_exec_ll16` / `_ll8`) reads every operation's kind, channel type and
//! counts from its `DevOp` slot at run time: a chain of dependent loads before a block's first
//! data access, a jump table per operation, and loops over channels and buffers whose bounds the
//! compiler does not know. A per-plan kernel (`mscclpp_exec_plan_ll16` / `_ll8`) is generated
//! from one rank's lowered operations: block `b` calls the same operation functions of
//! `kernel.cu` on a `FixedOp<kind, channel type, channels, sources, destinations, reduction,
//! semaphores>` view of each of its slots, in the interpreter's order, with the interpreter's
//! barriers (the same `packets_then_packets` rule, evaluated by the compiler). Only the shape is
//! compiled in: addresses, offsets, sizes, channel and semaphore indexes, pipeline iteration
//! counts are still read from the same `DevOp` slots, so one compiled kernel serves every message
//! size and buffer set with the same shape, and the host fills the slots exactly as for the
//! interpreter. Blocks with the same sequence of shapes share one code path.
//!
//! The source depends on the plan's shape only; compiled PTX is cached by source text (see
//! `exec.rs`).

use std::fmt::Write as _;

use crate::device::{self, DevOp};
use crate::model::OpKind;

/// The per-plan kernel's entry for LL16 packets.
pub const KERNEL_LL16: &str = "mscclpp_exec_plan_ll16";
/// The entry for LL8 packets.
pub const KERNEL_LL8: &str = "mscclpp_exec_plan_ll8";

/// The kind's CUDA constant (`OP_put` ...).
fn kind_name(kind: u32) -> String {
    match OpKind::ALL.get(kind as usize) {
        Some(k) => format!("OP_{}", k.name()),
        None => format!("{kind}u"),
    }
}

/// The `FixedOp` type of `op`.
fn fixed(op: &DevOp) -> String {
    format!(
        "FixedOp<{}, {}u, {}u, {}u, {}u, {}u, {}u>",
        kind_name(op.kind),
        op.ctype,
        op.n_chan,
        op.n_src,
        op.n_dst,
        op.reduce_op,
        op.n_sems
    )
}

/// The statements that run one block's operations (`ops[i]` is the block's slot `i`), in the
/// order and with the barriers of the interpreter's loop (`run` in `kernel.cu`).
fn block_body(ops: &[DevOp]) -> String {
    let pipeline = device::op_code(OpKind::Pipeline);
    let mut s = String::new();
    let mut i = 0;
    while i < ops.len() {
        let op = &ops[i];
        if op.kind == pipeline {
            // Iterations and unit size come from the slot (they depend on the message size).
            let _ = writeln!(s, "    for (u32 it = 0; it < ops[{i}].n_iter; it++) {{");
            let _ = writeln!(s, "      const u64 unit = ops[{i}].unit_size, po = (u64)it * unit;");
            for j in 1..=op.n_body as usize {
                let Some(body) = ops.get(i + j) else { break };
                let _ = writeln!(s, "      c.op = {};", i + j);
                let _ = writeln!(s, "      exec_fixed<PK>(c, {}(ops[{}]), po, unit);", fixed(body), i + j);
                s.push_str("      __syncthreads();\n");
            }
            s.push_str("    }\n");
            i += 1 + op.n_body as usize;
        } else {
            let _ = writeln!(s, "    c.op = {i};");
            let _ = writeln!(s, "    exec_fixed<PK>(c, {}(ops[{i}]), 0, ~0ull);", fixed(op));
            i += 1;
            if let Some(next) = ops.get(i) {
                let _ = writeln!(
                    s,
                    "    if (!packets_then_packets({}, {}u, {}, {}u)) __syncthreads();",
                    kind_name(op.kind),
                    op.ctype,
                    kind_name(next.kind),
                    next.ctype
                );
            }
        }
    }
    s
}

/// The per-plan part of the source: `PlanBlocks::run` for `ops` and `blocks` as
/// [`crate::lower::Lowered`] holds them (block `b`'s operations are `ops[blocks[2b] ..][..
/// blocks[2b + 1]]`), and the two entries.
pub fn plan_part(ops: &[DevOp], blocks: &[u32]) -> String {
    // Blocks grouped by their code, in order of first appearance.
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (b, pair) in blocks.chunks(2).enumerate() {
        let (first, count) = (pair[0] as usize, pair.get(1).copied().unwrap_or(0) as usize);
        // The slots `Lowered::device_image` fills for the block.
        let slots: Vec<DevOp> = ops.iter().skip(first).take(count).copied().collect();
        let body = block_body(&slots);
        match groups.iter_mut().find(|(g, _)| *g == body) {
            Some((_, ids)) => ids.push(b),
            None => groups.push((body, vec![b])),
        }
    }
    let mut s = String::from("\n// Generated from one rank's lowered plan (mscclpp_executor::plan_kernel).\n");
    s.push_str("struct PlanBlocks {\n  template <typename PK>\n");
    s.push_str("  __device__ static __forceinline__ void run(Ctx& c, const DevOp* ops) {\n");
    if let [(body, _)] = groups.as_slice() {
        // Every block runs the same code.
        s.push_str(body);
    } else {
        s.push_str("  switch (blockIdx.x) {\n");
        for (body, ids) in &groups {
            for b in ids {
                let _ = writeln!(s, "  case {b}:");
            }
            s.push_str("  {\n");
            s.push_str(body);
            s.push_str("    break;\n  }\n");
        }
        s.push_str("  default: break;\n  }\n");
    }
    s.push_str("  }\n};\n\n");
    for (name, pk) in [(KERNEL_LL16, "PL16"), (KERNEL_LL8, "PL8")] {
        let _ = writeln!(
            s,
            "extern \"C\" __global__ void __launch_bounds__(1024, 1) {name}(const __grid_constant__ ExecArgs a) {{ \
             run_plan<{pk}, PlanBlocks>(a); }}"
        );
    }
    s
}

/// The whole source of the per-plan kernel of one rank's lowered operations: the interpreter's
/// source without its entries, then [`plan_part`].
pub fn source(ops: &[DevOp], blocks: &[u32]) -> String {
    let mut s = String::from("#define MSCCLPP_EXEC_PLAN_KERNEL 1\n");
    s.push_str(&device::source());
    s.push_str(&plan_part(ops, blocks));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{self, Algorithm};
    use crate::lower::lower_unbound;
    use crate::model::Protocol;

    fn lowered(plan: &crate::model::Plan, rank: usize) -> crate::lower::Lowered {
        lower_unbound(plan, rank, 1024).unwrap()
    }

    #[test]
    fn identical_blocks_share_one_path_and_keep_the_interpreters_barriers() {
        let plan = generate::one_hop_allreduce(2, false, 4, 256).unwrap();
        let low = lowered(&plan, 0);
        let part = plan_part(&low.ops, &low.blocks);
        // Four blocks, one shape (put packets, then reduce packets): no switch, two operations,
        // and between them the rule that lets packets follow packets without a barrier.
        assert!(!part.contains("switch"), "{part}");
        assert_eq!(part.matches("exec_fixed<PK>").count(), 2, "{part}");
        assert!(part.contains("FixedOp<OP_ppkt, 1u, 0u, 1u, 1u, 0u, 0u>(ops[0])"), "{part}");
        assert!(part.contains("FixedOp<OP_repkt, 0u, 0u, 2u, 1u, 0u, 0u>(ops[1])"), "{part}");
        assert!(part.contains("if (!packets_then_packets(OP_ppkt, 1u, OP_repkt, 0u)) __syncthreads();"), "{part}");
        assert!(part.contains(KERNEL_LL16) && part.contains(KERNEL_LL8));
    }

    #[test]
    fn blocks_of_different_shapes_get_their_own_cases() {
        // The two-node plan's blocks differ (memory and port channels, Simple protocol).
        let plan = generate::plan(Algorithm::HierarchicalAllReduce, 4, Protocol::Simple, true).unwrap();
        for rank in 0..4 {
            let low = lowered(&plan, rank);
            let part = plan_part(&low.ops, &low.blocks);
            let nblocks = low.blocks.len() / 2;
            // Every block has a case when the shapes differ; the operation count matches the
            // lowering (pipeline headers are loops, not calls).
            let pipeline = device::op_code(OpKind::Pipeline);
            let calls: usize = low.ops.iter().filter(|o| o.kind != pipeline).count();
            if part.contains("switch") {
                for b in 0..nblocks {
                    assert!(part.contains(&format!("  case {b}:\n")), "rank {rank} block {b}:\n{part}");
                }
                assert!(part.matches("exec_fixed<PK>").count() <= calls);
            } else {
                assert_eq!(part.matches("exec_fixed<PK>").count() * nblocks, calls, "{part}");
            }
        }
    }

    #[test]
    fn pipelines_loop_over_their_body_with_a_barrier_after_each_operation() {
        let pipeline = device::op_code(OpKind::Pipeline);
        let put = device::op_code(OpKind::Put);
        let sig = device::op_code(OpKind::Signal);
        let ops = vec![
            DevOp { kind: pipeline, n_body: 2, n_iter: 3, unit_size: 64, ..DevOp::default() },
            DevOp { kind: put, ctype: 1, n_src: 1, n_dst: 1, ..DevOp::default() },
            DevOp { kind: sig, ctype: 1, n_chan: 1, ..DevOp::default() },
            DevOp { kind: sig, ctype: 1, n_chan: 1, ..DevOp::default() },
        ];
        let body = block_body(&ops);
        let want = "    for (u32 it = 0; it < ops[0].n_iter; it++) {\n      const u64 unit = ops[0].unit_size, po = \
                    (u64)it * unit;\n      c.op = 1;\n      exec_fixed<PK>(c, FixedOp<OP_put, 1u, 0u, 1u, 1u, 0u, \
                    0u>(ops[1]), po, unit);\n      __syncthreads();\n      c.op = 2;\n      exec_fixed<PK>(c, \
                    FixedOp<OP_signal, 1u, 1u, 0u, 0u, 0u, 0u>(ops[2]), po, unit);\n      __syncthreads();\n    }\n    \
                    c.op = 3;\n    exec_fixed<PK>(c, FixedOp<OP_signal, 1u, 1u, 0u, 0u, 0u, 0u>(ops[3]), 0, ~0ull);\n";
        assert_eq!(body, want);
    }
}

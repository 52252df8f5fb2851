//! Kernels generated per plan: the interpreter's operation code, with each operation's shape
//! fixed at compile time.
//!
//! The interpreter (`mscclpp_exec_ll16` / `_ll8`) reads every operation's kind, channel type and
//! counts from its `DevOp` slot at run time: a chain of dependent loads before a block's first
//! data access, a jump table per operation, and loops over channels and buffers whose bounds the
//! compiler does not know. A per-plan kernel (`mscclpp_exec_plan_ll16` / `_ll8`) is generated
//! from one rank's lowered operations: block `b` calls the same operation functions of
//! `kernel.cu` on each of its slots seen as an operation of fixed shape (kind, channel type,
//! channels, sources, destinations, reduction, semaphores), in the interpreter's order, with the
//! interpreter's barriers (the same `packets_then_packets` rule, evaluated by the compiler). Only
//! the shape is compiled in: addresses, offsets, sizes, channel and semaphore indexes, pipeline
//! iteration counts are still read from the same `DevOp` slots, so one compiled kernel serves
//! every message size and buffer set with the same shape, and the host fills the slots exactly as
//! for the interpreter. Blocks with the same sequence of shapes share one code path. A block's
//! first operations, within [`held_buffers`], are `HeldOp`s: their fields loaded into registers
//! before the launch's flag barrier, overlapping the flag's load; the others are `FixedOp` views
//! whose fields are read where the operation runs.
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

/// The `FixedOp` type of `op` (its fields read where they are used), or with `held` its
/// `HeldOp` type (its fields loaded into registers when it is constructed).
fn fixed(op: &DevOp, held: bool) -> String {
    format!(
        "{}<{}, {}u, {}u, {}u, {}u, {}u, {}u>",
        if held { "HeldOp" } else { "FixedOp" },
        kind_name(op.kind),
        op.ctype,
        op.n_chan,
        op.n_src,
        op.n_dst,
        op.reduce_op,
        op.n_sems
    )
}

/// How many buffers (sources and destinations) the operations a block constructs before its
/// flag barrier (as `HeldOp`s) may hold together (a channel, peer or semaphore index counting an
/// eighth of a buffer), by default: their fields live in registers from the start (8 spilled in
/// the two-node LL plan under the 64 registers of 1024-thread blocks), so a block loads its
/// first operations early and the rest (as `FixedOp`s) where they run.
/// `MSCCLPP_EXECUTOR_HELD_BUFFERS` overrides it (0: every operation a `FixedOp`, the kernel of
/// session 19), for comparing the two in one run.
pub const HELD_BUFFERS: u32 = 6;

/// The held-buffer budget: `MSCCLPP_EXECUTOR_HELD_BUFFERS` when set to a number (read once per
/// process; anything else warns once and keeps [`HELD_BUFFERS`]).
pub fn held_buffers() -> u32 {
    static HELD: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *HELD.get_or_init(|| match std::env::var("MSCCLPP_EXECUTOR_HELD_BUFFERS") {
        Err(_) => HELD_BUFFERS,
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(
                target: "mscclpp::executor",
                "MSCCLPP_EXECUTOR_HELD_BUFFERS={v:?} is not a number: using {HELD_BUFFERS}"
            );
            HELD_BUFFERS
        }),
    })
}

/// What holding `op` costs against the budget, in buffers: its sources and destinations, and
/// an eighth of its channel, peer and semaphore indexes (one register each, where a held buffer
/// takes up to ten).
fn held_cost(op: &DevOp) -> u32 {
    op.n_src + op.n_dst + (2 * op.n_chan + op.n_sems).div_ceil(8)
}

/// The slots of `ops` constructed before the flag barrier: the first operations, in order, while
/// their cost ([`held_cost`]) fits `budget`; a pipeline's header and body count as one group
/// (its registers stay live through every iteration), so a first pipeline over the budget holds
/// nothing. Budget 0 holds nothing at all (not even operations that cost nothing).
fn preloaded(ops: &[DevOp], budget: u32) -> usize {
    if budget == 0 {
        return 0;
    }
    let (mut end, mut held) = (0, 0);
    for g in groups(ops) {
        let cost: u32 = ops[g.clone()].iter().map(held_cost).sum();
        if held + cost > budget {
            break;
        }
        held += cost;
        end = g.end;
    }
    end
}

/// The slots as the interpreter walks them: a pipeline header with its body (cut at the end of
/// `ops`), or one operation. A pipeline inside another's body is an operation of that body
/// (which does nothing), not a header.
fn groups(ops: &[DevOp]) -> Vec<std::ops::Range<usize>> {
    let pipeline = device::op_code(OpKind::Pipeline);
    let mut v = Vec::new();
    let mut i = 0;
    while i < ops.len() {
        let n = if ops[i].kind == pipeline { 1 + ops[i].n_body as usize } else { 1 };
        let end = (i + n).min(ops.len());
        v.push(i..end);
        i = end;
    }
    v
}

/// Which slots are pipeline headers as the interpreter walks them ([`groups`]).
fn headers(ops: &[DevOp]) -> Vec<bool> {
    let pipeline = device::op_code(OpKind::Pipeline);
    let mut h = vec![false; ops.len()];
    for g in groups(ops) {
        h[g.start] = ops[g.start].kind == pipeline;
    }
    h
}

/// The declaration of slot `i`'s operation (`o{i}`), or of a pipeline header's iteration count
/// and unit size.
fn declare(s: &mut String, ops: &[DevOp], i: usize, header: bool, held: bool) {
    let (op, indent) = (&ops[i], "    ");
    if header {
        let _ = writeln!(s, "{indent}const u32 n_iter{i} = ops[{i}].n_iter;");
        let _ = writeln!(s, "{indent}const u64 unit{i} = ops[{i}].unit_size;");
    } else {
        let _ = writeln!(s, "{indent}const {} o{i}(ops[{i}]);", fixed(op, held));
    }
}

/// The statements that run one block's operations (`ops[i]` is the block's slot `i`), in the
/// order and with the barriers of the interpreter's loop (`run` in `kernel.cu`): the first
/// operations constructed (their fields loaded) before `block_start`, the others just before
/// they run (a pipeline's before its loop), then `finish`.
fn block_body(ops: &[DevOp], budget: u32) -> String {
    let pipeline = device::op_code(OpKind::Pipeline);
    let early = preloaded(ops, budget);
    let header = headers(ops);
    let mut s = String::new();
    for (i, &h) in header.iter().enumerate().take(early) {
        declare(&mut s, ops, i, h, true);
    }
    s.push_str("    Ctx c;\n    if (!block_start(a, c)) return;\n");
    let mut i = 0;
    while i < ops.len() {
        let op = &ops[i];
        if op.kind == pipeline {
            let body = (i + 1..=i + op.n_body as usize).filter(|&j| j < ops.len());
            for j in std::iter::once(i).chain(body.clone()) {
                if j >= early {
                    declare(&mut s, ops, j, header[j], false);
                }
            }
            // Iterations and unit size come from the slot (they depend on the message size).
            let _ = writeln!(s, "    for (u32 it = 0; it < n_iter{i}; it++) {{");
            let _ = writeln!(s, "      const u64 unit = unit{i}, po = (u64)it * unit;");
            for j in body {
                let _ = writeln!(s, "      c.op = {j};");
                let _ = writeln!(s, "      exec_fixed<PK>(c, o{j}, po, unit);");
                s.push_str("      __syncthreads();\n");
            }
            s.push_str("    }\n");
            i += 1 + op.n_body as usize;
        } else {
            if i >= early {
                declare(&mut s, ops, i, header[i], false);
            }
            let _ = writeln!(s, "    c.op = {i};");
            let _ = writeln!(s, "    exec_fixed<PK>(c, o{i}, 0, ~0ull);");
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
    s.push_str("    finish(a, c);\n");
    s
}

/// The per-plan part of the source: `PlanBlocks::run` for `ops` and `blocks` as
/// [`crate::lower::Lowered`] holds them (block `b`'s operations are `ops[blocks[2b] ..][..
/// blocks[2b + 1]]`), and the two entries; each block's first operations held in registers
/// within [`held_buffers`].
pub fn plan_part(ops: &[DevOp], blocks: &[u32]) -> String {
    plan_part_held(ops, blocks, held_buffers())
}

/// [`plan_part`] with the held-buffer budget `held` (0: no operation held).
pub fn plan_part_held(ops: &[DevOp], blocks: &[u32], held: u32) -> String {
    // Blocks grouped by their code, in order of first appearance.
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (b, pair) in blocks.chunks(2).enumerate() {
        let (first, count) = (pair[0] as usize, pair.get(1).copied().unwrap_or(0) as usize);
        // The slots `Lowered::device_image` fills for the block.
        let slots: Vec<DevOp> = ops.iter().skip(first).take(count).copied().collect();
        let body = block_body(&slots, held);
        match groups.iter_mut().find(|(g, _)| *g == body) {
            Some((_, ids)) => ids.push(b),
            None => groups.push((body, vec![b])),
        }
    }
    let mut s = String::from("\n// Generated from one rank's lowered plan (mscclpp_executor::plan_kernel).\n");
    s.push_str("struct PlanBlocks {\n  template <typename PK>\n");
    s.push_str("  __device__ static __forceinline__ void run(const ExecArgs& a, const DevOp* ops) {\n");
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
        // Every block has a case; a block past them (none is launched) still keeps its flag.
        s.push_str("  default: {\n    Ctx c;\n    if (block_start(a, c)) finish(a, c);\n  }\n  }\n");
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
    source_held(ops, blocks, held_buffers())
}

/// [`source`] with the held-buffer budget `held`.
pub fn source_held(ops: &[DevOp], blocks: &[u32], held: u32) -> String {
    let mut s = String::from("#define MSCCLPP_EXEC_PLAN_KERNEL 1\n");
    s.push_str(&device::source());
    s.push_str(&plan_part_held(ops, blocks, held));
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
        let part = plan_part_held(&low.ops, &low.blocks, HELD_BUFFERS);
        // Four blocks, one shape (put packets, then reduce packets): no switch, two operations,
        // and between them the rule that lets packets follow packets without a barrier.
        assert!(!part.contains("switch"), "{part}");
        assert_eq!(part.matches("exec_fixed<PK>").count(), 2, "{part}");
        // Both operations are loaded before the flag barrier (2 + 3 buffers fit the budget).
        let loads = part.find("HeldOp<OP_ppkt, 1u, 0u, 1u, 1u, 0u, 0u> o0(ops[0]);").expect("o0");
        let repkt = part.find("HeldOp<OP_repkt, 0u, 0u, 2u, 1u, 0u, 0u> o1(ops[1]);").expect("o1");
        let start = part.find("if (!block_start(a, c)) return;").expect("block_start");
        assert!(loads < start && repkt < start, "{part}");
        assert!(part.contains("finish(a, c);"), "{part}");
        assert!(part.contains("if (!packets_then_packets(OP_ppkt, 1u, OP_repkt, 0u)) __syncthreads();"), "{part}");
        assert!(part.contains(KERNEL_LL16) && part.contains(KERNEL_LL8));
    }

    #[test]
    fn blocks_of_different_shapes_get_their_own_cases() {
        // The two-node plan's blocks differ (memory and port channels, Simple protocol).
        let plan = generate::plan(Algorithm::HierarchicalAllReduce, 4, Protocol::Simple, true).unwrap();
        for rank in 0..4 {
            let low = lowered(&plan, rank);
            let part = plan_part_held(&low.ops, &low.blocks, HELD_BUFFERS);
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
        let body = block_body(&ops, HELD_BUFFERS);
        let want = "    const u32 n_iter0 = ops[0].n_iter;\n    const u64 unit0 = ops[0].unit_size;\n    const \
                    HeldOp<OP_put, 1u, 0u, 1u, 1u, 0u, 0u> o1(ops[1]);\n    const HeldOp<OP_signal, 1u, 1u, 0u, 0u, 0u, \
                    0u> o2(ops[2]);\n    const HeldOp<OP_signal, 1u, 1u, 0u, 0u, 0u, 0u> o3(ops[3]);\n    Ctx c;\n    \
                    if (!block_start(a, c)) return;\n    for (u32 it = 0; it < n_iter0; it++) {\n      const u64 unit = \
                    unit0, po = (u64)it * unit;\n      c.op = 1;\n      exec_fixed<PK>(c, o1, po, unit);\n      \
                    __syncthreads();\n      c.op = 2;\n      exec_fixed<PK>(c, o2, po, unit);\n      __syncthreads();\n    \
                    }\n    c.op = 3;\n    exec_fixed<PK>(c, o3, 0, ~0ull);\n    finish(a, c);\n";
        assert_eq!(body, want);
    }

    #[test]
    fn operations_past_the_preload_budget_are_loaded_where_they_run() {
        let re = device::op_code(OpKind::Reduce);
        let sig = device::op_code(OpKind::Signal);
        // 3 buffers each: the first two fit HELD_BUFFERS (6), the third and fourth load after
        // the flag barrier (as FixedOps), each just before it runs; a signal holds no buffer but
        // comes after.
        let r = DevOp { kind: re, n_src: 2, n_dst: 1, ..DevOp::default() };
        let ops = vec![r, r, r, DevOp { kind: sig, ctype: 1, n_chan: 1, ..DevOp::default() }, r];
        assert_eq!(preloaded(&ops, HELD_BUFFERS), 2);
        let body = block_body(&ops, HELD_BUFFERS);
        let at = |what: &str| body.find(what).unwrap_or_else(|| panic!("no {what} in\n{body}"));
        let start = at("block_start");
        assert!(
            at("HeldOp<OP_re, 0u, 0u, 2u, 1u, 0u, 0u> o0(ops[0]);") < start
                && at("HeldOp<OP_re, 0u, 0u, 2u, 1u, 0u, 0u> o1(ops[1]);") < start
        );
        assert!(at("FixedOp<OP_re, 0u, 0u, 2u, 1u, 0u, 0u> o2(ops[2]);") > start);
        assert!(start < at(" o2(ops[2]);") && at(" o2(ops[2]);") < at("exec_fixed<PK>(c, o2,"));
        assert!(at("exec_fixed<PK>(c, o3,") < at(" o4(ops[4]);") && at(" o4(ops[4]);") < at("exec_fixed<PK>(c, o4,"));
        // A first operation over the budget is not held, nor anything after it.
        let big = DevOp { kind: re, n_src: 8, n_dst: 8, ..DevOp::default() };
        assert_eq!(preloaded(&[big, r], HELD_BUFFERS), 0);
        // Neither is a first pipeline whose body is over it (its registers would stay live
        // through every iteration); one that fits is held whole, header and body.
        let pipeline = device::op_code(OpKind::Pipeline);
        let head = |n_body| DevOp { kind: pipeline, n_body, n_iter: 4, unit_size: 64, ..DevOp::default() };
        assert_eq!(preloaded(&[head(3), r, r, r, r], HELD_BUFFERS), 0);
        assert_eq!(preloaded(&[head(2), r, r, r], HELD_BUFFERS), 3);
        // Channels and semaphores count, an eighth of a buffer each index (two per channel).
        let chans = DevOp { kind: sig, ctype: 1, n_chan: 8, ..DevOp::default() };
        assert_eq!(held_cost(&chans), 2);
        assert_eq!(preloaded(&[r, chans, r], HELD_BUFFERS), 2);
        assert_eq!(preloaded(&[], HELD_BUFFERS), 0);
        // Budget 0: nothing held, every operation a FixedOp constructed where it runs.
        assert_eq!(preloaded(&ops, 0), 0);
        let none = block_body(&ops, 0);
        assert!(!none.contains("HeldOp") && none.matches("FixedOp").count() == ops.len(), "{none}");
        assert!(none.find("block_start").unwrap_or(usize::MAX) < none.find("FixedOp").unwrap_or(0), "{none}");
    }
}

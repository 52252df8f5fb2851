//! The per-plan kernels' block code against the interpreter's loop, on the CPU: the generated
//! `PlanBlocks::run` and the loop of `run` in `kernel.cu` (the text itself, cut out of the
//! source) are compiled together as host C++ with the operation calls and `__syncthreads()`
//! replaced by recorders, and run on the same device image, block by block. For every generated
//! plan and a few hundred random programs (every kind, pipelines whose bodies may run past the
//! block, blocks of different shapes, padding), both must make the same calls in the same order:
//! the same `c.op`, kind and shape, the same slot for the data, the same pipeline offset and unit,
//! and the same barriers between them. Needs a host C++17 compiler (`$CXX`, else `c++`); skipped
//! without one.

use std::fmt::Write as _;
use std::process::Command;

use mscclpp_executor::OpKind;
use mscclpp_executor::device::{self, DevOp, op_code};
use mscclpp_executor::generate;
use mscclpp_executor::lower::{Lowered, lower_unbound};

const KERNEL: &str = include_str!("../src/kernel.cu");

/// The text of `s` from `from` up to (not including) `to`.
fn cut<'a>(s: &'a str, from: &str, to: &str) -> &'a str {
    let a = s.find(from).unwrap_or_else(|| panic!("kernel.cu no longer has {from:?}: update this test"));
    let b = s[a..].find(to).unwrap_or_else(|| panic!("kernel.cu no longer has {to:?} after {from:?}"));
    &s[a..a + b]
}

/// The interpreter dispatches every kind the executor runs (a kind left out of `EXEC_KINDS` would
/// silently be a no-op in the interpreter and run in a per-plan kernel).
#[test]
fn the_interpreter_dispatches_every_kind_it_runs() {
    let list = cut(KERNEL, "#define EXEC_KINDS(X)", "\n\n");
    let listed: Vec<&str> =
        list.split("X(").skip(1).map(|x| x.split(')').next().unwrap_or_default()).collect::<Vec<_>>();
    let skip =
        [OpKind::Nop, OpKind::Pipeline, OpKind::MultiLoadReduceStore, OpKind::MultiStore, OpKind::MultiStorePackets];
    let mut want: Vec<&str> = OpKind::ALL.iter().filter(|k| !skip.contains(k)).map(|k| k.name()).collect();
    let mut got = listed.clone();
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, want, "EXEC_KINDS: {list}");
    // And each has its line in exec_kind.
    let table = cut(KERNEL, "__device__ __forceinline__ void exec_kind(", "\n}\n");
    for k in listed {
        assert!(table.contains(&format!("OP_{k}")), "exec_kind does not handle {k}");
    }
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u32) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) % u64::from(n)) as u32
    }
}

/// Random programs: `nblocks` blocks drawn from up to three op sequences, with per-block data.
fn random_program(r: &mut Rng) -> Lowered {
    let pipeline = op_code(OpKind::Pipeline);
    let packets = [
        OpKind::PutPackets,
        OpKind::CopyPackets,
        OpKind::ReducePackets,
        OpKind::ReadPutPackets,
        OpKind::UnpackPackets,
        OpKind::ReduceCopySendPackets,
    ];
    let shapes: Vec<Vec<DevOp>> = (0..1 + r.below(3))
        .map(|_| {
            (0..r.below(9))
                .map(|_| {
                    let kind = match r.below(4) {
                        0 => pipeline,
                        1 => op_code(packets[r.below(packets.len() as u32) as usize]),
                        _ => r.below(OpKind::ALL.len() as u32),
                    };
                    DevOp {
                        kind,
                        ctype: r.below(3),
                        n_chan: r.below(4),
                        n_src: r.below(4),
                        n_dst: r.below(4),
                        reduce_op: r.below(3),
                        n_sems: r.below(3),
                        n_body: if kind == pipeline { r.below(4) } else { 0 },
                        unit_size: if kind == pipeline { 64 * (1 + u64::from(r.below(8))) } else { 0 },
                        ..DevOp::default()
                    }
                })
                .collect()
        })
        .collect();
    let (mut ops, mut blocks) = (Vec::new(), Vec::new());
    for _ in 0..1 + r.below(6) {
        let s = &shapes[r.below(shapes.len() as u32) as usize];
        blocks.extend([ops.len() as u32, s.len() as u32]);
        for o in s {
            ops.push(DevOp {
                barrier_id: r.below(16),
                n_blocks: r.below(4),
                n_iter: if o.kind == pipeline { r.below(4) } else { 0 },
                ..*o
            });
        }
    }
    Lowered { ops, blocks, semaphores: vec![] }
}

/// One case: its device image and generated block code (with the held-buffer budget `held`), in
/// namespace `c{i}`.
fn case(i: usize, low: &Lowered, held: u32) -> String {
    let img = low.device_image();
    let mut s = format!("namespace c{i} {{\nstatic const u32 NB = {}, ST = {};\n", img.nblocks, img.stride);
    s.push_str("static DevOp SLOTS[] = {\n");
    for o in &img.slots {
        let _ = writeln!(
            s,
            "  {{{}u, {}u, {}u, {}u, {}u, {}u, {}u, {}u, {}u, {}u, {}u, {}u, {}ull}},",
            o.kind,
            o.ctype,
            o.n_chan,
            o.n_src,
            o.n_dst,
            o.reduce_op,
            o.barrier_id,
            o.n_blocks,
            o.n_sems,
            o.n_body,
            o.n_iter,
            o.block_ops,
            o.unit_size
        );
    }
    s.push_str("};\n");
    let part = mscclpp_executor::plan_kernel::plan_part_held(&low.ops, &low.blocks, held);
    s.push_str(part.split("extern \"C\"").next().unwrap_or_default());
    s.push_str("}\n");
    s
}

const HARNESS_HEAD: &str = r#"
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <tuple>
#include <vector>
typedef unsigned u32;
typedef unsigned long long u64;
#define __device__
#define __forceinline__ inline
#define CT_MEMORY 1u
#define CT_PORT 2u
struct Dim { u32 x; };
static Dim blockIdx;
struct Ctx { u32 op; };
struct PL16 {};
struct DevOp;
struct ExecArgs {};
static void __syncthreads();
// The launch's start and end: no calls to record (the generated code brackets every block with
// them; `starts` and `finishes` count them).
static int starts, finishes;
static bool block_start(const ExecArgs&, Ctx&) { starts++; return true; }
static void finish(const ExecArgs&, const Ctx&) { finishes++; }
template <typename PK> void exec_op(const Ctx& c, const DevOp& op, u64 po, u64 unit);
"#;

const HARNESS_RECORDERS: &str = r#"
// (barrier?, c.op, kind, ctype, n_chan, n_src, n_dst, reduce_op, n_sems, slot, barrier_id, n_blocks, po, unit)
typedef std::tuple<int, u32, u32, u32, u32, u32, u32, u32, u32, long, u32, u32, u64, u64> Ev;
static std::vector<Ev> events;
static const DevOp* slots;
static int broken;
static void __syncthreads() { events.push_back(Ev(1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)); }
static long slot_of(const void* p, size_t field) {
  long d = (long)((const char*)p - (const char*)slots) - (long)field;
  if (d % (long)sizeof(DevOp) != 0) broken = 1;
  return d / (long)sizeof(DevOp);
}
// A slot's array fields (channels, peers, semaphores, buffers) hold `slot << 8 | salt`, written
// by `mark` before a case runs: a HeldOp (values copied from its slot) names its slot by them,
// and each value must sit where its salt says (a field copied from the wrong place is caught).
static void mark(DevOp* s, u32 n) {
  for (u32 i = 0; i < n; i++) {
    const u64 b = (u64)i << 8;
    for (u32 k = 0; k < sizeof(s[i].chans) / sizeof(u32); k++) {
      s[i].chans[k] = (u32)(b | k);
      s[i].chan_peer[k] = (u32)(b | (16 + k));
    }
    for (u32 k = 0; k < sizeof(s[i].sems) / sizeof(u32); k++) s[i].sems[k] = (u32)(b | (32 + k));
    for (u32 k = 0; k < sizeof(s[i].src) / sizeof(DevBuf); k++) {
      s[i].src[k] = DevBuf{b | (48 + k), b | (64 + k), b | (80 + k), (u32)(b | (96 + k)), (u32)(b | (112 + k)),
                           (u32)(b | (128 + k)), (u32)(b | (144 + k))};
      s[i].dst[k] = DevBuf{b | (160 + k), b | (176 + k), b | (192 + k), (u32)(b | (208 + k)), (u32)(b | (224 + k)),
                           (u32)(b | (240 + k)), (u32)(b | (8 + k))};
    }
  }
}
// An operation with no array field: its slot is not told by its data (-2 on every side).
static bool no_arrays(u32 n_chan, u32 n_src, u32 n_dst, u32 n_sems) { return !n_chan && !n_src && !n_dst && !n_sems; }
static void take(long& s, u64 v, u64 salt) {
  if ((v & 0xff) != salt) broken = 1;
  const long t = (long)(v >> 8);
  if (s == -2) s = t;
  else if (s != t) broken = 1;
}
template <typename PK>
void exec_op(const Ctx& c, const DevOp& op, u64 po, u64 unit) {
  const long s = no_arrays(op.n_chan, op.n_src, op.n_dst, op.n_sems) ? -2 : slot_of(&op, 0);
  events.push_back(Ev(0, c.op, op.kind, op.ctype, op.n_chan, op.n_src, op.n_dst, op.reduce_op, op.n_sems, s,
                      op.barrier_id, op.n_blocks, po, unit));
}
template <typename PK, u32 K, u32 C, u32 NC, u32 NS, u32 ND, u32 R, u32 NM>
void exec_fixed(const Ctx& c, const FixedOp<K, C, NC, NS, ND, R, NM>& op, u64 po, u64 unit) {
  long s = slot_of(op.src, offsetof(DevOp, src));
  if (slot_of(op.dst, offsetof(DevOp, dst)) != s || slot_of(op.chans, offsetof(DevOp, chans)) != s ||
      slot_of(op.chan_peer, offsetof(DevOp, chan_peer)) != s || slot_of(op.sems, offsetof(DevOp, sems)) != s)
    broken = 1;
  if (no_arrays(NC, NS, ND, NM)) s = -2;
  events.push_back(Ev(0, c.op, K, C, NC, NS, ND, R, NM, s, op.barrier_id, op.n_blocks, po, unit));
}
template <typename PK, u32 K, u32 C, u32 NC, u32 NS, u32 ND, u32 R, u32 NM>
void exec_fixed(const Ctx& c, const HeldOp<K, C, NC, NS, ND, R, NM>& op, u64 po, u64 unit) {
  long s = -2;
  for (u32 k = 0; k < NC; k++) {
    take(s, op.chans[k], k);
    take(s, op.chan_peer[k], 16 + k);
  }
  for (u32 k = 0; k < NM; k++) take(s, op.sems[k], 32 + k);
  for (u32 k = 0; k < NS; k++) {
    const DevBuf b = op.src[k];
    take(s, b.base, 48 + k), take(s, b.off, 64 + k), take(s, b.size, 80 + k), take(s, b.kind, 96 + k);
    take(s, b.btype, 112 + k), take(s, b.mem_id, 128 + k), take(s, b.peer, 144 + k);
  }
  for (u32 k = 0; k < ND; k++) {
    const DevBuf b = op.dst[k];
    take(s, b.base, 160 + k), take(s, b.off, 176 + k), take(s, b.size, 192 + k), take(s, b.kind, 208 + k);
    take(s, b.btype, 224 + k), take(s, b.mem_id, 240 + k), take(s, b.peer, 8 + k);
  }
  events.push_back(Ev(0, c.op, K, C, NC, NS, ND, R, NM, s, op.barrier_id, op.n_blocks, po, unit));
}
static int check(const char* what, DevOp* s, u32 nb, u32 st, void (*run)(const ExecArgs&, const DevOp*)) {
  int bad = 0;
  slots = s;
  mark(s, nb * st);
  for (u32 b = 0; b < nb; b++) {
    blockIdx.x = b;
    Ctx c{0xffff};
    events.clear();
    interp<PL16>(c, s + (u64)b * st);
    std::vector<Ev> want = events;
    events.clear();
    broken = 0;
    starts = finishes = 0;
    run(ExecArgs{}, s + (u64)b * st);
    if (starts != 1 || finishes != 1) {
      printf("%s: block %u: %d starts and %d finishes (want one each)\n", what, b, starts, finishes);
      bad = 1;
    }
    if (events != want || broken) {
      printf("%s: block %u: the per-plan code differs from the interpreter (%zu events, the interpreter %zu)\n",
             what, b, events.size(), want.size());
      bad = 1;
    }
  }
  return bad;
}
"#;

#[test]
fn per_plan_block_code_runs_the_interpreters_calls_and_barriers() {
    let test = "per_plan_block_code_runs_the_interpreters_calls_and_barriers";
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        // CI has one (gcc is on every machine of ours): a missing one there is a failure.
        assert!(std::env::var_os("CI").is_none(), "{test} cannot run in CI: no host C++ compiler {cxx:?}");
        println!("SKIPPED {test}: no host C++ compiler {cxx:?}");
        return;
    }
    let src = device::source();
    let mut cpp = String::from(HARNESS_HEAD);
    for l in src.lines().filter(|l| l.starts_with("#define OP_")) {
        cpp.push_str(l);
        cpp.push('\n');
    }
    cpp.push_str(cut(&src, "struct DevBuf {", "struct ExecArgs {"));
    cpp.push_str(cut(KERNEL, "__device__ __forceinline__ constexpr bool packets_then_packets", "\n}\n"));
    cpp.push_str("\n}\n");
    // FixedOp, Held and HeldOp.
    cpp.push_str(cut(KERNEL, "template <u32 KIND, u32 CTYPE", "// The start of every launch"));
    let lp = cut(KERNEL, "  const u32 count = ops[0].block_ops;", "\n}\n");
    let _ = write!(cpp, "template <typename PK>\nvoid interp(Ctx& c, const DevOp* ops) {{\n{lp}\n}}\n");
    cpp.push_str(HARNESS_RECORDERS);

    let mut names = Vec::new();
    let mut seen = std::collections::HashSet::new();
    // Every case with no operation held (FixedOps only), the default budget, and all held.
    let mut add = |cpp: &mut String, low: &Lowered, name: String| {
        for held in [0, mscclpp_executor::plan_kernel::HELD_BUFFERS, 64] {
            let body = case(0, low, held);
            if seen.insert(body) {
                cpp.push_str(&case(names.len(), low, held));
                names.push(format!("{name} (held {held})"));
            }
        }
    };
    let mut plans = Vec::new();
    for ranks in [2, 3, 4, 8] {
        plans.extend(generate::all(ranks));
    }
    for (b, t) in [(1, 128), (4, 256), (32, 512)] {
        plans.extend(generate::one_hop_allreduce(2, false, b, t));
        plans.extend(generate::one_hop_allreduce(4, true, b, t));
    }
    for plan in &plans {
        for rank in 0..plan.gpus.len() {
            let low = lower_unbound(plan, rank, 4096).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
            add(&mut cpp, &low, format!("{} rank {rank}", plan.name));
        }
    }
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    for k in 0..300 {
        add(&mut cpp, &random_program(&mut r), format!("random program {k}"));
    }
    cpp.push_str("int main() {\n  int bad = 0;\n");
    for (i, name) in names.iter().enumerate() {
        let _ =
            writeln!(cpp, "  bad |= check({name:?}, c{i}::SLOTS, c{i}::NB, c{i}::ST, &c{i}::PlanBlocks::run<PL16>);");
    }
    let _ = writeln!(cpp, "  printf(\"%d cases\\n\", {});\n  return bad;\n}}", names.len());

    let dir = std::env::temp_dir().join(format!("mscclpp-plan-kernel-equivalence-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (file, exe) = (dir.join("equivalence.cpp"), dir.join("equivalence"));
    std::fs::write(&file, &cpp).unwrap();
    let out = Command::new(&cxx).args(["-std=c++17", "-O0", "-w", "-o"]).arg(&exe).arg(&file).output().unwrap();
    assert!(out.status.success(), "{cxx} failed on {}:\n{}", file.display(), String::from_utf8_lossy(&out.stderr));
    let run = Command::new(&exe).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}");
    println!("{}", stdout.trim());
    let _ = std::fs::remove_dir_all(&dir);
}

// Where the executor's extra microsecond goes: the one-hop LL AllReduce of two ranks on one GPU
// (two streams of one process; a peer's scratch is plain device memory of this process), bf16
// sum, built up from the built-in `allpair` exchange to the real interpreter kernel a piece at a
// time. Each variant is checked once against a CPU reference (PASS/FAIL), then timed as 200
// calls captured in one CUDA graph per rank (per call: graph GPU time / 200, the slower rank,
// best of 5; graph_timing.cuh of mscclpp-collectives' bench).
//
//   cargo run -p mscclpp-executor --example dump_breakdown_inputs -- exec_breakdown_inputs.h
//   nvcc -O3 -arch=sm_90 -o exec_breakdown exec_breakdown.cu && ./exec_breakdown [bytes]
// (the inputs are generated, not committed: scripts/gpu-bundle-exec.sh writes them into the
// bundle, where breakdown.sh compiles and runs this file.)
//
// Without an argument: a table for 1K 4K 16K 64K. The sizes are those of exec_breakdown_inputs.h
// (the one-hop plan's best split per size: 4x256, 4x256, 8x512, 16x512 blocks x threads); every
// variant from `plan-grid` on runs on that split, block b owning chunk b as the plan does.
//
// Variants (each adds one piece to the one before):
//   empty          an empty kernel on the plan's grid: the floor of a graph node
//   builtin        allpair_breakdown's `lazy+sig@d` on the built-in's own grid (grid-stride,
//                  signature polled with the first data packet, deadline started lazily)
//   plan-grid      the same code on the plan's grid, packets at the plan's scratch slots and
//                  halves (flag parity picks the half, as with a double scratch buffer)
//   no-sig         without the signature packet and the closing __syncthreads (the interpreter
//                  has neither); addresses still precomputed in the arguments
//   ops-global     the real ExecArgs by value and the real lowered DevOps (exec_breakdown_inputs.h)
//                  in global memory: every address and size read from the op structs by each
//                  thread; flag from ExecArgs.flags[block], the ExecState failed word
//   ops-shared     the interpreter's prologue: the block's op slots copied to shared memory,
//                  thread 0 reads flag and failed word, __syncthreads, ops read from shared
//   two-ops        the exchange split into the plan's operations (ppkt: packets out; repkt: poll
//                  and reduce, each its own loop; the input read twice), dispatched by a switch
//                  on op.kind over block_ops, no barrier between them (packets_then_packets)
//   generic        the op bodies are the interpreter's own put_packets<PL16> and
//                  reduce_packets<PL16> (Ctx, addr() with the packet multiplier, loops over
//                  n_src/n_dst, red_word on the run-time dtype, read_pkt's bounded wait)
//   interp         the real kernel mscclpp_exec_ll16 (its prelude and exec_op's full switch),
//                  ExecArgs filled as exec.rs fills them
//   interp-global  the same kernel with ops_stride 13 (op bytes > SHARED_OPS_BYTES): it reads
//                  its ops from global memory instead of copying them
//   interp-param   a candidate fix: the interpreter's run loop (same exec_op) with the ops in
//                  the kernel parameters (__grid_constant__) instead of global memory
//   per-plan-nopf  the executor's per-plan kernel (KernelKind::PerPlan: the same operation
//                  code on HeldOp/FixedOp views, shape compiled in, same ExecArgs) without its prefetch
//                  of the op slots
//   per-plan       the per-plan kernel as the executor builds it (mscclpp_exec_plan_ll16)
//
// The bench's kernels are declared __launch_bounds__(1024, 1): up to 64 registers, the budget
// ptxas gives mscclpp_exec_ll16 (__launch_bounds__(1024)); without the ", 1" it held some of them
// to 32 registers with spills. The table's head lists each kernel's registers and local memory.
//
// Every spin wait is bounded (1 s; the interpreter's timeout_ns is set to 1 s): a variant that
// fails its check is not timed. Not part of the library or its tests: a measurement tool.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>
#include <cuda_runtime.h>

#include "../../mscclpp-collectives/bench/bench_pieces.cuh"
#include "../../mscclpp-collectives/bench/graph_timing.cuh"
#include "exec_breakdown_inputs.h"

#define BK_TIMEOUT_NS 1000000000ull

// The per-plan kernel without its prefetch of the op slots.
extern "C" __global__ void __launch_bounds__(1024, 1) bk_exec_plan_nopf(const __grid_constant__ ExecArgs a) {
  run_plan<PL16, PlanBlocks, false>(a);
}

// ---------------------------------------------------------------------------------------------
// Pieces of the model kernels.

// A thread's bounded wait: the clock is read every 256 spins, the deadline set at the first read.
struct BkWait {
  u64 deadline = 0;
  __device__ __forceinline__ bool expired(u32& spins) {
    if ((++spins & 255) != 0) return false;
    const u64 now = bench_now();
    if (deadline == 0) {
      deadline = now + BK_TIMEOUT_NS;
      return false;
    }
    return now > deadline;
  }
};

__global__ void k_empty() {}

// ---------------------------------------------------------------------------------------------
// builtin, plan-grid, no-sig: everything precomputed in the arguments.

struct BArgs {
  const uint2* in;
  uint2* out;
  char* peer_scratch;  // the peer's scratch (both halves)
  char* my_scratch;
  uint4* peer_sig;  // the peer's signature slots [2]
  uint4* my_sig;
  u32* state;        // [blocks][2]: flag, failed (a word pair per block: no race on one flag)
  u64 units;         // 8-byte units of the message
  u64 chunk_units;   // per block on the plan's grid
  u64 scratch_half;  // bytes
  u64 sig;
  u32 rank, blocks;  // blocks of the plan's grid
};

// V 0: builtin (own grid, grid-stride); 1: plan-grid; 2: no-sig.
template <int V>
__global__ void __launch_bounds__(1024, 1) k_model(BArgs a) {
  constexpr bool SIG = V < 2;
  volatile u32* st = a.state + 2 * blockIdx.x;
  const u32 flag = st[0];
  if (st[1]) return;
  const u32 half = flag & 1;
  const bool t0 = blockIdx.x == 0 && threadIdx.x == 0;
  if (SIG && t0) bench_pkt_write(a.peer_sig + half, make_uint2((u32)a.sig, (u32)(a.sig >> 32)), flag);
  BkWait w;
  // Units [first, end) step `step`; unit i's packet is number i - base of the packet areas.
  u64 first, end, step, base;
  const char *peer_pk, *my_pk;
  if (V == 0) {
    first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    end = a.units;
    step = (u64)gridDim.x * blockDim.x;
    base = 0;
    peer_pk = a.peer_scratch + half * a.units * 16;
    my_pk = a.my_scratch + half * a.units * 16;
  } else {
    // The plan: block b sends chunk b to the peer's slot (rank * blocks + b) and reads the peer's
    // from its own slot (peer * blocks + b); flag parity 0 uses the upper half.
    const u64 so = (flag & 1) == 0 ? a.scratch_half : 0, cb = a.chunk_units * 8;
    const u32 peer = 1 - a.rank;
    base = (u64)blockIdx.x * a.chunk_units;
    first = base + threadIdx.x;
    end = base + a.chunk_units;
    step = blockDim.x;
    peer_pk = a.peer_scratch + so + 2 * (u64)(a.rank * a.blocks + blockIdx.x) * cb;
    my_pk = a.my_scratch + so + 2 * (u64)(peer * a.blocks + blockIdx.x) * cb;
  }
  for (u64 i = first; i < end; i += step) {
    const uint2 x = a.in[i];
    bench_pkt_write((void*)(peer_pk + 16 * (i - base)), x, flag);
    uint2 y;
    u32 spins = 0;
    bool sig_ok = !(SIG && i == 0);
    while (true) {
      const bool d = bench_pkt_read(my_pk + 16 * (i - base), flag, y);
      if (!sig_ok) {
        uint2 sv;
        sig_ok = bench_pkt_read(a.my_sig + half, flag, sv);
      }
      if (d && sig_ok) break;
      if (w.expired(spins)) {
        for (u32 b = 0; b < gridDim.x; b++) a.state[2 * b + 1] = 1;
        return;
      }
    }
    a.out[i] = bench_add_bf16x4(x, y);
  }
  if (SIG) __syncthreads();
  if (threadIdx.x == 0) st[0] = flag + 1;
}

// ---------------------------------------------------------------------------------------------
// ops-global, ops-shared, two-ops, generic: the real ExecArgs and lowered ops, the interpreter's
// structure growing a piece at a time.

enum { V_OPS_GLOBAL, V_OPS_SHARED, V_TWO_OPS, V_GENERIC };

// One of this rank's buffers without a local array (the interpreter's Ctx.buf is one).
__device__ __forceinline__ char* bk_buf(const ExecArgs& a, u32 btype, u64 so) {
  return btype == 0 ? (char*)a.input : btype == 1 ? (char*)a.output : (char*)a.scratch + so;
}
__device__ __forceinline__ bool bk_failed(const ExecArgs& a) {
  atomicExch(&((ExecState*)a.state)->failed, 1u);
  return false;
}

// Polls the packet at `p` until it carries `flag` (its data in `y`); false, with this rank
// marked failed, once the wait expires.
__device__ __forceinline__ bool bk_poll(const ExecArgs& a, const char* p, u32 flag, uint2& y, BkWait& w) {
  u32 spins = 0;
  while (!bench_pkt_read(p, flag, y)) {
    if (w.expired(spins)) return bk_failed(a);
  }
  return true;
}

// ppkt through a memory channel, one source and one destination, LL16.
__device__ __forceinline__ void bk_put(const ExecArgs& a, const DevOp& op, u64 so, u32 flag) {
  const uint2* src = (const uint2*)(bk_buf(a, op.src[0].btype, so) + op.src[0].off);
  char* dst = (char*)(op.dst[0].base + 2 * op.dst[0].off + so);
  const u64 n = op.src[0].size / 8;
  for (u64 j = threadIdx.x; j < n; j += blockDim.x) bench_pkt_write(dst + 16 * j, src[j], flag);
}
// repkt, one local source and one packet source, bf16 sum.
__device__ __forceinline__ void bk_reduce(const ExecArgs& a, const DevOp& op, u64 so, u32 flag) {
  const uint2* in = (const uint2*)(bk_buf(a, op.src[0].btype, so) + op.src[0].off);
  const char* pk = (const char*)a.scratch + so + 2 * op.src[1].off;
  uint2* out = (uint2*)(bk_buf(a, op.dst[0].btype, so) + op.dst[0].off);
  const u64 n = op.src[0].size / 8;
  BkWait w;
  for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
    uint2 y;
    if (!bk_poll(a, pk + 16 * j, flag, y, w)) return;
    out[j] = bench_add_bf16x4(in[j], y);
  }
}

template <int V>
__global__ void __launch_bounds__(1024, 1) k_ops(const __grid_constant__ ExecArgs a) {
  __shared__ u32 s_flag;
  __shared__ u32 s_stop;
  __shared__ __align__(16) u64 s_ops[V == V_OPS_GLOBAL ? 2 : SHARED_OPS_BYTES / 8];
  ExecState* st = (ExecState*)a.state;
  const DevOp* g_ops = (const DevOp*)a.ops + (u64)blockIdx.x * a.ops_stride;
  u32* my_flag = (u32*)a.flags + blockIdx.x;
  const DevOp* ops;
  u32 flag;
  if (V == V_OPS_GLOBAL) {
    flag = vload(my_flag);
    if (vload(&st->failed)) return;
    ops = g_ops;
  } else {
    const u64 op_bytes = a.ops_stride * sizeof(DevOp);
    const u64* src = (const u64*)g_ops;
    for (u32 i = threadIdx.x; i < op_bytes / 8; i += blockDim.x) s_ops[i] = src[i];
    if (threadIdx.x == 0) {
      s_flag = vload(my_flag);
      s_stop = vload(&st->failed) != 0 ? 1u : 0u;
    }
    __syncthreads();
    if (s_stop) return;
    flag = s_flag;
    ops = (const DevOp*)s_ops;
  }
  const u64 so = (a.scratch_half != 0 && (flag & 1u) == 0) ? a.scratch_half : 0;
  if (V <= V_OPS_SHARED) {
    // One fused loop as the built-in's: the put's addresses from ops[0], the reduce's from ops[1].
    const DevOp& P = ops[0];
    const DevOp& R = ops[1];
    const uint2* src = (const uint2*)(bk_buf(a, P.src[0].btype, so) + P.src[0].off);
    char* dst = (char*)(P.dst[0].base + 2 * P.dst[0].off + so);
    const char* pk = (const char*)a.scratch + so + 2 * R.src[1].off;
    uint2* out = (uint2*)(bk_buf(a, R.dst[0].btype, so) + R.dst[0].off);
    const u64 n = P.src[0].size / 8;
    BkWait w;
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
      const uint2 x = src[j];
      bench_pkt_write(dst + 16 * j, x, flag);
      uint2 y;
      if (!bk_poll(a, pk + 16 * j, flag, y, w)) return;
      out[j] = bench_add_bf16x4(x, y);
    }
  } else {
    Ctx c;
    c.a = &a;
    c.flag = flag;
    c.deadline = 0;
    c.stopped = 0;
    c.block = blockIdx.x;
    c.op = 0xffff;
    c.scratch_off = so;
    c.buf[0] = (char*)a.input;
    c.buf[1] = (char*)a.output;
    c.buf[2] = (char*)a.scratch + so;
    const u32 count = ops[0].block_ops;
    for (u32 i = 0; i < count;) {
      const DevOp& op = ops[i];
      c.op = i;
      switch (op.kind) {
        case OP_ppkt:
          if (V == V_TWO_OPS) bk_put(a, op, so, flag);
          else put_packets<PL16>(c, op);
          break;
        case OP_repkt:
          if (V == V_TWO_OPS) bk_reduce(a, op, so, flag);
          else reduce_packets<PL16>(c, op, false);
          break;
        default: break;
      }
      i++;
      if (i < count && !packets_then_packets(op.kind, op.ctype, ops[i].kind, ops[i].ctype)) __syncthreads();
    }
  }
  if (threadIdx.x == 0) *my_flag = flag + 1 == 0 ? 2u : flag + 1;
}

// ---------------------------------------------------------------------------------------------
// interp-param: the interpreter's run<PL16> (kernel.cu: begin, run_ops, finish) with one change,
// the ops read from the kernel's parameters. 32 slots: the largest case (16 blocks x 2 ops); 31.6 KB of parameters
// (CUDA 12.1+ allows 32764 bytes).

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
#define BK_PARAM_SLOTS 32
struct ParamProgram {
  ExecArgs a;
  DevOp ops[BK_PARAM_SLOTS];
};
static_assert(sizeof(ParamProgram) <= 32764, "kernel parameters past CUDA's limit");

extern "C" __global__ void __launch_bounds__(1024, 1) bk_exec_param(const __grid_constant__ ParamProgram p) {
  const ExecArgs& a = p.a;
  __shared__ Start s;
  begin(a, s);
  __syncthreads();
  Ctx c;
  if (!begin_ctx(a, s, c)) return;
  run_ops<PL16>(c, p.ops + (u64)blockIdx.x * a.ops_stride);
  finish(a, c);
}
#endif

// ---------------------------------------------------------------------------------------------
// Host side.

#define GLOBAL_STRIDE 13  // op slots per block for interp-global: 13 * sizeof(DevOp) > SHARED_OPS_BYTES
static_assert(GLOBAL_STRIDE * sizeof(DevOp) > SHARED_OPS_BYTES, "interp-global would copy its ops");

static unsigned short f2bf(float f) {
  u32 u;
  memcpy(&u, &f, 4);
  return (unsigned short)(u >> 16);  // exact for the small integers used here
}

struct RankBufs {
  char *in, *out, *scratch;
  uint4* sig;
  u32* pairs;                          // model variants' [blocks][2] flag/failed words
  char* state;                         // the interpreter's state buffer
  DevOp *ops, *ops_wide;               // slots at ops_stride / at GLOBAL_STRIDE
  BaseMemoryChannelDeviceHandle* chans;
  u64* tokens;                         // per channel: inbound, expected
  u64* status_h;                       // pinned: error word, abort word
  std::vector<DevOp> host_ops;
  ExecArgs args, args_wide;
  BArgs model;
  std::vector<unsigned short> expect;
};

struct Setup {
  const DumpCase* dc;
  RankBufs r[2];
  cudaStream_t s[2];
  u32 own_blocks, own_threads;  // the built-in's launch for this size
};

static char* dalloc(size_t n) {
  void* p;
  CK(cudaMalloc(&p, n));
  CK(cudaMemset(p, 0, n));
  return (char*)p;
}

static bool setup(Setup& S, const DumpCase* dc, cudaStream_t s[2]) {
  S.dc = dc;
  S.s[0] = s[0];
  S.s[1] = s[1];
  const u64 bytes = dc->bytes, units = bytes / 8;
  // allpair_breakdown's (and the library's) shape for the built-in kernel.
  S.own_threads = units <= 256 ? (u32)((units + 31) / 32 * 32 < 64 ? 64 : (units + 31) / 32 * 32) : 512;
  S.own_blocks = (u32)((units + S.own_threads - 1) / S.own_threads > 32 ? 32 : (units + S.own_threads - 1) / S.own_threads);
  for (int r = 0; r < 2; r++) {
    RankBufs& R = S.r[r];
    const DumpRank& d = dc->rank[r];
    R.in = dalloc(bytes);
    R.out = dalloc(bytes);
    R.scratch = dalloc(d.scratch_bytes);
    R.sig = (uint4*)dalloc(2 * 16);
    R.pairs = (u32*)dalloc(2 * 4 * 64);
    R.state = dalloc(d.state_words * 4);
    R.ops = (DevOp*)dalloc(dc->n_slots * sizeof(DevOp));
    R.ops_wide = (DevOp*)dalloc((u64)dc->blocks * GLOBAL_STRIDE * sizeof(DevOp));
    R.chans = (BaseMemoryChannelDeviceHandle*)dalloc((d.mem_chans + 1) * sizeof(BaseMemoryChannelDeviceHandle));
    R.tokens = (u64*)dalloc((d.mem_chans + 1) * 2 * 8);
    CK(cudaHostAlloc(&R.status_h, 64, cudaHostAllocMapped));
    memset(R.status_h, 0, 64);
    std::vector<unsigned short> in(bytes / 2);
    for (u64 e = 0; e < in.size(); e++) in[e] = f2bf((float)((int)((e * 7 + r * 13) % 97) - 48));
    CK(cudaMemcpy(R.in, in.data(), bytes, cudaMemcpyHostToDevice));
    if (d.port_chans != 0) {
      fprintf(stderr, "%s: port channels are not reproduced here\n", dc->plan);
      return false;
    }
  }
  for (int r = 0; r < 2; r++) {
    S.r[r].expect.resize(bytes / 2);
    std::vector<unsigned short> a(bytes / 2), b(bytes / 2);
    CK(cudaMemcpy(a.data(), S.r[r].in, bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), S.r[1 - r].in, bytes, cudaMemcpyDeviceToHost));
    for (u64 e = 0; e < a.size(); e++) {
      u32 x = (u32)a[e] << 16, y = (u32)b[e] << 16;
      float fx, fy;
      memcpy(&fx, &x, 4);
      memcpy(&fy, &y, 4);
      S.r[r].expect[e] = f2bf(fx + fy);
    }
  }
  for (int r = 0; r < 2; r++) {
    RankBufs& R = S.r[r];
    const DumpRank& d = dc->rank[r];
    // The lowered ops, a memory-channel buffer's base patched to the peer's buffer (what the
    // executor's MemoryChannel maps: the whole buffer; the kernel adds the scratch half).
    R.host_ops.resize(dc->n_slots);
    d.fill_ops(R.host_ops.data());
    for (DevOp& o : R.host_ops) {
      for (int k = 0; k < 2 * 10; k++) {
        DevBuf& b = k < 10 ? o.src[k] : o.dst[k - 10];
        if (b.kind != KIND_MEMORY) continue;
        if ((b.base & 0xffff000000000000ull) != DUMP_REMOTE_MARK || b.peer > 1 || b.btype > 2) {
          fprintf(stderr, "%s rank %d: a remote buffer the bench cannot patch\n", dc->plan, r);
          return false;
        }
        const RankBufs& P = S.r[b.peer];
        b.base = (u64)(b.btype == 0 ? P.in : b.btype == 1 ? P.out : P.scratch);
      }
    }
    CK(cudaMemcpy(R.ops, R.host_ops.data(), dc->n_slots * sizeof(DevOp), cudaMemcpyHostToDevice));
    std::vector<DevOp> wide((u64)dc->blocks * GLOBAL_STRIDE);
    for (auto& o : wide) dump_blank(o);
    for (u64 b = 0; b < dc->blocks; b++)
      for (u64 k = 0; k < GLOBAL_STRIDE; k++) {
        if (k < dc->ops_stride) wide[b * GLOBAL_STRIDE + k] = R.host_ops[b * dc->ops_stride + k];
        else wide[b * GLOBAL_STRIDE + k].block_ops = R.host_ops[b * dc->ops_stride].block_ops;
      }
    CK(cudaMemcpy(R.ops_wide, wide.data(), wide.size() * sizeof(DevOp), cudaMemcpyHostToDevice));
    // Memory channel handles as exec.rs uploads them (their semaphores on plain device words;
    // the one-hop ops never touch them).
    std::vector<BaseMemoryChannelDeviceHandle> ch(d.mem_chans + 1);
    for (u32 i = 0; i < d.mem_chans; i++) {
      ch[i].semaphore_.inboundToken = R.tokens + 2 * i;
      ch[i].semaphore_.expectedInboundToken = R.tokens + 2 * i + 1;
    }
    for (u32 i = 0; i < d.mem_chans; i++) ch[i].semaphore_.remoteInboundToken = S.r[1 - r].tokens + 2 * i;
    CK(cudaMemcpy(R.chans, ch.data(), ch.size() * sizeof(ch[0]), cudaMemcpyHostToDevice));
    u64* status_d;
    CK(cudaHostGetDevicePointer((void**)&status_d, R.status_h, 0));
    ExecArgs& A = R.args;
    memset(&A, 0, sizeof(A));
    A.input = (u64)R.in;
    A.output = (u64)R.out;
    A.scratch = (u64)R.scratch;
    A.scratch_half = d.scratch_half;
    A.ops = (u64)R.ops;
    A.ops_stride = dc->ops_stride;
    A.mem_chans = d.mem_chans ? (u64)R.chans : 0;
    A.port_chans = 0;
    A.state = (u64)R.state;
    A.barriers = (u64)R.state + d.barriers_off;
    A.sems = (u64)R.state + d.sems_off;
    A.err = (u64)status_d;
    A.abort = (u64)status_d + 8;
    A.timeout_ns = BK_TIMEOUT_NS;  // exec.rs: ExecutorConfig::timeout (30 s default)
    A.dtype = dc->dtype;
    A.flags = (u64)R.state + d.flags_off;
    R.args_wide = A;
    R.args_wide.ops = (u64)R.ops_wide;
    R.args_wide.ops_stride = GLOBAL_STRIDE;
    BArgs& M = R.model;
    M.in = (const uint2*)R.in;
    M.out = (uint2*)R.out;
    M.my_scratch = R.scratch;
    M.peer_scratch = S.r[1 - r].scratch;
    M.my_sig = R.sig;
    M.peer_sig = S.r[1 - r].sig;
    M.state = R.pairs;
    M.units = bytes / 8;
    M.chunk_units = bytes / 8 / dc->blocks;
    M.scratch_half = d.scratch_half;
    M.sig = 0x1234567890abcdefull;
    M.rank = r;
    M.blocks = dc->blocks;
  }
  return true;
}

// Fresh state for a variant: zeroed scratch and signatures, every flag 1, nothing failed.
static void reset(Setup& S) {
  CK(cudaDeviceSynchronize());
  for (int r = 0; r < 2; r++) {
    RankBufs& R = S.r[r];
    const DumpRank& d = S.dc->rank[r];
    CK(cudaMemset(R.scratch, 0, d.scratch_bytes));
    CK(cudaMemset(R.sig, 0, 32));
    std::vector<u32> pairs(2 * 64);
    for (int b = 0; b < 64; b++) pairs[2 * b] = 1;
    CK(cudaMemcpy(R.pairs, pairs.data(), pairs.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(R.state, d.state, d.state_words * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(R.tokens, 0, (d.mem_chans + 1) * 2 * 8));
    CK(cudaMemset(R.out, 0xff, S.dc->bytes));
    memset(R.status_h, 0, 64);
  }
  CK(cudaDeviceSynchronize());
}

// Waits for both streams at most `sec` seconds (every kernel wait is bounded, this is a backstop).
static bool wait_streams(Setup& S, double sec) {
  for (long i = 0; i < (long)(sec * 1e4); i++) {
    cudaError_t a = cudaStreamQuery(S.s[0]), b = cudaStreamQuery(S.s[1]);
    if (a != cudaErrorNotReady && b != cudaErrorNotReady) {
      CK(a);
      CK(b);
      return true;
    }
    struct timespec ts = {0, 100000};
    nanosleep(&ts, nullptr);
  }
  return false;
}

static bool check(Setup& S, const char* name) {
  if (!wait_streams(S, 5.0)) {
    fprintf(stderr, "%s: a call did not finish within 5 s; giving up\n", name);
    exit(3);
  }
  bool ok = true;
  for (int r = 0; r < 2; r++) {
    std::vector<unsigned short> got(S.dc->bytes / 2);
    CK(cudaMemcpy(got.data(), S.r[r].out, S.dc->bytes, cudaMemcpyDeviceToHost));
    u64 bad = 0, first = 0;
    for (u64 e = 0; e < got.size(); e++)
      if (got[e] != S.r[r].expect[e] && bad++ == 0) first = e;
    if (bad) {
      fprintf(stderr, "%s, %llu B, rank %d: %llu of %zu elements wrong (first at %llu: %#x, want %#x)\n", name,
              S.dc->bytes, r, bad, got.size(), first, got[first], S.r[r].expect[first]);
      ok = false;
    }
    if (S.r[r].status_h[0] != 0) {
      const u64 w = S.r[r].status_h[0];
      fprintf(stderr, "%s, rank %d: the kernel reported error kind %llu, peer %llu, block %llu, op %llu\n", name, r,
              (w >> 48) & 0x7fff, (w >> 32) & 0xffff, (w >> 16) & 0xffff, w & 0xffff);
      ok = false;
    }
  }
  return ok;
}

// Whether a wait gave up in any variant's state words (the model's pairs, ExecState.failed, the
// interpreter's error word).
static bool any_failed(Setup& S) {
  CK(cudaDeviceSynchronize());
  for (int r = 0; r < 2; r++) {
    std::vector<u32> pairs(2 * 64);
    ExecState st;
    CK(cudaMemcpy(pairs.data(), S.r[r].pairs, pairs.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&st, S.r[r].state, sizeof(st), cudaMemcpyDeviceToHost));
    for (int b = 0; b < 64; b++)
      if (pairs[2 * b + 1]) return true;
    if (st.failed || S.r[r].status_h[0] != 0) return true;
  }
  return false;
}

struct Variant {
  const char* name;
  int id;
};
enum {
  K_EMPTY,
  K_BUILTIN,
  K_PLAN_GRID,
  K_NO_SIG,
  K_OPS_GLOBAL,
  K_OPS_SHARED,
  K_TWO_OPS,
  K_GENERIC,
  K_INTERP,
  K_INTERP_GLOBAL,
  K_INTERP_PARAM,
  K_PER_PLAN_NOPF,
  K_PER_PLAN,
};
static const Variant variants[] = {
    {"empty", K_EMPTY},         {"builtin", K_BUILTIN},       {"plan-grid", K_PLAN_GRID},
    {"no-sig", K_NO_SIG},       {"ops-global", K_OPS_GLOBAL}, {"ops-shared", K_OPS_SHARED},
    {"two-ops", K_TWO_OPS},     {"generic", K_GENERIC},       {"interp", K_INTERP},
    {"interp-global", K_INTERP_GLOBAL}, {"interp-param", K_INTERP_PARAM}, {"per-plan-nopf", K_PER_PLAN_NOPF}, {"per-plan", K_PER_PLAN},
};
static const int n_variants = sizeof(variants) / sizeof(variants[0]);

#ifdef BK_PARAM_SLOTS
static ParamProgram g_param[2];
#endif

static const void* kernel_of(int id) {
  switch (id) {
    case K_EMPTY: return (const void*)k_empty;
    case K_BUILTIN: return (const void*)k_model<0>;
    case K_PLAN_GRID: return (const void*)k_model<1>;
    case K_NO_SIG: return (const void*)k_model<2>;
    case K_OPS_GLOBAL: return (const void*)k_ops<V_OPS_GLOBAL>;
    case K_OPS_SHARED: return (const void*)k_ops<V_OPS_SHARED>;
    case K_TWO_OPS: return (const void*)k_ops<V_TWO_OPS>;
    case K_GENERIC: return (const void*)k_ops<V_GENERIC>;
    case K_INTERP:
    case K_INTERP_GLOBAL: return (const void*)mscclpp_exec_ll16;
    case K_PER_PLAN_NOPF: return (const void*)bk_exec_plan_nopf;
    case K_PER_PLAN: return (const void*)mscclpp_exec_plan_ll16;
#ifdef BK_PARAM_SLOTS
    case K_INTERP_PARAM: return (const void*)bk_exec_param;
#endif
    default: return nullptr;
  }
}

// Enqueues one call of variant `id` for rank r; false if the variant cannot run here.
static bool launch(Setup& S, int id, int r, cudaStream_t st) {
  const DumpCase* dc = S.dc;
  RankBufs& R = S.r[r];
  const dim3 g(dc->blocks), t(dc->threads);
  switch (id) {
    case K_EMPTY: k_empty<<<g, t, 0, st>>>(); break;
    case K_BUILTIN: k_model<0><<<S.own_blocks, S.own_threads, 0, st>>>(R.model); break;
    case K_PLAN_GRID: k_model<1><<<g, t, 0, st>>>(R.model); break;
    case K_NO_SIG: k_model<2><<<g, t, 0, st>>>(R.model); break;
    case K_OPS_GLOBAL: k_ops<V_OPS_GLOBAL><<<g, t, 0, st>>>(R.args); break;
    case K_OPS_SHARED: k_ops<V_OPS_SHARED><<<g, t, 0, st>>>(R.args); break;
    case K_TWO_OPS: k_ops<V_TWO_OPS><<<g, t, 0, st>>>(R.args); break;
    case K_GENERIC: k_ops<V_GENERIC><<<g, t, 0, st>>>(R.args); break;
    case K_INTERP: mscclpp_exec_ll16<<<g, t, 0, st>>>(R.args); break;
    case K_INTERP_GLOBAL: mscclpp_exec_ll16<<<g, t, 0, st>>>(R.args_wide); break;
    case K_PER_PLAN_NOPF: bk_exec_plan_nopf<<<g, t, 0, st>>>(R.args); break;
    case K_PER_PLAN: mscclpp_exec_plan_ll16<<<g, t, 0, st>>>(R.args); break;
    case K_INTERP_PARAM:
#ifdef BK_PARAM_SLOTS
      if (dc->n_slots > BK_PARAM_SLOTS) return false;
      bk_exec_param<<<g, t, 0, st>>>(g_param[r]);
      break;
#else
      return false;
#endif
    default: return false;
  }
  return true;
}

// us per call of each variant at one size (negative: failed or not run).
static std::vector<float> run_case(const DumpCase* dc, cudaStream_t s[2]) {
  std::vector<float> us(n_variants, -1.0f);
  Setup S;
  if (!setup(S, dc, s)) return us;
#ifdef BK_PARAM_SLOTS
  for (int r = 0; r < 2; r++) {
    memset(&g_param[r], 0, sizeof(g_param[r]));
    g_param[r].a = S.r[r].args;
    for (u64 k = 0; k < dc->n_slots && k < BK_PARAM_SLOTS; k++) g_param[r].ops[k] = S.r[r].host_ops[k];
  }
#endif
  printf("# %s: %llu B, plan grid %u x %u, built-in grid %u x %u\n", dc->plan, dc->bytes, dc->blocks, dc->threads,
         S.own_blocks, S.own_threads);
  for (int v = 0; v < n_variants; v++) {
    const int id = variants[v].id;
    reset(S);
    bool ran = true;
    for (int r = 0; r < 2; r++) ran = ran && launch(S, id, r, s[r]);
    CK(cudaGetLastError());
    if (!ran) {
      printf("  %-14s SKIPPED (cannot run here)\n", variants[v].name);
      wait_streams(S, 5.0);
      continue;
    }
    const bool ok = id == K_EMPTY ? wait_streams(S, 5.0) : check(S, variants[v].name);
    printf("  %-14s %s\n", variants[v].name, ok ? "PASS" : "FAIL");
    fflush(stdout);
    if (!ok) continue;
    us[v] = graph_us_per_call(s, 200, 5, [&](int r, cudaStream_t st) { launch(S, id, r, st); });
    CK(cudaGetLastError());
    // The timed calls too must have worked: no wait of either rank gave up.
    if (any_failed(S)) us[v] = -2.0f;
  }
  reset(S);
  for (int r = 0; r < 2; r++) {
    RankBufs& R = S.r[r];
    for (void* p : {(void*)R.in, (void*)R.out, (void*)R.scratch, (void*)R.sig, (void*)R.pairs, (void*)R.state,
                    (void*)R.ops, (void*)R.ops_wide, (void*)R.chans, (void*)R.tokens})
      CK(cudaFree(p));
    CK(cudaFreeHost(R.status_h));
  }
  return us;
}

int main(int argc, char** argv) {
  const u64 want = argc > 1 ? strtoull(argv[1], nullptr, 0) : 0;
  const int n_cases = sizeof(dump_cases) / sizeof(dump_cases[0]);
  std::vector<const DumpCase*> cases;
  for (int i = 0; i < n_cases; i++)
    if (want == 0 || dump_cases[i].bytes == want) cases.push_back(&dump_cases[i]);
  if (cases.empty()) {
    fprintf(stderr, "no dumped program for %llu bytes; sizes:", want);
    for (int i = 0; i < n_cases; i++) fprintf(stderr, " %llu", dump_cases[i].bytes);
    fprintf(stderr, " (more: CASES in examples/dump_breakdown_inputs.rs)\n");
    return 2;
  }
  CK(cudaSetDevice(0));
  cudaStream_t s[2];
  for (int r = 0; r < 2; r++) CK(cudaStreamCreateWithFlags(&s[r], cudaStreamNonBlocking));
  printf("# kernels (registers, local bytes per thread, static shared bytes):");
  for (int v = 0; v < n_variants; v++) {
    cudaFuncAttributes fa;
    const void* k = kernel_of(variants[v].id);
    if (k && cudaFuncGetAttributes(&fa, k) == cudaSuccess)
      printf("%s %s %d/%zu/%zu", v ? "," : "", variants[v].name, fa.numRegs, fa.localSizeBytes, fa.sharedSizeBytes);
  }
  printf("\n");
  std::vector<std::vector<float>> res;
  for (const DumpCase* dc : cases) res.push_back(run_case(dc, s));
  printf("\n# exec breakdown: one-hop AllReduce, bf16, 2 ranks (streams) on one GPU, 200 calls per graph, best of 5;\n");
  printf("# us per call (FAIL: wrong result, not timed; ERR: a timed call reported a failed wait)\n");
  printf("%-14s", "variant");
  for (const DumpCase* dc : cases) printf(" %9lluB", dc->bytes);
  printf("\n");
  for (int v = 0; v < n_variants; v++) {
    printf("%-14s", variants[v].name);
    for (auto& r : res) {
      if (r[v] >= 0) printf(" %10.2f", r[v]);
      else printf(" %10s", r[v] == -2.0f ? "ERR" : "FAIL");
    }
    printf("\n");
  }
  return 0;
}

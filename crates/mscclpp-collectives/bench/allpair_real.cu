// The library's own `allreduce_allpair_bf16` kernel (the generated source, compiled by nvcc)
// timed in the harness of allpair_breakdown.cu: two ranks as two streams of one process on one
// GPU, 200 calls in one CUDA graph per rank, best of 5, the slower rank. Comparing it with the
// breakdown's `+sig` variant separates what the kernel costs from what mscclpp-perf's harness
// adds.
//
//   cargo run -p mscclpp-collectives --example kernel_source > collectives_generated.cu
//   nvcc -O3 -arch=sm_90 -I crates/mscclpp/include -include collectives_generated.cu \
//        -o allpair_real crates/mscclpp-collectives/bench/allpair_real.cu && ./allpair_real [bytes] [threads]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#include "bench_pieces.cuh"
#include "graph_timing.cuh"


// Variants built from the library's own pieces, to find what the real kernel costs over the
// breakdown's `lazy+sig@d` model:
//   L0 addressing: the model's body on the library's addressing (scratch_of, pkt_slot,
//      sig_pkt_from, LL16Packet, wrap_rank), its plain bf16 add, its own spin loop
//   L1 +waits: L0 with the library's read_pkt / read_pkt_and_sig (bounded, with the peek)
//   L2 +reduce: L1 with the library's Acc<BF16, 2>, ld8 and st8
//   L3 +prologue/epilogue: L2 with pkt_begin / pkt_end (the library's allpair but for its loop
//      shape)
//   L1 +Acc only / +ld8/st8 only: L2's two halves apart
//   L0 host addresses: L0 with every packet address computed on the host (no dependent
//      argument loads before the first packet leaves)

// ACC / LD: the library's Acc reduce / its ld8+st8 (default: both from L2 on), to split L2's cost.
template <int L, int ACC = (L >= 2), int LD = (L >= 2)>
__device__ __forceinline__ void lib_body(const CollArgs& a) {
  u32 flag;
  u64 deadline = 0;
  CollState* st = (CollState*)a.state;
  if (L >= 3) {
    if (!pkt_begin(a, flag, deadline)) return;
  } else {
    uint2 ff;
    detail::ld_volatile_v2_u32(st, ff.x, ff.y);
    if (ff.y) return;
    flag = ff.x;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      const u32 R = (u32)a.nranks, me = (u32)a.rank;
      for (u32 k = 1; k < R; k++)
        ((LL16Packet*)(scratch_of(a, wrap_rank(me + k, R)) + a.sig_pkt_off) + (flag & 1) * R + me)->write(a.sig, flag);
    }
  }
  const u32 half = flag & 1, R = (u32)a.nranks, me = (u32)a.rank;
  const u64 units = (a.nbytes + 7) / 8;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
  bool ok = true;
  for (u64 i = tid; i < units && ok; i += nth) {
    uint2 v;
    if (LD) v = ld8((const char*)a.in + i * 8, unit_bytes(i, a.nbytes));
    else v = ((const uint2*)a.in)[i];
    for (u32 k = 1; k < R; k++) pkt_slot(a, wrap_rank(me + k, R), half, me, units)[i].write(v, flag);
    Acc<BF16, 2> acc;
    uint2 sum = v;
    if (ACC) acc.init((const u32*)&v);
    for (u32 k = 1; k < R && ok; k++) {
      const u32 p = wrap_rank(me + R - k, R);
      const LL16Packet* src = pkt_slot(a, me, half, p, units) + i;
      uint2 w;
      if (L >= 1) {
        ok = i == 0 ? read_pkt_and_sig(a, src, flag, deadline, p, w) : read_pkt(a, src, flag, deadline, p, w);
      } else {
        bool sig_ok = i != 0;
        while (true) {
          const bool d = !src->readOnce(flag, w);
          if (!sig_ok) {
            uint2 sv;
            sig_ok = !sig_pkt_from(a, flag, p)->readOnce(flag, sv);
          }
          if (d && sig_ok) break;
        }
      }
      if (ACC) acc.add((const u32*)&w, (int)a.op, a.acc32 != 0);
      else sum = bench_add_bf16x4(sum, w);
    }
    if (ACC) acc.finish((u32*)&sum, (int)a.op, a.nranks);
    if (LD) st8((char*)a.out + i * 8, sum, unit_bytes(i, a.nbytes));
    else ((uint2*)a.out)[i] = sum;
  }
  if (L >= 3) {
    pkt_end(a, flag, deadline, tid == 0 && ok && units > 0);
  } else {
    __syncthreads();
    if (threadIdx.x == 0) st->flag = flag + 1;
  }
}
extern "C" __global__ void lib0(const __grid_constant__ CollArgs a) { lib_body<0>(a); }
extern "C" __global__ void lib1(const __grid_constant__ CollArgs a) { lib_body<1>(a); }
extern "C" __global__ void lib2(const __grid_constant__ CollArgs a) { lib_body<2>(a); }
extern "C" __global__ void lib3(const __grid_constant__ CollArgs a) { lib_body<3>(a); }
extern "C" __global__ void lib1acc(const __grid_constant__ CollArgs a) { lib_body<1, 1, 0>(a); }
extern "C" __global__ void lib1ld(const __grid_constant__ CollArgs a) { lib_body<1, 0, 1>(a); }

// L0 with the packet addresses computed on the host (per half: where my packets go in the peer's
// scratch, where the peer's arrive in mine; 2 ranks): no dependent argument loads (rank ->
// peer -> scratch[peer]) before the first packet leaves. Does the library's addressing cost
// what L0 shows over the breakdown's model?
struct Rot {
  u64 peer_pkts[2], my_pkts[2], peer_sig[2], my_sig[2];
};
extern "C" __global__ void lib0_rot(const __grid_constant__ CollArgs a, const __grid_constant__ Rot r) {
  CollState* st = (CollState*)a.state;
  uint2 ff;
  detail::ld_volatile_v2_u32(st, ff.x, ff.y);
  if (ff.y) return;
  const u32 flag = ff.x, half = flag & 1;
  if (blockIdx.x == 0 && threadIdx.x == 0) ((LL16Packet*)r.peer_sig[half])->write(a.sig, flag);
  const u64 units = (a.nbytes + 7) / 8;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
  for (u64 i = tid; i < units; i += nth) {
    const uint2 v = ((const uint2*)a.in)[i];
    ((LL16Packet*)r.peer_pkts[half])[i].write(v, flag);
    uint2 w;
    bool sig_ok = i != 0;
    while (true) {
      const bool d = !((const LL16Packet*)r.my_pkts[half])[i].readOnce(flag, w);
      if (!sig_ok) {
        uint2 sv;
        sig_ok = !((const LL16Packet*)r.my_sig[half])->readOnce(flag, sv);
      }
      if (d && sig_ok) break;
    }
    ((uint2*)a.out)[i] = bench_add_bf16x4(v, w);
  }
  __syncthreads();
  if (threadIdx.x == 0) st->flag = flag + 1;
}

// Programmatic dependent launch (sm_90): the kernel waits for the one before it to finish and
// flush (wait) before touching anything it wrote (the state word, scratch, the output), then lets
// the next kernel of its stream be scheduled (launch_dependents; after the wait, so a rank has at
// most two kernels on the GPU). Launched with the programmatic-stream-serialization attribute, a
// kernel's launch and block scheduling overlap its predecessor; without the attribute the two
// instructions change nothing. (The library's entries do this themselves, `pdl_enter`, when
// CollArgs.pdl is set.)
extern "C" __global__ void __launch_bounds__(512) real_pdl(const __grid_constant__ CollArgs a) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  allreduce_allpair<BF16>(a);
}
// The same with the trigger after the work (the next kernel starts only as this one ends).
extern "C" __global__ void __launch_bounds__(512) real_pdl_late(const __grid_constant__ CollArgs a) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  allreduce_allpair<BF16>(a);
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
extern "C" __global__ void empty_plain(const __grid_constant__ CollArgs a) {}
extern "C" __global__ void empty_pdl(const __grid_constant__ CollArgs a) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

static void launch_ex(void (*k)(CollArgs), bool pdl, unsigned blocks, unsigned threads, cudaStream_t st, CollArgs& a) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.stream = st;
  cudaLaunchAttribute at[1] = {};
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, k, a));
}

typedef void (*CollKern)(CollArgs);

int main(int argc, char** argv) {
  const unsigned long long bytes = argc > 1 ? strtoull(argv[1], nullptr, 0) : 1024;
  const unsigned units = (unsigned)((bytes + 7) / 8);
  unsigned threads = argc > 2 ? (unsigned)atoi(argv[2]) : (units <= 256 ? ((units + 31) / 32 * 32 < 64 ? 64 : (units + 31) / 32 * 32) : 512);
  unsigned blocks = (units + threads - 1) / threads;
  if (blocks > 32) blocks = 32;
  const int calls = 200, reps = 5;
  const unsigned long long pkt_off = 4096, pkt_half = 2ull * units * 16 + 4096;
  const unsigned long long scratch_bytes = pkt_off + 2 * pkt_half;
  CK(cudaSetDevice(0));
  CollArgs a[2];
  cudaStream_t s[2];
  void* scratch[2];
  for (int r = 0; r < 2; r++) {
    memset(&a[r], 0, sizeof(CollArgs));
    CK(cudaStreamCreateWithFlags(&s[r], cudaStreamNonBlocking));
    void *in, *out, *state, *err;
    CK(cudaMalloc(&in, bytes));
    CK(cudaMemset(in, 0x3f, bytes));
    CK(cudaMalloc(&out, bytes));
    CK(cudaMalloc(&scratch[r], scratch_bytes));
    CK(cudaMemset(scratch[r], 0, scratch_bytes));
    CK(cudaMalloc(&state, 16));
    unsigned init[4] = {1, 0, 0, 0};
    CK(cudaMemcpy(state, init, 16, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&err, 16));
    CK(cudaMemset(err, 0, 16));
    a[r].in = (unsigned long long)in;
    a[r].out = (unsigned long long)out;
    a[r].nbytes = bytes;
    a[r].state = (unsigned long long)state;
    a[r].err = (unsigned long long)err;
    a[r].abort = (unsigned long long)err + 8;
    a[r].timeout_ns = 10000000000ull;
    a[r].rank = r;
    a[r].nranks = 2;
    a[r].sig = 0x1234;
    a[r].op = 0;
    a[r].pkt_off = pkt_off;
    a[r].pkt_half = pkt_half;
    a[r].sig_pkt_off = 0;
  }
  for (int r = 0; r < 2; r++)
    for (int p = 0; p < 2; p++) a[r].scratch[p] = (unsigned long long)scratch[p];
  printf("# allreduce_allpair_bf16 (the library's kernel, nvcc): %llu B, 2 ranks (streams), %u block(s) x %u threads, %d calls per graph, best of %d\n",
         bytes, blocks, threads, calls, reps);
  struct V {
    const char* name;
    CollKern k;
  } vs[] = {{"L0 addressing", (CollKern)lib0}, {"L1 +waits", (CollKern)lib1},
            {"L1 +Acc only", (CollKern)lib1acc}, {"L1 +ld8/st8 only", (CollKern)lib1ld},
            {"L2 +reduce", (CollKern)lib2}, {"L3 +pro/epi", (CollKern)lib3},
            {"real", (CollKern)allreduce_allpair_bf16}};
  for (auto& v : vs) {
    const float us = graph_us_per_call(s, calls, reps, [&](int r, cudaStream_t st) { v.k<<<blocks, threads, 0, st>>>(a[r]); });
    printf("%-22s %8.2f us/call\n", v.name, us);
  }
  {
    // L0 with host-computed packet addresses (2 ranks).
    Rot rot[2];
    for (int r = 0; r < 2; r++) {
      const int p = 1 - r;
      for (int h = 0; h < 2; h++) {
        rot[r].peer_pkts[h] = a[r].scratch[p] + pkt_off + h * pkt_half + (unsigned long long)r * units * 16;
        rot[r].my_pkts[h] = a[r].scratch[r] + pkt_off + h * pkt_half + (unsigned long long)p * units * 16;
        rot[r].peer_sig[h] = a[r].scratch[p] + (unsigned long long)(h * 2 + r) * 16;
        rot[r].my_sig[h] = a[r].scratch[r] + (unsigned long long)(h * 2 + p) * 16;
      }
    }
    const float us =
        graph_us_per_call(s, calls, reps, [&](int r, cudaStream_t st) { lib0_rot<<<blocks, threads, 0, st>>>(a[r], rot[r]); });
    printf("%-22s %8.2f us/call\n", "L0 host addresses", us);
  }
  {
    // Programmatic dependent launch: the empty kernel and the library's kernel, plain and PDL.
    struct P {
      const char* name;
      CollKern k;
      bool pdl;
    } ps[] = {{"empty", (CollKern)empty_plain, false},     {"empty pdl", (CollKern)empty_pdl, true},
              {"real (Ex)", (CollKern)allreduce_allpair_bf16, false}, {"real+pdl insns", (CollKern)real_pdl, false},
              {"real pdl", (CollKern)real_pdl, true},        {"real pdl late", (CollKern)real_pdl_late, true}};
    CollArgs ap[2] = {a[0], a[1]};
    for (int r = 0; r < 2; r++) ap[r].pdl = 1;  // the library's own entry, as comm.rs launches it
    for (int round = 0; round < 2; round++) {
      for (auto& v : ps) {
        const float us = graph_us_per_call(s, calls, reps, [&](int r, cudaStream_t st) { launch_ex(v.k, v.pdl, blocks, threads, st, a[r]); });
        printf("%-22s %8.2f us/call\n", v.name, us);
      }
      const float us = graph_us_per_call(s, calls, reps, [&](int r, cudaStream_t st) {
        launch_ex((CollKern)allreduce_allpair_bf16, true, blocks, threads, st, ap[r]);
      });
      printf("%-22s %8.2f us/call\n", "library pdl (a.pdl=1)", us);
    }
  }
  unsigned long long ew[2];
  for (int r = 0; r < 2; r++) {
    CK(cudaMemcpy(&ew[r], (void*)a[r].err, 8, cudaMemcpyDeviceToHost));
  }
  printf("error words %llx %llx\n", ew[0], ew[1]);
  return 0;
}

// Where the time of a small AllReduce goes: the one-hop LL exchange of `allpair` between two
// ranks on one GPU (two streams of one process), built up a piece at a time, each variant timed
// as 200 calls captured in one CUDA graph (per call: GPU time of the graph / 200, the slower rank).
//
//   nvcc -O3 -arch=sm_90 -o allpair_breakdown allpair_breakdown.cu && ./allpair_breakdown [bytes]
//
// Variants (each adds one piece to the one before, except `old sig`):
//   empty        a kernel that does nothing: the floor of a graph node
//   bare         the exchange alone: flag from device state, packets out, poll, reduce, flag++
//   +deadline    every thread reads %globaltimer once; waits check it every 256 spins
//   +sig         block 0 thread 0 writes a signature packet to the peer at the start and
//                checks the peer's at the end
//   old sig      the signature written and checked before the data (the kernels before)
//   lazy dl      `+deadline`, the clock started at a thread's first wait of 256 spins
//   lazy+sig@d   `lazy dl`, the signature polled together with thread 0's first data packet
//                (what mscclpp-collectives does now)
//   +16K cold    `lazy+sig@d` with ~16 KiB of code inside its spin loop that never runs
//   688B args    `lazy+sig@d` with its arguments padded to the library's 688 bytes
// Not part of the library or its tests: a measurement tool (docs/performance.md).
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>

#include "bench_pieces.cuh"
#include "graph_timing.cuh"


typedef unsigned int u32;
typedef unsigned long long u64;

struct Args {
  const uint2* in;
  uint2* out;
  uint4* peer_pkts;  // the peer's packet area [2][units]
  uint4* my_pkts;    // mine
  uint4* peer_sig;   // the peer's signature slots [2]
  uint4* my_sig;
  u32* state;        // [flag, failed]
  u64 units;
  u64 sig;
};

__global__ void k_empty(Args) {}

// About 16 KiB of code that never runs (a branch no call takes), placed inside the spin loop:
// does the size of a kernel's cold code cost a small call (instruction fetch)?
__device__ __forceinline__ void cold_code(const Args& a, uint2 y, u32 salt) {
  float x = __uint_as_float(y.x ^ salt);
#pragma unroll
  for (int i = 0; i < 700; i++) x = x * 1.0001f + __uint_as_float(salt + i);
  a.out[salt & 7] = make_uint2(__float_as_uint(x), salt);
}

// DL: 0 no deadline, 1 read at kernel start, 2 started at a thread's first wait of 256 spins.
// SIG: 0 none, 1 checked at the end, 2 checked before the data, 3 polled with the first data.
template <int DL, int SIG, bool COLD = false>
__device__ __forceinline__ void allpair_body(const Args& a) {
  u64 deadline = 0;
  if (DL == 1) deadline = bench_now() + 10000000000ull;
  volatile u32* st = a.state;
  const u32 flag = st[0];
  if (DL && st[1]) return;
  const u32 half = flag & 1;
  const bool t0 = blockIdx.x == 0 && threadIdx.x == 0;
  if (SIG != 0 && t0) bench_pkt_write(a.peer_sig + half, make_uint2((u32)a.sig, (u32)(a.sig >> 32)), flag);
  auto expired = [&](u32& spins) {
    if (!DL || (++spins & 255) != 0) return false;
    const u64 now = bench_now();
    if (DL == 2 && deadline == 0) {
      deadline = now + 10000000000ull;
      return false;
    }
    return now > deadline;
  };
  if (SIG == 2 && t0) {
    uint2 v;
    u32 spins = 0;
    while (!bench_pkt_read(a.my_sig + half, flag, v) && !expired(spins)) {
    }
  }
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
  for (u64 i = tid; i < a.units; i += nth) {
    uint2 x = a.in[i];
    bench_pkt_write(a.peer_pkts + half * a.units + i, x, flag);
    uint2 y;
    u32 spins = 0;
    bool sig_ok = !(SIG == 3 && i == 0);
    while (true) {
      const bool d = bench_pkt_read(a.my_pkts + half * a.units + i, flag, y);
      if (!sig_ok) {
        uint2 sv;
        sig_ok = bench_pkt_read(a.my_sig + half, flag, sv);
      }
      if (d && sig_ok) break;
      if (COLD && spins == 0x7ffffffdu) cold_code(a, y, spins);
      if (expired(spins)) {
        st[1] = 1;
        break;
      }
    }
    a.out[i] = bench_add_bf16x4(x, y);
  }
  if (SIG == 1 && t0) {
    uint2 v;
    u32 spins = 0;
    while (!bench_pkt_read(a.my_sig + half, flag, v) && !expired(spins)) {
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) st[0] = flag + 1;
}

template <int DL, int SIG>
__global__ void k_allpair(Args a) {
  allpair_body<DL, SIG>(a);
}

// The same arguments padded to the library's 688-byte argument block (its inline peer table):
// does the size of a kernel's parameters cost launch time inside a graph?
struct BigArgs {
  Args a;
  u64 pad[(688 - sizeof(Args)) / 8];
};
__global__ void k_big(BigArgs b) { allpair_body<2, 3>(b.a); }
__global__ void k_cold(Args a) { allpair_body<2, 3, true>(a); }

typedef void (*Kern)(Args);

int main(int argc, char** argv) {
  const u64 bytes = argc > 1 ? strtoull(argv[1], nullptr, 0) : 1024;
  const u64 units = (bytes + 7) / 8;
  const int calls = 200, reps = 5;
  const u32 threads = units <= 256 ? (u32)((units + 31) / 32 * 32 < 64 ? 64 : (units + 31) / 32 * 32) : 512;
  const u32 blocks = (u32)((units + threads - 1) / threads > 32 ? 32 : (units + threads - 1) / threads);
  CK(cudaSetDevice(0));
  Args a[2];
  cudaStream_t s[2];
  for (int r = 0; r < 2; r++) {
    CK(cudaStreamCreateWithFlags(&s[r], cudaStreamNonBlocking));
    void *in, *out, *pk, *sg, *stt;
    CK(cudaMalloc(&in, units * 8));
    CK(cudaMemset(in, 0x3f, units * 8));
    CK(cudaMalloc(&out, units * 8));
    CK(cudaMalloc(&pk, 2 * units * 16));
    CK(cudaMemset(pk, 0, 2 * units * 16));
    CK(cudaMalloc(&sg, 2 * 16));
    CK(cudaMemset(sg, 0, 2 * 16));
    CK(cudaMalloc(&stt, 8));
    u32 init[2] = {1, 0};
    CK(cudaMemcpy(stt, init, 8, cudaMemcpyHostToDevice));
    a[r].in = (const uint2*)in;
    a[r].out = (uint2*)out;
    a[r].my_pkts = (uint4*)pk;
    a[r].my_sig = (uint4*)sg;
    a[r].state = (u32*)stt;
    a[r].units = units;
    a[r].sig = 0x1234567890abcdefull;
  }
  for (int r = 0; r < 2; r++) {
    a[r].peer_pkts = a[1 - r].my_pkts;
    a[r].peer_sig = a[1 - r].my_sig;
  }
  struct V {
    const char* name;
    Kern k;
  } vs[] = {
      {"empty", k_empty},
      {"bare", k_allpair<0, 0>},
      {"+deadline", k_allpair<1, 0>},
      {"+sig", k_allpair<1, 1>},
      {"old sig", k_allpair<1, 2>},
      {"lazy dl", k_allpair<2, 0>},
      {"lazy+sig@d", k_allpair<2, 3>},
      {"+16K cold", k_cold},
  };
  printf("# allpair breakdown: %llu B bf16, 2 ranks (streams) on one GPU, %u block(s) x %u threads, %d calls per graph, best of %d\n",
         bytes, blocks, threads, calls, reps);
  printf("%-10s %10s\n", "variant", "us/call");
  for (auto& v : vs) {
    const float us = graph_us_per_call(s, calls, reps, [&](int r, cudaStream_t st) { v.k<<<blocks, threads, 0, st>>>(a[r]); });
    printf("%-10s %10.2f\n", v.name, us);
  }
  {
    BigArgs b[2];
    memset(b, 0, sizeof(b));
    for (int r = 0; r < 2; r++) b[r].a = a[r];
    const float us = graph_us_per_call(s, calls, reps, [&](int r, cudaStream_t st) { k_big<<<blocks, threads, 0, st>>>(b[r]); });
    printf("%-10s %10.2f\n", "688B args", us);
  }
  return 0;
}

// Device pieces the bench tools' model kernels share (allpair_breakdown.cu, allpair_real.cu,
// crates/mscclpp-executor/bench/exec_breakdown.cu): an LL16 packet's store and poll, the global
// timer, and a bf16 x 4 sum. Not part of the library.
#pragma once
#include <cuda_runtime.h>

// An LL16 packet: two data words, each followed by the flag.
__device__ __forceinline__ void bench_pkt_write(void* p, uint2 v, unsigned f) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(f), "r"(v.y), "r"(f));
}
// One look at a packet: true (and its data in `v`) once both flags equal `f`.
__device__ __forceinline__ bool bench_pkt_read(const void* p, unsigned f, uint2& v) {
  unsigned a, b, c, d;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
  v = make_uint2(a, c);
  return b == f && d == f;
}
__device__ __forceinline__ unsigned long long bench_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// bf16 x 4 sum, truncating (the benches' checks use values whose sums are exact).
__device__ __forceinline__ uint2 bench_add_bf16x4(uint2 a, uint2 b) {
  uint2 r;
  unsigned* pa = (unsigned*)&a;
  unsigned* pb = (unsigned*)&b;
  unsigned* pr = (unsigned*)&r;
  for (int i = 0; i < 2; i++) {
    float lo = __uint_as_float(pa[i] << 16) + __uint_as_float(pb[i] << 16);
    float hi = __uint_as_float(pa[i] & 0xffff0000u) + __uint_as_float(pb[i] & 0xffff0000u);
    pr[i] = (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
  }
  return r;
}

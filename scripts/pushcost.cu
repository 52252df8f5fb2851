// What one FIFO push costs a lone GPU thread, part by part (issue 25, one producer): where the
// 16-byte trigger lives (pinned host memory, as the FIFO has it, or device memory, as a FIFO read
// through GDRCopy could have it) and which ordering precedes its store. Each iteration stores 8
// bytes of "payload" to device memory first, as a put's data would be written.
//
// Run on the GPU machine (it has nvcc; not part of the build):
//   nvcc -O2 -arch=sm_90 -o /tmp/pushcost scripts/pushcost.cu && /tmp/pushcost
// Session 28 (H100, docs/performance.md): the system-scope release costs ~0.7 us wherever the
// trigger lives, the atomic on head ~0.17 us, an unordered store 0.05 us.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.global.release.sys.v2.u64 [%0], {%1,%2};" :: "l"(p), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.global.relaxed.sys.v2.u64 [%0], {%1,%2};" :: "l"(p), "l"(a), "l"(b) : "memory");
}
// mode: bit0 atomic on head, bits1-3 fence/store kind, data write before each push always.
__global__ void k(int mode, uint64_t* trig, unsigned long long* head, uint64_t* data, int n, unsigned long long* ns) {
  unsigned long long t0; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (int i = 0; i < n; i++) {
    data[i & 1023] = i;                       // the payload a put would carry
    uint64_t slot = i;
    if (mode & 1) slot = atomicAdd(head, 1ULL);
    uint64_t* p = trig + 2 * (slot & 511);
    switch (mode >> 1) {
      case 0: st_release_sys(p, i, i | (1ULL << 63)); break;            // what push does
      case 1: asm volatile("fence.acq_rel.gpu;" ::: "memory"); st_relaxed_sys(p, i, i | (1ULL << 63)); break;
      case 2: st_relaxed_sys(p, i, i | (1ULL << 63)); break;            // no ordering at all
      case 3: asm volatile("fence.sc.sys;" ::: "memory"); st_relaxed_sys(p, i, i | (1ULL << 63)); break;
    }
  }
  unsigned long long t1; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  *ns = t1 - t0;
}
int main() {
  uint64_t *host, *dev, *data; unsigned long long *head, *ns;
  CK(cudaHostAlloc(&host, 512 * 16, cudaHostAllocMapped));
  CK(cudaMalloc(&dev, 512 * 16)); CK(cudaMalloc(&data, 8192)); CK(cudaMalloc(&head, 8)); CK(cudaMallocManaged(&ns, 8));
  uint64_t* hostd; CK(cudaHostGetDevicePointer(&hostd, host, 0));
  const char* fence[4] = {"st.release.sys", "fence.acq_rel.gpu + st.relaxed.sys", "st.relaxed.sys (unordered)", "fence.sc.sys + st.relaxed.sys"};
  const int n = 200000;
  for (int where = 0; where < 2; where++)
    for (int f = 0; f < 4; f++)
      for (int atom = 1; atom >= 0; atom--) {
        int mode = (f << 1) | atom;
        double best = 1e30;
        for (int r = 0; r < 3; r++) {
          k<<<1, 1>>>(mode, where ? dev : hostd, head, data, n, ns);
          CK(cudaDeviceSynchronize());
          best = best < *ns ? best : (double)*ns;
        }
        printf("push parts, 1 thread, trigger in %-6s: %-36s %-10s %7.1f ns/push\n", where ? "device" : "host", fence[f],
               atom ? "+ atomic" : "no atomic", best / n);
      }
  return 0;
}

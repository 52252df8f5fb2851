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

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e = (x);                                                                 \
    if (e != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

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
  cudaGraphExec_t ge[2];
  for (int r = 0; r < 2; r++) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s[r], cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; i++) allreduce_allpair_bf16<<<blocks, threads, 0, s[r]>>>(a[r]);
    CK(cudaStreamEndCapture(s[r], &g));
    CK(cudaGraphInstantiate(&ge[r], g, 0));
    CK(cudaGraphDestroy(g));
  }
  float best = 1e30f;
  for (int rep = 0; rep < reps + 1; rep++) {
    cudaEvent_t e0[2], e1[2];
    for (int r = 0; r < 2; r++) {
      CK(cudaEventCreate(&e0[r]));
      CK(cudaEventCreate(&e1[r]));
      CK(cudaEventRecord(e0[r], s[r]));
      CK(cudaGraphLaunch(ge[r], s[r]));
      CK(cudaEventRecord(e1[r], s[r]));
    }
    float worst = 0;
    for (int r = 0; r < 2; r++) {
      CK(cudaEventSynchronize(e1[r]));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0[r], e1[r]));
      if (ms > worst) worst = ms;
    }
    if (rep > 0 && worst < best) best = worst;
  }
  unsigned long long ew[2];
  for (int r = 0; r < 2; r++) {
    CK(cudaMemcpy(&ew[r], (void*)a[r].err, 8, cudaMemcpyDeviceToHost));
  }
  printf("real       %10.2f us/call (error words %llx %llx)\n", best * 1e3f / calls, ew[0], ew[1]);
  return 0;
}

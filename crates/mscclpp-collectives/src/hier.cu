// Two-level collectives (mscclpp-collectives::hier): AllReduce and AllGather over nodes of
// `nlocal` consecutive ranks. Inside a node, ranks read each other's scratch through
// MemoryChannels (CUDA IPC mappings) and meet at barriers on the channels' semaphores; between
// nodes, rank (n, l) exchanges with ranks (n', l) through PortChannels (a proxy thread moves the
// bytes over CUDA IPC, Ethernet or IB). The steps are those of `hier::schedule` (see there for
// the phases and the scratch layout); `struct HierArgs` is generated from the Rust definition.
//
// Every wait is bounded: `timeout_ns` per wait (a node peer's semaphore, a cross peer's
// semaphore, a full FIFO, a grid barrier). A failed wait records (kind, peer) in the error word
// (page-locked host memory) and sets state->failed; every block of the grid leaves at the next
// grid barrier, and later launches return at once.
//
// Only block 0 waits for peers (one thread per peer); all blocks meet at grid barriers around
// those waits, so all blocks of a launch must be resident at once (the host caps the grid).
//
// Each call's signature (`a.sig`) is compared with every node peer's at the call's first node
// barrier (send_sig / check_sigs) and with every cross peer's in the call's first inter-node
// exchange, where it rides after the data of the put (inter_exchange); a peer that made another
// call fails both ranks with HERR_MISMATCH naming the other, before the output is written.

using namespace mscclpp;

#define HERR_TIMEOUT 1ull
#define HERR_PROXY 2ull
#define HERR_ABORTED 3ull
#define HERR_FAILED_BEFORE 4ull
#define HERR_GRID 5ull
#define HERR_MISMATCH 6ull

#define HOP_SUM 0
#define HOP_PROD 1
#define HOP_MIN 2
#define HOP_MAX 3
#define HOP_AVG 4

#define HMAX_GROUP 64

struct HierState {
  u32 count;     // grid barrier arrivals
  u32 gen;       // grid barrier generation
  u32 failed;    // nonzero once any wait of this rank failed
  u32 pad;
  u64 exchanges; // inter-node exchanges so far (the parity of the exchange slots)
};

__device__ __forceinline__ u32 hvol(const u32* p) { return *(volatile const u32*)p; }
__device__ __forceinline__ void hstore_sys(u64* p, u64 v) { asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ u64 hload_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Records this rank's first error (host-visible) and marks the rank failed.
__device__ void hfail(const HierArgs& a, u64 kind, u64 peer) {
  HierState* st = (HierState*)a.state;
  atomicExch(&st->failed, 1u);
  u64* err = (u64*)a.err;
  if (hload_sys(err) == 0) hstore_sys(err, (1ull << 63) | (kind << 48) | ((peer & 0xffff) << 32));
  __threadfence_system();
}

// A wait's periodic check: aborted by the host, or older than the timeout.
__device__ __forceinline__ bool hmust_stop(const HierArgs& a, u64 start, u32 peer, u32& spins) {
  if ((++spins & 255) != 0) return false;
  if ((spins & 0xffff) == 0 && hload_sys((const u64*)a.abort) != 0) {
    hfail(a, HERR_ABORTED, peer);
    return true;
  }
  if (detail::globaltimer() - start > a.timeout_ns) {
    hfail(a, HERR_TIMEOUT, peer);
    return true;
  }
  return false;
}

// Grid barrier: every block calls it; false (in every block) once this rank has failed.
__device__ bool grid_sync(const HierArgs& a) {
  HierState* st = (HierState*)a.state;
  __shared__ int failed;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    if (gridDim.x > 1) {
      const u32 gen = atomicAdd(&st->gen, 0u);
      __threadfence();
      if (atomicAdd(&st->count, 1u) == gridDim.x - 1) {
        atomicExch(&st->count, 0u);
        __threadfence();
        atomicAdd(&st->gen, 1u);
      } else {
        const u64 start = detail::globaltimer();
        u32 spins = 0;
        // Block 0 may be in a peer wait (a push and a signal wait, each up to the timeout):
        // wait longer than that; leave at once when the rank failed.
        while (hvol(&st->gen) == gen) {
          if ((++spins & 1023) == 0) {
            if (hvol(&st->failed)) break;
            if (detail::globaltimer() - start > 4 * a.timeout_ns) {
              hfail(a, HERR_GRID, a.rank);
              break;
            }
          }
        }
      }
      __threadfence_system();
    }
    failed = hvol(&st->failed);
  }
  __syncthreads();
  return failed == 0;
}

__device__ __forceinline__ MemoryChannelDeviceHandle* mem_ch(const HierArgs& a, u32 l) {
  return (MemoryChannelDeviceHandle*)a.mem + l;
}
__device__ __forceinline__ PortChannelDeviceHandle* port_ch(const HierArgs& a, u32 n) {
  return (PortChannelDeviceHandle*)a.port + n;
}
// Scratch of local rank l of this node (mine, or a node peer's mapped here).
__device__ __forceinline__ char* scratch_of(const HierArgs& a, u32 l) {
  return l == a.local ? (char*)a.scratch : (char*)mem_ch(a, l)->dst_;
}

// Barrier with every node peer: a grid barrier, one signal to and one bounded wait for each
// node peer (block 0, one thread per peer), a grid barrier.
__device__ bool node_barrier(const HierArgs& a) {
  if (!grid_sync(a)) return false;
  if (blockIdx.x == 0 && a.nlocal > 1) {
    const u32 t = threadIdx.x;
    if (t < a.nlocal && t != a.local) {
      MemoryChannelDeviceHandle* ch = mem_ch(a, t);
      __threadfence_system();
      ch->signal();
      const u64 start = detail::globaltimer();
      u32 spins = 0;
      while (!ch->poll()) {
        if (hmust_stop(a, start, (u32)(a.node * a.nlocal + t), spins)) break;
      }
    }
  }
  return grid_sync(a);
}

// This call's signature into every node peer's slot for this rank, by the thread that signals
// that peer in the next node barrier (its fence and signal order the store before it).
__device__ __forceinline__ void send_sig(const HierArgs& a) {
  const u32 t = threadIdx.x;
  if (blockIdx.x == 0 && t < a.nlocal && t != a.local) hstore_sys((u64*)(scratch_of(a, t) + a.sig_off) + a.local, a.sig);
}
// After that barrier: every node peer's slot must hold this call's signature (read by the thread
// that waited for that peer). A peer making another call fails both ranks, each naming the other,
// at their next grid barrier, before anything reaches the output.
__device__ __forceinline__ void check_sigs(const HierArgs& a) {
  const u32 t = threadIdx.x;
  if (blockIdx.x == 0 && t < a.nlocal && t != a.local &&
      hload_sys((const u64*)((const char*)a.scratch + a.sig_off) + t) != a.sig) {
    hfail(a, HERR_MISMATCH, a.node * a.nlocal + t);
  }
}

__device__ __forceinline__ u64 halign8(u64 x) { return (x + 7) / 8 * 8; }

// Inter-node exchange of the slots at scratch offset `slots` (node n' at `slots + n' * stride`):
// puts `bytes` of this rank's slot (node `a.node`) into the same offset of every cross peer
// (n', local) with a signal, then waits (bounded) for each cross peer's signal.
//
// With `sig` (a call's first round) the put also carries the call's signature: block 0's thread
// 0 writes it into this rank's slot at halign8(bytes), after the chunk (which the grid wrote
// before inter_exchange; the grid barrier below orders both before the pushes), and the put covers
// halign8(bytes) + 8 bytes (also for an empty chunk: then it is the signature alone). The proxy
// copies the bytes and then signals, so once the peer's signal is polled (an acquire) the word at
// halign8(bytes) of the slot that peer wrote is its signature, if it made this call: the same
// call gives the peer (n', local) the same chunk length. A peer that made another call put its
// word elsewhere (or data over this place), so the word read here is not this call's signature
// (see the clearing below): both ranks fail, each naming the other, and the closing grid barrier
// stops the grid before anything reaches the output. The room after each slot's data
// (`hier::schedule::SIG_ROOM`) holds any peer's put: every rank agreed on the layout at setup.
//
// The checked word is cleared (it is this rank's scratch), so that a signature left by an
// earlier call never passes for this one. Race-free: the peer writes that slot of this rank
// (this parity, its node) again only in the exchange after next (the one in between uses the
// other parity's slots), and it issues that put only after its wait for this rank's signal of the
// next exchange returned; this rank pushes that signal only after this exchange's closing grid
// barrier, which follows the clear (the same thread's stores, fenced before the push). Words of
// a call that was never checked stay: a rank that failed refuses every later call, and one that
// launched nothing for that call (no bytes, or refused arguments) numbers its calls like its
// peers (the signature holds the call's number), so a stale word never equals a later call's
// signature.
__device__ bool inter_exchange(const HierArgs& a, u64 slots, u64 stride, u64 bytes, bool sig) {
  const u64 off = slots + a.node * stride, at = halign8(bytes);
  const u64 put = sig ? at + 8 : bytes;
  if (sig && a.nnodes > 1 && blockIdx.x == 0 && threadIdx.x == 0) {
    hstore_sys((u64*)((char*)a.scratch + off + at), a.sig);
  }
  if (!grid_sync(a)) return false;
  if (blockIdx.x == 0 && a.nnodes > 1) {
    const u32 t = threadIdx.x;
    if (t < a.nnodes && t != a.node) {
      PortChannelDeviceHandle* ch = port_ch(a, t);
      const u32 peer = (u32)(t * a.nlocal + a.local);
      __threadfence_system();
      const ProxyTrigger trig = put > 0
          ? ProxyTrigger(TriggerData | TriggerFlag, ch->dst_, off, ch->src_, off, put, ch->semaphoreId_)
          : ProxyTrigger(TriggerFlag, 0, 0, 0, 0, 0, ch->semaphoreId_);
      if (!ch->fifo_.push_for(trig, a.timeout_ns)) {
        hfail(a, ch->fifo_.proxy_error() != 0 ? HERR_PROXY : HERR_TIMEOUT, peer);
      } else {
        const u64 start = detail::globaltimer();
        u32 spins = 0;
        bool arrived = true;
        while (!ch->poll()) {
          if ((spins & 4095) == 4095 && ch->fifo_.proxy_error() != 0) {
            hfail(a, HERR_PROXY, peer);
            arrived = false;
            break;
          }
          if (hmust_stop(a, start, peer, spins)) {
            arrived = false;
            break;
          }
        }
        if (arrived && sig) {
          u64* word = (u64*)((char*)a.scratch + slots + t * stride + at);
          if (hload_sys(word) != a.sig) hfail(a, HERR_MISMATCH, peer);
          hstore_sys(word, 0);
        }
      }
    }
  }
  return grid_sync(a);
}

// Grid-wide copy of n bytes (n a multiple of 2).
__device__ void grid_copy(char* dst, const char* src, u64 n) {
  if (dst == src || n == 0) return;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
  u64 i = tid;
  u64 done = 0;
  if ((((u64)dst | (u64)src) & 15) == 0) {
    for (; i < n / 16; i += nth) ((uint4*)dst)[i] = ((const uint4*)src)[i];
    done = n / 16 * 16;
  } else if ((((u64)dst | (u64)src) & 3) == 0) {
    for (; i < n / 4; i += nth) ((u32*)dst)[i] = ((const u32*)src)[i];
    done = n / 4 * 4;
  }
  for (i = done / 2 + tid; i < n / 2; i += nth) ((unsigned short*)dst)[i] = ((const unsigned short*)src)[i];
}

// Element types: load one element as its accumulator type, store it back.
__device__ __forceinline__ float hh2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short hf2h(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ unsigned short hf2b(float f) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
struct HF32 {
  typedef float A;
  typedef float E;
  __device__ static A ld(const E* p) { return *p; }
  __device__ static void st(E* p, A v) { *p = v; }
};
struct HF16 {
  typedef float A;
  typedef unsigned short E;
  __device__ static A ld(const E* p) { return hh2f(*p); }
  __device__ static void st(E* p, A v) { *p = hf2h(v); }
};
struct HBF16 {
  typedef float A;
  typedef unsigned short E;
  __device__ static A ld(const E* p) { return __uint_as_float(((u32)*p) << 16); }
  __device__ static void st(E* p, A v) { *p = hf2b(v); }
};
struct HI32 {
  typedef int A;
  typedef int E;
  __device__ static A ld(const E* p) { return *p; }
  __device__ static void st(E* p, A v) { *p = v; }
};
struct HU32 {
  typedef u32 A;
  typedef u32 E;
  __device__ static A ld(const E* p) { return *p; }
  __device__ static void st(E* p, A v) { *p = v; }
};

template <typename A>
__device__ __forceinline__ A happly(int op, A x, A y) {
  switch (op) {
    case HOP_PROD: return x * y;
    case HOP_MIN: return x < y ? x : y;
    case HOP_MAX: return x > y ? x : y;
    default: return x + y;  // SUM, AVG
  }
}

// out[i] (and out2[i] when not null) = srcs[0][i] op srcs[1][i] op ... (in order), divided by
// `div` when nonzero; n bytes, grid-wide. srcs lives in shared memory (set before, synced).
template <typename D>
__device__ void grid_reduce(char* out, char* out2, const char* const* srcs, u32 k, u64 n, int op, u32 div) {
  typedef typename D::E E;
  typedef typename D::A A;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
  const u64 ne = n / sizeof(E);
  for (u64 i = tid; i < ne; i += nth) {
    A v = D::ld((const E*)srcs[0] + i);
    for (u32 j = 1; j < k; j++) v = happly<A>(op, v, D::ld((const E*)srcs[j] + i));
    if (div) v = v / (A)div;
    D::st((E*)out + i, v);
    if (out2) D::st((E*)out2 + i, v);
  }
}

// Common prologue: false (nothing done) when this rank failed before.
__device__ __forceinline__ bool hbegin(const HierArgs& a, u64& exchanges) {
  HierState* st = (HierState*)a.state;
  exchanges = *(volatile u64*)&st->exchanges;
  if (hvol(&st->failed)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) hfail(a, HERR_FAILED_BEFORE, 0xffff);
    return false;
  }
  return true;
}
__device__ __forceinline__ void hend(const HierArgs& a, u64 exchanges) {
  if (blockIdx.x == 0 && threadIdx.x == 0) ((HierState*)a.state)->exchanges = exchanges;
}

__device__ __forceinline__ void chunk_of(u64 len, u32 parts, u32 i, u64& lo, u64& hi) {
  const u64 cb = ((len + parts - 1) / parts + 15) / 16 * 16;
  lo = (u64)i * cb;
  hi = lo + cb;
  if (lo > len) lo = len;
  if (hi > len) hi = len;
}

template <typename D>
__device__ void hier_allreduce(const HierArgs& a) {
  u64 ex;
  if (!hbegin(a, ex)) return;
  const u32 L = (u32)a.nlocal, M = (u32)a.nnodes, l = (u32)a.local, n = (u32)a.node;
  const u64 R = a.ar_round, S = a.x_stride;
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  char* me = (char*)a.scratch;
  __shared__ const char* srcs[HMAX_GROUP];
  send_sig(a);
  for (u64 base = 0; base < a.nbytes; base += R, ex++) {
    const u64 rb = a.nbytes - base < R ? a.nbytes - base : R;
    const u64 par = ex & 1;
    // Stage.
    grid_copy(me + a.in_off, in + base, rb);
    if (!node_barrier(a)) return hend(a, ex);
    if (base == 0) check_sigs(a);
    // IntraReduceScatter: my chunk of every node peer's staging, in local order.
    u64 lo, hi;
    chunk_of(rb, L, l, lo, hi);
    const u64 xs = a.x_off + par * M * S;  // X[par][0]; X[par][n'] is S bytes further per node
    if (threadIdx.x < L) srcs[threadIdx.x] = scratch_of(a, threadIdx.x) + a.in_off + lo;
    __syncthreads();
    grid_reduce<D>(me + xs + n * S, nullptr, srcs, L, hi - lo, (int)a.op, 0);
    // InterExchange (with the cross peers' signatures in the first round).
    if (!inter_exchange(a, xs, S, hi - lo, base == 0)) return hend(a, ex + 1);
    // InterReduce, in node order, into RES and my chunk of the output.
    if (threadIdx.x < M) srcs[threadIdx.x] = me + xs + threadIdx.x * S;
    __syncthreads();
    grid_reduce<D>(me + a.res_off, out + base + lo, srcs, M, hi - lo, (int)a.op, a.op == HOP_AVG ? (u32)a.nranks : 0u);
    if (!node_barrier(a)) return hend(a, ex + 1);
    // IntraAllGather.
    for (u32 j = 1; j < L; j++) {
      const u32 lp = (l + j) % L;
      u64 plo, phi;
      chunk_of(rb, L, lp, plo, phi);
      grid_copy(out + base + plo, scratch_of(a, lp) + a.res_off, phi - plo);
    }
  }
  hend(a, ex);
}

__device__ void hier_allgather(const HierArgs& a) {
  u64 ex;
  if (!hbegin(a, ex)) return;
  const u32 L = (u32)a.nlocal, M = (u32)a.nnodes, l = (u32)a.local, n = (u32)a.node;
  const u64 R = a.ag_round, S = a.col_stride, sb = a.nbytes;
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  char* me = (char*)a.scratch;
  send_sig(a);
  for (u64 base = 0; base < sb; base += R, ex++) {
    const u64 len = sb - base < R ? sb - base : R;
    const u64 par = ex & 1;
    const u64 cols = a.col_off + par * M * S;  // COL[par][0]; COL[par][n'] is S bytes further per node
    // Stage.
    grid_copy(me + cols + n * S, in + base, len);
    if (!node_barrier(a)) return hend(a, ex);
    if (base == 0) check_sigs(a);
    // InterExchange (with the cross peers' signatures in the first round).
    if (!inter_exchange(a, cols, S, len, base == 0)) return hend(a, ex + 1);
    // My own segment (`hier::schedule` copies it in Stage; here it waits for the signature
    // checks, node and cross-node, so that a mismatched call writes no output).
    grid_copy(out + a.rank * sb + base, in + base, len);
    // IntraAllGather: the other nodes' slots of my column, then every slot of my peers' columns.
    for (u32 np = 0; np < M; np++) {
      if (np != n) grid_copy(out + (np * L + l) * sb + base, me + cols + np * S, len);
    }
    if (!node_barrier(a)) return hend(a, ex + 1);
    for (u32 j = 1; j < L; j++) {
      const u32 lp = (l + j) % L;
      const char* peer = scratch_of(a, lp);
      for (u32 np = 0; np < M; np++) grid_copy(out + (np * L + lp) * sb + base, peer + cols + np * S, len);
    }
  }
  hend(a, ex);
}

#define HIER_TYPED(D, name) \
  extern "C" __global__ void __launch_bounds__(512) hier_allreduce_##name(HierArgs a) { hier_allreduce<D>(a); }
HIER_TYPED(HF32, f32)
HIER_TYPED(HF16, f16)
HIER_TYPED(HBF16, bf16)
HIER_TYPED(HI32, i32)
HIER_TYPED(HU32, u32)

extern "C" __global__ void __launch_bounds__(512) hier_allgather_any(HierArgs a) { hier_allgather(a); }

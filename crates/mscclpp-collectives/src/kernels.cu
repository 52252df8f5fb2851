// Collective kernels of mscclpp-collectives: AllReduce, AllGather, ReduceScatter and Broadcast
// over scratch buffers every rank maps from every other (CUDA IPC, through MemoryChannels).
// Compiled at run time with NVRTC; `struct CollArgs` is generated from the Rust definition and
// prepended, so the two cannot disagree.
//
// Scratch of every rank (offsets in CollArgs):
//   ctrl:    inbox[src rank][block] u64 counters (block barriers of the simple algorithms),
//            simple signature slots [src rank] u64, LL signature packets [half][src rank]
//   packets: two halves; a packet call with flag f uses half f & 1 (LL16 packets, flag f)
//   simple:  the staging area of the large-message algorithms, in rounds
//
// Every wait is bounded: a thread's deadline is its kernel start + timeout (packet kernels: its
// first wait of 256 spins + timeout); a timed-out wait
// records (kind, peer) in the error word (page-locked host memory the host reads) and sets
// state->failed, which every other wait and every later launch checks, so the kernel ends
// within about the timeout and later launches (graph replays too) return at once.

using namespace mscclpp;

#define ERR_TIMEOUT 1ull
#define ERR_MISMATCH 2ull
#define ERR_ABORTED 3ull
#define ERR_FAILED_BEFORE 4ull

#define OP_SUM 0
#define OP_PROD 1
#define OP_MIN 2
#define OP_MAX 3
#define OP_AVG 4

#define MAX_BLOCKS 256

struct CollState {
  u32 flag;    // LL flag of the next packet call (starts at 1)
  u32 failed;  // nonzero once any wait of this rank failed
  u32 done;    // blocks of the running launch that finished
  u32 pad;
};

__device__ __forceinline__ void store_sys(u64* p, u64 v) { asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ u64 load_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 load_volatile_u32(const u32* p) { return *(volatile const u32*)p; }

// Records the first error this rank sees (host-visible) and stops every wait of this rank.
__device__ __noinline__ void fail(const CollArgs& a, u64 kind, u64 peer) {
  CollState* st = (CollState*)a.state;
  atomicExch(&st->failed, 1u);
  u64* err = (u64*)a.err;
  if (load_sys(err) == 0) store_sys(err, (1ull << 63) | (kind << 48) | ((peer & 0xffff) << 32) | (a.sig & 0xffffffffull));
}

// Whether this thread should stop waiting: failed before, aborted by the host, or past the
// deadline. A deadline of 0 is not started yet: the packet kernels start the clock at a thread's
// first wait that lasts 256 spins (kernel start + timeout otherwise), which keeps the timer read
// off the path of a call whose waits all end sooner; every wait is still bounded.
__device__ __noinline__ bool must_stop_slow(const CollArgs& a, u64& deadline, u32 peer, u32 spins) {
  CollState* st = (CollState*)a.state;
  if (load_volatile_u32(&st->failed)) return true;
  if ((spins & 0xffff) == 0 && load_sys((const u64*)a.abort) != 0) {
    fail(a, ERR_ABORTED, peer);
    return true;
  }
  const u64 now = detail::globaltimer();
  if (deadline == 0) {
    deadline = now + a.timeout_ns;
    return false;
  }
  if (now > deadline) {
    fail(a, ERR_TIMEOUT, peer);
    return true;
  }
  return false;
}
// Out of line past the first test: the slow part is cold code, kept off the instruction cache
// lines the fast path of every call runs through (the kernels were 10x the size of their hot
// path; see bench/allpair_breakdown.cu).
__device__ __forceinline__ bool must_stop(const CollArgs& a, u64& deadline, u32 peer, u32& spins) {
  if ((++spins & 255) != 0) return false;
  return must_stop_slow(a, deadline, peer, spins);
}

// ---------------------------------------------------------------------------------------------
// Element types: a 4-byte word holds N elements; reductions run on floats (f16/bf16/f32) or
// integers, rounding to the element type after every step unless accumulating in f32.

__device__ __forceinline__ float h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float b2f(unsigned short h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ unsigned short f2b(float f) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

struct F32 {
  typedef float A;
  static constexpr int N = 1;
  __device__ static void load(u32 w, A* a) { a[0] = __uint_as_float(w); }
  __device__ static u32 store(const A* a) { return __float_as_uint(a[0]); }
  __device__ static void round(A*) {}
};
struct F16 {
  typedef float A;
  static constexpr int N = 2;
  __device__ static void load(u32 w, A* a) { a[0] = h2f(w & 0xffff); a[1] = h2f(w >> 16); }
  __device__ static u32 store(const A* a) { return (u32)f2h(a[0]) | ((u32)f2h(a[1]) << 16); }
  __device__ static void round(A* a) { a[0] = h2f(f2h(a[0])); a[1] = h2f(f2h(a[1])); }
};
struct BF16 {
  typedef float A;
  static constexpr int N = 2;
  __device__ static void load(u32 w, A* a) { a[0] = b2f(w & 0xffff); a[1] = b2f(w >> 16); }
  __device__ static u32 store(const A* a) { return (u32)f2b(a[0]) | ((u32)f2b(a[1]) << 16); }
  __device__ static void round(A* a) { a[0] = b2f(f2b(a[0])); a[1] = b2f(f2b(a[1])); }
};
struct I32 {
  typedef int A;
  static constexpr int N = 1;
  __device__ static void load(u32 w, A* a) { a[0] = (int)w; }
  __device__ static u32 store(const A* a) { return (u32)a[0]; }
  __device__ static void round(A*) {}
};
struct U32 {
  typedef u32 A;
  static constexpr int N = 1;
  __device__ static void load(u32 w, A* a) { a[0] = w; }
  __device__ static u32 store(const A* a) { return a[0]; }
  __device__ static void round(A*) {}
};

// `op` known at compile time (OPC >= 0) or not (OPC < 0): a sum is one add instead of a chain
// of compares in the latency-bound small-message path.
template <int OPC, typename A>
__device__ __forceinline__ A apply_c(int op, A x, A y);

template <typename A>
__device__ __forceinline__ A apply(int op, A x, A y) {
  switch (op) {
    case OP_PROD: return x * y;
    case OP_MIN: return x < y ? x : y;
    case OP_MAX: return x > y ? x : y;
    default: return x + y;  // SUM, AVG
  }
}
template <int OPC, typename A>
__device__ __forceinline__ A apply_c(int op, A x, A y) {
  if (OPC == OP_SUM) return x + y;
  return apply(OPC >= 0 ? OPC : op, x, y);
}

template <typename A>
__device__ __forceinline__ A scale(A x, u32 n) { return x / (A)n; }
template <>
__device__ __forceinline__ float scale<float>(float x, u32 n) { return x * (1.0f / (float)n); }

// Reduces words: `init` with the first operand, `add` the others, `finish` gives the result.
template <typename D, int W>
struct Acc {
  typename D::A v[W][D::N];
  __device__ void init(const u32* w) {
#pragma unroll
    for (int i = 0; i < W; i++) D::load(w[i], v[i]);
  }
  // `no_round`: keep f32 (acc32, or the last add of a sum, whose result `finish` rounds the same
  // way anyway).
  template <int OPC = -1>
  __device__ void add(const u32* w, int op, bool no_round) {
#pragma unroll
    for (int i = 0; i < W; i++) {
      typename D::A b[D::N];
      D::load(w[i], b);
#pragma unroll
      for (int k = 0; k < D::N; k++) v[i][k] = apply_c<OPC>(op, v[i][k], b[k]);
      if (!no_round) D::round(v[i]);
    }
  }
  __device__ void finish(u32* w, int op, u32 nranks) {
#pragma unroll
    for (int i = 0; i < W; i++) {
      if (op == OP_AVG) {
#pragma unroll
        for (int k = 0; k < D::N; k++) v[i][k] = scale(v[i][k], nranks);
      }
      w[i] = D::store(v[i]);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// 8-byte units that may be partial (the last one of a buffer) or misaligned (a rank's segment
// of an AllGather output): loads pad with zeros, stores write only the valid bytes.

__device__ __noinline__ uint2 ld8_slow(const char* p, u32 n) {
  u64 v = 0;
  for (u32 i = 0; i < n / 2; i++) v |= (u64)((const unsigned short*)p)[i] << (16 * i);
  return make_uint2((u32)v, (u32)(v >> 32));
}
__device__ __forceinline__ uint2 ld8(const char* p, u32 n) {
  if (n == 8 && (((u64)p) & 7) == 0) return *(const uint2*)p;
  return ld8_slow(p, n);
}
__device__ __noinline__ void st8_slow(char* p, uint2 w, u32 n) {
  const u64 v = ((u64)w.y << 32) | w.x;
  for (u32 i = 0; i < n / 2; i++) ((unsigned short*)p)[i] = (unsigned short)(v >> (16 * i));
}
__device__ __forceinline__ void st8(char* p, uint2 w, u32 n) {
  if (n == 8 && (((u64)p) & 7) == 0) {
    *(uint2*)p = w;
    return;
  }
  st8_slow(p, w, n);
}
__device__ __forceinline__ u32 unit_bytes(u64 i, u64 nbytes) {
  u64 rest = nbytes - i * 8;
  return rest >= 8 ? 8u : (u32)rest;
}

// The rank count: compiled in when MSCCLPP_COLL_NRANKS is defined (an experiment of the 1 KiB
// breakdown, bench/allpair_real.cu: peer loops and rank arithmetic then fold), else from the
// arguments (what the library compiles).
__device__ __forceinline__ u32 nranks_of(const CollArgs& a) {
#ifdef MSCCLPP_COLL_NRANKS
  return MSCCLPP_COLL_NRANKS;
#else
  return (u32)a.nranks;
#endif
}

// Rank `rank`'s scratch (mapped here): from the kernel's parameters for the first 64 ranks.
__device__ __forceinline__ char* scratch_of(const CollArgs& a, u32 rank) {
  return (char*)(rank < 64 ? a.scratch[rank] : ((const u64*)a.peers)[rank]);
}
// My LL packets in `rank`'s scratch, in half `half`, slot `slot` of `slot_units` packets.
__device__ __forceinline__ LL16Packet* pkt_slot(const CollArgs& a, u32 rank, u32 half, u64 slot, u64 slot_units) {
  return (LL16Packet*)(scratch_of(a, rank) + a.pkt_off + half * a.pkt_half + slot * slot_units * 16);
}
// `peer`'s signature packet of the call with `flag`, in my scratch.
__device__ __forceinline__ const LL16Packet* sig_pkt_from(const CollArgs& a, u32 flag, u32 peer) {
  return (const LL16Packet*)(scratch_of(a, a.rank) + a.sig_pkt_off) + (flag & 1) * nranks_of(a) + peer;
}

// Whether `peer` has started a call with this flag whose signature differs from mine (a look,
// no wait): a wait on that peer's data would otherwise end as a timeout, not as the mismatch.
__device__ __noinline__ bool peer_sig_differs(const CollArgs& a, u32 flag, u32 peer) {
  uint2 v;
  if (peer >= nranks_of(a) || sig_pkt_from(a, flag, peer)->readOnce(flag, v)) return false;
  return (((u64)v.y << 32) | v.x) != a.sig;
}

// LL16 packet read with the bounded wait. Every 4096 spins (and before it reports a timeout)
// it looks at the peer's signature, so a mismatched call is named as such quickly.
__device__ __forceinline__ bool read_pkt(const CollArgs& a, const LL16Packet* p, u32 flag, u64& deadline, u32 peer,
                                         uint2& v) {
  u32 spins = 0;
  while (p->readOnce(flag, v)) {
    if ((spins & 0xfff) == 0xfff && peer_sig_differs(a, flag, peer)) {
      fail(a, ERR_MISMATCH, peer);
      return false;
    }
    if (must_stop(a, deadline, peer, spins)) return false;
  }
  return true;
}

// `r + k` for 0 <= k < 2 * R - r, wrapped to a rank (32-bit: a 64-bit `%` is a long software
// division on the critical path of every small call).
__device__ __forceinline__ u32 wrap_rank(u32 x, u32 R) { return x >= R ? x - R : x; }

// `read_pkt` of a data packet from `peer` together with that peer's signature packet: both loads
// are in flight at once, so checking the signature costs no round trip of its own (the
// signature is written at the peer's start, before its data). A different signature is a
// mismatch, named as such.
__device__ __forceinline__ bool read_pkt_and_sig(const CollArgs& a, const LL16Packet* p, u32 flag, u64& deadline,
                                                 u32 peer, uint2& v) {
  const LL16Packet* sp = sig_pkt_from(a, flag, peer);
  bool have_sig = false;
  u32 spins = 0;
  while (true) {
    const bool data_waits = p->readOnce(flag, v);
    if (!have_sig) {
      uint2 sv;
      have_sig = !sp->readOnce(flag, sv);
      if (have_sig && (((u64)sv.y << 32) | sv.x) != a.sig) {
        fail(a, ERR_MISMATCH, peer);
        return false;
      }
    }
    if (!data_waits && have_sig) return true;
    if (must_stop(a, deadline, peer, spins)) return false;
  }
}

// The per-call packet prologue: every thread reads the flag and the failed bit itself (in
// parallel with its first input load: a block-wide broadcast through shared memory put the two
// loads in series and cost 0.25 us per call); block 0 thread 0 sends this call's signature to
// every peer (an LL packet) without waiting, so it travels beside the data rather than a round
// trip ahead of it (checked with the data, or in the epilogue).
// Returns false when this rank has failed before (nothing is done then).
__device__ __forceinline__ bool pkt_begin(const CollArgs& a, u32& flag, u64& deadline) {
  CollState* st = (CollState*)a.state;
  deadline = 0;  // started at the first long wait (must_stop)
  uint2 ff;
  detail::ld_volatile_v2_u32(st, ff.x, ff.y);  // flag and failed in one load
  if (ff.y) {
    if (blockIdx.x == 0 && threadIdx.x == 0) fail(a, ERR_FAILED_BEFORE, 0xffff);
    return false;
  }
  flag = ff.x;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const u32 R = nranks_of(a), me = (u32)a.rank, half = flag & 1;
    #pragma unroll 1
    for (u32 k = 1; k < R; k++) {
      LL16Packet* s = (LL16Packet*)(scratch_of(a, wrap_rank(me + k, R)) + a.sig_pkt_off) + half * R + me;
      s->write(a.sig, flag);
    }
  }
  return true;
}

// Block 0 thread 0 checks every peer's signature of this call. Reading them is also what lets
// the next-but-one call reuse this half: a peer writes its signature only after it finished the
// call before.
__device__ __forceinline__ void pkt_check_sigs(const CollArgs& a, u32 flag, u64& deadline) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const u32 R = nranks_of(a);
  #pragma unroll 1
  for (u32 i = 1; i < R; i++) {
    const u32 p = wrap_rank((u32)a.rank + i, R);
    uint2 v;
    if (!read_pkt(a, sig_pkt_from(a, flag, p), flag, deadline, p, v)) break;
    if ((((u64)v.y << 32) | v.x) != a.sig) {
      fail(a, ERR_MISMATCH, p);
      break;
    }
  }
}

// The per-call packet epilogue: the peers' signatures are checked, then the flag advances.
// `sigs_checked`: block 0 thread 0 already read every peer's signature (`read_pkt_and_sig`).
__device__ __forceinline__ void pkt_end(const CollArgs& a, u32 flag, u64& deadline, bool sigs_checked = false) {
  if (!sigs_checked) pkt_check_sigs(a, flag, deadline);
  CollState* st = (CollState*)a.state;
  __syncthreads();
  const u32 next = flag + 1 == 0 ? 1 : flag + 1;
  if (gridDim.x == 1) {
    // One block, whose threads all read the flag (the barrier above); the next launch starts
    // after this one ends.
    if (threadIdx.x == 0) st->flag = next;
    return;
  }
  if (threadIdx.x == 0) {
    // Every block read the flag at its start; the last one to get here advances it (the next
    // launch starts after this one ends, so no fence is needed for it).
    if (atomicAdd(&st->done, 1u) == gridDim.x - 1) {
      st->done = 0;
      st->flag = next;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Packet (LL) algorithms. nbytes: the bytes of one rank's buffer (AllReduce, Broadcast) or of
// one rank's segment (AllGather input, ReduceScatter output).

// AllReduce, all pairs: every rank sends its whole input to every peer and reduces all of them.
// A sum (the common case) takes a branch of its own in the reduction: one add, and no rounding
// after the last one (the store rounds the same way), on the latency-bound path.
template <typename D>
__device__ void allreduce_allpair(const CollArgs& a) {
  u32 flag;
  u64 deadline;
  if (!pkt_begin(a, flag, deadline)) return;
  const u32 half = flag & 1, R = nranks_of(a), me = (u32)a.rank;
  const bool sum = a.op == OP_SUM;
  const u64 units = (a.nbytes + 7) / 8;
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
  bool ok = true;
  for (u64 i = tid; i < units && ok; i += nth) {
    const u32 n = unit_bytes(i, a.nbytes);
    uint2 v = ld8(in + i * 8, n);
    #pragma unroll 1
    for (u32 k = 1; k < R; k++) pkt_slot(a, wrap_rank(me + k, R), half, me, units)[i].write(v, flag);
    Acc<D, 2> acc;
    acc.init((const u32*)&v);
    #pragma unroll 1
    for (u32 k = 1; k < R && ok; k++) {
      const u32 p = wrap_rank(me + R - k, R);
      uint2 w;
      const LL16Packet* src = pkt_slot(a, me, half, p, units) + i;
      // Thread 0 of block 0 (unit 0, which every call has) checks each peer's signature with
      // that peer's first packet.
      ok = i == 0 ? read_pkt_and_sig(a, src, flag, deadline, p, w) : read_pkt(a, src, flag, deadline, p, w);
      if (ok) {
        if (sum) {
          acc.template add<OP_SUM>((const u32*)&w, OP_SUM, a.acc32 != 0 || k == R - 1);
        } else {
          acc.add((const u32*)&w, (int)a.op, a.acc32 != 0);
        }
      }
    }
    uint2 r;
    acc.finish((u32*)&r, (int)a.op, nranks_of(a));
    if (ok) st8(out + i * 8, r, n);
  }
  // A failed wait of thread 0 left some signatures unread: check them (bounded; ends at once
  // once this rank has failed).
  pkt_end(a, flag, deadline, tid == 0 && ok && units > 0);
}

// AllReduce in two packet phases: chunk p of every input goes to rank p, which reduces it and
// sends the result to everyone.
template <typename D>
__device__ void allreduce_packet(const CollArgs& a) {
  u32 flag;
  u64 deadline;
  if (!pkt_begin(a, flag, deadline)) return;
  const u32 half = flag & 1, R = nranks_of(a), r = a.rank;
  const u64 units = (a.nbytes + 7) / 8;
  const u64 cu = (units + R - 1) / R;  // units per chunk
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
  // Slots: phase 1 [src][cu], phase 2 at R*cu: [src][cu].
  for (u64 x = tid; x < (u64)(R - 1) * cu; x += nth) {
    const u32 q = (u32)x / (u32)cu;  // packet calls stay far below 2^32 units
    u32 p = wrap_rank(r + 1 + q, R);
    u64 j = (u32)x - q * (u32)cu, i = p * cu + j;
    if (i >= units) continue;
    uint2 v = ld8(in + i * 8, unit_bytes(i, a.nbytes));
    pkt_slot(a, p, half, r, cu)[j].write(v, flag);
  }
  bool ok = true;
  for (u64 j = tid; j < cu && ok; j += nth) {
    u64 i = r * cu + j;
    if (i >= units) break;
    const u32 n = unit_bytes(i, a.nbytes);
    uint2 v = ld8(in + i * 8, n);
    Acc<D, 2> acc;
    acc.init((const u32*)&v);
    #pragma unroll 1
    for (u32 k = 1; k < R && ok; k++) {
      u32 p = wrap_rank(r + R - k, R);
      uint2 w;
      ok = read_pkt(a, pkt_slot(a, r, half, p, cu) + j, flag, deadline, p, w);
      if (ok) acc.add((const u32*)&w, (int)a.op, a.acc32 != 0);
    }
    if (!ok) break;
    uint2 res;
    acc.finish((u32*)&res, (int)a.op, R);
    st8(out + i * 8, res, n);
    #pragma unroll 1
    for (u32 k = 1; k < R; k++) {
      u32 p = wrap_rank(r + k, R);
      pkt_slot(a, p, half, R + r, cu)[j].write(res, flag);
    }
  }
  for (u64 x = tid; x < (u64)(R - 1) * cu && ok; x += nth) {
    const u32 q = (u32)x / (u32)cu;  // packet calls stay far below 2^32 units
    u32 p = wrap_rank(r + 1 + q, R);
    u64 j = (u32)x - q * (u32)cu, i = p * cu + j;
    if (i >= units) continue;
    uint2 v;
    ok = read_pkt(a, pkt_slot(a, r, half, R + p, cu) + j, flag, deadline, p, v);
    if (ok) st8(out + i * 8, v, unit_bytes(i, a.nbytes));
  }
  pkt_end(a, flag, deadline);
}

// ReduceScatter with packets: segment p of every input goes to rank p, which reduces it.
template <typename D>
__device__ void reducescatter_packet(const CollArgs& a) {
  u32 flag;
  u64 deadline;
  if (!pkt_begin(a, flag, deadline)) return;
  const u32 half = flag & 1, R = nranks_of(a), r = a.rank;
  const u64 units = (a.nbytes + 7) / 8;
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
  for (u64 x = tid; x < (u64)(R - 1) * units; x += nth) {
    const u32 q = (u32)x / (u32)units;  // packet calls stay far below 2^32 units
    u32 p = wrap_rank(r + 1 + q, R);
    u64 i = (u32)x - q * (u32)units;
    uint2 v = ld8(in + p * a.nbytes + i * 8, unit_bytes(i, a.nbytes));
    pkt_slot(a, p, half, r, units)[i].write(v, flag);
  }
  bool ok = true;
  for (u64 i = tid; i < units && ok; i += nth) {
    const u32 n = unit_bytes(i, a.nbytes);
    uint2 v = ld8(in + r * a.nbytes + i * 8, n);
    Acc<D, 2> acc;
    acc.init((const u32*)&v);
    #pragma unroll 1
    for (u32 k = 1; k < R && ok; k++) {
      u32 p = wrap_rank(r + R - k, R);
      uint2 w;
      ok = read_pkt(a, pkt_slot(a, r, half, p, units) + i, flag, deadline, p, w);
      if (ok) acc.add((const u32*)&w, (int)a.op, a.acc32 != 0);
    }
    if (!ok) break;
    uint2 res;
    acc.finish((u32*)&res, (int)a.op, R);
    st8(out + i * 8, res, n);
  }
  pkt_end(a, flag, deadline);
}

// AllGather with packets: every rank sends its segment to every peer.
__device__ void allgather_packet(const CollArgs& a) {
  u32 flag;
  u64 deadline;
  if (!pkt_begin(a, flag, deadline)) return;
  const u32 half = flag & 1, R = nranks_of(a), r = a.rank;
  const u64 units = (a.nbytes + 7) / 8;
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
  const bool copy_own = in != out + r * a.nbytes;
  for (u64 i = tid; i < units; i += nth) {
    const u32 n = unit_bytes(i, a.nbytes);
    uint2 v = ld8(in + i * 8, n);
    #pragma unroll 1
    for (u32 k = 1; k < R; k++) pkt_slot(a, wrap_rank(r + k, R), half, r, units)[i].write(v, flag);
    if (copy_own) st8(out + r * a.nbytes + i * 8, v, n);
  }
  bool ok = true;
  for (u64 x = tid; x < (u64)(R - 1) * units && ok; x += nth) {
    const u32 q = (u32)x / (u32)units;  // packet calls stay far below 2^32 units
    u32 p = wrap_rank(r + 1 + q, R);
    u64 i = (u32)x - q * (u32)units;
    uint2 v;
    ok = read_pkt(a, pkt_slot(a, r, half, p, units) + i, flag, deadline, p, v);
    if (ok) st8(out + p * a.nbytes + i * 8, v, unit_bytes(i, a.nbytes));
  }
  pkt_end(a, flag, deadline);
}

// Broadcast with packets: the root sends to everyone (every rank still exchanges signatures).
__device__ void broadcast_packet(const CollArgs& a) {
  u32 flag;
  u64 deadline;
  if (!pkt_begin(a, flag, deadline)) return;
  const u32 half = flag & 1, R = nranks_of(a), r = a.rank, root = (u32)a.root;
  const u64 units = (a.nbytes + 7) / 8;
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
  bool ok = true;
  for (u64 i = tid; i < units && ok; i += nth) {
    const u32 n = unit_bytes(i, a.nbytes);
    if (r == root) {
      uint2 v = ld8(in + i * 8, n);
      #pragma unroll 1
      for (u32 k = 1; k < R; k++) pkt_slot(a, wrap_rank(r + k, R), half, 0, units)[i].write(v, flag);
      if (in != out) st8(out + i * 8, v, n);
    } else {
      uint2 v;
      ok = read_pkt(a, pkt_slot(a, r, half, 0, units) + i, flag, deadline, root, v);
      if (ok) st8(out + i * 8, v, n);
    }
  }
  pkt_end(a, flag, deadline);
}

// ---------------------------------------------------------------------------------------------
// Simple (large-message) algorithms: stage through scratch in rounds, with block barriers.
// Block b of every rank handles slice b of every chunk, in every phase, so a block barrier
// (block b signals block b of every peer) orders exactly the data the next phase reads.

// Block barrier with every peer: returns false when a wait failed (the whole block then stops).
__device__ bool block_barrier(const CollArgs& a, u64& deadline, bool send_sig) {
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  const u32 t = threadIdx.x;
  if (t < nranks_of(a) && t != a.rank) {
    u64* inbox_at_peer = (u64*)(scratch_of(a, t) + a.inbox_off) + (u64)a.rank * MAX_BLOCKS + blockIdx.x;
    if (send_sig) store_sys((u64*)(scratch_of(a, t) + a.sig_off) + a.rank, a.sig);
    __threadfence_system();
    detail::red_add_release_sys(inbox_at_peer, 1);
    const u64* mine = (const u64*)(scratch_of(a, a.rank) + a.inbox_off) + (u64)t * MAX_BLOCKS + blockIdx.x;
    u64* exp = (u64*)a.expected + (u64)t * MAX_BLOCKS + blockIdx.x;
    u64 want = *exp + 1;
    *exp = want;
    u32 spins = 0;
    bool ok = true;
    while (detail::load_acquire_sys(mine) < want) {
      if (must_stop(a, deadline, t, spins)) {
        ok = false;
        break;
      }
    }
    if (ok && send_sig && load_sys((const u64*)(scratch_of(a, a.rank) + a.sig_off) + t) != a.sig) {
      fail(a, ERR_MISMATCH, t);
      ok = false;
    }
    if (!ok) atomicExch(&bad, 1);
  }
  __syncthreads();
  return bad == 0;
}

__device__ __forceinline__ bool simple_begin(const CollArgs& a, u64& deadline) {
  CollState* st = (CollState*)a.state;
  deadline = detail::globaltimer() + a.timeout_ns;
  if (load_volatile_u32(&st->failed)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) fail(a, ERR_FAILED_BEFORE, 0xffff);
    return false;
  }
  return true;
}

// Bytes of each of the n parts of `len` bytes cut into 16-byte multiples (the last part may
// be shorter or empty): a round's chunks (n ranks), a chunk's slices (n blocks).
__device__ __forceinline__ u64 part_bytes(u64 len, u32 n) { return ((len + n - 1) / n + 15) / 16 * 16; }

// The bytes [lo, hi) of block `b` of `B` in a chunk of `len` bytes (slices are 16-byte multiples).
__device__ __forceinline__ void slice_of(u64 len, u32 b, u32 B, u64& lo, u64& hi) {
  u64 s = part_bytes(len, B);
  lo = s * b;
  hi = lo + s;
  if (lo > len) lo = len;
  if (hi > len) hi = len;
}

// `slice_of` for the rounds of a staged algorithm: the bytes [lo, hi) of block `b` in a chunk of
// `len` bytes, sliced as a whole round's chunk of `full` bytes is (len <= full), so that block b
// touches the same offsets of scratch in every round of a call. The block barriers pair block b
// with block b of every peer; they order a round's reuse of scratch only for offsets the same
// block used the round before. Slicing a shorter last round by its own length moved offsets to
// other blocks: block 1 of a rank that was ahead overwrote a peer's result area where that
// peer's block 0 was still copying out the previous round (an AllReduce of 64 MiB + 20 bytes of
// f32 over 3 processes returned 4 elements of its last round in the middle one's place).
__device__ __forceinline__ void slice_in(u64 len, u64 full, u32 b, u32 B, u64& lo, u64& hi) {
  slice_of(full, b, B, lo, hi);
  if (lo > len) lo = len;
  if (hi > len) hi = len;
}

// Copies [0, n) bytes with this block's threads (16-byte units when both ends allow).
__device__ __forceinline__ void block_copy(char* dst, const char* src, u64 n) {
  if (dst == src || n == 0) return;
  u64 i = threadIdx.x;
  if ((((u64)dst | (u64)src) & 15) == 0) {
    // Four 16-byte loads in flight per thread, then their stores.
    const uint4* s4 = (const uint4*)src;
    uint4* d4 = (uint4*)dst;
    const u64 n16 = n / 16, step = blockDim.x;
    for (; i + 3 * step < n16; i += 4 * step) {
      uint4 a0 = s4[i], a1 = s4[i + step], a2 = s4[i + 2 * step], a3 = s4[i + 3 * step];
      d4[i] = a0;
      d4[i + step] = a1;
      d4[i + 2 * step] = a2;
      d4[i + 3 * step] = a3;
    }
    for (; i < n16; i += step) d4[i] = s4[i];
    i = n16 * 8 + threadIdx.x;
  }
  for (; i < n / 2; i += blockDim.x) ((unsigned short*)dst)[i] = ((const unsigned short*)src)[i];
}

// out[0, n) = reduce over the R sources srcs[k] (srcs[0] first), with this block's threads.
template <typename D>
__device__ __forceinline__ void block_reduce(char* out, char* out2, const char* const* srcs, u32 R, u64 n, const CollArgs& a) {
  u64 al = (u64)out | (u64)out2;
  for (u32 k = 0; k < R; k++) al |= (u64)srcs[k];
  u64 i = threadIdx.x;
  if ((al & 15) == 0) {
    for (; i < n / 16; i += blockDim.x) {
      uint4 v = ((const uint4*)srcs[0])[i];
      Acc<D, 4> acc;
      acc.init((const u32*)&v);
      #pragma unroll 1
      for (u32 k = 1; k < R; k++) {
        uint4 w = ((const uint4*)srcs[k])[i];
        acc.add((const u32*)&w, (int)a.op, a.acc32 != 0);
      }
      uint4 res;
      acc.finish((u32*)&res, (int)a.op, nranks_of(a));
      ((uint4*)out)[i] = res;
      if (out2) ((uint4*)out2)[i] = res;
    }
    i = n / 16 * 4 + threadIdx.x;
  }
  if ((al & 3) == 0) {
    for (; i < (n + 3) / 4; i += blockDim.x) {
      const u32 nb = (n - i * 4) >= 4 ? 4 : (u32)(n - i * 4);
      u32 v = nb == 4 ? ((const u32*)srcs[0])[i] : (u32)((const unsigned short*)srcs[0])[2 * i];
      Acc<D, 1> acc;
      acc.init(&v);
      #pragma unroll 1
      for (u32 k = 1; k < R; k++) {
        u32 w = nb == 4 ? ((const u32*)srcs[k])[i] : (u32)((const unsigned short*)srcs[k])[2 * i];
        acc.add(&w, (int)a.op, a.acc32 != 0);
      }
      u32 res;
      acc.finish(&res, (int)a.op, nranks_of(a));
      if (nb == 4) {
        ((u32*)out)[i] = res;
        if (out2) ((u32*)out2)[i] = res;
      } else {
        ((unsigned short*)out)[2 * i] = (unsigned short)res;
        if (out2) ((unsigned short*)out2)[2 * i] = (unsigned short)res;
      }
    }
    return;
  }
  // Only 2-byte aligned (a 2-byte type at an odd element offset): one element per step, in the
  // low half of a word.
  for (i = threadIdx.x; i < n / 2; i += blockDim.x) {
    u32 v = ((const unsigned short*)srcs[0])[i];
    Acc<D, 1> acc;
    acc.init(&v);
    #pragma unroll 1
    for (u32 k = 1; k < R; k++) {
      u32 w = ((const unsigned short*)srcs[k])[i];
      acc.add(&w, (int)a.op, a.acc32 != 0);
    }
    u32 res;
    acc.finish(&res, (int)a.op, nranks_of(a));
    ((unsigned short*)out)[i] = (unsigned short)res;
    if (out2) ((unsigned short*)out2)[i] = (unsigned short)res;
  }
}

#define MAX_RANKS_SIMPLE 64

// AllReduce for large messages, per round of the message: (0) every rank writes chunk p of its
// input into rank p's scratch (slot = the writer); (1) rank r reduces chunk r from its own input
// and those slots, into its output and into every peer's result area (slot r); (2) every rank
// copies the other chunks' results from its own result area. Each byte crosses to a peer once
// each way and nothing is staged locally; the result reaches the next rank from registers.
// Barriers: before (1) the slots are full; before (2) the results have arrived. A round's (0)
// overwrites slots only after the peer passed the previous round's second barrier (its (1)
// read them), and (1) overwrites results only after the peer passed this round's first barrier
// (its (2) of the previous round is done).
template <typename D>
__device__ void allreduce_simple(const CollArgs& a) {
  u64 deadline;
  if (!simple_begin(a, deadline)) return;
  const u32 R = nranks_of(a), r = a.rank, b = blockIdx.x, B = gridDim.x;
  const u64 round_bytes = a.simple_round;  // per round, a multiple of 16 * R
  // A slot in scratch: a chunk of the first round, the call's largest. Every round keeps chunk
  // p in slot p and slices it as the first round's chunk (`slice_in`): a shorter last round too,
  // so that block b of every rank uses the same bytes of every slot in every round, which is
  // what its block barriers order.
  const u64 slot = part_bytes(a.nbytes < round_bytes ? a.nbytes : round_bytes, R);
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  __shared__ const char* srcs[MAX_RANKS_SIMPLE];
  bool first = true;
  for (u64 base = 0; base < a.nbytes; base += round_bytes) {
    const u64 rb = a.nbytes - base < round_bytes ? a.nbytes - base : round_bytes;
    const u64 cb = part_bytes(rb, R);  // this round's chunk bytes (at most `slot`)
    // (0) chunk p of my input -> rank p's slot r.
    #pragma unroll 1
    for (u32 k = 1; k < R; k++) {
      u32 p = wrap_rank(r + k, R);
      u64 c_lo = p * cb, c_len = c_lo >= rb ? 0 : (rb - c_lo < cb ? rb - c_lo : cb), lo, hi;
      slice_in(c_len, slot, b, B, lo, hi);
      block_copy(scratch_of(a, p) + a.simple_off + r * slot + lo, in + base + c_lo + lo, hi - lo);
    }
    if (!block_barrier(a, deadline, first)) return;
    first = false;
    // (1) reduce chunk r (slice b): mine from the input, the others from my slots.
    u64 c_lo = r * cb, c_len = c_lo >= rb ? 0 : (rb - c_lo < cb ? rb - c_lo : cb), lo, hi;
    slice_in(c_len, slot, b, B, lo, hi);
    if (threadIdx.x < R) {
      u32 q = wrap_rank(r + threadIdx.x, R);
      srcs[threadIdx.x] = q == r ? in + base + c_lo + lo : scratch_of(a, r) + a.simple_off + q * slot + lo;
    }
    __syncthreads();
    char* res0 = out + base + c_lo + lo;
    // ... and push the result to every peer's result area, slot r: the next rank's straight
    // from the registers (one read of the result fewer), the others' from my output.
    char* res_next = scratch_of(a, wrap_rank(r + 1, R)) + a.simple_off + round_bytes + r * slot + lo;
    block_reduce<D>(res0, res_next, srcs, R, hi - lo, a);
    __syncthreads();
    for (u32 k = 2; k < R; k++) {
      u32 p = wrap_rank(r + k, R);
      block_copy(scratch_of(a, p) + a.simple_off + round_bytes + r * slot + lo, res0, hi - lo);
    }
    if (!block_barrier(a, deadline, false)) return;
    // (2) the other chunks' results, from my result area.
    #pragma unroll 1
    for (u32 k = 1; k < R; k++) {
      u32 p = wrap_rank(r + k, R);
      u64 p_lo = p * cb, p_len = p_lo >= rb ? 0 : (rb - p_lo < cb ? rb - p_lo : cb), plo, phi;
      slice_in(p_len, slot, b, B, plo, phi);
      block_copy(out + base + p_lo + plo, scratch_of(a, r) + a.simple_off + round_bytes + p * slot + plo, phi - plo);
    }
    __syncthreads();
  }
}

// Zero-copy AllReduce over registered buffers: a.in and a.out are device tables of every rank's
// send and receive buffer (mapped here). After a barrier (every rank's input is ready), block b
// of rank r reduces slice b of chunk r from every rank's send buffer into its own receive buffer,
// then copies the result into every peer's receive buffer; a second barrier makes every write
// land (and every read of our send buffer finish) before the kernel ends. In place works: chunk
// r of any buffer is read and written only by rank r's threads, each element read before it is
// written by the same thread.
template <typename D>
__device__ void allreduce_zerocopy(const CollArgs& a) {
  u64 deadline;
  if (!simple_begin(a, deadline)) return;
  const u32 R = nranks_of(a), r = a.rank, b = blockIdx.x, B = gridDim.x;
  const char* const* sends = (const char* const*)a.in;
  char* const* recvs = (char* const*)a.out;
  __shared__ const char* srcs[MAX_RANKS_SIMPLE];
  if (!block_barrier(a, deadline, true)) return;
  const u64 cb = part_bytes(a.nbytes, R);
  const u64 c_lo = r * cb, c_len = c_lo >= a.nbytes ? 0 : (a.nbytes - c_lo < cb ? a.nbytes - c_lo : cb);
  u64 lo, hi;
  slice_of(c_len, b, B, lo, hi);
  if (threadIdx.x < R) srcs[threadIdx.x] = sends[wrap_rank(r + threadIdx.x, R)] + c_lo + lo;
  __syncthreads();
  char* mine = recvs[r] + c_lo + lo;
  // The next rank's copy straight from the registers, the others' from mine.
  block_reduce<D>(mine, recvs[wrap_rank(r + 1, R)] + c_lo + lo, srcs, R, hi - lo, a);
  __syncthreads();
  #pragma unroll 1
  for (u32 k = 2; k < R; k++) block_copy(recvs[wrap_rank(r + k, R)] + c_lo + lo, mine, hi - lo);
  block_barrier(a, deadline, false);
}

// ReduceScatter for large messages: per round, copy the whole input to scratch; reduce my
// segment's slice from every rank's scratch; a second barrier before scratch is reused.
template <typename D>
__device__ void reducescatter_simple(const CollArgs& a) {
  u64 deadline;
  if (!simple_begin(a, deadline)) return;
  const u32 R = nranks_of(a), r = a.rank, b = blockIdx.x, B = gridDim.x;
  const u64 seg_round = a.simple_round / R / 16 * 16;  // per segment and round
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  __shared__ const char* srcs[MAX_RANKS_SIMPLE];
  bool first = true;
  // Every round sliced as the first, the call's largest (see allreduce_simple).
  const u64 first_round = a.nbytes < seg_round ? a.nbytes : seg_round;
  for (u64 base = 0; base < a.nbytes; base += seg_round) {
    const u64 sb = a.nbytes - base < seg_round ? a.nbytes - base : seg_round;
    u64 lo, hi;
    slice_in(sb, first_round, b, B, lo, hi);
    char* my_in = scratch_of(a, r) + a.simple_off;
    for (u32 c = 0; c < R; c++) block_copy(my_in + c * seg_round + lo, in + c * a.nbytes + base + lo, hi - lo);
    if (!block_barrier(a, deadline, first)) return;
    first = false;
    if (threadIdx.x < R) {
      u32 q = wrap_rank(r + threadIdx.x, R);
      srcs[threadIdx.x] = scratch_of(a, q) + a.simple_off + r * seg_round + lo;
    }
    __syncthreads();
    block_reduce<D>(out + base + lo, nullptr, srcs, R, hi - lo, a);
    if (!block_barrier(a, deadline, false)) return;
  }
}

// AllGather for large messages: copy my segment to scratch, then every peer's from theirs.
__device__ void allgather_simple(const CollArgs& a) {
  u64 deadline;
  if (!simple_begin(a, deadline)) return;
  const u32 R = nranks_of(a), r = a.rank, b = blockIdx.x, B = gridDim.x;
  const u64 round_bytes = a.simple_round;
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  bool first = true;
  // Every round sliced as the first, the call's largest (see allreduce_simple).
  const u64 first_round = a.nbytes < round_bytes ? a.nbytes : round_bytes;
  for (u64 base = 0; base < a.nbytes; base += round_bytes) {
    const u64 sb = a.nbytes - base < round_bytes ? a.nbytes - base : round_bytes;
    u64 lo, hi;
    slice_in(sb, first_round, b, B, lo, hi);
    block_copy(scratch_of(a, r) + a.simple_off + lo, in + base + lo, hi - lo);
    block_copy(out + r * a.nbytes + base + lo, in + base + lo, hi - lo);
    if (!block_barrier(a, deadline, first)) return;
    first = false;
    #pragma unroll 1
    for (u32 k = 1; k < R; k++) {
      u32 p = wrap_rank(r + k, R);
      block_copy(out + p * a.nbytes + base + lo, scratch_of(a, p) + a.simple_off + lo, hi - lo);
    }
    if (!block_barrier(a, deadline, false)) return;
  }
}

// Broadcast for large messages: the root stages, everyone copies from the root's scratch.
__device__ void broadcast_simple(const CollArgs& a) {
  u64 deadline;
  if (!simple_begin(a, deadline)) return;
  const u32 r = a.rank, root = (u32)a.root, b = blockIdx.x, B = gridDim.x;
  const u64 round_bytes = a.simple_round;
  const char* in = (const char*)a.in;
  char* out = (char*)a.out;
  bool first = true;
  // Every round sliced as the first, the call's largest (see allreduce_simple).
  const u64 first_round = a.nbytes < round_bytes ? a.nbytes : round_bytes;
  for (u64 base = 0; base < a.nbytes; base += round_bytes) {
    const u64 sb = a.nbytes - base < round_bytes ? a.nbytes - base : round_bytes;
    u64 lo, hi;
    slice_in(sb, first_round, b, B, lo, hi);
    if (r == root) {
      block_copy(scratch_of(a, r) + a.simple_off + lo, in + base + lo, hi - lo);
      block_copy(out + base + lo, in + base + lo, hi - lo);
    }
    if (!block_barrier(a, deadline, first)) return;
    first = false;
    if (r != root) block_copy(out + base + lo, scratch_of(a, root) + a.simple_off + lo, hi - lo);
    if (!block_barrier(a, deadline, false)) return;
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points: one per (collective, algorithm, element type); the reduction op and f32
// accumulation are arguments.
//
// Every entry starts with `pdl_enter`: on sm_90 and later it waits until the kernel before this
// one on the stream has finished and its writes are visible (griddepcontrol.wait: returns at
// once unless this kernel was launched as a programmatic dependent launch). A kernel launched
// that way (`a.pdl`) then lets the next kernel of the stream be scheduled
// (launch_dependents: only a successor launched programmatically starts early; ours wait in
// their own pdl_enter). Waiting first bounds what a rank has on the GPU to two kernels, the one
// running and the next one waiting: triggering before the wait would let the next kernel
// release the one after it while this one still runs, and so on down the queue. The host
// launches programmatically only when two launches of every rank sharing the GPU fit at once
// (comm.rs, `programmatic_blocks`).
__device__ __forceinline__ void pdl_enter(const CollArgs& a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (a.pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define TYPED(coll, algo, D, name)                                                                            \
  extern "C" __global__ void __launch_bounds__(512) coll##_##algo##_##name(const __grid_constant__ CollArgs a) { \
    pdl_enter(a);                                                                                              \
    coll##_##algo<D>(a);                                                                                      \
  }
#define ALL_TYPES(coll, algo)   \
  TYPED(coll, algo, F32, f32)   \
  TYPED(coll, algo, F16, f16)   \
  TYPED(coll, algo, BF16, bf16) \
  TYPED(coll, algo, I32, i32)   \
  TYPED(coll, algo, U32, u32)

ALL_TYPES(allreduce, allpair)
ALL_TYPES(allreduce, packet)
ALL_TYPES(allreduce, simple)
ALL_TYPES(allreduce, zerocopy)
ALL_TYPES(reducescatter, packet)
ALL_TYPES(reducescatter, simple)

// Collectives that move bytes without reducing them: one entry for every element type.
#define ANY_TYPE(coll, algo)                                                                            \
  extern "C" __global__ void __launch_bounds__(512) coll##_##algo##_any(const __grid_constant__ CollArgs a) { \
    pdl_enter(a);                                                                                        \
    coll##_##algo(a);                                                                                    \
  }

ANY_TYPE(allgather, packet)
ANY_TYPE(allgather, simple)
ANY_TYPE(broadcast, packet)
ANY_TYPE(broadcast, simple)

// Point-to-point kernel of mscclpp-collectives: send, receive and local copies of one group in
// one launch. Compiled at run time with NVRTC; `struct P2pArgs` and the P2P_* constants are
// generated from the Rust definitions and prepended.
//
// A pipe is (sender s, receiver r, block b): a ring of `slots` slots in r's scratch
// (inbox[s][b][slot], a 16-byte header then `slot_bytes` of data), a counter posted[s][b] in r's
// scratch (chunks s has put there, written by s) and a counter consumed[r][b] in s's scratch
// (chunks r has taken out, written by r). Every pipe end keeps how many chunks it has moved so
// far in device memory (seq), so a launch captured in a CUDA graph continues the sequence at
// every replay. The chunks of one message of L bytes go round-robin to B(L) = min(bmax,
// ceil(L / slot_bytes)) blocks, the same on both sides; each block is one pipe.
//
// Every wait is bounded: a thread's deadline is its kernel start + timeout; a failed wait records
// (kind, peer) in the error word (page-locked host memory) and sets the failed word, which every
// other wait and every later launch checks.

using namespace mscclpp;

__device__ __forceinline__ void store_release_sys(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void store_sys(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 load_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Local state (not mapped): [0] failed, then sent[nranks][bmax], then received[nranks][bmax].
__device__ __forceinline__ u64* failed_word(const P2pArgs& a) { return (u64*)a.hdr[P2P_STATE]; }
__device__ __forceinline__ u64* seq_word(const P2pArgs& a, u32 dir, u32 peer, u32 b) {
  return (u64*)a.hdr[P2P_STATE] + 1 + ((u64)dir * a.hdr[P2P_NRANKS] + peer) * a.hdr[P2P_BMAX] + b;
}
__device__ __forceinline__ char* scratch_of(const P2pArgs& a, u32 rank) {
  return (char*)((const u64*)a.hdr[P2P_PEERS])[rank];
}

__device__ void fail(const P2pArgs& a, u64 kind, u64 peer) {
  atomicExch((unsigned long long*)failed_word(a), 1ull);
  u64* err = (u64*)a.hdr[P2P_ERR];
  if (load_sys(err) == 0) store_sys(err, (1ull << 63) | (kind << 48) | ((peer & 0xffff) << 32));
}

__device__ __forceinline__ bool must_stop(const P2pArgs& a, u64 deadline, u32 peer, u32& spins) {
  if ((++spins & 255) != 0) return false;
  if (*(volatile const u64*)failed_word(a)) return true;
  if ((spins & 0xffff) == 0 && load_sys((const u64*)a.hdr[P2P_ABORT]) != 0) {
    fail(a, P2P_ERR_ABORTED, peer);
    return true;
  }
  if (detail::globaltimer() > deadline) {
    fail(a, P2P_ERR_TIMEOUT, peer);
    return true;
  }
  return false;
}

// Waits (thread 0 of the block) until *p >= want; false when the wait failed.
__device__ bool wait_at_least(const P2pArgs& a, const u64* p, u64 want, u64 deadline, u32 peer) {
  u32 spins = 0;
  while (detail::load_acquire_sys(p) < want) {
    if (must_stop(a, deadline, peer, spins)) return false;
  }
  return true;
}

// Copies n bytes with this block's threads; 16-, 4- or 1-byte units as the ends allow. `fresh`
// reads bypass L1 (data a peer wrote since this SM last read the slot).
__device__ __forceinline__ void block_copy(char* dst, const char* src, u64 n, bool fresh) {
  if (n == 0 || dst == src) return;
  const u64 t = threadIdx.x, step = blockDim.x;
  if ((((u64)dst | (u64)src | n) & 15) == 0) {
    const uint4* s4 = (const uint4*)src;
    uint4* d4 = (uint4*)dst;
    for (u64 i = t; i < n / 16; i += step) d4[i] = fresh ? __ldcv(s4 + i) : s4[i];
  } else if ((((u64)dst | (u64)src | n) & 3) == 0) {
    const unsigned int* s = (const unsigned int*)src;
    unsigned int* d = (unsigned int*)dst;
    for (u64 i = t; i < n / 4; i += step) d[i] = fresh ? __ldcv(s + i) : s[i];
  } else {
    for (u64 i = t; i < n; i += step) dst[i] = fresh ? *(volatile const char*)(src + i) : src[i];
  }
}

__device__ __forceinline__ u64 ceil_div(u64 x, u64 y) { return (x + y - 1) / y; }

extern "C" __global__ void __launch_bounds__(512) p2p_group(const __grid_constant__ P2pArgs a) {
  __shared__ int bad;
  __shared__ u64 seq;
  // This block's channel: a run of blocks serving one (kind, peer) and its operations in order.
  u32 c = 0, first = 0, nb = 0;
  for (; c < a.hdr[P2P_NCH]; c++) {
    const u64 w = a.ch[c];
    first = (u32)(w & 0xffff);
    nb = (u32)((w >> 16) & 0xffff);
    if (blockIdx.x >= first && blockIdx.x < first + nb) break;
  }
  if (c >= a.hdr[P2P_NCH]) return;
  const u32 b = blockIdx.x - first, op_lo = (u32)((a.ch[c] >> 32) & 0xffff), op_hi = (u32)(a.ch[c] >> 48);
  const u32 me = (u32)a.hdr[P2P_RANK], bmax = (u32)a.hdr[P2P_BMAX], slots = (u32)a.hdr[P2P_SLOTS];
  const u64 slot = a.hdr[P2P_SLOT_BYTES], stride = slot + 16;
  const u64 deadline = detail::globaltimer() + a.hdr[P2P_TIMEOUT_NS];
  if (*(volatile const u64*)failed_word(a)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) fail(a, P2P_ERR_FAILED_BEFORE, 0xffff);
    return;
  }
  if (threadIdx.x == 0) bad = 0;
  for (u32 o = op_lo; o < op_hi; o++) {
    const u64 kind = a.op[o][0] & 0xff, peer = a.op[o][0] >> 8;
    char* ptr = (char*)a.op[o][1];
    const char* src = (const char*)a.op[o][2];
    const u64 len = a.op[o][3];
    const u64 nchunks = ceil_div(len, slot);
    if (kind == P2P_COPY) {
      // Block b of nb copies chunks b, b + nb, ...
      for (u64 j = b; j < nchunks; j += nb) {
        const u64 lo = j * slot, n = len - lo < slot ? len - lo : slot;
        block_copy(ptr + lo, src + lo, n, false);
      }
      continue;
    }
    const u64 B = nchunks < bmax ? nchunks : bmax;
    if (b >= B) continue;
    const bool sending = kind == P2P_SEND;
    u64* my_seq = seq_word(a, sending ? 0 : 1, (u32)peer, b);
    __syncthreads();
    if (threadIdx.x == 0) seq = *my_seq;
    __syncthreads();
    u64 q = seq;
    for (u64 j = b; j < nchunks; j += B, q++) {
      const u64 lo = j * slot, n = len - lo < slot ? len - lo : slot;
      const u64 k = q % slots;
      if (sending) {
        // Wait for the slot to be free (the receiver took chunk q - slots out of it).
        if (threadIdx.x == 0 && q >= slots) {
          const u64* consumed = (const u64*)(scratch_of(a, me) + a.hdr[P2P_CONSUMED_OFF]) + peer * bmax + b;
          if (!wait_at_least(a, consumed, q + 1 - slots, deadline, (u32)peer)) bad = 1;
        }
        __syncthreads();
        if (bad) return;
        char* dst = scratch_of(a, (u32)peer) + a.hdr[P2P_DATA_OFF] + (((u64)me * bmax + b) * slots + k) * stride;
        block_copy(dst + 16, ptr + lo, n, false);
        if (threadIdx.x == 0) *(volatile u64*)dst = len;
        __syncthreads();
        if (threadIdx.x == 0) {
          __threadfence_system();
          u64* posted = (u64*)(scratch_of(a, (u32)peer) + a.hdr[P2P_POSTED_OFF]) + (u64)me * bmax + b;
          store_release_sys(posted, q + 1);
        }
      } else {
        const char* box = scratch_of(a, me) + a.hdr[P2P_DATA_OFF] + ((peer * bmax + b) * slots + k) * stride;
        if (threadIdx.x == 0) {
          const u64* posted = (const u64*)(scratch_of(a, me) + a.hdr[P2P_POSTED_OFF]) + peer * bmax + b;
          if (!wait_at_least(a, posted, q + 1, deadline, (u32)peer)) {
            bad = 1;
          } else if (load_sys((const u64*)box) != len) {
            // The sender's message has another size: both sides would split it differently.
            fail(a, P2P_ERR_MISMATCH, peer);
            bad = 1;
          }
        }
        __syncthreads();
        if (bad) return;
        block_copy(ptr + lo, box + 16, n, true);
        __syncthreads();
        if (threadIdx.x == 0) {
          __threadfence_system();
          u64* consumed = (u64*)(scratch_of(a, (u32)peer) + a.hdr[P2P_CONSUMED_OFF]) + (u64)me * bmax + b;
          store_release_sys(consumed, q + 1);
        }
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) *my_seq = q;
  }
}

// The execution-plan interpreter of mscclpp-executor. Compiled at run time with NVRTC; the
// structs DevBuf, DevOp and ExecArgs and the OP_* constants are generated from the Rust
// definitions (src/device.rs) and prepended.
//
// Block b runs its ops (slots b * ops_stride .., the count in each slot's block_ops) in order, with __syncthreads() after
// each operation (so one operation's writes are visible to the whole block before the next, and
// a signal follows every thread's stores). A pipeline op is followed by its body; the body runs
// n_iter times over unit_size-byte slices of every data operation.
//
// LL packets carry the launch's flag (each block's own word in ExecArgs.flags, advanced by the
// block at its end, so CUDA graph replays use a fresh flag each time; all blocks' flags stay
// equal); with a double scratch buffer the flag's parity picks the half.
//
// Every wait is bounded: a thread's deadline is the moment one of its waits first spun long
// enough to look at the clock + timeout_ns (barriers and semaphores, which wait for this rank's
// own blocks, an eighth later). The first wait
// that fails records (kind, peer, block, op) in the error word (page-locked host memory the host
// reads) and sets ExecState.failed, which every other wait and every later launch checks.

#define ERR_TIMEOUT 1ull
#define ERR_ABORTED 2ull
#define ERR_PROXY 3ull
#define ERR_FAILED_BEFORE 4ull

#define KIND_LOCAL 0u
#define KIND_MEMORY 1u
#define KIND_PORT 2u
#define BUF_SCRATCH 2u
#define NO_PEER 0xffffu

#define CT_MEMORY 1u
#define CT_PORT 2u

#define DT_I32 0u
#define DT_U32 1u
#define DT_F32 2u
#define DT_F16 3u
#define DT_BF16 4u

#define RO_SUM 0u
#define RO_MIN 1u
#define RO_MAX 2u

struct ExecState {
  u32 unused0;   // was the shared LL flag (now per block: ExecArgs.flags)
  u32 failed;    // nonzero once any wait of this rank failed
  u32 unused2;   // was the count of finished blocks
  u32 reported;  // the error word was written
};

struct Ctx {
  const ExecArgs* a;
  char* buf[3];
  u64 scratch_off;
  // This thread's wait limit: 0 until a wait first spins long enough to look at the clock, then
  // that moment + timeout_ns (reading the clock at every launch's start costs latency).
  mutable u64 deadline;
  u32 flag;
  u32 block;
  u32 op;
};

__device__ __forceinline__ void store_sys(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 load_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u32 vload(const u32* p) { return *(volatile const u32*)p; }

// Records the first error of this rank (host-visible) and stops every wait of this rank.
__device__ void fail(const Ctx& c, u64 kind, u32 peer) {
  ExecState* st = (ExecState*)c.a->state;
  atomicExch(&st->failed, 1u);
  if (atomicCAS(&st->reported, 0u, 1u) == 0u) {
    store_sys((u64*)c.a->err, (1ull << 63) | (kind << 48) | ((u64)(peer & 0xffff) << 32) |
                                  ((u64)(c.block & 0xffff) << 16) | (u64)(c.op & 0xffff));
  }
}

// Whether this thread should stop waiting: failed before, aborted by the host, or past its
// deadline (+ `extra`).
__device__ __forceinline__ bool must_stop_by(const Ctx& c, u32 peer, u32& spins, u64 extra) {
  if ((++spins & 127) != 0) return false;
  if (vload(&((ExecState*)c.a->state)->failed)) return true;
  if ((spins & 0x3fff) == 0 && load_sys((const u64*)c.a->abort) != 0) {
    fail(c, ERR_ABORTED, peer);
    return true;
  }
  const u64 now = detail::globaltimer();
  if (c.deadline == 0) c.deadline = now + c.a->timeout_ns;
  if (now > c.deadline + extra) {
    fail(c, ERR_TIMEOUT, peer);
    return true;
  }
  return false;
}
__device__ __forceinline__ bool must_stop(const Ctx& c, u32 peer, u32& spins) {
  return must_stop_by(c, peer, spins, 0);
}
// Waits inside the rank (barriers, semaphores) only wait for this rank's other blocks, which
// wait for peers: they time out an eighth of the timeout later, so the report names the wait
// that stalled (and the peer it waited for) rather than a barrier behind it.
__device__ __forceinline__ bool must_stop_local(const Ctx& c, u32& spins) {
  return must_stop_by(c, NO_PEER, spins, c.a->timeout_ns / 8);
}

__device__ __forceinline__ u64 remaining(const Ctx& c) {
  const u64 now = detail::globaltimer();
  if (c.deadline == 0) c.deadline = now + c.a->timeout_ns;
  return c.deadline > now ? c.deadline - now : 0;
}

// ---------------------------------------------------------------------------------------------
// Addresses. `mult` is 2 for packet views (packets take twice the data's bytes).

__device__ __forceinline__ char* addr(const Ctx& c, const DevBuf& b, u64 extra, u64 mult) {
  u64 off = (b.off + extra) * mult;
  if (b.kind == KIND_MEMORY) return (char*)(b.base + off + (b.btype == BUF_SCRATCH ? c.scratch_off : 0));
  return c.buf[b.btype < 3 ? b.btype : 0] + off;
}
// A packet range in this rank's scratch (the reductions' packet sources and unpack sources).
__device__ __forceinline__ char* scratch_pkt(const Ctx& c, const DevBuf& b) { return c.buf[BUF_SCRATCH] + 2 * b.off; }

__device__ __forceinline__ u64 slice(u64 size, u64 off, u64 unit) {
  if (off >= size) return 0;
  u64 n = size - off;
  return n < unit ? n : unit;
}

// ---------------------------------------------------------------------------------------------
// Element arithmetic on 4-byte words.

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
template <typename A>
__device__ __forceinline__ A apply(u32 op, A x, A y) {
  if (op == RO_MIN) return x < y ? x : y;
  if (op == RO_MAX) return x > y ? x : y;
  return x + y;
}
__device__ __forceinline__ u32 red_word(u32 dt, u32 op, u32 x, u32 y) {
  switch (dt) {
    case DT_I32: return (u32)apply<int>(op, (int)x, (int)y);
    case DT_U32: return apply<u32>(op, x, y);
    case DT_F32: return __float_as_uint(apply<float>(op, __uint_as_float(x), __uint_as_float(y)));
    case DT_F16: {
      u32 lo = f2h(apply<float>(op, h2f(x & 0xffff), h2f(y & 0xffff)));
      u32 hi = f2h(apply<float>(op, h2f(x >> 16), h2f(y >> 16)));
      return lo | (hi << 16);
    }
    default: {
      u32 lo = f2b(apply<float>(op, b2f(x & 0xffff), b2f(y & 0xffff)));
      u32 hi = f2b(apply<float>(op, b2f(x >> 16), b2f(y >> 16)));
      return lo | (hi << 16);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Copies: 16-byte units where everything is aligned, else 4-byte, else bytes.

__device__ void copy_bytes(char* dst, const char* src, u64 n) {
  const u32 t = threadIdx.x, nt = blockDim.x;
  if (((((u64)dst) | ((u64)src) | n) & 15) == 0) {
    for (u64 i = t; i < n / 16; i += nt) ((uint4*)dst)[i] = ((const uint4*)src)[i];
  } else if (((((u64)dst) | ((u64)src) | n) & 3) == 0) {
    for (u64 i = t; i < n / 4; i += nt) ((u32*)dst)[i] = ((const u32*)src)[i];
  } else {
    for (u64 i = t; i < n; i += nt) dst[i] = src[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Packets: LL16 (8 data bytes in 16) and LL8 (4 in 8), behind one interface of u32 words.

struct PL16 {
  typedef LL16Packet P;
  static constexpr int W = 2;  // data words per packet
  __device__ static void write(P* p, const u32* w, u32 flag) { p->write(w[0], w[1], flag); }
  __device__ static bool read_once(const P* p, u32 flag, u32* w) {
    uint2 v;
    bool busy = p->readOnce(flag, v);
    w[0] = v.x;
    w[1] = v.y;
    return busy;
  }
};
struct PL8 {
  typedef LL8Packet P;
  static constexpr int W = 1;
  __device__ static void write(P* p, const u32* w, u32 flag) { p->write(w[0], flag); }
  __device__ static bool read_once(const P* p, u32 flag, u32* w) { return p->readOnce(flag, w[0]); }
};

// Reads packet i of `p` with the bounded wait; false when the wait stopped.
template <typename PK>
__device__ __forceinline__ bool read_pkt(const Ctx& c, const typename PK::P* p, u32 peer, u32* w) {
  u32 spins = 0;
  while (PK::read_once(p, c.flag, w)) {
    if (must_stop(c, peer, spins)) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Synchronization.

__device__ void barrier(const Ctx& c, const DevOp& op) {
  __syncthreads();
  if (threadIdx.x == 0) {
    u32* ctr = (u32*)c.a->barriers + (op.barrier_id & 15);
    u32 n = op.n_blocks ? op.n_blocks : 1;
    __threadfence();
    u32 old = atomicAdd(ctr, 1u);
    u32 target = (old / n + 1) * n;
    u32 spins = 0;
    while ((int)(vload(ctr) - target) < 0) {
      if (must_stop_local(c, spins)) break;
    }
    __threadfence();
  }
}

__device__ void wait_token(const Ctx& c, u64* inbound, u64* expected, u32 peer, bool relaxed) {
  u64 e = detail::fetch_add_relaxed_gpu(expected, 1) + 1;
  u32 spins = 0;
  while ((relaxed ? detail::load_relaxed_sys(inbound) : detail::load_acquire_sys(inbound)) < e) {
    if (must_stop(c, peer, spins)) {
      detail::fetch_add_relaxed_gpu(expected, (u64)-1);
      return;
    }
  }
}

__device__ __forceinline__ BaseMemoryChannelDeviceHandle* mem_chan(const Ctx& c, u32 i) {
  return (BaseMemoryChannelDeviceHandle*)c.a->mem_chans + i;
}
__device__ __forceinline__ BasePortChannelDeviceHandle* port_chan(const Ctx& c, u32 i) {
  return (BasePortChannelDeviceHandle*)c.a->port_chans + i;
}

__device__ void proxy_failed(const Ctx& c, BasePortChannelDeviceHandle* h, u32 peer) {
  fail(c, h->fifo_.proxy_error() != 0 ? ERR_PROXY : ERR_TIMEOUT, peer);
}

// Pushes a trigger with the bounded wait; with `flush`, waits until the proxy completed it.
__device__ void port_push(const Ctx& c, BasePortChannelDeviceHandle* h, ProxyTrigger t, bool flush, u32 peer) {
  if (vload(&((ExecState*)c.a->state)->failed)) return;
  u64 pos = 0;
  if (!h->fifo_.push_for(t, remaining(c), &pos)) {
    proxy_failed(c, h, peer);
    return;
  }
  if (!flush) return;
  u32 spins = 0;
  u64 done;
  while ((done = detail::load_acquire_sys(h->flushDonePos_)) <= pos) {
    if (must_stop(c, peer, spins)) return;
  }
  if (done == ~0ull) proxy_failed(c, h, peer);
}

__device__ void signal(const Ctx& c, const DevOp& op, bool relaxed) {
  const u32 t = threadIdx.x;
  if (t >= op.n_chan) return;
  if (op.ctype == CT_MEMORY) {
    u64* remote = mem_chan(c, op.chans[t])->semaphore_.remoteInboundToken;
    if (relaxed) {
      detail::red_add_relaxed_sys(remote, 1);
    } else {
      __threadfence_system();
      detail::red_add_release_sys(remote, 1);
    }
  } else if (op.ctype == CT_PORT) {
    BasePortChannelDeviceHandle* h = port_chan(c, op.chans[t]);
    port_push(c, h, ProxyTrigger(TriggerFlag, 0, 0, 0, 0, 0, h->semaphoreId_), false, op.chan_peer[t]);
  }
}

__device__ void wait(const Ctx& c, const DevOp& op, bool relaxed) {
  const u32 t = threadIdx.x;
  if (t >= op.n_chan) return;
  if (op.ctype == CT_MEMORY) {
    MemoryDevice2DeviceSemaphoreDeviceHandle& s = mem_chan(c, op.chans[t])->semaphore_;
    wait_token(c, s.inboundToken, s.expectedInboundToken, op.chan_peer[t], relaxed);
  } else if (op.ctype == CT_PORT) {
    Host2DeviceSemaphoreDeviceHandle& s = port_chan(c, op.chans[t])->semaphore_;
    wait_token(c, s.inboundToken, s.expectedInboundToken, op.chan_peer[t], relaxed);
  }
  if (!relaxed) __threadfence_system();
}

__device__ void flush(const Ctx& c, const DevOp& op) {
  const u32 t = threadIdx.x;
  if (t >= op.n_chan || op.ctype != CT_PORT) return;
  BasePortChannelDeviceHandle* h = port_chan(c, op.chans[t]);
  port_push(c, h, ProxyTrigger(TriggerSync, 0, 0, 0, 0, 0, h->semaphoreId_), true, op.chan_peer[t]);
}

__device__ void sem_acquire(const Ctx& c, const DevOp& op) {
  const u32 t = threadIdx.x;
  if (t >= op.n_sems) return;
  u32* s = (u32*)c.a->sems + op.sems[t];
  u32 spins = 0;
  for (;;) {
    u32 v = vload(s);
    if (v > 0 && atomicCAS(s, v, v - 1) == v) break;
    if (must_stop_local(c, spins)) return;
  }
  __threadfence();
}

__device__ void sem_release(const Ctx& c, const DevOp& op) {
  const u32 t = threadIdx.x;
  if (t >= op.n_sems) return;
  __threadfence();
  atomicAdd((u32*)c.a->sems + op.sems[t], 1u);
}

// ---------------------------------------------------------------------------------------------
// Data movement.

// put / get / copy (and pws, pwsf): pair i copies src[min(i, n_src - 1)] into dst[i]; through a
// port channel, thread i pushes pair i to the proxy instead.
__device__ void transfer(const Ctx& c, const DevOp& op, u64 po, u64 unit, bool with_signal, bool with_flush) {
  const u32 n = op.n_dst;
  if (op.ctype == CT_PORT && op.kind != OP_copy && op.kind != OP_get) {
    const u32 t = threadIdx.x;
    if (t >= n || op.n_src == 0) return;
    const DevBuf& s = op.src[t < op.n_src ? t : op.n_src - 1];
    const DevBuf& d = op.dst[t];
    u64 size = slice(d.size, po, unit);
    BasePortChannelDeviceHandle* h = port_chan(c, op.chans[t < op.n_chan ? t : 0]);
    u64 soff = s.off + po + (s.btype == BUF_SCRATCH ? c.scratch_off : 0);
    u64 doff = d.off + po + (d.btype == BUF_SCRATCH ? c.scratch_off : 0);
    TriggerType ty = TriggerData | (with_signal ? TriggerFlag : 0) | (with_flush ? TriggerSync : 0);
    if (size > 0 || with_signal || with_flush)
      port_push(c, h, ProxyTrigger(ty, d.mem_id, doff, s.mem_id, soff, size, h->semaphoreId_), with_flush,
                op.chan_peer[t < op.n_chan ? t : 0]);
    return;
  }
  for (u32 i = 0; i < n && op.n_src > 0; i++) {
    const DevBuf& s = op.src[i < op.n_src ? i : op.n_src - 1];
    const DevBuf& d = op.dst[i];
    copy_bytes(addr(c, d, po, 1), addr(c, s, po, 1), slice(op.kind == OP_get ? s.size : d.size, po, unit));
  }
  if (with_signal && op.ctype == CT_MEMORY) {
    __syncthreads();
    signal(c, op, false);
  }
}

// re / res / rre / rres: dst[0] = src[0] (op) src[1] ... ; dst[1..] get copies of the result.
__device__ void reduce(const Ctx& c, const DevOp& op, u64 po, u64 unit) {
  const u32 dt = (u32)c.a->dtype, rop = op.reduce_op;
  const u64 size = slice(op.src[0].size, po, unit);
  const u32 ns = op.n_src, nd = op.n_dst;
  const char* s[10];
  char* d[10];
  u64 align = size;
  for (u32 k = 0; k < ns; k++) {
    s[k] = addr(c, op.src[k], po, 1);
    align |= (u64)s[k];
  }
  for (u32 k = 0; k < nd; k++) {
    d[k] = addr(c, op.dst[k], po, 1);
    align |= (u64)d[k];
  }
  if ((align & 15) == 0) {
    for (u64 i = threadIdx.x; i < size / 16; i += blockDim.x) {
      uint4 acc = ((const uint4*)s[0])[i];
      for (u32 k = 1; k < ns; k++) {
        uint4 v = ((const uint4*)s[k])[i];
        acc.x = red_word(dt, rop, acc.x, v.x);
        acc.y = red_word(dt, rop, acc.y, v.y);
        acc.z = red_word(dt, rop, acc.z, v.z);
        acc.w = red_word(dt, rop, acc.w, v.w);
      }
      for (u32 k = 0; k < nd; k++) ((uint4*)d[k])[i] = acc;
    }
  } else {
    for (u64 i = threadIdx.x; i < size / 4; i += blockDim.x) {
      u32 acc = ((const u32*)s[0])[i];
      for (u32 k = 1; k < ns; k++) acc = red_word(dt, rop, acc, ((const u32*)s[k])[i]);
      for (u32 k = 0; k < nd; k++) ((u32*)d[k])[i] = acc;
    }
  }
}

// cpkt / ppkt: data of src[min(i, n_src - 1)] into packets at dst[i] (local or a peer's scratch);
// ppkt through a port channel moves packets already in this rank's scratch.
template <typename PK>
__device__ void put_packets(const Ctx& c, const DevOp& op) {
  typedef typename PK::P P;
  if (op.ctype == CT_PORT && op.kind == OP_ppkt) {
    const u32 t = threadIdx.x;
    if (t >= op.n_dst || op.n_src == 0) return;
    const DevBuf& s = op.src[t < op.n_src ? t : op.n_src - 1];
    const DevBuf& d = op.dst[t];
    BasePortChannelDeviceHandle* h = port_chan(c, op.chans[t < op.n_chan ? t : 0]);
    u64 soff = 2 * s.off + (s.btype == BUF_SCRATCH ? c.scratch_off : 0);
    u64 doff = 2 * d.off + c.scratch_off;
    port_push(c, h, ProxyTrigger(TriggerData, d.mem_id, doff, s.mem_id, soff, 2 * s.size, h->semaphoreId_), false,
              op.chan_peer[t < op.n_chan ? t : 0]);
    return;
  }
  for (u32 i = 0; i < op.n_dst && op.n_src > 0; i++) {
    const DevBuf& s = op.src[i < op.n_src ? i : op.n_src - 1];
    const u32* src = (const u32*)addr(c, s, 0, 1);
    P* dst = (P*)addr(c, op.dst[i], 0, 2);
    const u64 n = s.size / (4 * PK::W);
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) PK::write(dst + j, src + j * PK::W, c.flag);
  }
}

// rppkt: packets in this rank's scratch (src[0]), once arrived, forwarded to every dst.
template <typename PK>
__device__ void read_put_packets(const Ctx& c, const DevOp& op) {
  typedef typename PK::P P;
  const DevBuf& s = op.src[0];
  const P* src = (const P*)scratch_pkt(c, s);
  const u64 n = s.size / (4 * PK::W);
  if (op.ctype == CT_PORT) {
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
      u32 w[PK::W];
      if (!read_pkt<PK>(c, src + j, s.peer, w)) break;
    }
    __syncthreads();
    const u32 t = threadIdx.x;
    if (t >= op.n_dst) return;
    const DevBuf& d = op.dst[t];
    BasePortChannelDeviceHandle* h = port_chan(c, op.chans[t < op.n_chan ? t : 0]);
    u64 soff = 2 * s.off + c.scratch_off, doff = 2 * d.off + c.scratch_off;
    port_push(c, h, ProxyTrigger(TriggerData, d.mem_id, doff, s.mem_id, soff, 2 * s.size, h->semaphoreId_), false,
              op.chan_peer[t < op.n_chan ? t : 0]);
    return;
  }
  for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
    u32 w[PK::W];
    if (!read_pkt<PK>(c, src + j, s.peer, w)) return;
    for (u32 i = 0; i < op.n_dst; i++) PK::write((P*)addr(c, op.dst[i], 0, 2) + j, w, c.flag);
  }
}

// upkt: packets in this rank's scratch (src[0]) into data at dst[0].
template <typename PK>
__device__ void unpack_packets(const Ctx& c, const DevOp& op) {
  typedef typename PK::P P;
  const DevBuf& s = op.src[0];
  const P* src = (const P*)scratch_pkt(c, s);
  u32* dst = (u32*)addr(c, op.dst[0], 0, 1);
  const u64 n = s.size / (4 * PK::W);
  for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
    u32 w[PK::W];
    if (!read_pkt<PK>(c, src + j, s.peer, w)) return;
    for (int k = 0; k < PK::W; k++) dst[j * PK::W + k] = w[k];
  }
}

// repkt / respkt / recpkt / recspkt: dst[0] = src[0] (op) the packets of src[1..] (in this rank's
// scratch); recpkt and recspkt also write the result as packets at dst[1] (local); respkt and
// recspkt send it as packets to the remaining dsts.
template <typename PK>
__device__ void reduce_packets(const Ctx& c, const DevOp& op, bool keep_copy) {
  typedef typename PK::P P;
  const u32 dt = (u32)c.a->dtype, rop = op.reduce_op;
  const u32* base = (const u32*)addr(c, op.src[0], 0, 1);
  u32* out = (u32*)addr(c, op.dst[0], 0, 1);
  const u64 n = op.src[0].size / (4 * PK::W);
  const u32 first_remote = keep_copy ? 2 : 1;
  for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
    u32 acc[PK::W];
    for (int k = 0; k < PK::W; k++) acc[k] = base[j * PK::W + k];
    for (u32 i = 1; i < op.n_src; i++) {
      u32 w[PK::W];
      if (!read_pkt<PK>(c, (const P*)scratch_pkt(c, op.src[i]) + j, op.src[i].peer, w)) return;
      for (int k = 0; k < PK::W; k++) acc[k] = red_word(dt, rop, acc[k], w[k]);
    }
    for (int k = 0; k < PK::W; k++) out[j * PK::W + k] = acc[k];
    if (keep_copy && op.n_dst > 1) PK::write((P*)addr(c, op.dst[1], 0, 2) + j, acc, c.flag);
    for (u32 i = first_remote; i < op.n_dst; i++) PK::write((P*)addr(c, op.dst[i], 0, 2) + j, acc, c.flag);
  }
}

// ---------------------------------------------------------------------------------------------

template <typename PK>
__device__ void exec_op(const Ctx& c, const DevOp& op, u64 po, u64 unit) {
  switch (op.kind) {
    case OP_nop: break;
    case OP_barrier: barrier(c, op); break;
    case OP_signal: signal(c, op, false); break;
    case OP_rlxsignal: signal(c, op, true); break;
    case OP_wait: wait(c, op, false); break;
    case OP_rlxwait: wait(c, op, true); break;
    case OP_flush: flush(c, op); break;
    case OP_put: transfer(c, op, po, unit, false, false); break;
    case OP_pws: transfer(c, op, po, unit, true, false); break;
    case OP_pwsf: transfer(c, op, po, unit, true, true); break;
    case OP_get: transfer(c, op, po, unit, false, false); break;
    case OP_copy: transfer(c, op, po, unit, false, false); break;
    case OP_ppkt: put_packets<PK>(c, op); break;
    case OP_cpkt: put_packets<PK>(c, op); break;
    case OP_rppkt: read_put_packets<PK>(c, op); break;
    case OP_upkt: unpack_packets<PK>(c, op); break;
    case OP_re: reduce(c, op, po, unit); break;
    case OP_res: reduce(c, op, po, unit); break;
    case OP_rre: reduce(c, op, po, unit); break;
    case OP_rres: reduce(c, op, po, unit); break;
    case OP_repkt: reduce_packets<PK>(c, op, false); break;
    case OP_respkt: reduce_packets<PK>(c, op, false); break;
    case OP_recpkt: reduce_packets<PK>(c, op, true); break;
    case OP_recspkt: reduce_packets<PK>(c, op, true); break;
    case OP_sem_acquire: sem_acquire(c, op); break;
    case OP_sem_release: sem_release(c, op); break;
    default: break;  // NVLS operations are refused when the plan loads
  }
}

// Whether `next` may start in a thread before every thread of the block finished `op`: `op`
// only wrote LL packets (to this rank's or a peer's scratch, not through a proxy) and `next`
// reads packets by polling their flags (so it waits for each one itself) and reads no data
// `op` wrote. After the last operation no barrier is needed either: every thread took the
// flag at the start.
__device__ __forceinline__ bool packets_then_packets(const DevOp& op, const DevOp& next) {
  const bool writes_packets = (op.kind == OP_ppkt || op.kind == OP_cpkt) && op.ctype != CT_PORT;
  const bool polls_packets = next.kind == OP_repkt || next.kind == OP_respkt || next.kind == OP_recpkt ||
                             next.kind == OP_recspkt || next.kind == OP_upkt ||
                             (next.kind == OP_rppkt && next.ctype != CT_PORT);
  return writes_packets && polls_packets;
}

// A block's operations are copied to shared memory at its start when they fit (one step for
// every thread instead of a chain of global loads per operation); else read where they are.
#define SHARED_OPS_BYTES 12288

template <typename PK>
__device__ void run(const ExecArgs& a) {
  __shared__ u32 s_flag;
  __shared__ u32 s_stop;
  __shared__ __align__(16) u64 s_ops[SHARED_OPS_BYTES / 8];
  ExecState* st = (ExecState*)a.state;
  const DevOp* g_ops = (const DevOp*)a.ops + (u64)blockIdx.x * a.ops_stride;
  const u64 op_bytes = a.ops_stride * sizeof(DevOp);
  const bool in_shared = op_bytes <= SHARED_OPS_BYTES;
  if (in_shared) {
    const u64* src = (const u64*)g_ops;
    for (u32 i = threadIdx.x; i < op_bytes / 8; i += blockDim.x) s_ops[i] = src[i];
  }
  // While the operations arrive, the first warp asks L1 for this block's share of the input (at
  // most 32 lines of 128 bytes): the first operation of most plans reads it, and an L1 hit then
  // replaces a second round trip to L2.
  if (threadIdx.x < 32) {
    const u64 lo = ((u64)blockIdx.x * a.input_bytes / gridDim.x) & ~127ull;
    const u64 hi = (u64)(blockIdx.x + 1) * a.input_bytes / gridDim.x;
    const u64 line = lo + (u64)threadIdx.x * 128;
    if (line < hi) asm volatile("prefetch.global.L1 [%0];" ::"l"(a.input + line));
  }
  u32* my_flag = (u32*)a.flags + blockIdx.x;
  if (threadIdx.x == 0) {
    s_flag = vload(my_flag);
    // The abort word lives in page-locked host memory: reading it here would put a PCIe round
    // trip (about a microsecond) at the start of every launch. Waits read it as they spin, and
    // the host refuses launches once it is set.
    s_stop = vload(&st->failed) != 0 ? 1u : 0u;
  }
  __syncthreads();
  Ctx c;
  c.a = &a;
  c.flag = s_flag;
  c.deadline = 0;
  c.block = blockIdx.x;
  c.op = 0xffff;
  c.scratch_off = (a.scratch_half != 0 && (c.flag & 1u) == 0) ? a.scratch_half : 0;
  c.buf[0] = (char*)a.input;
  c.buf[1] = (char*)a.output;
  c.buf[2] = (char*)a.scratch + c.scratch_off;
  if (s_stop) {
    if (threadIdx.x == 0) fail(c, ERR_FAILED_BEFORE, NO_PEER);
    return;
  }
  const DevOp* ops = in_shared ? (const DevOp*)s_ops : g_ops;
  const u32 count = ops[0].block_ops;
  for (u32 i = 0; i < count;) {
    const DevOp& op = ops[i];
    c.op = i;
    if (op.kind == OP_pipeline) {
      for (u32 it = 0; it < op.n_iter; it++) {
        for (u32 j = 1; j <= op.n_body && i + j < count; j++) {
          c.op = i + j;
          exec_op<PK>(c, ops[i + j], (u64)it * op.unit_size, op.unit_size);
          __syncthreads();
        }
      }
      i += 1 + op.n_body;
    } else {
      exec_op<PK>(c, op, 0, ~0ull);
      i++;
      if (i < count && !packets_then_packets(op, ops[i])) __syncthreads();
    }
  }
  // Each block advances its own flag for the next launch (which starts after this one ends: no
  // fence, no shared counter to wait on). Every block runs every launch, so the flags stay equal.
  // Past 2^32 launches it skips 0 (the value of zeroed memory) and keeps the parity alternating.
  if (threadIdx.x == 0) *my_flag = c.flag + 1 == 0 ? 2u : c.flag + 1;
}

// The arguments stay in parameter space (__grid_constant__): taking their address does not copy
// them to each thread's local memory.
extern "C" __global__ void __launch_bounds__(1024) mscclpp_exec_ll16(const __grid_constant__ ExecArgs a) { run<PL16>(a); }
extern "C" __global__ void __launch_bounds__(1024) mscclpp_exec_ll8(const __grid_constant__ ExecArgs a) { run<PL8>(a); }

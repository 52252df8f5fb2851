// mscclpp (Rust) device API for CUDA kernels: FIFO, semaphores and PortChannel handles.
//
// Include it as "mscclpp_rs/device.cuh" (the crate ships it under `include/`; `mscclpp::device::
// include_dir()` and `write_header(dir)` find or write it; `mscclpp::device::compile` hands it to
// NVRTC). It is self-contained: no #include, no libcu++, every atomic is inline PTX. Device code is
// compiled where `__CUDACC__` is defined (nvcc, NVRTC, clang -x cuda); NVRTC does not define
// `__NVCC__`, so nothing here depends on it. Without `__CUDACC__` (a host C++ compiler) only the
// structs, their layouts and the host-callable `ProxyTrigger` constructor remain, which is what the
// crate's layout test compiles with g++.
//
// Layouts are byte-identical to MSCCL++'s device handles (x86-64 and CUDA): a kernel ported from
// MSCCL++ changes only its include. The Rust side (`mscclpp::device::handles`) asserts the same
// sizes and offsets at compile time, and a test compares them with this header compiled by g++.
//
// Memory orderings (the PTX each method emits):
//   FIFO push:   head: atom.relaxed.gpu.add; full check against tailCache (plain, may be stale);
//                when full, wait for the slot: ld.acquire.gpu of tailCache with nanosleep
//                backoff, ld.acquire.sys of tail only by the next waiters in line (or when
//                tailCache stood still), who raise tailCache with red.release.gpu.max (every
//                tailCache update is that red.max, so it never goes back); trigger: one 16-byte
//                st.global.release.sys.v2.u64 {fst, snd} with the lap-parity bit 63 of snd set to
//                ((pos >> sizeShift) & 1) ^ 1 (lap 0 writes 1, so a zeroed ring reads empty).
//   FIFO poll/sync: ld.acquire.sys of tail.
//   semaphore wait: expected: atom.relaxed.gpu.add 1; inbound: ld.acquire.sys until >= expected.
//   semaphore poll: ld.acquire.sys inbound > ld.relaxed.gpu expected, then expected += 1.
//   flush:       push a Sync trigger at position pos, then ld.acquire.sys of flushDonePos until
//                it is > pos (each flusher waits for its own position).
//   MemoryDevice2Device signal: red.release.sys.global.add.u64 on the peer's token.
//
// Waits. MSCCL++'s waits take a spin count and trap (`__trap()`, the kernel fails with an illegal
// instruction error) when it runs out; a negative count never traps. They are kept with
// MSCCL++'s defaults. Each also has a time-limited form using %globaltimer (nanoseconds) that
// returns false instead of trapping: `push_for`, `sync_for`, `wait_for`, `flush_for`.
//
// Proxy error publication. The FIFO's `tail` word lives in a mapped host control page whose next
// word (tail[1]) is `proxy_error`: 0 while the proxy runs; nonzero once it failed or stopped (the
// host's `ProxyService::status()`/`stop()` say why). On error or stop the proxy first sets
// `proxy_error`, then writes UINT64_MAX into every flushDonePos word, so a trapping `flush()`
// returns instead of hanging. The time-limited PortChannel and FIFO calls check `proxy_error`
// while they wait and return false as soon as it is nonzero; `flush_for` also returns false when
// it sees UINT64_MAX (the flush was abandoned, not completed).
//
// Trigger encoding (16 bytes, MSCCL++'s bit fields; bit 63 of snd belongs to the FIFO):
//   fst bits 0..31 size, 32..63 srcOffset;
//   snd bits 0..31 dstOffset, 32..40 srcMemoryId, 41..49 dstMemoryId, 50..52 type,
//       53..62 semaphoreId, 63 FIFO commit bit.
//   type: OR of TriggerData (1, a put), TriggerFlag (2, a signal), TriggerSync (4, a flush);
//   type 0 = atomicAdd: fst holds the whole signed 64-bit operand, snd dstOffset/dstMemoryId/
//   semaphoreId. Types 5 (put+flush without signal) and 6 (signal+flush) are legal OR-ings.
//   The proxy records a trigger it cannot execute as its error; it never crashes on one.
#ifndef MSCCLPP_RS_DEVICE_CUH_
#define MSCCLPP_RS_DEVICE_CUH_

// Bumped whenever a layout or protocol here changes; `mscclpp::device::ABI_VERSION` must match.
#define MSCCLPP_RS_ABI_VERSION 1

#if defined(__CUDACC__)
#define MSCCLPP_RS_DEVICE_COMPILE 1
#define MSCCLPP_RS_DEVICE __device__ __forceinline__
#define MSCCLPP_RS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MSCCLPP_RS_HOST_DEVICE inline
#endif

namespace mscclpp {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

static_assert(sizeof(u32) == 4 && sizeof(u64) == 8 && sizeof(i64) == 8, "fixed-width types");

constexpr u32 ABI_VERSION = MSCCLPP_RS_ABI_VERSION;

/// Numeric ID of a semaphore registered with a ProxyService (10 bits on the wire).
typedef u32 SemaphoreId;
/// Numeric ID of a memory registered with a ProxyService (9 bits on the wire).
typedef u32 MemoryId;

typedef u64 TriggerType;
constexpr TriggerType TriggerData = 0x1;  // a put
constexpr TriggerType TriggerFlag = 0x2;  // a signal
constexpr TriggerType TriggerSync = 0x4;  // a flush
constexpr TriggerType TriggerAtomicAdd = 0x0;  // feature/ep: operand in fst

constexpr unsigned int TriggerBitsSize = 32;
constexpr unsigned int TriggerBitsOffset = 32;
constexpr unsigned int TriggerBitsMemoryId = 9;
constexpr unsigned int TriggerBitsType = 3;
constexpr unsigned int TriggerBitsSemaphoreId = 10;
constexpr unsigned int TriggerBitsFifoReserved = 1;

/// MSCCL++'s default FIFO size (slots, a power of two).
constexpr int DEFAULT_FIFO_SIZE = 512;

/// One request from a kernel to the proxy: two 64-bit words (see the encoding above).
union alignas(16) ProxyTrigger {
  struct {
    u64 fst;
    u64 snd;
  };
  struct {
    u64 size : TriggerBitsSize;
    u64 srcOffset : TriggerBitsOffset;
    u64 dstOffset : TriggerBitsOffset;
    u64 srcMemoryId : TriggerBitsMemoryId;
    u64 dstMemoryId : TriggerBitsMemoryId;
    u64 type : TriggerBitsType;
    u64 semaphoreId : TriggerBitsSemaphoreId;
    u64 reserved : TriggerBitsFifoReserved;
  } fields;

  ProxyTrigger() = default;

  /// MSCCL++'s constructor. Each value is masked to its field's width (a wider value is cut, as in
  /// MSCCL++ release builds); the Rust encoders refuse such values instead. Host-callable too.
  MSCCLPP_RS_HOST_DEVICE ProxyTrigger(TriggerType type, u32 dstId, u64 dstOffset, u32 srcId, u64 srcOffset,
                                      u64 bytes, u32 semaphoreId) {
    const u64 m32 = 0xffffffffull;
    const u64 mMem = (1ull << TriggerBitsMemoryId) - 1;
    const u64 mType = (1ull << TriggerBitsType) - 1;
    const u64 mSem = (1ull << TriggerBitsSemaphoreId) - 1;
    fst = ((srcOffset & m32) << TriggerBitsSize) | (bytes & m32);
    snd = (((((((((u64)semaphoreId & mSem) << TriggerBitsType) | (type & mType)) << TriggerBitsMemoryId) |
               ((u64)dstId & mMem))
              << TriggerBitsMemoryId) |
             ((u64)srcId & mMem))
            << TriggerBitsOffset) |
          (dstOffset & m32);
  }

  /// The feature/ep atomicAdd trigger: type 0, `value` in fst. Host-callable.
  static MSCCLPP_RS_HOST_DEVICE ProxyTrigger atomicAdd(u32 dstId, u64 dstOffset, i64 value, u32 semaphoreId) {
    ProxyTrigger t(TriggerAtomicAdd, dstId, dstOffset, 0, 0, 0, semaphoreId);
    t.fst = (u64)value;
    return t;
  }
};

#if defined(MSCCLPP_RS_DEVICE_COMPILE)
namespace detail {

MSCCLPP_RS_DEVICE u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
MSCCLPP_RS_DEVICE u64 load_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MSCCLPP_RS_DEVICE u64 load_relaxed_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MSCCLPP_RS_DEVICE u64 load_relaxed_gpu(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MSCCLPP_RS_DEVICE u64 load_acquire_gpu(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MSCCLPP_RS_DEVICE void red_max_release_gpu(u64* p, u64 v) {
  asm volatile("red.release.gpu.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
/// Suspends the thread for about `ns` nanoseconds (at most 1 ms; 0 returns at once).
MSCCLPP_RS_DEVICE void nanosleep(unsigned int ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }
MSCCLPP_RS_DEVICE u64 fetch_add_relaxed_gpu(u64* p, u64 v) {
  u64 old;
  asm volatile("atom.relaxed.gpu.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}
MSCCLPP_RS_DEVICE u64 cas_relaxed_gpu(u64* p, u64 expected, u64 desired) {
  u64 old;
  asm volatile("atom.relaxed.gpu.cas.b64 %0, [%1], %2, %3;" : "=l"(old) : "l"(p), "l"(expected), "l"(desired) : "memory");
  return old;
}
MSCCLPP_RS_DEVICE void red_add_release_sys(u64* p, u64 v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MSCCLPP_RS_DEVICE void red_add_relaxed_sys(u64* p, u64 v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MSCCLPP_RS_DEVICE void store_trigger_release_sys(ProxyTrigger* slot, u64 fst, u64 snd) {
  // Both words in one 16-byte store: a torn store would let the proxy act on a stale word.
  asm volatile("st.global.release.sys.v2.u64 [%0], {%1,%2};" ::"l"(slot), "l"(fst), "l"(snd) : "memory");
}
/// MSCCL++'s spin limit: trap when `spins` reaches `max` (never when `max` is negative).
MSCCLPP_RS_DEVICE void spin_check(i64& spins, i64 max) {
  if (max >= 0 && spins++ == max) {
    __trap();
  }
}
/// Nanoseconds since `start` exceed `timeout_ns`.
MSCCLPP_RS_DEVICE bool expired(u64 start, u64 timeout_ns) { return globaltimer() - start > timeout_ns; }

}  // namespace detail
#endif  // MSCCLPP_RS_DEVICE_COMPILE

// How `push` waits for a free slot (see `FifoDeviceHandle::wait_popped`); a kernel may define
// them before the include. The defaults were the best of five settings on an H200 (2026-12-03,
// one proxy, no-op triggers): 6.3 / 5.4 / 6.5 M triggers/s with 256 / 2048 / 16384 producers,
// where MSCCL++'s push (every waiter polls `tail`) gave 6.4 / 1.7 / 0.27.
#ifndef MSCCLPP_RS_FIFO_WAIT_LEAD
#define MSCCLPP_RS_FIFO_WAIT_LEAD 8
#endif
#ifndef MSCCLPP_RS_FIFO_WAIT_NS_PER_SLOT
#define MSCCLPP_RS_FIFO_WAIT_NS_PER_SLOT 64
#endif
#ifndef MSCCLPP_RS_FIFO_WAIT_MAX_NS
#define MSCCLPP_RS_FIFO_WAIT_MAX_NS 16384
#endif

/// The device side of a FIFO: a ring of `size` triggers in mapped host memory, `head` and
/// `tailCache` in device memory, `tail` (and `proxy_error` in the next word) in mapped host memory.
/// Any number of threads may push at once; one proxy thread consumes.
struct FifoDeviceHandle {
#if defined(MSCCLPP_RS_DEVICE_COMPILE)
  /// Reserves the next slot, waits while the ring is full (traps after `maxSpinCount` spins; never
  /// if negative), and writes `trigger` with the lap-parity bit. Returns its FIFO position.
  MSCCLPP_RS_DEVICE u64 push(ProxyTrigger trigger, i64 maxSpinCount = 1000000) {
    u64 pos = detail::fetch_add_relaxed_gpu(head, 1);
    if (pos >= (u64)size + *tailCache) {
      wait_popped(pos - size, maxSpinCount);
    }
    write(pos, trigger);
    return pos;
  }

  /// Time-limited push: reserves a slot only once it is free (compare-and-swap on head), so a
  /// timeout leaves the FIFO intact. False (nothing pushed) when the ring stays full for
  /// `timeout_ns` or the proxy reports an error; otherwise true with the position in `*pos`
  /// (`pos` may be null).
  MSCCLPP_RS_DEVICE bool push_for(ProxyTrigger trigger, u64 timeout_ns, u64* pos = nullptr) {
    u64 start = detail::globaltimer();
    u64 h = detail::load_relaxed_gpu(head);
    for (;;) {
      if (h >= (u64)size + *tailCache) {
        u64 t = detail::load_acquire_sys(tail);
        detail::red_max_release_gpu(tailCache, t);
        if (h >= (u64)size + t) {
          if (proxy_error() != 0 || detail::expired(start, timeout_ns)) {
            return false;
          }
          h = detail::load_relaxed_gpu(head);
          continue;
        }
      }
      u64 seen = detail::cas_relaxed_gpu(head, h, h + 1);
      if (seen == h) break;
      h = seen;
    }
    write(h, trigger);
    if (pos != nullptr) *pos = h;
    return true;
  }

  /// Whether the proxy has popped the trigger at `pos`.
  MSCCLPP_RS_DEVICE bool poll(u64 pos) {
    u64 t = detail::load_acquire_sys(tail);
    if (pos < t) {
      detail::red_max_release_gpu(tailCache, t);
      return true;
    }
    return false;
  }

  /// Waits until the proxy has popped the trigger at `pos` (traps after `maxSpinCount` spins).
  MSCCLPP_RS_DEVICE void sync(u64 pos, i64 maxSpinCount = 1000000) {
    u64 t;
    i64 spins = 0;
    while (pos >= (t = detail::load_acquire_sys(tail))) {
      detail::spin_check(spins, maxSpinCount);
    }
    detail::red_max_release_gpu(tailCache, t);
  }

  /// Time-limited `sync`: false on timeout or proxy error.
  MSCCLPP_RS_DEVICE bool sync_for(u64 pos, u64 timeout_ns) {
    u64 start = detail::globaltimer();
    u64 t;
    while (pos >= (t = detail::load_acquire_sys(tail))) {
      if (proxy_error() != 0 || detail::expired(start, timeout_ns)) return false;
    }
    detail::red_max_release_gpu(tailCache, t);
    return true;
  }

  /// The proxy's error word (tail[1]): 0 while it runs fine, nonzero once it failed or stopped.
  MSCCLPP_RS_DEVICE u64 proxy_error() const { return detail::load_acquire_sys(tail + 1); }

 private:
  /// `push`'s wait for a free slot: until the proxy has popped position `p` (traps after
  /// `maxSpinCount` rounds). With thousands of producers on a full ring, each polling `tail`
  /// across PCIe would flood the link and the proxy's cache line (MSCCL++ does that: 0.5 M
  /// triggers/s at 16384 producers on an H200). Here waiters read `tailCache` in device memory;
  /// only the next ones in line (within `kLead` slots of it), or a waiter that saw it stand still
  /// over a whole sleep, read `tail` and raise `tailCache` (release, so readers of the cache
  /// acquire the proxy's pop). Others sleep about `kSleepPerSlot` ns per slot ahead of them, at
  /// most `kMaxSleep`. Waiters' positions are contiguous (each reserved one is waited on), so
  /// after the leaders' last raise the next waiter is within reach of `tailCache` again.
  MSCCLPP_RS_DEVICE void wait_popped(u64 p, i64 maxSpinCount) {
    constexpr u64 kLead = MSCCLPP_RS_FIFO_WAIT_LEAD;
    constexpr u64 kSleepPerSlot = MSCCLPP_RS_FIFO_WAIT_NS_PER_SLOT;
    constexpr u64 kMaxSleep = MSCCLPP_RS_FIFO_WAIT_MAX_NS;
    i64 spins = 0;
    u64 seen = detail::load_acquire_gpu(tailCache);
    for (;;) {
      u64 t = detail::load_acquire_gpu(tailCache);
      if (p < t) return;
      if (t == seen || p - t < kLead) {
        u64 h = detail::load_acquire_sys(tail);
        if (h > t) {
          detail::red_max_release_gpu(tailCache, h);
          t = h;
          if (p < t) return;
        }
      }
      seen = t;
      detail::spin_check(spins, maxSpinCount);
      u64 ahead = p - t;
      if (ahead >= kLead) detail::nanosleep((unsigned int)(ahead * kSleepPerSlot < kMaxSleep ? ahead * kSleepPerSlot : kMaxSleep));
    }
  }

  MSCCLPP_RS_DEVICE void write(u64 pos, ProxyTrigger trigger) {
    trigger.fields.reserved = ((pos >> sizeShift) & 1ull) ^ 1ull;
    detail::store_trigger_release_sys(&triggers[pos & sizeMask], trigger.fst, trigger.snd);
  }

 public:
#endif  // MSCCLPP_RS_DEVICE_COMPILE

  ProxyTrigger* triggers;  // mapped pinned host memory, `size` slots
  u64* head;               // device memory: next position to reserve
  u64* tail;               // mapped pinned host memory: next position the proxy pops; tail[1] = proxy_error
  u64* tailCache;          // device memory: a (possibly stale) copy of tail
  int size;                // slots, a power of two
  u64 sizeMask;            // size - 1
  u64 sizeShift;           // log2(size)
};

#if defined(MSCCLPP_RS_DEVICE_COMPILE)
namespace detail {
/// The counting semaphore wait both semaphore kinds share. `abort_word` (may be null) is checked
/// while waiting; nonzero ends the wait with false. On timeout the expected count is taken back,
/// so a retry waits for the same signal.
MSCCLPP_RS_DEVICE bool wait_inbound_for(u64* inbound, u64* expected, u64 timeout_ns, const u64* abort_word) {
  u64 e = fetch_add_relaxed_gpu(expected, 1) + 1;
  u64 start = globaltimer();
  while (load_acquire_sys(inbound) < e) {
    if ((abort_word != nullptr && load_acquire_sys(abort_word) != 0) || expired(start, timeout_ns)) {
      fetch_add_relaxed_gpu(expected, (u64)-1);
      return false;
    }
  }
  return true;
}
}  // namespace detail
#endif  // MSCCLPP_RS_DEVICE_COMPILE

/// A semaphore the host (a proxy) signals and a kernel waits on. Tokens count: N signals allow N
/// waits; concurrent waiters each consume one.
struct Host2DeviceSemaphoreDeviceHandle {
#if defined(MSCCLPP_RS_DEVICE_COMPILE)
  /// True (and one signal consumed) if a signal is pending.
  MSCCLPP_RS_DEVICE bool poll() {
    bool signaled = detail::load_acquire_sys(inboundToken) > detail::load_relaxed_gpu(expectedInboundToken);
    if (signaled) detail::fetch_add_relaxed_gpu(expectedInboundToken, 1);
    return signaled;
  }

  /// Waits for one signal (traps after `maxSpinCount` spins; never if negative).
  MSCCLPP_RS_DEVICE void wait(i64 maxSpinCount = 100000000) {
    u64 e = detail::fetch_add_relaxed_gpu(expectedInboundToken, 1) + 1;
    i64 spins = 0;
    while (detail::load_acquire_sys(inboundToken) < e) detail::spin_check(spins, maxSpinCount);
  }

  /// Waits for one signal for at most `timeout_ns`; false on timeout (nothing consumed).
  MSCCLPP_RS_DEVICE bool wait_for(u64 timeout_ns) {
    return detail::wait_inbound_for(inboundToken, expectedInboundToken, timeout_ns, nullptr);
  }
#endif  // MSCCLPP_RS_DEVICE_COMPILE

  u64* inboundToken;          // written by the peer's transport
  u64* expectedInboundToken;  // device memory, this side's count of consumed signals
};

/// A semaphore one GPU signals directly in another's memory (CUDA IPC) and the other waits on.
struct MemoryDevice2DeviceSemaphoreDeviceHandle {
#if defined(MSCCLPP_RS_DEVICE_COMPILE)
  /// True (and one signal consumed) if a signal is pending.
  MSCCLPP_RS_DEVICE bool poll() {
    bool signaled = detail::load_acquire_sys(inboundToken) > detail::load_relaxed_gpu(expectedInboundToken);
    if (signaled) detail::fetch_add_relaxed_gpu(expectedInboundToken, 1);
    return signaled;
  }
  /// Waits for one signal (traps after `maxSpinCount` spins; never if negative).
  MSCCLPP_RS_DEVICE void wait(i64 maxSpinCount = 100000000) {
    u64 e = detail::fetch_add_relaxed_gpu(expectedInboundToken, 1) + 1;
    i64 spins = 0;
    while (detail::load_acquire_sys(inboundToken) < e) detail::spin_check(spins, maxSpinCount);
  }
  /// `wait` without ordering the data before the signal (execution sync only).
  MSCCLPP_RS_DEVICE void relaxedWait(i64 maxSpinCount = 100000000) {
    u64 e = detail::fetch_add_relaxed_gpu(expectedInboundToken, 1) + 1;
    i64 spins = 0;
    while (detail::load_relaxed_sys(inboundToken) < e) detail::spin_check(spins, maxSpinCount);
  }
  /// Waits for one signal for at most `timeout_ns`; false on timeout (nothing consumed).
  MSCCLPP_RS_DEVICE bool wait_for(u64 timeout_ns) {
    return detail::wait_inbound_for(inboundToken, expectedInboundToken, timeout_ns, nullptr);
  }
  /// Signals the peer: everything this thread wrote before is visible to it first.
  MSCCLPP_RS_DEVICE void signal() { detail::red_add_release_sys(remoteInboundToken, 1); }
  /// Signals without ordering earlier writes (execution sync only).
  MSCCLPP_RS_DEVICE void relaxedSignal() { detail::red_add_relaxed_sys(remoteInboundToken, 1); }
#endif  // MSCCLPP_RS_DEVICE_COMPILE

  u64* inboundToken;          // local token the peer signals
  u64* remoteInboundToken;    // the peer's token, mapped by CUDA IPC
  u64* expectedInboundToken;  // device memory
};

/// A PortChannel without fixed memories: every put names its memory IDs.
struct BasePortChannelDeviceHandle {
  SemaphoreId semaphoreId_;
  Host2DeviceSemaphoreDeviceHandle semaphore_;
  FifoDeviceHandle fifo_;
  /// One past the highest FIFO position whose flush completed on this connection (mapped host
  /// memory, written by the proxy; UINT64_MAX once the proxy stopped or failed).
  u64* flushDonePos_;

#if defined(MSCCLPP_RS_DEVICE_COMPILE)
  /// Asks the proxy to copy `size` bytes from memory `srcId` at `srcOffset` to `dstId` at `dstOffset`.
  MSCCLPP_RS_DEVICE void put(MemoryId dstId, u64 dstOffset, MemoryId srcId, u64 srcOffset, u64 size) {
    fifo_.push(ProxyTrigger(TriggerData, dstId, dstOffset, srcId, srcOffset, size, semaphoreId_));
  }
  /// `put` with one offset for both sides.
  MSCCLPP_RS_DEVICE void put(MemoryId dstId, MemoryId srcId, u64 offset, u64 size) {
    put(dstId, offset, srcId, offset, size);
  }
  /// Asks the proxy to signal the peer's semaphore (after the puts pushed before).
  MSCCLPP_RS_DEVICE void signal() { fifo_.push(ProxyTrigger(TriggerFlag, 0, 0, 0, 0, 0, semaphoreId_)); }
  /// A put and a signal in one trigger.
  MSCCLPP_RS_DEVICE void putWithSignal(MemoryId dstId, u64 dstOffset, MemoryId srcId, u64 srcOffset, u64 size) {
    fifo_.push(ProxyTrigger(TriggerData | TriggerFlag, dstId, dstOffset, srcId, srcOffset, size, semaphoreId_));
  }
  /// `putWithSignal` with one offset for both sides.
  MSCCLPP_RS_DEVICE void putWithSignal(MemoryId dstId, MemoryId srcId, u64 offset, u64 size) {
    putWithSignal(dstId, offset, srcId, offset, size);
  }
  /// A put, a signal and a flush in one trigger; waits for the flush (traps after `maxSpinCount`).
  MSCCLPP_RS_DEVICE void putWithSignalAndFlush(MemoryId dstId, u64 dstOffset, MemoryId srcId, u64 srcOffset,
                                               u64 size, i64 maxSpinCount = 1000000) {
    u64 pos = fifo_.push(
        ProxyTrigger(TriggerData | TriggerFlag | TriggerSync, dstId, dstOffset, srcId, srcOffset, size, semaphoreId_));
    waitFlush(pos, maxSpinCount);
  }
  /// `putWithSignalAndFlush` with one offset for both sides.
  MSCCLPP_RS_DEVICE void putWithSignalAndFlush(MemoryId dstId, MemoryId srcId, u64 offset, u64 size,
                                               i64 maxSpinCount = 1000000) {
    putWithSignalAndFlush(dstId, offset, srcId, offset, size, maxSpinCount);
  }
  /// Waits until every request pushed before on this connection completed (traps after
  /// `maxSpinCount` spins; returns, without completion, once the proxy stopped).
  MSCCLPP_RS_DEVICE void flush(i64 maxSpinCount = 1000000) {
    u64 pos = fifo_.push(ProxyTrigger(TriggerSync, 0, 0, 0, 0, 0, semaphoreId_));
    waitFlush(pos, maxSpinCount);
  }
  /// Time-limited `flush`: true only when the proxy completed it; false on timeout, when the
  /// FIFO stayed full, or once the proxy reports an error or stopped (also when the proxy
  /// stopped after completing it but before this thread looked: false means "not known done").
  MSCCLPP_RS_DEVICE bool flush_for(u64 timeout_ns) {
    u64 start = detail::globaltimer();
    u64 pos;
    if (!fifo_.push_for(ProxyTrigger(TriggerSync, 0, 0, 0, 0, 0, semaphoreId_), timeout_ns, &pos)) return false;
    u64 done;
    while ((done = detail::load_acquire_sys(flushDonePos_)) <= pos) {
      if (fifo_.proxy_error() != 0 || detail::expired(start, timeout_ns)) return false;
    }
    return done != ~0ull;
  }
  /// feature/ep: asks the proxy to add `value` to the 64-bit word at `dstOffset` of memory `dstId`.
  MSCCLPP_RS_DEVICE void atomicAdd(MemoryId dstId, u64 dstOffset, i64 value) {
    fifo_.push(ProxyTrigger::atomicAdd(dstId, dstOffset, value, semaphoreId_));
  }
  /// True (and one signal consumed) if the peer has signalled.
  MSCCLPP_RS_DEVICE bool poll() { return semaphore_.poll(); }
  /// Waits for one signal from the peer (traps after `maxSpinCount` spins).
  MSCCLPP_RS_DEVICE void wait(i64 maxSpinCount = 10000000) { semaphore_.wait(maxSpinCount); }
  /// Waits for one signal for at most `timeout_ns`; false on timeout or once the proxy reports
  /// an error (nothing consumed).
  MSCCLPP_RS_DEVICE bool wait_for(u64 timeout_ns) {
    return detail::wait_inbound_for(semaphore_.inboundToken, semaphore_.expectedInboundToken, timeout_ns,
                                    fifo_.tail + 1);
  }

 private:
  MSCCLPP_RS_DEVICE void waitFlush(u64 pos, i64 maxSpinCount) {
    i64 spins = 0;
    while (detail::load_acquire_sys(flushDonePos_) <= pos) detail::spin_check(spins, maxSpinCount);
  }

 public:
#endif  // MSCCLPP_RS_DEVICE_COMPILE
};

/// A PortChannel between two fixed memories (`dst_` at the peer, `src_` here).
struct PortChannelDeviceHandle : public BasePortChannelDeviceHandle {
  MemoryId dst_;
  MemoryId src_;

#if defined(MSCCLPP_RS_DEVICE_COMPILE)
  /// Copies `size` bytes from `src_` at `srcOffset` to `dst_` at `dstOffset` (through the proxy).
  MSCCLPP_RS_DEVICE void put(u64 dstOffset, u64 srcOffset, u64 size) {
    BasePortChannelDeviceHandle::put(dst_, dstOffset, src_, srcOffset, size);
  }
  /// `put` with one offset for both sides.
  MSCCLPP_RS_DEVICE void put(u64 offset, u64 size) { put(offset, offset, size); }
  /// A put and a signal in one trigger.
  MSCCLPP_RS_DEVICE void putWithSignal(u64 dstOffset, u64 srcOffset, u64 size) {
    BasePortChannelDeviceHandle::putWithSignal(dst_, dstOffset, src_, srcOffset, size);
  }
  /// `putWithSignal` with one offset for both sides.
  MSCCLPP_RS_DEVICE void putWithSignal(u64 offset, u64 size) { putWithSignal(offset, offset, size); }
  /// A put, a signal and a flush in one trigger; waits for the flush (traps after `maxSpinCount`).
  MSCCLPP_RS_DEVICE void putWithSignalAndFlush(u64 dstOffset, u64 srcOffset, u64 size,
                                               i64 maxSpinCount = 1000000) {
    BasePortChannelDeviceHandle::putWithSignalAndFlush(dst_, dstOffset, src_, srcOffset, size, maxSpinCount);
  }
  /// `putWithSignalAndFlush` with one offset for both sides.
  MSCCLPP_RS_DEVICE void putWithSignalAndFlush(u64 offset, u64 size) { putWithSignalAndFlush(offset, offset, size); }
  /// feature/ep: adds `value` to the 64-bit word at `dstOffset` of `dst_` (through the proxy).
  MSCCLPP_RS_DEVICE void atomicAdd(u64 dstOffset, i64 value) {
    BasePortChannelDeviceHandle::atomicAdd(dst_, dstOffset, value);
  }
#endif  // MSCCLPP_RS_DEVICE_COMPILE
};

/// A MemoryChannel without fixed memories (semaphore only).
struct BaseMemoryChannelDeviceHandle {
  MemoryDevice2DeviceSemaphoreDeviceHandle semaphore_;
};

/// A MemoryChannel: the peer's memory mapped here (`dst_`), local memory (`src_`) and an optional
/// local packet buffer. Its data-movement methods come with MemoryChannel.
struct MemoryChannelDeviceHandle : public BaseMemoryChannelDeviceHandle {
  void* dst_;
  void* src_;
  void* packetBuffer_;
};

/// An LL packet of 16 bytes: two data words, each with its own flag.
union alignas(16) LL16Packet {
  struct {
    u32 data1;
    u32 flag1;
    u32 data2;
    u32 flag2;
  };
  u64 raw_[2];
};

/// An LL packet of 8 bytes: one data word and its flag.
union alignas(8) LL8Packet {
  struct {
    u32 data;
    u32 flag;
  };
  u64 raw_;
};

static_assert(sizeof(ProxyTrigger) == 16 && alignof(ProxyTrigger) == 16, "ProxyTrigger layout");
static_assert(sizeof(FifoDeviceHandle) == 56, "FifoDeviceHandle layout");
// NVRTC 13.0 (the H200 machine) rejects __builtin_offsetof here; the host-compiler test checks them.
#ifndef __CUDACC_RTC__
static_assert(__builtin_offsetof(FifoDeviceHandle, tail) == 16, "FifoDeviceHandle.tail");
static_assert(__builtin_offsetof(FifoDeviceHandle, size) == 32, "FifoDeviceHandle.size");
static_assert(__builtin_offsetof(FifoDeviceHandle, sizeMask) == 40, "FifoDeviceHandle.sizeMask");
#endif
static_assert(sizeof(Host2DeviceSemaphoreDeviceHandle) == 16, "Host2DeviceSemaphoreDeviceHandle layout");
static_assert(sizeof(MemoryDevice2DeviceSemaphoreDeviceHandle) == 24, "MemoryDevice2DeviceSemaphoreDeviceHandle layout");
static_assert(sizeof(BasePortChannelDeviceHandle) == 88, "BasePortChannelDeviceHandle layout");
#ifndef __CUDACC_RTC__
static_assert(__builtin_offsetof(BasePortChannelDeviceHandle, fifo_) == 24, "BasePortChannelDeviceHandle.fifo_");
static_assert(__builtin_offsetof(BasePortChannelDeviceHandle, flushDonePos_) == 80, "flushDonePos_");
#endif
static_assert(sizeof(PortChannelDeviceHandle) == 96, "PortChannelDeviceHandle layout");
static_assert(sizeof(BaseMemoryChannelDeviceHandle) == 24, "BaseMemoryChannelDeviceHandle layout");
static_assert(sizeof(MemoryChannelDeviceHandle) == 48, "MemoryChannelDeviceHandle layout");
static_assert(sizeof(LL16Packet) == 16 && alignof(LL16Packet) == 16, "LL16Packet layout");
static_assert(sizeof(LL8Packet) == 8 && alignof(LL8Packet) == 8, "LL8Packet layout");

}  // namespace mscclpp

#endif  // MSCCLPP_RS_DEVICE_CUH_

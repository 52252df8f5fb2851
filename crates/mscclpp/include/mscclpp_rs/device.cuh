// mscclpp (Rust) device API for CUDA kernels: FIFO, semaphores, PortChannel and MemoryChannel
// handles, LL packets.
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
//                backoff, ld.acquire.sys of tail only by the head of the line (the waiter
//                for tailCache; the next few in line after a stagger of stillness), who raise tailCache with red.release.gpu.max (every
//                tailCache update is that red.max, so it never goes back); trigger: one 16-byte
//                st.global.release.sys.v2.u64 {fst, snd} with the lap-parity bit 63 of snd set to
//                ((pos >> sizeShift) & 1) ^ 1 (lap 0 writes 1, so a zeroed ring reads empty).
//   FIFO push_relaxed: as push, but the trigger's store is st.global.relaxed.sys.v2.u64; the
//                caller's fence.sc.sys (__threadfence_system) after the data makes the release
//                pattern, once for any number of pushes after it.
//   FIFO push_batch (n triggers): one atom.relaxed.gpu.add of n on head, one fence.acq_rel.sys,
//                then per trigger the wait above for its slot and one st.global.relaxed.sys.v2.u64
//                (the fence and each store form a release pattern).
//   FifoExclusiveProducer: no atomic for the position (a count in a register) and one
//                red.relaxed.gpu.add of 1 on head per push, not waited for; ld.acquire.gpu of
//                tailCache at construction, then ld.acquire.sys of tail (and red.release.gpu.max
//                of tailCache) only when the count reaches the free slots it knows of; the
//                trigger's store as push / push_relaxed; ld.relaxed.gpu of head at
//                construction, before the first push and then once a lap (the contract's check).
//   FIFO poll/sync: ld.acquire.sys of tail.
//   Pairs: the trigger's release store with the proxy's acquire load of snd (`Fifo::poll_at`);
//                the proxy's release store of tail (`Fifo::pop`) with every ld.acquire.sys of
//                tail here; red.release.gpu.max of tailCache with ld.acquire.gpu of it in
//                wait_popped and FifoExclusiveProducer's construction; the proxy's release
//                stores of proxy_error and flushDonePos with their ld.acquire.sys here; a
//                signal's release with the waiters' acquire loads of inbound. Each use below
//                names its partner; tests/ordering_models.rs checks the FIFO and the
//                semaphores' consume step with loom.
//   semaphore wait: expected: atom.relaxed.gpu.add 1; inbound: ld.acquire.sys until >= expected.
//   semaphore poll: ld.acquire.sys inbound > ld.relaxed.gpu expected, then atom.relaxed.gpu.cas expected += 1.
//   flush:       push a Sync trigger at position pos, then ld.acquire.sys of flushDonePos until
//                it is > pos (each flusher waits for its own position).
//   MemoryDevice2Device signal: red.release.sys.global.add.u64 on the peer's token (relaxedSignal:
//                red.relaxed.sys); its waits as the semaphore waits above (relaxedWait: ld.relaxed.sys).
//   MemoryChannel put/get: plain loads into registers and plain stores through the mapped pointer
//                (ordered for the peer only by a later signal). LL packets: one
//                st/ld.volatile.global.v4.u32 (LL16) or .v2.u32 (LL8) per packet; the flags are the sync.
//
// Waits. MSCCL++'s waits take a spin count and trap (`__trap()`, the kernel fails with an illegal
// instruction error) when it runs out; a negative count never traps. They are kept with
// MSCCL++'s defaults. Each also has a time-limited form using %globaltimer (nanoseconds) that
// returns false instead of trapping: `push_for`, `sync_for`, `wait_for`, `flush_for`, the packets'
// `read_for` and MemoryChannel's `unpackPacket_for`/`unpackPackets_for`.
//
// Proxy error publication. The FIFO's `tail` word lives in a mapped host control page whose next
// word (tail[1]) is `proxy_error`: 0 while the proxy runs; nonzero once it failed or stopped (the
// host's `ProxyService::status()`/`stop()` say why). On error or stop the proxy first sets
// `proxy_error`, then writes UINT64_MAX into every flushDonePos word, so a trapping `flush()`
// returns instead of hanging; a `push` that finds the ring full once the proxy has stopped
// popping traps as soon as `tail` stood still over MSCCLPP_RS_ERROR_CHECK_PERIOD reads with the
// error word set, not at its spin limit (a negative spin count still waits). The time-limited
// PortChannel and FIFO calls check `proxy_error` while they wait (every
// MSCCLPP_RS_ERROR_CHECK_PERIOD-th poll, 64 by default: the word is a PCIe round trip away) and
// return false soon after it becomes nonzero; `flush_for` also returns false when it sees
// UINT64_MAX (the flush was abandoned, not completed).
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
constexpr TriggerType TriggerAtomicAdd = 0x0;  // an atomicAdd: operand in fst

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

  /// The atomicAdd trigger: type 0, `value` in fst. Host-callable.
  static MSCCLPP_RS_HOST_DEVICE ProxyTrigger atomicAdd(u32 dstId, u64 dstOffset, i64 value, u32 semaphoreId) {
    ProxyTrigger t(TriggerAtomicAdd, dstId, dstOffset, 0, 0, 0, semaphoreId);
    t.fst = (u64)value;
    return t;
  }
};

// How many polls of a time-limited FIFO or PortChannel wait pass between two reads of the proxy's
// error word. The word is in mapped host memory: each read is a PCIe round trip (about 1-2 us on
// an H200), and the loop cannot look at the word it waits for again until the read returns, so
// reading it at every poll delayed the wait's return by about half a round trip on average
// (MSCCL++'s waits read no error word at all). A kernel may define it before the include.
#ifndef MSCCLPP_RS_ERROR_CHECK_PERIOD
#define MSCCLPP_RS_ERROR_CHECK_PERIOD 64u
#endif
static_assert(MSCCLPP_RS_ERROR_CHECK_PERIOD > 0u, "MSCCLPP_RS_ERROR_CHECK_PERIOD must be at least 1");

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
MSCCLPP_RS_DEVICE void red_add_relaxed_gpu(u64* p, u64 v) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MSCCLPP_RS_DEVICE void store_trigger_release_sys(ProxyTrigger* slot, u64 fst, u64 snd) {
  // Both words in one 16-byte store: a torn store would let the proxy act on a stale word.
  asm volatile("st.global.release.sys.v2.u64 [%0], {%1,%2};" ::"l"(slot), "l"(fst), "l"(snd) : "memory");
}
/// Both words in one 16-byte store, relaxed: published by a release fence before it
/// (`fence_acq_rel_sys`), as `FifoDeviceHandle::push_batch` does once for several triggers.
MSCCLPP_RS_DEVICE void store_trigger_relaxed_sys(ProxyTrigger* slot, u64 fst, u64 snd) {
  asm volatile("st.global.relaxed.sys.v2.u64 [%0], {%1,%2};" ::"l"(slot), "l"(fst), "l"(snd) : "memory");
}
/// fence.acq_rel.sys: with a later relaxed store, a release pattern at system scope.
MSCCLPP_RS_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
/// MSCCL++'s spin limit: trap when `spins` reaches `max` (never when `max` is negative).
MSCCLPP_RS_DEVICE void spin_check(i64& spins, i64 max) {
  if (max >= 0 && spins++ == max) {
    __trap();
  }
}
/// Nanoseconds since `start` exceed `timeout_ns`.
MSCCLPP_RS_DEVICE bool expired(u64 start, u64 timeout_ns) { return globaltimer() - start > timeout_ns; }
/// Whether this poll of a time-limited wait also reads the proxy's error word (or another abort
/// word in host memory): every `MSCCLPP_RS_ERROR_CHECK_PERIOD`-th poll (see its definition).
MSCCLPP_RS_DEVICE bool error_check_due(u32& polls) { return ++polls % MSCCLPP_RS_ERROR_CHECK_PERIOD == 0; }

}  // namespace detail
#endif  // MSCCLPP_RS_DEVICE_COMPILE

// How `push` waits for a free slot (see `FifoDeviceHandle::wait_popped`); a kernel may define
// them before the include. Only the waiter for `tailCache` polls the host's `tail` (the next
// LEAD - 1 in line take over after LEAD_STAGGER_NS per place of stillness); the others sleep
// about NS_PER_SLOT ns per slot ahead of them, at most MAX_NS. Keep
// NS_PER_SLOT below the time the proxy takes per pop, so that a waiter does not oversleep its
// turn, and MAX_NS long when many producers wait (tens of thousands): with a short cap every
// far-back waiter wakes often to read `tailCache`, and those loads of one line starve the pushes
// and the leaders' updates. The defaults keep throughput flat from a few thousand producers to
// over a hundred thousand; docs/performance.md has the measured figures.
#ifndef MSCCLPP_RS_FIFO_WAIT_LEAD
#define MSCCLPP_RS_FIFO_WAIT_LEAD 8
#endif
#ifndef MSCCLPP_RS_FIFO_WAIT_NS_PER_SLOT
#define MSCCLPP_RS_FIFO_WAIT_NS_PER_SLOT 64
#endif
#ifndef MSCCLPP_RS_FIFO_WAIT_MAX_NS
#define MSCCLPP_RS_FIFO_WAIT_MAX_NS 1000000
#endif
#ifndef MSCCLPP_RS_FIFO_WAIT_LEAD_STAGGER_NS
#define MSCCLPP_RS_FIFO_WAIT_LEAD_STAGGER_NS 2000
#endif

/// The device side of a FIFO: a ring of `size` triggers in mapped host memory, `head` and
/// `tailCache` in device memory, `tail` (and `proxy_error` in the next word) in mapped host memory.
/// Any number of threads may push at once; one proxy thread consumes.
struct FifoDeviceHandle {
#if defined(MSCCLPP_RS_DEVICE_COMPILE)
  friend struct FifoExclusiveProducer;

  /// Reserves the next slot, waits while the ring is full (traps after `maxSpinCount` spins; never
  /// if negative), and writes `trigger` with the lap-parity bit. Returns its FIFO position.
  MSCCLPP_RS_DEVICE u64 push(ProxyTrigger trigger, i64 maxSpinCount = 1000000) {
    u64 pos = reserve_one(maxSpinCount);
    write(pos, trigger);
    return pos;
  }

  /// `push` without its system-scope release: the trigger is stored relaxed, so nothing this
  /// thread wrote before is ordered before it by the push itself. The caller orders the data:
  /// once the data the next triggers refer to is written (a put's source; by this thread, or by
  /// others that then synchronized with it, e.g. `__syncthreads()`), one `__threadfence_system()`
  /// (`fence.sc.sys`) makes it visible before every trigger this thread stores after the fence,
  /// so one fence serves any number of `push_relaxed` calls. Data written by earlier kernels or
  /// copies needs that one fence too (anywhere in this kernel before the pushes). A put pushed
  /// this way with no fence since its source's last write may copy stale bytes: use `push`
  /// there. The FIFO's own order is unchanged (the proxy handles the triggers in position
  /// order, so a signal pushed after puts still follows them).
  ///
  /// What it saves: `push` costs one thread about 0.9-1.1 us on an H100 (0.65 us of it the
  /// release, `scripts/pushcost.cu`), so one thread pushing one trigger at a time stays under
  /// about 1 M triggers/s; `push_relaxed` measured 0.45 us from push to the consumer's pop
  /// against 1.13 for `push` (H100, `mscclpp-perf device --parts fifo`), and one thread pushed
  /// 2.2 M puts/s through the proxy this way. A thread that has its triggers at hand at once can
  /// also use `push_batch` (one atomic and one fence a call; 0.08 us a trigger in batches of
  /// 32). (An extension: MSCCL++'s FIFO has no relaxed push; the name follows its
  /// `relaxedSignal`, a signal without the fence.)
  MSCCLPP_RS_DEVICE u64 push_relaxed(ProxyTrigger trigger, i64 maxSpinCount = 1000000) {
    u64 pos = reserve_one(maxSpinCount);
    write_relaxed(pos, trigger);
    return pos;
  }

 private:
  /// `push`'s reservation of one position, waiting while its slot is still in use (traps after
  /// `maxSpinCount` rounds of `wait_popped`; never if negative).
  MSCCLPP_RS_DEVICE u64 reserve_one(i64 maxSpinCount) {
    // Relaxed: only hands out a number; the slot's reuse is ordered by `tail` (acquire in
    // `wait_popped`) and its contents by the release store in `write` (or, for
    // `push_relaxed`, the caller's fence).
    u64 pos = detail::fetch_add_relaxed_gpu(head, 1);
    // Plain load: a stale value only sends this thread to `wait_popped`. When it is high enough
    // because another producer raised it (red.release.gpu.max after its ld.acquire.sys of
    // `tail`), the slot's rewrite is ordered after the proxy's read of the previous lap only by
    // this load's control dependency: enough on GPUs (stores are not made visible before the
    // branch that guards them resolves), not in the PTX model's letter, which would want an
    // ld.acquire.gpu here (tests/ordering_models.rs: fifo_tail_cache_fast_path_is_ordered_by_
    // control_only finds the unordered rewrite with this load relaxed, none with it acquiring).
    if (pos >= (u64)size + *tailCache) {
      wait_popped(pos - size, maxSpinCount);
    }
    return pos;
  }

 public:
  /// Time-limited push: reserves a slot only once it is free (compare-and-swap on head), so a
  /// timeout leaves the FIFO intact. False (nothing pushed) when the ring stays full for
  /// `timeout_ns`, or while it is full the proxy reports an error; otherwise true with the
  /// position in `*pos` (`pos` may be null). The error word is read only while waiting for a
  /// slot: a push into a free slot succeeds whatever the proxy's state, so `sync_for` or
  /// `flush_for` is what tells whether the trigger was handled.
  MSCCLPP_RS_DEVICE bool push_for(ProxyTrigger trigger, u64 timeout_ns, u64* pos = nullptr) {
    return push_batch_for(&trigger, 1, timeout_ns, pos);
  }

  /// Pushes the `n` triggers at `triggers` with one reservation (one atomic on `head` for `n`
  /// consecutive positions) and one system-scope release fence for all of them, where `n`
  /// calls of `push` make one of each per trigger. Both are what a push costs (about 1.1-1.3 us
  /// on an H100/H200, so one thread pushing one at a time never passes about 0.8 M triggers/s);
  /// a thread that has several triggers to push at once (a signal or a put to each of several
  /// peers, on channels that share this FIFO) pushes them several times faster this way (H100:
  /// about 0.09 us a trigger in batches of 32 of one trigger repeated, 10-10.5 M/s for a batch
  /// of signals built once and pushed again; about 0.22 us, 4.5 M/s, when the thread builds 32
  /// distinct triggers in a local array before every call: build them once where they repeat). The
  /// proxy sees them in order, at consecutive positions; everything this thread wrote before
  /// the call is visible to the proxy before any of them. Each trigger is written as soon as
  /// its slot is free (waiting as `push` does, trapping after `maxSpinCount` rounds of one wait;
  /// never if negative), so any `n` works, larger than the ring too. Returns the first
  /// position (trigger k is at first + k); `n == 0` pushes nothing and returns UINT64_MAX.
  /// (An extension: MSCCL++'s FIFO has no batched push.)
  MSCCLPP_RS_DEVICE u64 push_batch(const ProxyTrigger* triggers, u32 n, i64 maxSpinCount = 1000000) {
    if (n == 0) return ~0ull;
    if (n == 1) return push(triggers[0], maxSpinCount);
    // Relaxed: hands out `n` numbers, as `push`'s fetch-add hands out one.
    u64 first = detail::fetch_add_relaxed_gpu(head, n);
    // As in `push`: a plain load of the hint. Kept in a register and read again only when a
    // position reaches it: `tailCache` only grows, so an old value can only be low, which sends
    // the thread to read it again (and to the head-of-line wait), never past a busy slot.
    u64 limit = (u64)size + *tailCache;
    // Release fence: with each relaxed trigger store below, a release pattern that pairs with
    // the proxy's acquire load of `snd` (Rust: `Fifo::poll_at`); this thread's earlier writes
    // are visible before any of the triggers. tests/ordering_models.rs: fifo_batch_*.
    detail::fence_acq_rel_sys();
    // Triggers are read kGroup at a time into registers, then stored: each store's `memory`
    // clobber would otherwise make every read wait for the store before it (one thread with 32
    // distinct triggers a call: 0.24 us a trigger read one by one; docs/performance.md).
    constexpr u32 kGroup = 4;
    for (u32 k = 0; k < n; k += kGroup) {
      const u32 m = n - k < kGroup ? n - k : kGroup;
      ProxyTrigger g[kGroup];
#pragma unroll
      for (u32 j = 0; j < kGroup; ++j) {
        if (j < m) g[j] = triggers[k + j];
      }
#pragma unroll
      for (u32 j = 0; j < kGroup; ++j) {
        if (j < m) {
          const u64 pos = first + k + j;
          if (pos >= limit) {
            limit = (u64)size + *tailCache;
            if (pos >= limit) {
              wait_popped(pos - size, maxSpinCount);
              limit = (u64)size + *tailCache;
            }
          }
          write_relaxed(pos, g[j]);
        }
      }
    }
    return first;
  }

  /// Time-limited `push_batch`: reserves the `n` positions only once all of their slots are
  /// free (compare-and-swap on head), so a timeout leaves the FIFO intact. False (nothing
  /// pushed) when they do not all come free within `timeout_ns`, when the proxy reports an
  /// error while it waits, or at once when `n` exceeds the ring's size (they never could);
  /// otherwise true with the first position in `*pos` (`pos` may be null). `n == 0` pushes
  /// nothing and returns true with UINT64_MAX in `*pos`.
  MSCCLPP_RS_DEVICE bool push_batch_for(const ProxyTrigger* triggers, u32 n, u64 timeout_ns, u64* pos = nullptr) {
    if (n == 0) {
      if (pos != nullptr) *pos = ~0ull;
      return true;
    }
    if (n > (u32)size) return false;
    u64 start = detail::globaltimer();
    u32 polls = 0;
    // Relaxed: a guess for the compare-and-swap below, which checks it.
    u64 h = detail::load_relaxed_gpu(head);
    for (;;) {
      // The last of the n slots is free when the proxy popped its previous lap (the earlier
      // ones are then free too). Plain load of the hint, as in `push`.
      if (h + n - 1 >= (u64)size + *tailCache) {
        // Acquire: pairs with the proxy's release store of `tail` (Rust: `Fifo::pop`/`pop_to`).
        u64 t = detail::load_acquire_sys(tail);
        // Release: pairs with the ld.acquire.gpu of tailCache in other producers' `wait_popped`.
        detail::red_max_release_gpu(tailCache, t);
        if (h + n - 1 >= (u64)size + t) {
          if ((detail::error_check_due(polls) && proxy_error() != 0) || detail::expired(start, timeout_ns)) {
            return false;
          }
          h = detail::load_relaxed_gpu(head);
          continue;
        }
      }
      // Relaxed: claims the numbers only, as `push`'s fetch-add; the slots were seen free above.
      u64 seen = detail::cas_relaxed_gpu(head, h, h + n);
      if (seen == h) break;
      h = seen;
    }
    if (n == 1) {
      write(h, triggers[0]);
    } else {
      // Release fence: as in `push_batch`.
      detail::fence_acq_rel_sys();
      for (u32 k = 0; k < n; ++k) write_relaxed(h + k, triggers[k]);
    }
    if (pos != nullptr) *pos = h;
    return true;
  }

  /// Whether the proxy has popped the trigger at `pos`.
  MSCCLPP_RS_DEVICE bool poll(u64 pos) {
    // Acquire: pairs with the proxy's release store of `tail` (Rust: `Fifo::pop`/`pop_to`).
    u64 t = detail::load_acquire_sys(tail);
    if (pos < t) {
      // Release: pairs with the ld.acquire.gpu of tailCache in `wait_popped`.
      detail::red_max_release_gpu(tailCache, t);
      return true;
    }
    return false;
  }

  /// Waits until the proxy has popped the trigger at `pos` (traps after `maxSpinCount` spins).
  MSCCLPP_RS_DEVICE void sync(u64 pos, i64 maxSpinCount = 1000000) {
    u64 t;
    i64 spins = 0;
    // Acquire: pairs with the proxy's release store of `tail` (Rust: `Fifo::pop`/`pop_to`).
    while (pos >= (t = detail::load_acquire_sys(tail))) {
      detail::spin_check(spins, maxSpinCount);
    }
    // Release: pairs with the ld.acquire.gpu of tailCache in `wait_popped`.
    detail::red_max_release_gpu(tailCache, t);
  }

  /// Time-limited `sync`: false on timeout or proxy error.
  MSCCLPP_RS_DEVICE bool sync_for(u64 pos, u64 timeout_ns) {
    u64 start = detail::globaltimer();
    u64 t;
    u32 polls = 0;
    // Acquire: pairs with the proxy's release store of `tail` (Rust: `Fifo::pop`/`pop_to`).
    while (pos >= (t = detail::load_acquire_sys(tail))) {
      if ((detail::error_check_due(polls) && proxy_error() != 0) || detail::expired(start, timeout_ns)) return false;
    }
    // Release: pairs with the ld.acquire.gpu of tailCache in `wait_popped`.
    detail::red_max_release_gpu(tailCache, t);
    return true;
  }

  /// The proxy's error word (tail[1]): 0 while it runs fine, nonzero once it failed or stopped.
  /// Acquire: pairs with the proxy's release store of the word (Rust: `Fifo::set_proxy_error`).
  MSCCLPP_RS_DEVICE u64 proxy_error() const { return detail::load_acquire_sys(tail + 1); }

 private:
  /// `push`'s wait for a free slot: until the proxy has popped position `p` (traps after
  /// `maxSpinCount` rounds). With thousands of producers on a full ring, each polling `tail`
  /// across PCIe floods the link and the proxy's cache line (MSCCL++ does that; see
  /// docs/performance.md for what it costs). Here waiters read `tailCache` in device memory and
  /// at most one of them reads `tail` at a time in the steady state: the head of the line (the
  /// waiter for `p == tailCache`), which raises `tailCache` (release, so readers of the cache
  /// acquire the proxy's pop) for everyone. The next `kLead - 1` waiters in line take over, one
  /// by one, only when `tailCache` has stood still for `kLeadStaggerNs` per place behind the
  /// head (the head may be asleep or not yet arrived); the others never read `tail` and sleep
  /// about `kSleepPerSlot` ns per slot ahead of them, at most `kMaxSleep`.
  ///
  /// Why the earlier rule ("also poll `tail` when `tailCache` stood still over a whole sleep")
  /// collapsed under slow triggers (issue 25: puts to 4 peers, 150,000/s with one producer,
  /// 3,200/s with 132, 280/s with 33,792): a put keeps the proxy several microseconds, so every
  /// waiter whose sleep is shorter than that (all within ~100 slots; all of them once the proxy
  /// slows further) found the cache unchanged and read `tail` across PCIe, and those reads,
  /// queued on one host cache line, slow the proxy's own copy submissions (the GPU fetches its
  /// command buffers over the same link), which slows the pops further.
  ///
  /// Liveness: positions are reserved contiguously and each reserved one is either above the
  /// cache when its producer looks (it waits here) or below it, so while anyone waits the
  /// waiter for `tailCache` exists or is about to (between its fetch-add and its check) or
  /// sleeps at most `kMaxSleep`; a later waiter within `kLead` takes over meanwhile.
  MSCCLPP_RS_DEVICE void wait_popped(u64 p, i64 maxSpinCount) {
    constexpr u64 kLead = MSCCLPP_RS_FIFO_WAIT_LEAD;
    constexpr u64 kSleepPerSlot = MSCCLPP_RS_FIFO_WAIT_NS_PER_SLOT;
    constexpr u64 kMaxSleep = MSCCLPP_RS_FIFO_WAIT_MAX_NS;
    constexpr u64 kLeadStaggerNs = MSCCLPP_RS_FIFO_WAIT_LEAD_STAGGER_NS;
    i64 spins = 0;
    // Reads of `tail` in a row that found nothing new (see the stall check below).
    u32 stalled = 0;
    // Acquire (both loads of tailCache): pairs with the red.release.gpu.max of the producer that
    // raised it, which had acquired `tail`: the proxy's pop happens before this slot's rewrite.
    u64 seen = detail::load_acquire_gpu(tailCache);
    u64 since = detail::globaltimer();
    for (;;) {
      u64 t = detail::load_acquire_gpu(tailCache);
      if (p < t) return;
      u64 ahead = p - t;
      if (t != seen) {
        seen = t;
        since = detail::globaltimer();
        stalled = 0;
      }
      if (ahead == 0 || (ahead < kLead && detail::globaltimer() - since >= ahead * kLeadStaggerNs)) {
        // Acquire: pairs with the proxy's release store of `tail` (Rust: `Fifo::pop`/`pop_to`).
        u64 h = detail::load_acquire_sys(tail);
        if (h > t) {
          stalled = 0;
          // Release: pairs with the ld.acquire.gpu loads of tailCache above, in other waiters.
          detail::red_max_release_gpu(tailCache, h);
          if (p < h) return;
          continue;
        }
        // A proxy that stopped (or failed and then stopped) never pops again: rather than spin
        // to the trap count (up to 1e6 rounds, each a PCIe read or a sleep of up to MAX_NS),
        // trap as soon as the error word is set and `tail` has not moved over a whole check
        // period. A negative count still waits (a later proxy on this FIFO may pop).
        if (detail::error_check_due(stalled) && maxSpinCount >= 0 && proxy_error() != 0) __trap();
        // A stand-in found nothing new: it waits out its stagger again before the next read.
        if (ahead > 0) since = detail::globaltimer();
      }
      detail::spin_check(spins, maxSpinCount);
      if (ahead > 0) {
        detail::nanosleep((unsigned int)(ahead * kSleepPerSlot < kMaxSleep ? ahead * kSleepPerSlot : kMaxSleep));
      }
    }
  }

  MSCCLPP_RS_DEVICE void write(u64 pos, ProxyTrigger trigger) {
    trigger.fields.reserved = ((pos >> sizeShift) & 1ull) ^ 1ull;
    // Release: pairs with the proxy's acquire load of `snd` (Rust: `Fifo::poll_at`), which sees
    // the parity bit and then the whole trigger.
    detail::store_trigger_release_sys(&triggers[pos & sizeMask], trigger.fst, trigger.snd);
  }

  /// `write` without the release: the caller made a release fence after its earlier writes
  /// (`push_batch`; the user of `push_relaxed`), which with this store pairs with the proxy's
  /// acquire load of `snd`.
  MSCCLPP_RS_DEVICE void write_relaxed(u64 pos, ProxyTrigger trigger) {
    trigger.fields.reserved = ((pos >> sizeShift) & 1ull) ^ 1ull;
    detail::store_trigger_relaxed_sys(&triggers[pos & sizeMask], trigger.fst, trigger.snd);
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
/// One thread's pushes to a FIFO that no other thread pushes to meanwhile: positions counted in
/// a register, not reserved by an atomic on `head`.
///
/// Every push through `FifoDeviceHandle` reserves its position with a fetch-add on `head` and
/// must wait for the answer before it can store the trigger. For one thread pushing one trigger
/// at a time that wait is most of what a relaxed push costs (H100, `scripts/pushcost.cu`: 228 ns
/// a relaxed store with the atomic, 53 without) and about 0.17 us of `push`'s 0.9. A thread that
/// is the FIFO's only producer makes one of these instead: it reads `head` once, then each push
/// stores the trigger at the next position of its own count and adds one to `head` with a
/// reduction it does not wait for (`red.relaxed.gpu.add`), so that pushes through the handle
/// after it (a later kernel, a PortChannel's `flush`) find `head` right. The triggers, their
/// orderings (`push` releases, `push_relaxed` relies on the caller's fence, as the handle's
/// methods of those names) and the waits for a free slot are the handle's; the proxy sees no
/// difference.
///
/// The contract: from the construction to its last push, no other thread pushes to this FIFO,
/// and this thread pushes to it only through this producer. A PortChannel's `put`, `signal`,
/// `flush` and `putWithSignal` push through the handle: make a new producer after them. The
/// PortChannels of one proxy share its FIFO, so a producer made from one channel's `fifo_` rules
/// out pushes through every other channel of that proxy meanwhile, from any thread. Pushes of
/// other threads must be ordered before the construction (an earlier kernel; a `__syncthreads()`
/// after them in this block) or after the last push (the same, the other way: the producer's
/// adds to `head` are not waited for, so an unordered push could take a position it used).
///
/// The check: before its first push, and then whenever it has pushed a ring's worth since it
/// last looked, it reads `head`, which must equal its own count; otherwise another producer
/// reserved positions meanwhile, and it traps (the kernel ends with an error; the host sees it on
/// the stream), the time-limited pushes too. It sees a breach only when the other reservation is
/// visible at one of those reads: a producer that pushes fewer than a ring's worth after its
/// first push can miss one. Then one of two triggers written to the same slot is lost and the
/// position the other producer reserved stays empty, so the proxy stops there and later flushes
/// and pushes wait to their limits. Keep the contract; the check is a net, not a licence.
/// Not copyable (a copy would count the same positions again). (An extension: MSCCL++'s FIFO
/// has no exclusive producer.)
///
/// ```cuda
/// // One thread of the whole grid pushes; data written, then one fence (push_relaxed's rule).
/// if (blockIdx.x == 0 && threadIdx.x == 0) {
///   __threadfence_system();
///   mscclpp::FifoExclusiveProducer p(ch.fifo_);
///   for (int i = 0; i < n; ++i) p.push_relaxed(ch.put_with_signal_trigger(i * size, i * size, size));
///   ch.flush();  // through the handle: `p` is not used after it
/// }
/// ```
struct FifoExclusiveProducer {
  FifoExclusiveProducer(const FifoExclusiveProducer&) = delete;
  FifoExclusiveProducer& operator=(const FifoExclusiveProducer&) = delete;

  /// Takes over `fifo` for this thread: reads `head` (where the pushes start) and `tailCache`.
  MSCCLPP_RS_DEVICE explicit FifoExclusiveProducer(const FifoDeviceHandle& fifo)
      // Relaxed: a count; other producers' reservations before this are ordered by the caller
      // (kernel boundary or barrier), as the contract says.
      : fifo_(fifo), next_(detail::load_relaxed_gpu(fifo.head)), free_(0), check_(next_) {
    // Acquire: pairs with the red.release.gpu.max of whoever raised it after its ld.acquire.sys
    // of `tail`: slots below `size + tailCache` were popped, and their pops happen before this
    // thread rewrites them.
    free_ = (u64)fifo.size + detail::load_acquire_gpu(fifo.tailCache);
  }

  /// `FifoDeviceHandle::push` without the atomic: writes `trigger` (release) at the next position
  /// and returns it; waits while the ring is full (traps after `maxSpinCount` polls of `tail`,
  /// or once the proxy reports an error while the ring stays full; never if negative).
  MSCCLPP_RS_DEVICE u64 push(ProxyTrigger trigger, i64 maxSpinCount = 1000000) {
    if (must_look()) make_room(maxSpinCount);
    fifo_.write(next_, trigger);
    return advance();
  }

  /// `FifoDeviceHandle::push_relaxed` without the atomic: the trigger is stored relaxed, so the
  /// caller's `__threadfence_system()` after the data must come before it (the handle's
  /// `push_relaxed` says when one fence serves many pushes). Waits as `push`.
  MSCCLPP_RS_DEVICE u64 push_relaxed(ProxyTrigger trigger, i64 maxSpinCount = 1000000) {
    if (must_look()) make_room(maxSpinCount);
    fifo_.write_relaxed(next_, trigger);
    return advance();
  }

  /// Time-limited `push`: false (nothing pushed, the count unchanged) when the ring stays full
  /// for `timeout_ns`, or while it is full the proxy reports an error; otherwise true with the
  /// position in `*pos` (`pos` may be null). A broken contract still traps (see the struct).
  MSCCLPP_RS_DEVICE bool push_for(ProxyTrigger trigger, u64 timeout_ns, u64* pos = nullptr) {
    if (must_look() && !make_room_for(timeout_ns)) return false;
    fifo_.write(next_, trigger);
    u64 p = advance();
    if (pos != nullptr) *pos = p;
    return true;
  }

  /// Time-limited `push_relaxed`: as `push_for`, the trigger stored relaxed.
  MSCCLPP_RS_DEVICE bool push_relaxed_for(ProxyTrigger trigger, u64 timeout_ns, u64* pos = nullptr) {
    if (must_look() && !make_room_for(timeout_ns)) return false;
    fifo_.write_relaxed(next_, trigger);
    u64 p = advance();
    if (pos != nullptr) *pos = p;
    return true;
  }

  /// The position the next push takes (for `FifoDeviceHandle::sync` of the last one: `position() - 1`).
  MSCCLPP_RS_DEVICE u64 position() const { return next_; }

 private:
  /// Whether the next push must look at the FIFO first: the count reached the slots known to be
  /// free, or the contract's check is due.
  MSCCLPP_RS_DEVICE bool must_look() const { return next_ >= free_ || next_ >= check_; }

  MSCCLPP_RS_DEVICE u64 advance() {
    // Relaxed and not waited for: only keeps `head` equal to the count for pushes through the
    // handle after this producer (the proxy never reads `head`; the trigger's own store orders
    // it for the proxy).
    detail::red_add_relaxed_gpu(fifo_.head, 1);
    return next_++;
  }

  /// The contract's check: `head` must equal the count.
  MSCCLPP_RS_DEVICE void check_sole() {
    // Relaxed: this thread's own reductions on `head` precede this load in the location's
    // coherence order (same thread, same address), so it reads at least `next_`; more means
    // another thread reserved positions meanwhile.
    if (detail::load_relaxed_gpu(fifo_.head) != next_) __trap();
    check_ = next_ + (u64)fifo_.size;
  }

  /// Whether the next slot is free, after reading `tail` once if the cached bound says no.
  MSCCLPP_RS_DEVICE bool poll_room() {
    if (next_ < free_) return true;
    // Acquire: pairs with the proxy's release store of `tail` (Rust: `Fifo::pop`/`pop_to`): its
    // read of the slot's previous lap happens before this thread rewrites the slot.
    u64 t = detail::load_acquire_sys(fifo_.tail);
    // Release: keeps `tailCache` current for pushes through the handle (its readers acquire it).
    detail::red_max_release_gpu(fifo_.tailCache, t);
    free_ = (u64)fifo_.size + t;
    return next_ < free_;
  }

  MSCCLPP_RS_DEVICE void make_room(i64 maxSpinCount) {
    if (next_ >= check_) check_sole();
    i64 spins = 0;
    u32 polls = 0;
    while (!poll_room()) {
      // A proxy that stopped never pops again: trap once it says so (a negative count waits on,
      // for a later proxy on this FIFO), rather than poll to the spin limit.
      if (detail::error_check_due(polls) && maxSpinCount >= 0 && fifo_.proxy_error() != 0) __trap();
      detail::spin_check(spins, maxSpinCount);
    }
  }

  MSCCLPP_RS_DEVICE bool make_room_for(u64 timeout_ns) {
    if (next_ >= check_) check_sole();
    u64 start = detail::globaltimer();
    u32 polls = 0;
    while (!poll_room()) {
      if ((detail::error_check_due(polls) && fifo_.proxy_error() != 0) || detail::expired(start, timeout_ns)) {
        return false;
      }
    }
    return true;
  }

  FifoDeviceHandle fifo_;
  u64 next_;   // the position the next push writes
  u64 free_;   // positions below it are known free (size + a `tail` seen)
  u64 check_;  // the count at which `head` is compared with it again
};
#endif  // MSCCLPP_RS_DEVICE_COMPILE

#if defined(MSCCLPP_RS_DEVICE_COMPILE)
namespace detail {
// The counting protocol every semaphore handle shares (Host2Device and MemoryDevice2Device):
// `inbound` only grows (the peer adds one per signal); `expected` counts the signals this side
// consumed. A wait takes the next count with one relaxed fetch-add (so concurrent waiters each
// consume a distinct signal) and spins until `inbound` reaches it.

/// True (and one signal consumed) if `inbound` is above `expected`. The count is claimed with a
/// compare-and-swap, so concurrent pollers and waiters each consume a distinct signal (MSCCL++'s
/// poll loads, compares and then increments: two threads polling at once can both take one
/// signal there).
MSCCLPP_RS_DEVICE bool poll_inbound(const u64* inbound, u64* expected) {
  // Relaxed: a count only (the CAS below checks it); the data is ordered by `inbound`'s load.
  u64 e = load_relaxed_gpu(expected);
  // Acquire: pairs with the signal's release: red.release.sys.add of MemoryDevice2Device
  // `signal`, or the peer transport's token update after the data (Host2Device; Rust:
  // `Connection::update_and_sync`). Modelled in tests/ordering_models.rs.
  const u64 in = load_acquire_sys(inbound);
  while (in > e) {
    // Relaxed: claims one count against other pollers' CAS and waiters' fetch-add (all on
    // `expected`, one location: their order is its modification order); no data rides on it.
    const u64 seen = cas_relaxed_gpu(expected, e, e + 1);
    if (seen == e) return true;
    e = seen;
  }
  return false;
}

/// Waits for one signal: acquire loads (`Acquire`, data written before the signal is visible
/// after) or relaxed loads (execution sync only). Traps after `maxSpinCount` spins (never when
/// negative).
template <bool Acquire>
MSCCLPP_RS_DEVICE void wait_inbound(const u64* inbound, u64* expected, i64 maxSpinCount) {
  // Relaxed: takes the next count (against `poll_inbound`'s CAS); no data rides on it.
  u64 e = fetch_add_relaxed_gpu(expected, 1) + 1;
  i64 spins = 0;
  // Acquire: pairs with the signal's release, as in `poll_inbound` (relaxedWait: no pairing).
  while ((Acquire ? load_acquire_sys(inbound) : load_relaxed_sys(inbound)) < e) spin_check(spins, maxSpinCount);
}

/// Time-limited wait. `abort_word` (may be null) is checked while waiting (every
/// `MSCCLPP_RS_ERROR_CHECK_PERIOD`-th poll); nonzero ends the wait with false. On timeout the
/// expected count is taken back, so a retry waits for the same signal. That give-back is exact
/// for one waiter; with several threads waiting on one semaphore at once, a timeout can let two
/// of the others wait for the same count (one signal then releases both): after a timeout with
/// concurrent waiters, treat the semaphore's count as lost.
MSCCLPP_RS_DEVICE bool wait_inbound_for(u64* inbound, u64* expected, u64 timeout_ns, const u64* abort_word) {
  // Relaxed: takes the next count, as in `wait_inbound`.
  u64 e = fetch_add_relaxed_gpu(expected, 1) + 1;
  u64 start = globaltimer();
  u32 polls = 0;
  // Acquire: pairs with the signal's release, as in `poll_inbound`.
  while (load_acquire_sys(inbound) < e) {
    // Acquire: pairs with the proxy's release store of its error word (Rust:
    // `Fifo::set_proxy_error`). Read every MSCCLPP_RS_ERROR_CHECK_PERIOD-th poll only.
    if ((abort_word != nullptr && error_check_due(polls) && load_acquire_sys(abort_word) != 0) ||
        expired(start, timeout_ns)) {
      // Relaxed: gives the count back (see above for several waiters).
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
  MSCCLPP_RS_DEVICE bool poll() { return detail::poll_inbound(inboundToken, expectedInboundToken); }

  /// Waits for one signal (traps after `maxSpinCount` spins; never if negative).
  MSCCLPP_RS_DEVICE void wait(i64 maxSpinCount = 100000000) {
    detail::wait_inbound<true>(inboundToken, expectedInboundToken, maxSpinCount);
  }

  /// Waits for one signal for at most `timeout_ns`; false on timeout (nothing consumed).
  MSCCLPP_RS_DEVICE bool wait_for(u64 timeout_ns) {
    return detail::wait_inbound_for(inboundToken, expectedInboundToken, timeout_ns, nullptr);
  }
#endif  // MSCCLPP_RS_DEVICE_COMPILE

  u64* inboundToken;          // written by the peer's transport
  u64* expectedInboundToken;  // device memory, this side's count of consumed signals
};

/// A semaphore one GPU signals directly in another's memory (CUDA IPC, NVLink or PCIe) and the
/// other waits on, with no host thread in between. The host side is
/// `mscclpp::MemoryDevice2DeviceSemaphore` (Rust); tokens come from a per-GPU token pool.
///
/// Orderings: `signal` is one `red.release.sys.global.add.u64` on the peer's token: every write
/// this thread made before (to any memory, the peer's included) is visible to a thread that
/// consumed the signal with `wait`/`poll`/`wait_for` (acquire loads at system scope). Writes of
/// *other* threads of the block are ordered only if they are ordered before the signalling
/// thread (`__syncthreads()` first, or a fence). `relaxedSignal`/`relaxedWait` order execution
/// only (no data): pair them with your own fences.
///
/// Device atomics over CUDA IPC: a kernel may apply `atom`/`red` with `.sys` scope straight on a
/// pointer mapped from a peer (a MemoryChannel's `dst_`, a token): that is how `signal` works, and
/// it is the way to do remote atomics between GPUs of one host. Do not ask a proxy to do them
/// (PortChannel `atomicAdd` over CUDA IPC is refused): a proxy would have to launch a kernel,
/// which either cannot be scheduled while the caller's kernel spins waiting for it (same
/// context) or costs milliseconds per operation (a separate context).
struct MemoryDevice2DeviceSemaphoreDeviceHandle {
#if defined(MSCCLPP_RS_DEVICE_COMPILE)
  /// True (and one signal consumed) if a signal is pending.
  MSCCLPP_RS_DEVICE bool poll() { return detail::poll_inbound(inboundToken, expectedInboundToken); }
  /// Waits for one signal (traps after `maxSpinCount` spins; never if negative).
  MSCCLPP_RS_DEVICE void wait(i64 maxSpinCount = 100000000) {
    detail::wait_inbound<true>(inboundToken, expectedInboundToken, maxSpinCount);
  }
  /// `wait` without ordering the data before the signal (execution sync only).
  MSCCLPP_RS_DEVICE void relaxedWait(i64 maxSpinCount = 100000000) {
    detail::wait_inbound<false>(inboundToken, expectedInboundToken, maxSpinCount);
  }
  /// Waits for one signal for at most `timeout_ns`; false on timeout (nothing consumed). A peer
  /// that died never signals: this is the wait that returns then.
  MSCCLPP_RS_DEVICE bool wait_for(u64 timeout_ns) {
    return detail::wait_inbound_for(inboundToken, expectedInboundToken, timeout_ns, nullptr);
  }
  /// Signals the peer: everything this thread wrote before is visible to it first.
  /// Release: pairs with the peer's ld.acquire.sys of its inbound token in `poll`/`wait`/`wait_for`.
  MSCCLPP_RS_DEVICE void signal() { detail::red_add_release_sys(remoteInboundToken, 1); }
  /// Signals without ordering earlier writes (execution sync only): pairs with nothing.
  MSCCLPP_RS_DEVICE void relaxedSignal() { detail::red_add_relaxed_sys(remoteInboundToken, 1); }
#endif  // MSCCLPP_RS_DEVICE_COMPILE

  u64* inboundToken;          // local token the peer signals (a token-pool slot)
  u64* remoteInboundToken;    // the peer's token, mapped by CUDA IPC
  u64* expectedInboundToken;  // device memory (a token-pool slot)
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
  /// The trigger `put` pushes, not pushed: for `fifo_.push_batch`, which pushes several (of
  /// this channel and of others on the same FIFO) with one reservation and one fence.
  MSCCLPP_RS_DEVICE ProxyTrigger put_trigger(MemoryId dstId, u64 dstOffset, MemoryId srcId, u64 srcOffset,
                                             u64 size) const {
    return ProxyTrigger(TriggerData, dstId, dstOffset, srcId, srcOffset, size, semaphoreId_);
  }
  /// The trigger `signal` pushes, not pushed (see `put_trigger`).
  MSCCLPP_RS_DEVICE ProxyTrigger signal_trigger() const {
    return ProxyTrigger(TriggerFlag, 0, 0, 0, 0, 0, semaphoreId_);
  }
  /// The trigger `putWithSignal` pushes, not pushed (see `put_trigger`).
  MSCCLPP_RS_DEVICE ProxyTrigger put_with_signal_trigger(MemoryId dstId, u64 dstOffset, MemoryId srcId,
                                                         u64 srcOffset, u64 size) const {
    return ProxyTrigger(TriggerData | TriggerFlag, dstId, dstOffset, srcId, srcOffset, size, semaphoreId_);
  }
  /// Asks the proxy to copy `size` bytes from memory `srcId` at `srcOffset` to `dstId` at `dstOffset`.
  MSCCLPP_RS_DEVICE void put(MemoryId dstId, u64 dstOffset, MemoryId srcId, u64 srcOffset, u64 size) {
    fifo_.push(put_trigger(dstId, dstOffset, srcId, srcOffset, size));
  }
  /// `put` with one offset for both sides.
  MSCCLPP_RS_DEVICE void put(MemoryId dstId, MemoryId srcId, u64 offset, u64 size) {
    put(dstId, offset, srcId, offset, size);
  }
  /// Asks the proxy to signal the peer's semaphore (after the puts pushed before).
  MSCCLPP_RS_DEVICE void signal() { fifo_.push(signal_trigger()); }
  /// A put and a signal in one trigger.
  MSCCLPP_RS_DEVICE void putWithSignal(MemoryId dstId, u64 dstOffset, MemoryId srcId, u64 srcOffset, u64 size) {
    fifo_.push(put_with_signal_trigger(dstId, dstOffset, srcId, srcOffset, size));
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
    u32 polls = 0;
    // Acquire: pairs with the proxy's release of flushDonePos (Rust: `FlushWords::publish`, a
    // fetch_max after it saw the connection complete; `release_all` on error or stop).
    while ((done = detail::load_acquire_sys(flushDonePos_)) <= pos) {
      if ((detail::error_check_due(polls) && fifo_.proxy_error() != 0) || detail::expired(start, timeout_ns)) {
        return false;
      }
    }
    return done != ~0ull;
  }
  /// Asks the proxy to add `value` to the 64-bit word at `dstOffset` of memory `dstId`.
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
    // Acquire: pairs with the proxy's release of flushDonePos, as in `flush_for`.
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
  /// The trigger `put(dstOffset, srcOffset, size)` pushes, not pushed (for `fifo_.push_batch`).
  MSCCLPP_RS_DEVICE ProxyTrigger put_trigger(u64 dstOffset, u64 srcOffset, u64 size) const {
    return BasePortChannelDeviceHandle::put_trigger(dst_, dstOffset, src_, srcOffset, size);
  }
  /// The trigger `putWithSignal(dstOffset, srcOffset, size)` pushes, not pushed.
  MSCCLPP_RS_DEVICE ProxyTrigger put_with_signal_trigger(u64 dstOffset, u64 srcOffset, u64 size) const {
    return BasePortChannelDeviceHandle::put_with_signal_trigger(dst_, dstOffset, src_, srcOffset, size);
  }
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
  /// Adds `value` to the 64-bit word at `dstOffset` of `dst_` (through the proxy).
  MSCCLPP_RS_DEVICE void atomicAdd(u64 dstOffset, i64 value) {
    BasePortChannelDeviceHandle::atomicAdd(dst_, dstOffset, value);
  }
#endif  // MSCCLPP_RS_DEVICE_COMPILE
};

#if defined(MSCCLPP_RS_DEVICE_COMPILE)
namespace detail {
/// Both flags of an LL16 packet and both data words in one 16-byte volatile load / store (the
/// packet protocol relies on each 8-byte half {data, flag} landing whole).
MSCCLPP_RS_DEVICE void st_volatile_v4_u32(void* p, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d));
}
MSCCLPP_RS_DEVICE void ld_volatile_v4_u32(const void* p, u32& a, u32& b, u32& c, u32& d) {
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}
MSCCLPP_RS_DEVICE void st_volatile_v2_u32(void* p, u32 a, u32 b) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1,%2};" ::"l"(p), "r"(a), "r"(b));
}
MSCCLPP_RS_DEVICE void ld_volatile_v2_u32(const void* p, u32& a, u32& b) {
  asm volatile("ld.volatile.global.v2.u32 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
}
}  // namespace detail
#endif  // MSCCLPP_RS_DEVICE_COMPILE

/// An LL ("low latency") packet of 16 bytes: two 4-byte data words, each followed by its flag.
///
/// The flag protocol: a writer stores {data1, flag, data2, flag} with one 16-byte volatile store;
/// a reader spins on 16-byte volatile loads until both flags equal the flag of the round it
/// expects, then uses the data. Only 8-byte atomicity is assumed (each half carries its own
/// flag). Flags are never cleared: a caller gives every round a new flag (e.g. a round counter
/// starting at 1 over a zeroed buffer) and double-buffers the packet memory, so a reader can
/// never mistake last round's packet for this round's and a writer never overwrites a packet
/// the reader has not consumed (the reader tells the writer with a semaphore, or the writer
/// alternates halves every round).
/// Orderings: none. The volatile store pairs with the reader's volatile load of the same 8 (or
/// 16) bytes: data and flag travel in one access, so seeing the flag is seeing the data. Nothing
/// else the writer stored is ordered by a packet; for that, signal a semaphore (release/acquire).
union alignas(16) LL16Packet {
  struct {
    u32 data1;
    u32 flag1;
    u32 data2;
    u32 flag2;
  };
  u64 raw_[2];

#if defined(MSCCLPP_RS_DEVICE_COMPILE)
  /// What one packet carries.
  typedef uint2 Payload;

  LL16Packet() = default;
  MSCCLPP_RS_DEVICE LL16Packet(uint2 val, u32 flag) : data1(val.x), flag1(flag), data2(val.y), flag2(flag) {}

  /// Writes 8 bytes of data with `flag` (one 16-byte volatile store).
  MSCCLPP_RS_DEVICE void write(u32 val1, u32 val2, u32 flag) {
    detail::st_volatile_v4_u32(raw_, val1, flag, val2, flag);
  }
  /// Writes 8 bytes of data (low word first) with `flag`.
  MSCCLPP_RS_DEVICE void write(u64 val, u32 flag) { write((u32)val, (u32)(val >> 32), flag); }
  /// Writes 8 bytes of data with `flag`.
  MSCCLPP_RS_DEVICE void write(uint2 val, u32 flag) { write(val.x, val.y, flag); }
  /// One load: true while the packet is NOT ready (a flag differs from `flag`); `data` gets the
  /// data words either way (MSCCL++'s convention).
  MSCCLPP_RS_DEVICE bool readOnce(u32 flag, uint2& data) const {
    u32 f1, f2;
    detail::ld_volatile_v4_u32(raw_, data.x, f1, data.y, f2);
    return (f1 != flag) || (f2 != flag);
  }
  /// Spins until both flags equal `flag` and returns the data (traps after `maxSpinCount` spins;
  /// never if negative).
  MSCCLPP_RS_DEVICE uint2 read(u32 flag, i64 maxSpinCount = 100000000) const {
    uint2 data;
    i64 spins = 0;
    while (readOnce(flag, data)) detail::spin_check(spins, maxSpinCount);
    return data;
  }
  /// Time-limited `read`: true with the data in `data` once both flags equal `flag`; false after
  /// `timeout_ns` (a writer that never came, e.g. a dead peer).
  MSCCLPP_RS_DEVICE bool read_for(u32 flag, u64 timeout_ns, uint2& data) const {
    if (!readOnce(flag, data)) return true;
    u64 start = detail::globaltimer();
    while (readOnce(flag, data)) {
      if (detail::expired(start, timeout_ns)) return false;
    }
    return true;
  }
  /// Zeroes the packet (data and flags).
  MSCCLPP_RS_DEVICE void clear() { detail::st_volatile_v4_u32(raw_, 0, 0, 0, 0); }
#endif  // MSCCLPP_RS_DEVICE_COMPILE
};

/// An LL packet of 8 bytes: one 4-byte data word and its flag (one 8-byte volatile store / load).
/// The same flag rules as `LL16Packet`; half the payload per byte of packet buffer, but a packet
/// needs only 4-byte alignment of the data.
union alignas(8) LL8Packet {
  struct {
    u32 data;
    u32 flag;
  };
  u64 raw_;

#if defined(MSCCLPP_RS_DEVICE_COMPILE)
  /// What one packet carries.
  typedef u32 Payload;

  LL8Packet() = default;
  MSCCLPP_RS_DEVICE LL8Packet(u32 val, u32 flag) : data(val), flag(flag) {}

  /// Writes 4 bytes of data with `flag` (one 8-byte volatile store).
  MSCCLPP_RS_DEVICE void write(u32 val, u32 flag) { detail::st_volatile_v2_u32(&raw_, val, flag); }
  /// One load: true while the packet is NOT ready; `out` gets the data word either way.
  MSCCLPP_RS_DEVICE bool readOnce(u32 flag, u32& out) const {
    u32 f;
    detail::ld_volatile_v2_u32(&raw_, out, f);
    return f != flag;
  }
  /// Spins until the flag equals `flag` and returns the data (traps after `maxSpinCount`
  /// spins; never if negative).
  MSCCLPP_RS_DEVICE u32 read(u32 flag, i64 maxSpinCount = 1000000) const {
    u32 out;
    i64 spins = 0;
    while (readOnce(flag, out)) detail::spin_check(spins, maxSpinCount);
    return out;
  }
  /// Time-limited `read`: true with the data in `out` once the flag equals `flag`; false after
  /// `timeout_ns`.
  MSCCLPP_RS_DEVICE bool read_for(u32 flag, u64 timeout_ns, u32& out) const {
    if (!readOnce(flag, out)) return true;
    u64 start = detail::globaltimer();
    while (readOnce(flag, out)) {
      if (detail::expired(start, timeout_ns)) return false;
    }
    return true;
  }
  /// Zeroes the packet.
  MSCCLPP_RS_DEVICE void clear() { detail::st_volatile_v2_u32(&raw_, 0, 0); }
#endif  // MSCCLPP_RS_DEVICE_COMPILE
};

/// MSCCL++'s name for the default packet.
typedef LL16Packet LLPacket;

#if defined(MSCCLPP_RS_DEVICE_COMPILE)
namespace detail {
/// The element a copy moves per thread and step, by alignment (4, 8 or 16 bytes; other values
/// do not compile).
template <int Alignment>
struct CopyElem;
template <>
struct CopyElem<4> {
  typedef int type;
};
template <>
struct CopyElem<8> {
  typedef long long type;
};
template <>
struct CopyElem<16> {
  typedef longlong2 type;
};

/// Threads `tid` of `nthreads` copy elements `tid, tid + nthreads, ...` of `n`, one load then its
/// store per step. Kept this small on purpose (13 registers on sm_90): a copy with four loads in
/// flight per thread used 40 registers, which cost occupancy in grids that give each thread one
/// to four elements and gained nothing in persistent grids (docs/performance.md).
template <typename T>
MSCCLPP_RS_DEVICE void copy_elems(T* dst, const T* src, u64 n, u32 tid, u32 nthreads) {
  for (u64 i = tid; i < n; i += nthreads) dst[i] = src[i];
}

/// The collective copy behind MemoryChannel `put`/`get` (the contract is documented on `put`).
template <int Alignment, bool CopyRemainder>
MSCCLPP_RS_DEVICE void copy(void* dst, const void* src, u64 bytes, u32 tid, u32 nthreads) {
  typedef typename CopyElem<Alignment>::type T;
  const u64 dp = (u64)dst, sp = (u64)src;
  char* d = (char*)dst;
  const char* s = (const char*)src;
  if (((dp | sp | bytes) & (sizeof(T) - 1)) == 0) {
    // Both ends aligned and a whole number of elements (the common case): elements only.
    copy_elems<T>((T*)d, (const T*)s, bytes / sizeof(T), tid, nthreads);
    return;
  }
  if (CopyRemainder && (((dp | sp) & 3) != 0 || ((dp - sp) % sizeof(T)) != 0)) {
    // Outside the fast path's contract, still exact: 4-byte words when both ends are 4-aligned,
    // else bytes.
    if (((dp | sp) & 3) == 0) {
      copy_elems<int>((int*)d, (const int*)s, bytes / 4, tid, nthreads);
      copy_elems<char>(d + (bytes & ~3ull), s + (bytes & ~3ull), bytes & 3, tid, nthreads);
    } else {
      copy_elems<char>(d, s, bytes, tid, nthreads);
    }
    return;
  }
  // Fast path (src and dst equally misaligned to sizeof(T), both 4-aligned): head words up to
  // the element boundary, elements, tail words, tail bytes.
  const u64 numInt = bytes / 4;
  u64 head = (((dp + sizeof(T) - 1) / sizeof(T) * sizeof(T)) - dp) / 4;
  if (head > numInt) head = numInt;
  if (CopyRemainder) copy_elems<int>((int*)d, (const int*)s, head, tid, nthreads);
  const u64 intsPerElem = sizeof(T) / 4;
  const u64 nElem = (numInt - head) / intsPerElem;
  copy_elems<T>((T*)(d + head * 4), (const T*)(s + head * 4), nElem, tid, nthreads);
  if (CopyRemainder) {
    const u64 done = head + nElem * intsPerElem;
    copy_elems<int>((int*)d + done, (const int*)s + done, numInt - done, tid, nthreads);
    copy_elems<char>(d + numInt * 4, s + numInt * 4, bytes & 3, tid, nthreads);
  }
}

/// LL16: packet i carries source words 2i and 2i+1 (`bytes / 8` packets; a remainder is not sent).
MSCCLPP_RS_DEVICE void copy_to_packets(LL16Packet* dst, const u32* src, u64 bytes, u32 tid, u32 nthreads, u32 flag) {
  for (u64 i = tid; i < bytes / 8; i += nthreads) dst[i].write(src[2 * i], src[2 * i + 1], flag);
}
/// LL8: packet i carries source word i (`bytes / 4` packets).
MSCCLPP_RS_DEVICE void copy_to_packets(LL8Packet* dst, const u32* src, u64 bytes, u32 tid, u32 nthreads, u32 flag) {
  for (u64 i = tid; i < bytes / 4; i += nthreads) dst[i].write(src[i], flag);
}
MSCCLPP_RS_DEVICE void copy_from_packets(u32* dst, const LL16Packet* src, u64 bytes, u32 tid, u32 nthreads, u32 flag,
                                         i64 maxSpinCount) {
  uint2* out = (uint2*)dst;
  for (u64 i = tid; i < bytes / 8; i += nthreads) out[i] = src[i].read(flag, maxSpinCount);
}
MSCCLPP_RS_DEVICE void copy_from_packets(u32* dst, const LL8Packet* src, u64 bytes, u32 tid, u32 nthreads, u32 flag,
                                         i64 maxSpinCount) {
  for (u64 i = tid; i < bytes / 4; i += nthreads) dst[i] = src[i].read(flag, maxSpinCount);
}
MSCCLPP_RS_DEVICE bool copy_from_packets_for(u32* dst, const LL16Packet* src, u64 bytes, u32 tid, u32 nthreads,
                                             u32 flag, u64 start, u64 timeout_ns) {
  uint2* out = (uint2*)dst;
  for (u64 i = tid; i < bytes / 8; i += nthreads) {
    uint2 v;
    while (src[i].readOnce(flag, v)) {
      if (expired(start, timeout_ns)) return false;
    }
    out[i] = v;
  }
  return true;
}
MSCCLPP_RS_DEVICE bool copy_from_packets_for(u32* dst, const LL8Packet* src, u64 bytes, u32 tid, u32 nthreads,
                                             u32 flag, u64 start, u64 timeout_ns) {
  for (u64 i = tid; i < bytes / 4; i += nthreads) {
    u32 v;
    while (src[i].readOnce(flag, v)) {
      if (expired(start, timeout_ns)) return false;
    }
    dst[i] = v;
  }
  return true;
}
}  // namespace detail
#endif  // MSCCLPP_RS_DEVICE_COMPILE

/// A MemoryChannel without fixed memories (semaphore only): what MSCCL++'s own expert-parallel
/// kernels use next to raw peer pointers.
struct BaseMemoryChannelDeviceHandle {
  MemoryDevice2DeviceSemaphoreDeviceHandle semaphore_;

  BaseMemoryChannelDeviceHandle() = default;
  MSCCLPP_RS_HOST_DEVICE BaseMemoryChannelDeviceHandle(MemoryDevice2DeviceSemaphoreDeviceHandle semaphore)
      : semaphore_(semaphore) {}

#if defined(MSCCLPP_RS_DEVICE_COMPILE)
  /// Signals the peer after every earlier write of this thread (see the semaphore's orderings).
  MSCCLPP_RS_DEVICE void signal() { semaphore_.signal(); }
  /// Signals without ordering earlier writes (fence yourself).
  MSCCLPP_RS_DEVICE void relaxedSignal() { semaphore_.relaxedSignal(); }
  /// True (and one signal consumed) if the peer has signalled.
  MSCCLPP_RS_DEVICE bool poll() { return semaphore_.poll(); }
  /// Waits for one signal from the peer (traps after `maxSpinCount` spins; never if negative).
  MSCCLPP_RS_DEVICE void wait(i64 maxSpinCount = 10000000) { semaphore_.wait(maxSpinCount); }
  /// `wait` for execution sync only (no data ordering).
  MSCCLPP_RS_DEVICE void relaxedWait(i64 maxSpinCount = 10000000) { semaphore_.relaxedWait(maxSpinCount); }
  /// Waits for one signal for at most `timeout_ns`; false on timeout (nothing consumed).
  MSCCLPP_RS_DEVICE bool wait_for(u64 timeout_ns) { return semaphore_.wait_for(timeout_ns); }
#endif  // MSCCLPP_RS_DEVICE_COMPILE
};

/// A MemoryChannel: the peer's memory mapped here (`dst_`), local memory (`src_`) and an optional
/// local packet buffer (`packetBuffer_`, where the peer's `putPackets` land).
///
/// Copy contract of `put`/`get` (threads `threadId` of `numThreads` call them together, e.g.
/// every thread of a grid with its global index; each copies a share):
///  * Fast path, MSCCL++'s: both addresses (base + offset) 4-byte aligned and equally misaligned
///    to `Alignment` (4, 8 or 16; 16 moves `longlong2`): leading 4-byte words up to the
///    `Alignment` boundary, then `Alignment`-byte elements, then trailing words.
///  * `CopyRemainder = true` (default): every one of `bytes` bytes is copied, for any size and
///    any addresses. Inputs outside the fast path (differently misaligned ends, addresses not
///    4-aligned, `bytes % 4 != 0`) are copied with 4-byte words or single bytes: exact, slower.
///    (MSCCL++ leaves these undefined and drops `bytes % 4`.)
///  * `CopyRemainder = false`: only the whole `Alignment`-byte elements of the fast path are
///    copied (the caller handles head and tail), as in MSCCL++; outside the fast path's
///    alignment rule the result is undefined.
/// A copy is not ordered with the peer: `signal()` after it (from one thread, after a
/// `__syncthreads()` or a grid-wide barrier covering every copying thread) publishes it.
/// Speed: each thread loads then stores one element per step. Where HBM is the limit (both ends
/// on one GPU), use a flat grid with at least 16 KiB per block, such as 1024-thread blocks with
/// two 16-byte elements per thread (`blocks = bytes / 32 KiB`): from 64 MiB up it comes close to
/// `cuMemcpyDtoDAsync`. With 8 KiB per block or less the rate at which the GPU starts blocks
/// limits the copy; a persistent grid (many elements per thread) comes a little below the flat
/// one; and the same copy launched back to back with identical parameters runs slower than
/// launches whose parameters differ (a round number, a flag). Figures: docs/performance.md.
/// In flat grids pass the handle by value (a kernel parameter): through the device-memory copy
/// (`device_handle_ptr`, stable for CUDA graphs) every short-lived thread first waits for a load
/// of the handle.
struct MemoryChannelDeviceHandle : public BaseMemoryChannelDeviceHandle {
  void* dst_;
  void* src_;
  void* packetBuffer_;

  MemoryChannelDeviceHandle() = default;
  MSCCLPP_RS_HOST_DEVICE MemoryChannelDeviceHandle(MemoryDevice2DeviceSemaphoreDeviceHandle semaphore, void* dst,
                                                   void* src, void* packetBuffer)
      : BaseMemoryChannelDeviceHandle(semaphore), dst_(dst), src_(src), packetBuffer_(packetBuffer) {}

#if defined(MSCCLPP_RS_DEVICE_COMPILE)
  /// Loads element `index` (of type T) of the peer's memory.
  template <typename T>
  MSCCLPP_RS_DEVICE T read(u64 index) {
    return *((T*)dst_ + index);
  }
  /// Stores `v` as element `index` (of type T) of the peer's memory.
  template <typename T>
  MSCCLPP_RS_DEVICE void write(u64 index, const T& v) {
    *((T*)dst_ + index) = v;
  }

  /// Collective copy of `originBytes` from `src_ + originOffset` (here) to `dst_ + targetOffset`
  /// (the peer), under the contract above.
  template <int Alignment = 16, bool CopyRemainder = true>
  MSCCLPP_RS_DEVICE void put(u64 targetOffset, u64 originOffset, u64 originBytes, u32 threadId, u32 numThreads) {
    detail::copy<Alignment, CopyRemainder>((char*)dst_ + targetOffset, (const char*)src_ + originOffset, originBytes,
                                           threadId, numThreads);
  }
  /// `put` with one offset for both sides.
  template <int Alignment = 16, bool CopyRemainder = true>
  MSCCLPP_RS_DEVICE void put(u64 offset, u64 originBytes, u32 threadId, u32 numThreads) {
    put<Alignment, CopyRemainder>(offset, offset, originBytes, threadId, numThreads);
  }
  /// Collective copy of `originBytes` from the peer (`dst_ + originOffset`) to here
  /// (`src_ + targetOffset`), under the contract above.
  template <int Alignment = 16, bool CopyRemainder = true>
  MSCCLPP_RS_DEVICE void get(u64 targetOffset, u64 originOffset, u64 originBytes, u32 threadId, u32 numThreads) {
    detail::copy<Alignment, CopyRemainder>((char*)src_ + targetOffset, (const char*)dst_ + originOffset, originBytes,
                                           threadId, numThreads);
  }
  /// `get` with one offset for both sides.
  template <int Alignment = 16, bool CopyRemainder = true>
  MSCCLPP_RS_DEVICE void get(u64 offset, u64 originBytes, u32 threadId, u32 numThreads) {
    get<Alignment, CopyRemainder>(offset, offset, originBytes, threadId, numThreads);
  }

  /// Collective: packs `originBytes` from `src_ + originOffset` into packets written with `flag`
  /// at `dst_ + targetOffset` (the peer's packet buffer: `dst_` must be the peer's memory its
  /// channel uses as `packetBuffer_`). LL16: 8 data bytes per 16-byte packet (offsets 8-aligned,
  /// `originBytes` a multiple of 8); LL8: 4 per 8 (4-aligned, a multiple of 4); a remainder is
  /// not sent. The destination needs 2 x `originBytes`.
  template <typename PacketType = LL16Packet>
  MSCCLPP_RS_DEVICE void putPackets(u64 targetOffset, u64 originOffset, u64 originBytes, u32 threadId,
                                    u32 numThreads, u32 flag) {
    detail::copy_to_packets((PacketType*)((char*)dst_ + targetOffset), (const u32*)((const char*)src_ + originOffset),
                            originBytes, threadId, numThreads, flag);
  }
  /// `putPackets` with one offset for both sides.
  template <typename PacketType = LL16Packet>
  MSCCLPP_RS_DEVICE void putPackets(u64 offset, u64 originBytes, u32 threadId, u32 numThreads, u32 flag) {
    putPackets<PacketType>(offset, offset, originBytes, threadId, numThreads, flag);
  }
  /// Reads packet `index` of the local packet buffer once its flag(s) equal `flag` (traps after
  /// `maxSpinCount` spins; never if negative, the default). Traps if there is no packet buffer.
  template <typename PacketType = LL16Packet>
  MSCCLPP_RS_DEVICE typename PacketType::Payload unpackPacket(u64 index, u32 flag, i64 maxSpinCount = -1) {
    if (packetBuffer_ == nullptr) __trap();
    return ((const PacketType*)packetBuffer_)[index].read(flag, maxSpinCount);
  }
  /// Time-limited `unpackPacket`: true with the payload in `out`, false after `timeout_ns`.
  template <typename PacketType = LL16Packet>
  MSCCLPP_RS_DEVICE bool unpackPacket_for(u64 index, u32 flag, u64 timeout_ns, typename PacketType::Payload& out) {
    if (packetBuffer_ == nullptr) __trap();
    return ((const PacketType*)packetBuffer_)[index].read_for(flag, timeout_ns, out);
  }
  /// Collective: waits for the packets at `packetBuffer_ + targetOffset` to carry `flag` and
  /// writes their data to `src_ + originOffset` (`originBytes` of payload; the packets span
  /// 2 x `originBytes`). Traps after `maxSpinCount` spins per packet (never if negative, the
  /// default) or if there is no packet buffer.
  template <typename PacketType = LL16Packet>
  MSCCLPP_RS_DEVICE void unpackPackets(u64 targetOffset, u64 originOffset, u64 originBytes, u32 threadId,
                                       u32 numThreads, u32 flag, i64 maxSpinCount = -1) {
    if (packetBuffer_ == nullptr) __trap();
    detail::copy_from_packets((u32*)((char*)src_ + originOffset),
                              (const PacketType*)((const char*)packetBuffer_ + targetOffset), originBytes, threadId,
                              numThreads, flag, maxSpinCount);
  }
  /// `unpackPackets` with one offset for both sides.
  template <typename PacketType = LL16Packet>
  MSCCLPP_RS_DEVICE void unpackPackets(u64 offset, u64 originBytes, u32 threadId, u32 numThreads, u32 flag,
                                       i64 maxSpinCount = -1) {
    unpackPackets<PacketType>(offset, offset, originBytes, threadId, numThreads, flag, maxSpinCount);
  }
  /// Time-limited `unpackPackets`: true when this thread's share of packets arrived and was
  /// written; false once `timeout_ns` passed since the call (its share is then incomplete).
  template <typename PacketType = LL16Packet>
  MSCCLPP_RS_DEVICE bool unpackPackets_for(u64 targetOffset, u64 originOffset, u64 originBytes, u32 threadId,
                                           u32 numThreads, u32 flag, u64 timeout_ns) {
    if (packetBuffer_ == nullptr) __trap();
    return detail::copy_from_packets_for((u32*)((char*)src_ + originOffset),
                                         (const PacketType*)((const char*)packetBuffer_ + targetOffset), originBytes,
                                         threadId, numThreads, flag, detail::globaltimer(), timeout_ns);
  }
#endif  // MSCCLPP_RS_DEVICE_COMPILE
};

static_assert(sizeof(ProxyTrigger) == 16 && alignof(ProxyTrigger) == 16, "ProxyTrigger layout");
static_assert(sizeof(FifoDeviceHandle) == 56, "FifoDeviceHandle layout");
// NVRTC 13.0 rejects __builtin_offsetof here; the host-compiler test checks them.
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

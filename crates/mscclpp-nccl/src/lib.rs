//! # mscclpp-nccl: an NCCL-compatible library over mscclpp's collectives
//!
//! Builds `libmscclpp_nccl.so`, which exports every host function of NCCL 2.31's `nccl.h` (72 with the deprecated `ncclResetDebugInit`)
//! (both the `nccl*` names and the `pnccl*` profiling names) with NCCL's ABI. Programs that
//! call NCCL (PyTorch's `nccl` backend, vLLM's and SGLang's PyNCCL, nccl-tests) run on
//! mscclpp unchanged, either with `LD_PRELOAD=libmscclpp_nccl.so` or by loading it by path.
//!
//! - **Native**: AllReduce, AllGather, ReduceScatter, Broadcast/Bcast and Reduce on
//!   [`mscclpp_collectives`] (f32, f16, bf16, i32, u32; sum, prod, max, min, avg; any type for
//!   the data movers); Send/Recv, AlltoAll, Gather and Scatter on the device point-to-point path
//!   ([`mscclpp_collectives::PointToPoint`]: per-pair staging rings mapped over CUDA IPC, one
//!   kernel per group and communicator, graph-capturable), or, where no rank can build it (no
//!   GPU, `MSCCLPP_NCCL_P2P=host`), host-staged over the communicator's bootstrap (correct and
//!   deadlock-free in groups, not fast, not graph-capturable). The log says which path runs.
//! - **Fallback**: anything else (other types, PreMulSum, forced operations, signals,
//!   parameters, suspend/resume) goes to a real NCCL loaded at run time when
//!   `MSCCLPP_ENABLE_NCCL_FALLBACK=1` (`MSCCLPP_NCCL_LIB_PATH`, default `libnccl.so.2`;
//!   `MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION` sends named operations there always). Without it
//!   such calls return `ncclInvalidUsage` and `ncclGetLastError` says what is missing.
//! - Routing decisions are logged once per (operation, type, route) at `info` on target
//!   `mscclpp::nccl` (`MSCCLPP_LOG_LEVEL=INFO`).
//!
//! See the crate README for `LD_PRELOAD`, by-path loading and torchrun.
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
// The C names of nccl.h (ncclFloat32, ncclSum...) are kept as they are.
#![allow(non_upper_case_globals)]

pub mod abi;
pub mod comm;
pub mod error;
pub mod exports;
pub mod fallback;
pub mod group;
pub mod mem;
pub mod route;

/// A marker only this library exports, so that the NCCL fallback never loads a copy of it.
#[unsafe(no_mangle)]
pub static mscclpp_nccl_library: u8 = 1;

//! Kernels that communicate: the CUDA device header, the handles kernels receive, the trigger
//! codec and the FIFO between kernels and a proxy thread.
//!
//! Kernel authors include [`HEADER_NAME`] (`"mscclpp_rs/device.cuh"`): from the crate's
//! [`include_dir`] when building with nvcc, from a copy written by [`write_header`], or, when
//! compiling at run time with NVRTC, through [`compile`](self::compile::compile), which hands the
//! header to NVRTC directly. The header is self-contained (no includes, inline PTX only) and its
//! layouts are byte-identical to MSCCL++'s device handles, so a ported kernel changes only its
//! include. [`handles`] mirrors them in Rust; [`trigger`] encodes and decodes the FIFO's requests.
//!
//! # Layers inside this module
//! The primitives ([`header`], [`handles`], [`trigger`], [`fifo`], [`token_pool`], [`compile`])
//! sit below the semaphores ([`MemoryDevice2DeviceSemaphore`](crate::MemoryDevice2DeviceSemaphore),
//! [`Host2DeviceSemaphore`](crate::Host2DeviceSemaphore)), which use them; the channels
//! ([`memory_channel`], [`port_channel`]) and the [`proxy`] sit above and are made from
//! semaphores (`ChannelSemaphore: From<MemoryDevice2DeviceSemaphore>`,
//! `ProxySemaphore: From<Host2DeviceSemaphore>`). This file only re-exports.

pub mod compile;
pub mod fifo;
pub mod handles;
pub mod header;
pub mod memory_channel;
pub mod port_channel;
pub mod proxy;
pub mod token_pool;
pub mod trigger;

pub use fifo::{DEFAULT_FIFO_SIZE, Fifo};
pub use handles::{
    BaseMemoryChannelDeviceHandle, BasePortChannelDeviceHandle, FifoDeviceHandle, Host2DeviceSemaphoreDeviceHandle,
    LL8Packet, LL16Packet, MemoryChannelDeviceHandle, MemoryDevice2DeviceSemaphoreDeviceHandle,
    PortChannelDeviceHandle,
};
pub use header::{ABI_VERSION, DEVICE_HEADER, HEADER_NAME, include_dir, write_header};
pub use memory_channel::{BaseMemoryChannel, ChannelSemaphore, MemoryChannel};
pub use port_channel::PortChannel;
pub use proxy::{
    HandlerResult, MemoryId, Proxy, ProxyConfig, ProxyHandler, ProxyOptions, ProxySemaphore, ProxyService, SemaphoreId,
    TriggerContext,
};
pub use trigger::{ProxyTrigger, Put, Request, decode};

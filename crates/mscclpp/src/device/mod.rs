//! STAND-IN (deviceb) for devicea's `device/mod.rs`: keep devicea's file at merge and add the
//! `fifo`, `proxy` and `port_channel` modules to it.

pub mod fifo;
pub mod handles;
pub mod port_channel;
pub mod proxy;
pub mod trigger;

pub use handles::{
    BasePortChannelDeviceHandle, FifoDeviceHandle, Host2DeviceSemaphoreDeviceHandle, LL8Packet, LL16Packet,
    MemoryChannelDeviceHandle, MemoryDevice2DeviceSemaphoreDeviceHandle, PortChannelDeviceHandle,
};
pub use port_channel::PortChannel;
pub use proxy::{MemoryId, ProxyConfig, ProxySemaphore, ProxyService, SemaphoreId};
pub use trigger::{ProxyTrigger, Put, Request, decode};

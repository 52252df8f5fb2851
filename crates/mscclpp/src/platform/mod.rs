//! Layer 1, platform access: every `unsafe` operation of the crate lives under this module, each
//! block with a `// SAFETY:` line saying why it is sound. It imports nothing from the layers above
//! but vocabulary (`error`, `transport`, `sync`, `env`, `identity`).
//!
//! - [`cuda`]: the CUDA driver API through `cudarc` (devices, streams, events, device and pinned
//!   memory, CUDA IPC, the atomic-add kernel, dma-buf registration with an RDMA device);
//! - [`gdr`]: host stores into GPU memory (GDRCopy, else stream writes) for signal forwarding;
//! - [`verbs`]: libibverbs (hand-declared ABI, loader, the in-process test provider) and the
//!   device objects over it (`IbDevice`, `IbMr`, `IbCq`, `IbQp`);
//! - [`hostmem`]: page-aligned host allocations, checked regions, vectored sends;
//! - [`numa`]: sysfs NUMA lookups and thread binding; [`topo`]: PCIe distance between a GPU and NICs.

pub(crate) mod cuda;
pub(crate) mod gdr;
pub(crate) mod hostmem;
pub(crate) mod numa;
pub(crate) mod pidfd;
pub(crate) mod topo;
pub(crate) mod verbs;

use crate::error::{Error, Result};

/// The one range check of the crate: `[offset, offset + n)` must lie inside the `len` bytes of
/// `what` (a host region, a GPU region, a registered memory). `InvalidUsage` naming the range
/// otherwise; an `offset + n` that overflows is outside too.
pub(crate) fn check_range(offset: u64, n: u64, len: u64, what: &str) -> Result<()> {
    match offset.checked_add(n) {
        Some(end) if end <= len => Ok(()),
        _ => Err(Error::invalid_usage(format!("range [{offset}, {offset}+{n}) is outside the {len}-byte {what}"))),
    }
}

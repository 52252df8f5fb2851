//! Registration of GPU memory with an RDMA device: a dma-buf of the allocation, else plain
//! `ibv_reg_mr` (nvidia-peermem).
#![allow(unsafe_code)]

use std::ffi::c_int;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use super::{GpuRegion, check};
use crate::error::{Error, ErrorKind, Result};
use crate::platform::verbs::dev::{IbDevice, IbMr};

/// Registers GPU memory `g` with `dev`: a dma-buf of its allocation (`cuMemGetHandleForAddressRange`
/// and `ibv_reg_dmabuf_mr`) first, then plain `ibv_reg_mr` (works with nvidia-peermem); an error
/// naming both failures otherwise.
pub(crate) fn reg_ib_mr(dev: &Arc<IbDevice>, g: &GpuRegion) -> Result<IbMr> {
    let dmabuf = (|| -> Result<IbMr> {
        g.dev.bind()?;
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: valid out-pointers; g.ptr is a live allocation of the bound context.
        check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, g.ptr) })?;
        let mut fd: c_int = -1;
        // SAFETY: fd is a valid out-pointer for a file descriptor; [base, base + size) is the
        // whole allocation (page-granular, as the call requires).
        check("cuMemGetHandleForAddressRange(DMA_BUF_FD)", unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut c_int).cast(),
                base,
                size,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        if fd < 0 {
            return Err(Error::new(ErrorKind::Cuda, "cuMemGetHandleForAddressRange returned no file descriptor"));
        }
        // SAFETY: the driver returned a new descriptor that nothing else owns; closed on drop
        // (the MR keeps its own reference to the dma-buf).
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        use std::os::fd::AsRawFd;
        dev.reg_dmabuf_mr(g.ptr - base, g.len as u64, g.ptr, fd.as_raw_fd())
    })();
    let e1 = match dmabuf {
        Ok(mr) => {
            tracing::debug!(target: "mscclpp::ib", "GPU{} memory registered on {} through dma-buf", g.dev.ordinal, dev.name);
            return Ok(mr);
        }
        Err(e) => e,
    };
    match dev.reg_mr(g.ptr, g.len as u64) {
        Ok(mr) => {
            tracing::info!(
                target: "mscclpp::ib",
                "GPU{} memory registered on {} through ibv_reg_mr (nvidia-peermem); dma-buf failed: {e1}",
                g.dev.ordinal,
                dev.name
            );
            Ok(mr)
        }
        Err(e2) => Err(Error::new(
            ErrorKind::Ib,
            format!(
                "cannot register GPU{} memory for RDMA on {}: dma-buf: {}; ibv_reg_mr (needs nvidia-peermem): {}",
                g.dev.ordinal,
                dev.name,
                e1.message(),
                e2.message()
            ),
        )),
    }
}

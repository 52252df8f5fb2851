//! The memory operations the host-staged point-to-point path needs, behind a trait so the
//! group and exchange logic runs in CPU tests on host memory ([`HostMem`]) and on GPUs through
//! the CUDA driver ([`CudaMem`]).

use std::time::Duration;

use cudarc::driver::{result, sys};

use crate::error::{Failure, Res};

/// Copies between the caller's buffers and host memory, ordered with the caller's stream.
pub trait DeviceMem: Send + Sync {
    /// Waits (bounded) until everything submitted to `stream` so far has finished.
    fn wait_stream(&self, device: u32, stream: u64, timeout: Duration) -> Res;
    /// Whether `stream` is capturing a CUDA graph.
    fn capturing(&self, device: u32, stream: u64) -> Res<bool>;
    /// Reads `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` points to `len` readable bytes of the caller's memory.
    unsafe fn read(&self, device: u32, ptr: u64, len: usize) -> Res<Vec<u8>>;
    /// Writes `data` at `ptr`.
    ///
    /// # Safety
    /// `ptr` points to `data.len()` writable bytes of the caller's memory.
    unsafe fn write(&self, device: u32, ptr: u64, data: &[u8]) -> Res;
    /// Copies `len` bytes from `src` to `dst`, ordered on `stream`.
    ///
    /// # Safety
    /// Both ranges are the caller's memory and stay valid until the copy has run.
    unsafe fn copy(&self, device: u32, dst: u64, src: u64, len: usize, stream: u64) -> Res;
}

/// Whether the CUDA driver loads and shows a GPU; `Err` says why not.
pub fn driver() -> Result<usize, String> {
    match mscclpp::gpu::device_count() {
        Ok(0) => Err("no CUDA GPU is visible".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("no CUDA: {e}")),
    }
}

/// The GPU of the calling thread's current CUDA context (the runtime's `cudaGetDevice`), or
/// `None` without a driver or a current context.
pub fn current_device() -> Option<u32> {
    driver().ok()?;
    let ctx = result::ctx::get_current().ok()??;
    let _ = ctx;
    let mut d: sys::CUdevice = 0;
    // SAFETY: a valid out pointer; a context is current on this thread (checked above).
    let r = unsafe { sys::cuCtxGetDevice(&mut d) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(d as u32)
}

/// Makes GPU `device`'s primary context current on this thread when no context is (threads we
/// start, ncclCommInitAll).
pub fn bind(device: u32) -> Res {
    driver().map_err(Failure::usage)?;
    if result::ctx::get_current().ok().flatten().is_some() && current_device() == Some(device) {
        return Ok(());
    }
    let cu = |e: result::DriverError, what: &str| {
        Failure::new(crate::abi::ncclUnhandledCudaError, format!("{what} for GPU{device}: {e}"))
    };
    let dev = result::device::get(device as i32).map_err(|e| cu(e, "cuDeviceGet"))?;
    // SAFETY: dev is a valid device; the primary context is retained for the process's life (as
    // the runtime API does), so making it current leaves nothing dangling.
    let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(|e| cu(e, "cuDevicePrimaryCtxRetain"))?;
    // SAFETY: ctx is a live primary context.
    unsafe { result::ctx::set_current(ctx) }.map_err(|e| cu(e, "cuCtxSetCurrent"))
}

/// [`DeviceMem`] through the CUDA driver.
#[derive(Debug, Default)]
pub struct CudaMem;

fn cuda(what: &str, e: result::DriverError) -> Failure {
    Failure::new(crate::abi::ncclUnhandledCudaError, format!("{what}: {e}"))
}

impl DeviceMem for CudaMem {
    fn wait_stream(&self, device: u32, stream: u64, timeout: Duration) -> Res {
        // SAFETY: the caller's stream, live for the call it was passed with (NCCL's contract).
        let s = unsafe { mscclpp::gpu::Stream::from_raw(device, stream) }?;
        Ok(s.synchronize(timeout)?)
    }
    fn capturing(&self, device: u32, stream: u64) -> Res<bool> {
        // SAFETY: as in wait_stream.
        let s = unsafe { mscclpp::gpu::Stream::from_raw(device, stream) }?;
        Ok(s.is_capturing()?)
    }
    unsafe fn read(&self, device: u32, ptr: u64, len: usize) -> Res<Vec<u8>> {
        bind(device)?;
        let mut v = vec![0u8; len];
        // SAFETY: the caller's contract: ptr holds len bytes.
        unsafe { result::memcpy_dtoh_sync(&mut v, ptr) }.map_err(|e| cuda("cuMemcpyDtoH", e))?;
        Ok(v)
    }
    unsafe fn write(&self, device: u32, ptr: u64, data: &[u8]) -> Res {
        bind(device)?;
        // SAFETY: the caller's contract: ptr holds data.len() bytes.
        unsafe { result::memcpy_htod_sync(ptr, data) }.map_err(|e| cuda("cuMemcpyHtoD", e))
    }
    unsafe fn copy(&self, device: u32, dst: u64, src: u64, len: usize, stream: u64) -> Res {
        bind(device)?;
        // SAFETY: the caller's contract; stream is the caller's live stream.
        unsafe { result::memcpy_dtod_async(dst, src, len, stream as sys::CUstream) }
            .map_err(|e| cuda("cuMemcpyDtoDAsync", e))
    }
}

/// [`DeviceMem`] on host memory (pointers are host addresses; streams are ignored): the CPU
/// tests' stand-in for a GPU.
#[derive(Debug, Default)]
pub struct HostMem;

impl DeviceMem for HostMem {
    fn wait_stream(&self, _: u32, _: u64, _: Duration) -> Res {
        Ok(())
    }
    fn capturing(&self, _: u32, _: u64) -> Res<bool> {
        Ok(false)
    }
    unsafe fn read(&self, _: u32, ptr: u64, len: usize) -> Res<Vec<u8>> {
        // SAFETY: the caller's contract: ptr holds len readable bytes.
        Ok(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }.to_vec())
    }
    unsafe fn write(&self, _: u32, ptr: u64, data: &[u8]) -> Res {
        // SAFETY: the caller's contract: ptr holds data.len() writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, data.len()) };
        Ok(())
    }
    unsafe fn copy(&self, _: u32, dst: u64, src: u64, len: usize, _: u64) -> Res {
        // SAFETY: the caller's contract; std::ptr::copy allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
        Ok(())
    }
}

//! CUDA graphs (stream capture, instantiate, launch) and timing events: what a caller needs to
//! replay communication kernels without host work between replays, and to time them on the GPU.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::sys;

use super::{GpuDevice, LOG, Stream as RawStream, check};
use crate::error::Result;

/// Starts a thread-local capture on `stream` (unsafe calls are refused on this thread only, so
/// other ranks' threads of the process may allocate and synchronize meanwhile).
pub(crate) fn begin_capture(stream: &RawStream) -> Result<()> {
    stream.dev.bind()?;
    // SAFETY: a live stream of the bound context; the mode is a valid enum value.
    check("cuStreamBeginCapture", unsafe {
        sys::cuStreamBeginCapture_v2(stream.raw, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    })
}

/// Whether `stream` is capturing.
pub(crate) fn is_capturing(stream: &RawStream) -> Result<bool> {
    stream.dev.bind()?;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream; status is a local out-parameter.
    check("cuStreamIsCapturing", unsafe { sys::cuStreamIsCapturing(stream.raw, &mut status) })?;
    Ok(status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE)
}

/// Ends the capture on `stream` and instantiates what it captured.
pub(crate) fn end_capture(stream: &RawStream) -> Result<Graph> {
    stream.dev.bind()?;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: a live, capturing stream; graph is a local out-parameter.
    check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(stream.raw, &mut graph) })?;
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: graph was just produced by the capture; exec is a local out-parameter.
    let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
    // SAFETY: the graph is ours and no longer needed once instantiated (or failed to be).
    let _ = unsafe { sys::cuGraphDestroy(graph) };
    check("cuGraphInstantiate", r)?;
    Ok(Graph { exec, dev: stream.dev.clone() })
}

/// An instantiated CUDA graph, captured with [`Stream::begin_capture`](super::module::Stream::begin_capture)
/// and [`end_capture`](super::module::Stream::end_capture). Launch it as often as you like; the
/// memory its kernels use must stay valid for as long as it may be launched.
pub struct Graph {
    exec: sys::CUgraphExec,
    dev: Arc<GpuDevice>,
}

// SAFETY: an executable graph may be launched from any thread with its context bound (launch
// binds it); it is never mutated after instantiation.
unsafe impl Send for Graph {}
// SAFETY: as above; the driver serializes launches.
unsafe impl Sync for Graph {}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Graph({:?})", self.dev)
    }
}

impl Graph {
    /// Launches the graph on `stream` (asynchronously, in stream order).
    ///
    /// # Errors
    /// `Cuda` when the launch fails.
    pub fn launch(&self, stream: &super::module::Stream) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: exec is a live executable graph of this context and the stream a live stream.
        check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(self.exec, stream.as_raw() as sys::CUstream) })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: exec is live and destroyed once; the driver lets pending launches finish.
            if let Err(e) = check("cuGraphExecDestroy", unsafe { sys::cuGraphExecDestroy(self.exec) }) {
                tracing::warn!(target: LOG, "{e}");
            }
        }
    }
}

/// An event that records GPU time, for measuring work between two points of a stream.
pub struct TimingEvent {
    raw: sys::CUevent,
    dev: Arc<GpuDevice>,
}

// SAFETY: event handles may be used from any thread with the context bound (each method does).
unsafe impl Send for TimingEvent {}
// SAFETY: as above.
unsafe impl Sync for TimingEvent {}

impl std::fmt::Debug for TimingEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TimingEvent({:?})", self.dev)
    }
}

impl TimingEvent {
    /// A timing event on GPU `device`.
    ///
    /// # Errors
    /// `NotAvailable` without a CUDA driver; `InvalidUsage` for a missing GPU; `Cuda` otherwise.
    pub fn new(device: u32) -> Result<TimingEvent> {
        let dev = super::device(device)?;
        dev.bind()?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: raw is a local out-parameter; flag 0 is a timing event.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut raw, 0) })?;
        Ok(TimingEvent { raw, dev })
    }

    /// Records the event on `stream`.
    ///
    /// # Errors
    /// `Cuda` when the driver refuses (for example a stream of another GPU).
    pub fn record(&self, stream: &super::module::Stream) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: both handles are live.
        check("cuEventRecord", unsafe { sys::cuEventRecord(self.raw, stream.as_raw() as sys::CUstream) })
    }

    /// Milliseconds of GPU time from `start` to this event; both must have completed (synchronize
    /// the stream first).
    ///
    /// # Errors
    /// `Cuda` when either has not completed or was not recorded.
    pub fn elapsed_ms_since(&self, start: &TimingEvent) -> Result<f32> {
        self.dev.bind()?;
        let mut ms = 0f32;
        // SAFETY: both events are live; ms is a local out-parameter.
        check("cuEventElapsedTime", unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.raw, self.raw) })?;
        Ok(ms)
    }
}

impl Drop for TimingEvent {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: raw is live and destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}

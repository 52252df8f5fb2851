//! CUDA devices and GPU memory: the public face of `platform::cuda` (the
//! driver API, loaded at run time by `cudarc`; no CUDA needed to build). Every call returns
//! `NotAvailable` ("no CUDA driver found") where `libcuda` cannot be loaded.

pub use crate::buffer::{DeviceBuffer, PinnedBuffer};
pub use crate::platform::cuda::graph::{Graph, TimingEvent};
pub use crate::platform::cuda::module::{Kernel, Stream, compute_capability, programmatic_launch_supported, sm_count};
pub use crate::platform::cuda::usermem::check_device_range;
pub use crate::platform::cuda::{HW_QUEUES_MAX, HW_QUEUES_VAR, use_all_hw_queues};
pub use crate::platform::cuda::{device_count, device_name, numa_node, pci_bus_id};

//! # mscclpp: one-sided, signalled communication between GPUs and hosts
//!
//! A Rust rebuild of [MSCCL++](https://github.com/microsoft/mscclpp)'s communication stack. Ranks
//! (processes, on one host or many) register host or GPU memory, connect, and then `write` into
//! each other's memory and signal semaphores, over three transports behind one [`Connection`]:
//! **CudaIpc** (GPU memory of another process or GPU on the same host, copies on a CUDA stream),
//! **IB** (InfiniBand/RoCE verbs: RDMA write, write-with-immediate, fetch-and-add) and
//! **Ethernet** (TCP, for any host, with or without a GPU). CUDA and libibverbs are loaded at run
//! time: the crate builds and runs without either, and their calls then return `NotAvailable`.
//!
//! ## What it is not
//! No collectives (build them on top), no async runtime (blocking calls with bounded waits and
//! library threads), and no silent hangs: every wait takes a timeout, and errors name the peer,
//! the transport and the operation.
//!
//! ## Layers
//! Each uses only the ones below it (`tests/layers.rs` checks the imports):
//! ```text
//!  Channels     ── MemoryChannel / BaseMemoryChannel (kernel to mapped peer memory), PortChannel
//!                  and the proxy (ProxyService, or a proxy loop running your own ProxyHandler):
//!                  each made from a semaphore
//!  Semaphores   ── Host2HostSemaphore, Host2DeviceSemaphore, MemoryDevice2DeviceSemaphore:
//!                  tokens signalled over a Connection (or by kernels, device to device)
//!  Device       ── for kernels and semaphores: the CUDA header, `#[repr(C)]` handles, trigger
//!                  codec, FIFO, GPU token pool, NVRTC compile
//!  Setup        ── TcpBootstrap, Communicator, launcher: exchange endpoints, memories, semaphores
//!  Connections  ── Endpoint, Connection: write / update_and_sync / atomic_add / flush
//!                  (one per peer and transport: CudaIpc, IB, Ethernet)
//!  Resources    ── Context (registered memory table, CUDA streams, IB devices), RegisteredMemory,
//!                  Buffer / PinnedBuffer / DeviceBuffer, wire forms, network interfaces
//!  Vocabulary   ── Error, Transport, Device, EndpointConfig, environment, lock and deadlines
//!                  (usable from every layer)
//!  Platform     ── CUDA driver and NVRTC, libibverbs, GDRCopy, host memory, NUMA, PCIe topology,
//!                  pidfd: every FFI call, and every `unsafe` block but the two named below
//! ```
//! Outside `platform`, `unsafe` is only the raw-pointer registration API:
//! [`Context::register_host`], [`Context::register_device`] and
//! [`Communicator::register_memory`] are `unsafe fn`s whose callers promise that the memory
//! outlives the registration, and two `unsafe` blocks pass that promise on (`register_host`'s
//! to the platform layer's host-memory region, `register_memory`'s call of `register_host`).
//! The crate is `#![deny(unsafe_code)]`; each of those functions opts out by name.
//!
//! Channels and the proxy live in [`device`] next to the device primitives, but on their own
//! layer: `device::{memory_channel, port_channel, proxy}` use the semaphores, which use
//! `device::{handles, token_pool, ...}`; `device` itself only re-exports.
//! The public modules [`gpu`], [`ib`], [`net`] and [`mod@env`] expose what users call of the
//! lower layers (device count, GPU buffers, RDMA devices and the test provider, interfaces,
//! variables); [`launcher`] reads rank, size and root from `mpirun`, `srun` or `torchrun`.
//!
//! ## Getting started
//! Bootstrap two ranks (here two threads of one process for brevity; normally two processes):
//! ```
//! use mscclpp::{Bootstrap, RootServer, TcpBootstrap};
//! use std::time::Duration;
//! let (root, id) = RootServer::start(2, Duration::from_secs(10))?;
//! let t = std::thread::spawn({
//!     let id = id.clone();
//!     move || -> mscclpp::Result<Vec<Vec<u8>>> {
//!         TcpBootstrap::initialize(1, 2, &id)?.all_gather(b"one")
//!     }
//! });
//! let bs = TcpBootstrap::initialize(0, 2, &id)?;
//! assert_eq!(bs.all_gather(b"zero")?, vec![b"zero".to_vec(), b"one".to_vec()]);
//! assert_eq!(t.join().unwrap()?, vec![b"zero".to_vec(), b"one".to_vec()]);
//! root.join();
//! # Ok::<(), mscclpp::Error>(())
//! ```
//!
//! ## Environment
//! See [`mod@env`] for the `MSCCLPP_*` variables; logging is opt-in through [`init_logging`].
#![deny(unsafe_code)]
#![warn(missing_docs, unreachable_pub, unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

#[doc(hidden)]
pub mod bench;
mod bootstrap;
mod buffer;
mod communicator;
mod conn;
mod context;
pub mod device;
pub mod env;
mod error;
pub mod gpu;
pub mod ib;
mod identity;
pub mod launcher;
#[cfg(feature = "logging")]
mod logging;
mod memory;
pub mod net;
mod platform;
mod semaphore;
mod sync;
mod transport;
mod wire;

/// Entry points for the `cargo fuzz` targets in `fuzz/`: every peer-facing decoder, by name.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use crate::bootstrap::proto;
    use crate::wire::check::check_bytes;

    /// Defines [`FORMS`] and, for the tests, each form's fuzz target and `fuzz/Cargo.toml` as
    /// they were when the tests were built (a form without its target file does not build), so
    /// the test binary checks them from any directory.
    macro_rules! forms {
        ($($name:literal,)*) => {
            /// The names [`check`] accepts, one fuzz target each.
            pub const FORMS: &[&str] = &[$($name),*];
            #[cfg(test)]
            const FUZZ_TARGETS: &[(&str, &str)] = &[$((
                $name,
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/fuzz_targets/", $name, ".rs")),
            )),*];
        };
    }
    forms! {
        "unique_id",
        "bootstrap_hello",
        "bootstrap_root_answer",
        "bootstrap_address_table",
        "bootstrap_frame_header",
        "bootstrap_abort_notice",
        "bootstrap_gather_blocks",
        "bootstrap_frames",
        "bootstrap_readiness",
        "ethernet_header",
        "ethernet_record",
        "ethernet_hello",
        "ethernet_hello_ack",
        "ethernet_stream",
        "unique_id_bytes",
        "unique_id_text",
        "socket_addr",
        "registered_memory",
        "endpoint",
        "ipc_info",
        "vmm_info",
        "text_specs",
    }
    #[cfg(test)]
    const FUZZ_MANIFEST: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/Cargo.toml"));

    /// Decodes `data` as the form `name` and checks that nothing panics and that what decodes
    /// re-encodes to the same bytes (for text forms: prints as text that parses to the same
    /// value). Unknown names panic (a fuzz target naming a form that does not exist is a build
    /// mistake).
    pub fn check(name: &str, data: &[u8]) {
        match name {
            "unique_id" => check_bytes::<crate::UniqueId>(data),
            "bootstrap_hello" => check_bytes::<proto::Hello>(data),
            "bootstrap_root_answer" => check_bytes::<proto::RootAnswer>(data),
            "bootstrap_address_table" => check_bytes::<proto::AddressTable>(data),
            "bootstrap_frame_header" => check_bytes::<proto::FrameHeader>(data),
            "bootstrap_abort_notice" => check_bytes::<proto::AbortNotice>(data),
            "bootstrap_gather_blocks" => check_bytes::<proto::GatherBlocks>(data),
            "bootstrap_frames" => proto::check_frame_stream(data),
            "bootstrap_readiness" => crate::bootstrap::readiness::check(data),
            "ethernet_header" => check_bytes::<crate::conn::ethernet::wire::FrameHeader>(data),
            "ethernet_record" => check_bytes::<crate::conn::ethernet::wire::Record>(data),
            "ethernet_hello" => check_bytes::<crate::conn::ethernet::wire::Hello>(data),
            "ethernet_hello_ack" => check_bytes::<crate::conn::ethernet::wire::HelloAck>(data),
            "ethernet_stream" => crate::conn::ethernet::core::fuzz_stream(data),
            "unique_id_bytes" => crate::bootstrap::check_padded(data),
            "unique_id_text" => crate::bootstrap::check_text(&String::from_utf8_lossy(data)),
            "socket_addr" => check_bytes::<std::net::SocketAddr>(data),
            "registered_memory" => check_bytes::<crate::RegisteredMemory>(data),
            "endpoint" => check_bytes::<crate::Endpoint>(data),
            "ipc_info" => check_bytes::<crate::platform::cuda::IpcInfo>(data),
            "vmm_info" => check_bytes::<crate::platform::cuda::usermem::VmmInfo>(data),
            "text_specs" => {
                // Strings users pass in (command lines, environment): parsing never panics and a
                // parsed transport prints as a name that parses back to it.
                let s = String::from_utf8_lossy(data);
                if let Ok(t) = s.parse::<crate::Transport>() {
                    assert_eq!(t.to_string().parse::<crate::Transport>().ok(), Some(t));
                }
                let _ = crate::net::parse_addr_spec(&s);
                let _ = s.parse::<crate::IbMode>();
            }
            _ => panic!("no wire form named {name:?}"),
        }
    }

    #[cfg(test)]
    mod tests {
        /// Every form has its fuzz target, and every target is listed in fuzz/Cargo.toml.
        #[test]
        fn every_form_has_a_fuzz_target() {
            assert_eq!(super::FUZZ_TARGETS.len(), super::FORMS.len());
            for (&name, &(target, src)) in super::FORMS.iter().zip(super::FUZZ_TARGETS) {
                assert_eq!(name, target);
                let path = format!("fuzz/fuzz_targets/{name}.rs");
                assert!(src.contains(&format!("check({name:?}")), "{path} does not check {name}");
                assert!(
                    super::FUZZ_MANIFEST.contains(&format!("name = {name:?}")),
                    "fuzz/Cargo.toml has no [[bin]] {name}"
                );
                super::check(name, b"");
                super::check(name, &[0xff; 64]);
            }
        }
    }
}

pub use bootstrap::{
    Bootstrap, RESERVED_TAG_BASE, ReservedRoot, RootServer, TcpBootstrap, TcpBootstrapConfig, UniqueId,
};
pub use buffer::{Buffer, DeviceBuffer};
pub use communicator::{Communicator, Pending};
pub use conn::endpoint::{DEFAULT_ETHERNET_QUEUE, Endpoint};
pub use conn::ethernet::INLINE_LIMIT as ETHERNET_INLINE_LIMIT;
pub use conn::{Connection, Progress};
pub use context::Context;
pub use device::memory_channel::{BaseMemoryChannel, MemoryChannel};
pub use error::{Error, ErrorContext, ErrorKind, FirstError, Result};
pub use identity::{host_hash, process_hash, process_rank};
#[cfg(feature = "logging")]
pub use logging::init_logging;
pub use memory::{IbMrInfo, RegisteredMemory};
pub use platform::numa::{bind_thread_to_node, numa_node_count, pci_numa_node};
pub use semaphore::MemoryDevice2DeviceSemaphore;
pub use semaphore::{
    Host2DeviceSemaphore, Host2DeviceSemaphoreDeviceHandle, Host2HostSemaphore, Semaphore, SemaphoreStub,
};
pub use transport::{Device, EndpointConfig, EthernetConfig, IbConfig, IbMode, Transport, TransportFlags};

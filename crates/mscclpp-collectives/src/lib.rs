//! # mscclpp-collectives: AllReduce, AllGather, ReduceScatter and Broadcast
//!
//! Collectives over the ranks of an [`mscclpp::Communicator`], one GPU per rank (several ranks
//! may share one GPU), on the crate's device-side building blocks: every rank's scratch is
//! mapped into every other through a [`MemoryChannel`](mscclpp::MemoryChannel) over CUDA IPC,
//! small messages move as LL packets (data and flag in one 8-byte store, no separate signal),
//! large ones are staged through scratch in rounds with per-block barriers.
//!
//! - Build a [`Collectives`] once per communicator (a collective call; it compiles the kernels
//!   with NVRTC once per process and maps every peer's scratch), then call
//!   [`all_reduce`](Collectives::all_reduce), [`all_gather`](Collectives::all_gather),
//!   [`reduce_scatter`](Collectives::reduce_scatter) or [`broadcast`](Collectives::broadcast) on
//!   device pointers and a stream. Calls can be captured in a CUDA graph and replayed: flags,
//!   halves of the scratch and barrier counts live in device memory and advance on the GPU.
//! - Types f32, f16, bf16, i32, u32; sum, prod, min, max, avg; f16/bf16 can accumulate in f32
//!   ([`CallOptions::accumulate_f32`]). Any element count; in place or out of place.
//! - Algorithms ([`Algorithm`]): `allpair` (AllReduce, one hop, small), `packet` (LL packets up
//!   to about 1 MiB), `simple` (staged, large); the selector ([`select::select`]) picks by size
//!   and rank count, [`CallOptions`] overrides it.
//! - Every device wait is bounded ([`Config::timeout`]): a rank that never arrives, or one that
//!   makes a different call (type, count, operation...), makes the others' kernels return and
//!   [`Collectives::check`] name it. MSCCL++'s kernels spin without a limit.
//! - Kernels that wait on each other must all be resident: the number of ranks sharing a GPU is
//!   found at setup and every launch's grid is capped so that all of them fit (MSCCL++ hung at 8
//!   ranks on one GPU at 1 MiB).
#![deny(unsafe_code)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

mod comm;
pub mod external;
pub mod hier;
mod kernels;
mod mesh;
pub mod p2p;
pub mod select;
mod status;
pub mod tune;
mod types;

pub use comm::{CallOptions, Collectives, Config, Window};
pub use external::{ExternalAlgorithm, ExternalId};
pub use hier::{HierConfig, TwoLevel};
pub use p2p::{P2pConfig, P2pOp, PointToPoint};
pub use select::{Layout, Limits, Plan};
pub use types::{Algorithm, Collective, DataType, ReduceOp};

/// The CUDA source of the collective kernels (the device header included by name), as compiled.
pub fn kernel_source() -> String {
    kernels::source()
}

/// For the `collectives_setup` fuzz target: the setup messages peers send (`place\nagreement`,
/// a place of the two-level setup ending in `|blocks`), cut from arbitrary bytes at 0xff, never
/// make the setup checks panic; they are accepted exactly when every message's agreement equals
/// the first one's, and then each rank's place and GPU come back in rank order.
#[doc(hidden)]
pub fn fuzz_check(data: &[u8]) {
    let msgs: Vec<Vec<u8>> = data.split(|&b| b == 0xff).map(<[u8]>::to_vec).collect();
    let text = |m: &[u8]| String::from_utf8_lossy(m).into_owned();
    let agreement = |m: &[u8]| text(m).split_once('\n').map(|(_, a)| a.to_string()).unwrap_or_default();
    let mine = msgs.first().map(|m| agreement(m)).unwrap_or_default();
    let alike = msgs.iter().all(|m| agreement(m) == mine);
    match comm::agreed_places(&msgs, &mine, "fuzz", "settings") {
        Ok(places) => {
            assert!(alike, "a differing agreement was accepted");
            assert_eq!(places.len(), msgs.len());
            assert!(places.iter().all(|p| !p.contains('\n')), "a place kept the agreement's line");
            assert_eq!(hier::gpus_and_room(&places).len(), places.len());
        }
        Err(e) => {
            assert!(!alike, "agreeing messages were refused: {e}");
            assert!(e.peer().is_some_and(|p| p < msgs.len()), "a refusal named no peer: {e}");
        }
    }
}

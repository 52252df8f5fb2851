//! MSCCL++ execution plans, loaded unchanged.
//!
//! MSCCL++'s DSL (`mscclpp.language`) compiles a collective into a JSON *execution plan*: per
//! rank, thread blocks and the operations each runs (puts, signals, reductions, packets, ...)
//! over memory and port channels. This crate reads that JSON exactly as MSCCL++ writes it into a
//! typed [`Plan`], validates it (every channel id, buffer index, chunk range, peer rank and
//! semaphore in bounds; every operation name known; the fields each operation needs present;
//! MSCCL++'s fixed per-operation and per-block limits respected) and summarizes it. Every error
//! names the JSON path of the offending field, such as
//! `gpus[1].threadblocks[0].ops[3].src_buff[0].index`. No input makes it panic.
//!
//! [`Executor`] runs plans on the GPU: a kernel generated from each plan's shape
//! ([`plan_kernel`], [`KernelKind::PerPlan`], the default; compiled with NVRTC) executes every
//! rank's operation list per thread block over memory channels (CUDA IPC mapped peer buffers,
//! device semaphores) and port channels (through a proxy service), with every wait bounded;
//! [`lower`] turns a plan, a rank and message sizes into that kernel's program (no GPU needed).
//! [`KernelKind::Interpreter`] (or `MSCCLPP_EXECUTOR_KERNEL=interpreter`) runs the same program
//! with one interpreter kernel for every plan, which reads each operation's kind, channel type
//! and counts at run time. Switch (NVLS) channels are refused with [`PlanError::SwitchChannel`]: they need
//! NVLink multicast, which mscclpp-rs keeps off.
//!
//! [`sim`] interprets a plan on the CPU at chunk granularity: the reference the GPU executor's
//! results will be checked against, and a check that a plan computes its collective.
//!
//! [`generate`] writes plans in the same schema (ring and all-pair AllReduce, AllGather,
//! ReduceScatter, a two-node hierarchical AllReduce; Simple and LL; in and out of place).
//!
//! ```
//! use mscclpp_executor::{OpKind, Plan, PlanError};
//!
//! let json = r#"{
//!   "name": "tiny", "collective": "allgather", "protocol": "Simple", "inplace": true,
//!   "gpus": [
//!     {"id": 0, "input_chunks": 1, "output_chunks": 2, "scratch_chunks": 0,
//!      "channels": [{"channel_type": "memory", "connected_to": [1]}],
//!      "remote_buffers": [{"rank": 1, "type": "o", "access_channel_types": ["memory"]}],
//!      "threadblocks": [{"id": 0,
//!        "channels": [{"channel_type": "memory", "channel_ids": [0]}],
//!        "remote_buffer_refs": [{"access_channel_type": "memory", "remote_buffer_ids": [0]}],
//!        "ops": [
//!          {"name": "put", "src_buff": [{"type": "o", "index": 0, "size": 1}],
//!           "dst_buff": [{"buffer_id": 0, "index": 0, "size": 1}], "channel_type": "memory"},
//!          {"name": "signal", "channel_ids": [0], "channel_type": "memory"},
//!          {"name": "wait", "channel_ids": [0], "channel_type": "memory"}]}]},
//!     {"id": 1, "input_chunks": 1, "output_chunks": 2, "scratch_chunks": 0,
//!      "channels": [{"channel_type": "memory", "connected_to": [0]}],
//!      "remote_buffers": [{"rank": 0, "type": "o", "access_channel_types": ["memory"]}],
//!      "threadblocks": [{"id": 0,
//!        "channels": [{"channel_type": "memory", "channel_ids": [0]}],
//!        "remote_buffer_refs": [{"access_channel_type": "memory", "remote_buffer_ids": [0]}],
//!        "ops": [
//!          {"name": "put", "src_buff": [{"type": "o", "index": 1, "size": 1}],
//!           "dst_buff": [{"buffer_id": 0, "index": 1, "size": 1}], "channel_type": "memory"},
//!          {"name": "signal", "channel_ids": [0], "channel_type": "memory"},
//!          {"name": "wait", "channel_ids": [0], "channel_type": "memory"}]}]}
//!   ]
//! }"#;
//! let plan = Plan::from_json_str(json)?;
//! let summary = plan.summary();
//! assert_eq!(summary.ranks, 2);
//! assert_eq!(summary.ops_by_kind[&OpKind::Put], 2);
//! println!("{summary}");
//!
//! // The same plan with rank 1 putting past rank 0's two output chunks.
//! let bad = json.replace(r#""dst_buff": [{"buffer_id": 0, "index": 1"#, r#""dst_buff": [{"buffer_id": 0, "index": 2"#);
//! let err = Plan::from_json_str(&bad).unwrap_err();
//! assert_eq!(err.path(), Some("gpus[1].threadblocks[0].ops[0].dst_buff[0].index"));
//! # Ok::<(), PlanError>(())
//! ```

#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
#![deny(unsafe_code)]

mod algorithm;
pub mod device;
mod error;
mod exec;
pub mod generate;
pub mod lower;
mod model;
mod parse;
pub mod plan_kernel;
pub mod sim;
mod summary;
mod validate;

pub use algorithm::{PlanAlgorithm, to_core_error};
pub use error::PlanError;
pub use exec::{
    DataType, DeviceFailureKind, ExecError, ExecutionPlan, Executor, ExecutorConfig, KernelKind, PacketType,
};
pub use model::*;
pub use summary::Summary;

impl Plan {
    /// Parses and validates a plan from JSON text in MSCCL++'s schema.
    pub fn from_json_str(text: &str) -> Result<Plan, PlanError> {
        parse::parse_str(text)
    }

    /// Parses and validates a plan from JSON bytes; bytes that are not UTF-8 are refused as
    /// [`PlanError::Json`].
    pub fn from_json_slice(bytes: &[u8]) -> Result<Plan, PlanError> {
        match std::str::from_utf8(bytes) {
            Ok(s) => parse::parse_str(s),
            Err(e) => Err(PlanError::Json { line: 0, column: 0, message: format!("not UTF-8: {e}") }),
        }
    }

    /// Reads, parses and validates the plan file at `path`.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Plan, PlanError> {
        let path = path.as_ref();
        let text = std::fs::read(path).map_err(|source| PlanError::Io { path: path.to_owned(), source })?;
        Plan::from_json_slice(&text)
    }

    /// The plan as JSON in MSCCL++'s schema (what [`Plan::from_json_str`] reads back).
    pub fn to_json(&self) -> String {
        // Serializing these types cannot fail: every map key is a string.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// For the `executor_plan` fuzz target: parsing arbitrary bytes never panics, a plan that loads
/// writes JSON that loads back to the same plan, and summarizing and interpreting it never panic.
/// The same bytes, cut into 16-byte peer messages, go through the build's buffer-size check
/// (what peers send at a build's first exchange): it accepts exactly the messages that carry
/// this rank's sizes.
#[doc(hidden)]
pub fn fuzz_check(data: &[u8]) {
    if let Ok(plan) = Plan::from_json_slice(data) {
        let again = Plan::from_json_str(&plan.to_json());
        assert!(matches!(again, Ok(ref p) if *p == plan), "a loaded plan does not round-trip: {again:?}");
        let _ = plan.summary().to_string();
        let _ = sim::simulate(&plan, &[]);
    }
    let msgs: Vec<Vec<u8>> = data.chunks(16).map(<[u8]>::to_vec).collect();
    let mine = msgs.first().filter(|m| m.len() == 16).map_or((0, 0), |m| {
        let w = |i: usize| m[i * 8..i * 8 + 8].try_into().map_or(0, u64::from_le_bytes);
        (w(0), w(1))
    });
    let ok = exec::check_same_sizes("fuzz", mine, &msgs).is_ok();
    let mut same = mine.0.to_le_bytes().to_vec();
    same.extend_from_slice(&mine.1.to_le_bytes());
    assert_eq!(ok, msgs.iter().all(|m| *m == same), "the size check disagrees with the messages");
}

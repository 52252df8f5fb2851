//! The CUDA side of the two-level collectives: the argument block (one `#[repr(C)]` struct whose
//! CUDA definition is generated from [`ARG_FIELDS`]), the source (`src/hier.cu`), and the
//! compiled kernels (compiled with NVRTC once per process and architecture, loaded once per GPU).
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::Arc;

use mscclpp::Result;
use mscclpp::gpu::{Kernel, Stream};

use crate::kernels::Kernels;
use crate::types::DataType;

/// The argument block of every two-level kernel (by value), fields in [`ARG_FIELDS`] order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HierArgs {
    pub(crate) input: u64,
    pub(crate) output: u64,
    pub(crate) nbytes: u64,
    pub(crate) op: u64,
    pub(crate) rank: u64,
    pub(crate) nranks: u64,
    pub(crate) local: u64,
    pub(crate) nlocal: u64,
    pub(crate) node: u64,
    pub(crate) nnodes: u64,
    pub(crate) mem: u64,
    pub(crate) port: u64,
    pub(crate) scratch: u64,
    pub(crate) state: u64,
    pub(crate) err: u64,
    pub(crate) abort: u64,
    pub(crate) timeout_ns: u64,
    pub(crate) ar_round: u64,
    pub(crate) ag_round: u64,
    pub(crate) in_off: u64,
    pub(crate) res_off: u64,
    pub(crate) x_off: u64,
    /// Bytes from one AllReduce exchange slot to the next (data and signature room).
    pub(crate) x_stride: u64,
    pub(crate) col_off: u64,
    /// Bytes from one AllGather exchange slot to the next (data and signature room).
    pub(crate) col_stride: u64,
    /// The node peers' signature slots in the scratch (one word per local rank).
    pub(crate) sig_off: u64,
    /// This call's signature (collective, type, operation, bytes, call number; never 0).
    pub(crate) sig: u64,
}

/// The CUDA names of [`HierArgs`]' fields, in order.
pub(crate) const ARG_FIELDS: [&str; 27] = [
    "in",
    "out",
    "nbytes",
    "op",
    "rank",
    "nranks",
    "local",
    "nlocal",
    "node",
    "nnodes",
    "mem",
    "port",
    "scratch",
    "state",
    "err",
    "abort",
    "timeout_ns",
    "ar_round",
    "ag_round",
    "in_off",
    "res_off",
    "x_off",
    "x_stride",
    "col_off",
    "col_stride",
    "sig_off",
    "sig",
];

/// Bytes of the device state block (`HierState` in the CUDA source).
pub(crate) const STATE_BYTES: usize = 24;

const KERNELS: &str = include_str!("../hier.cu");

/// The whole CUDA source: the device header, the generated argument struct, the kernels.
pub(crate) fn source() -> String {
    let mut s = String::from("#include \"mscclpp_rs/device.cuh\"\n\nstruct HierArgs {\n");
    for f in ARG_FIELDS {
        s.push_str(&format!("  mscclpp::u64 {f};\n"));
    }
    s.push_str(&format!(
        "}};\nstatic_assert(sizeof(HierArgs) == {}, \"HierArgs layout\");\n\n",
        std::mem::size_of::<HierArgs>()
    ));
    s.push_str(KERNELS);
    s
}

/// The AllReduce kernel's name for `dtype`.
pub(crate) fn all_reduce_name(dtype: DataType) -> String {
    format!("hier_allreduce_{}", dtype.name())
}

/// The AllGather kernel's name.
pub(crate) const ALL_GATHER_NAME: &str = "hier_allgather_any";

/// Every kernel the source defines.
pub(crate) fn all_kernel_names() -> Vec<String> {
    let mut v: Vec<String> = DataType::ALL.iter().map(|&d| all_reduce_name(d)).collect();
    v.push(ALL_GATHER_NAME.to_string());
    v
}

/// The two-level kernels for GPU `device` (compiled and loaded once per process, see
/// [`crate::kernels::load`]).
pub(crate) fn kernels(device: u32) -> Result<Arc<Kernels>> {
    crate::kernels::load("two-level", "hier.cu", device, source, all_kernel_names)
}

/// Launches `kernel` with `args`.
///
/// # Safety
/// Every pointer in `args` is valid for what the kernel does with it until the launch finishes
/// on `stream`.
pub(crate) unsafe fn launch(
    kernel: &Kernel,
    blocks: u32,
    threads: u32,
    stream: &Stream,
    args: &HierArgs,
) -> Result<()> {
    let mut a = *args;
    let mut params = [(&mut a as *mut HierArgs).cast::<c_void>()];
    // SAFETY: the kernel takes one HierArgs by value (the CUDA struct is generated from the same
    // field list, checked by a test); `a` lives until cuLaunchKernel returns (it copies it); the
    // caller guarantees the pointers inside.
    unsafe { kernel.launch((blocks, 1, 1), (threads, 1, 1), 0, stream, &mut params) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_struct_matches_the_rust_layout() {
        assert_eq!(std::mem::size_of::<HierArgs>(), ARG_FIELDS.len() * 8);
        // Field by field: each Rust field (by name) at its place in ARG_FIELDS, from which the
        // CUDA struct is generated.
        macro_rules! at {
            ($cuda:literal, $field:ident) => {
                ($cuda, std::mem::offset_of!(HierArgs, $field))
            };
        }
        let offsets = [
            at!("in", input),
            at!("out", output),
            at!("nbytes", nbytes),
            at!("op", op),
            at!("rank", rank),
            at!("nranks", nranks),
            at!("local", local),
            at!("nlocal", nlocal),
            at!("node", node),
            at!("nnodes", nnodes),
            at!("mem", mem),
            at!("port", port),
            at!("scratch", scratch),
            at!("state", state),
            at!("err", err),
            at!("abort", abort),
            at!("timeout_ns", timeout_ns),
            at!("ar_round", ar_round),
            at!("ag_round", ag_round),
            at!("in_off", in_off),
            at!("res_off", res_off),
            at!("x_off", x_off),
            at!("x_stride", x_stride),
            at!("col_off", col_off),
            at!("col_stride", col_stride),
            at!("sig_off", sig_off),
            at!("sig", sig),
        ];
        assert_eq!(offsets.len(), ARG_FIELDS.len());
        for (i, ((cuda, off), name)) in offsets.iter().zip(ARG_FIELDS).enumerate() {
            assert_eq!((*cuda, *off), (name, i * 8), "HierArgs field {i}");
        }
        let src = source();
        let body = src.split("struct HierArgs {\n").nth(1).and_then(|s| s.split("};").next()).unwrap_or_default();
        let fields: Vec<&str> = body.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        assert_eq!(fields.len(), ARG_FIELDS.len());
        for (line, name) in fields.iter().zip(ARG_FIELDS) {
            assert_eq!(*line, format!("mscclpp::u64 {name};"));
            assert!(KERNELS.contains(&format!("a.{name}")), "the kernels never read HierArgs.{name}");
        }
        assert!(KERNELS.contains("struct HierState {\n  u32 count;"));
    }

    #[test]
    fn every_kernel_name_is_defined() {
        for n in all_kernel_names() {
            let defined = match n.strip_prefix("hier_allreduce_") {
                Some(t) => KERNELS.contains(&format!(", {t})")),
                None => KERNELS.contains(&format!("void __launch_bounds__(512) {n}(HierArgs a)")),
            };
            assert!(defined, "{n} is not defined in hier.cu");
        }
    }
}

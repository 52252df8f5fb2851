//! The CUDA side: the argument block every kernel takes (one `#[repr(C)]` struct whose CUDA
//! definition is generated from [`ARG_FIELDS`], so the two layouts cannot drift), the kernel
//! source, and the compiled modules (compiled once per process and architecture, loaded once per
//! GPU, every kernel resolved before any rank launches one).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use mscclpp::device::compile::{CompileOptions, KernelModule, Ptx, compile};
use mscclpp::gpu::{Kernel, Stream};
use mscclpp::{Error, Result};

use crate::types::{Algorithm, Collective, DataType};

/// Ranks whose scratch address travels in the argument block itself ([`CollArgs::scratch`]);
/// the others' are read from the `peers` table in device memory.
pub(crate) const INLINE_PEERS: usize = 64;

/// The argument block of every collective kernel (passed by value, `__grid_constant__`). Every
/// field is a `u64`, in the order of [`ARG_FIELDS`], then the inline scratch addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CollArgs {
    pub(crate) input: u64,
    pub(crate) output: u64,
    pub(crate) nbytes: u64,
    pub(crate) peers: u64,
    pub(crate) state: u64,
    pub(crate) expected: u64,
    pub(crate) err: u64,
    pub(crate) abort: u64,
    pub(crate) timeout_ns: u64,
    pub(crate) rank: u64,
    pub(crate) nranks: u64,
    pub(crate) sig: u64,
    pub(crate) root: u64,
    pub(crate) op: u64,
    pub(crate) acc32: u64,
    pub(crate) pkt_off: u64,
    pub(crate) pkt_half: u64,
    pub(crate) sig_pkt_off: u64,
    pub(crate) sig_off: u64,
    pub(crate) inbox_off: u64,
    pub(crate) simple_off: u64,
    pub(crate) simple_round: u64,
    /// 1 when this launch is a programmatic dependent launch: the kernel then lets the next
    /// kernel of the stream be scheduled at its start (`pdl_enter`); 0 leaves that to the kernel's
    /// end, as without programmatic launches. Set by [`launch`].
    pub(crate) pdl: u64,
    /// The scratch address of ranks `0..INLINE_PEERS` (mapped here): a kernel reads them from
    /// its parameters, not from a table in device memory whose first read costs a trip to
    /// memory before the first packet can leave (about 1 us of a 3 us small AllReduce).
    pub(crate) scratch: [u64; INLINE_PEERS],
}

impl Default for CollArgs {
    fn default() -> CollArgs {
        CollArgs {
            input: 0,
            output: 0,
            nbytes: 0,
            peers: 0,
            state: 0,
            expected: 0,
            err: 0,
            abort: 0,
            timeout_ns: 0,
            rank: 0,
            nranks: 0,
            sig: 0,
            root: 0,
            op: 0,
            acc32: 0,
            pkt_off: 0,
            pkt_half: 0,
            sig_pkt_off: 0,
            sig_off: 0,
            inbox_off: 0,
            simple_off: 0,
            simple_round: 0,
            pdl: 0,
            scratch: [0; INLINE_PEERS],
        }
    }
}

/// The CUDA names of [`CollArgs`]' fields, in order (`in`/`out` are the first two).
pub(crate) const ARG_FIELDS: [&str; 23] = [
    "in",
    "out",
    "nbytes",
    "peers",
    "state",
    "expected",
    "err",
    "abort",
    "timeout_ns",
    "rank",
    "nranks",
    "sig",
    "root",
    "op",
    "acc32",
    "pkt_off",
    "pkt_half",
    "sig_pkt_off",
    "sig_off",
    "inbox_off",
    "simple_off",
    "simple_round",
    "pdl",
];

/// Bytes of the per-rank state block (`CollState` in the CUDA source).
pub(crate) const STATE_BYTES: usize = 16;

const KERNELS: &str = include_str!("kernels.cu");

/// The whole CUDA source: the device header, the generated argument struct, the kernels.
pub(crate) fn source() -> String {
    let mut s = String::from("#include \"mscclpp_rs/device.cuh\"\n\nstruct CollArgs {\n");
    for f in ARG_FIELDS {
        s.push_str(&format!("  mscclpp::u64 {f};\n"));
    }
    s.push_str(&format!("  mscclpp::u64 scratch[{INLINE_PEERS}];\n"));
    s.push_str(&format!(
        "}};\nstatic_assert(sizeof(CollArgs) == {}, \"CollArgs layout\");\n\n",
        std::mem::size_of::<CollArgs>()
    ));
    s.push_str(KERNELS);
    s
}

/// The entry name of the kernel for `coll` with `algo` on `dtype`.
pub(crate) fn kernel_name(coll: Collective, algo: Algorithm, dtype: DataType) -> String {
    let t = if coll.reduces() { dtype.name() } else { "any" };
    format!("{}_{}_{}", coll.name(), algo.name(), t)
}

/// Every kernel the source defines.
pub(crate) fn all_kernel_names() -> Vec<String> {
    let mut v = Vec::new();
    for coll in [Collective::AllReduce, Collective::ReduceScatter] {
        for algo in Algorithm::ALL {
            if algo.serves(coll) {
                for d in DataType::ALL {
                    v.push(kernel_name(coll, algo, d));
                }
            }
        }
    }
    for d in DataType::ALL {
        v.push(format!("allreduce_zerocopy_{}", d.name()));
    }
    for coll in [Collective::AllGather, Collective::Broadcast] {
        for algo in [Algorithm::Packet, Algorithm::Simple] {
            v.push(kernel_name(coll, algo, DataType::F32));
        }
    }
    v
}

/// The kernels of one module on one GPU, by name.
#[derive(Debug)]
pub(crate) struct Kernels {
    /// What the kernels are, for messages ("collective", "two-level").
    what: &'static str,
    by_name: HashMap<String, Kernel>,
    /// `by_name`'s entries for [`get`](Kernels::get), indexed by [`key`]: every call looks its
    /// kernel up here (no name formatting, no hashing).
    keyed: Vec<Option<Kernel>>,
    _module: KernelModule,
}

const COLLECTIVES: [Collective; 4] =
    [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::Broadcast];

/// The slot of `(coll, algo, dtype)` in [`Kernels::keyed`].
fn key(coll: Collective, algo: Algorithm, dtype: DataType) -> usize {
    (coll as usize * Algorithm::ALL.len() + algo as usize) * DataType::ALL.len() + dtype as usize
}

impl Kernels {
    /// The kernel `name`.
    pub(crate) fn named(&self, name: &str) -> Result<&Kernel> {
        self.by_name.get(name).ok_or_else(|| Error::internal(format!("{} kernel {name} was not loaded", self.what)))
    }

    pub(crate) fn get(&self, coll: Collective, algo: Algorithm, dtype: DataType) -> Result<&Kernel> {
        match self.keyed.get(key(coll, algo, dtype)) {
            Some(Some(k)) => Ok(k),
            _ => self.named(&kernel_name(coll, algo, dtype)),
        }
    }

    /// The zero-copy AllReduce kernel for `dtype`.
    pub(crate) fn get_zero_copy(&self, dtype: DataType) -> Result<&Kernel> {
        self.named(&format!("allreduce_zerocopy_{}", dtype.name()))
    }

    /// Blocks of `threads` threads one SM holds of the heaviest kernel (the residency bound).
    pub(crate) fn min_blocks_per_sm(&self, threads: u32) -> Result<u32> {
        let mut m = u32::MAX;
        for k in self.by_name.values() {
            m = m.min(k.max_active_blocks_per_sm(threads, 0)?);
        }
        Ok(if m == u32::MAX { 0 } else { m })
    }
}

/// The kernels of the program `what` (CUDA file `file`, text from `source`, entries `names`) for
/// GPU `device`: compiled with NVRTC once per process and architecture, loaded once per GPU and
/// shared by every rank of this process on it (one rank compiles and loads; the others wait).
pub(crate) fn load(
    what: &'static str,
    file: &'static str,
    device: u32,
    source: fn() -> String,
    names: fn() -> Vec<String>,
) -> Result<Arc<Kernels>> {
    type Cache<K, V> = OnceLock<Mutex<HashMap<(&'static str, K), Arc<V>>>>;
    static LOADED: Cache<u32, Kernels> = OnceLock::new();
    static COMPILED: Cache<String, Ptx> = OnceLock::new();
    let poisoned = || Error::internal(format!("the {what} kernel cache lock is poisoned"));
    let mut map = LOADED.get_or_init(Default::default).lock().map_err(|_| poisoned())?;
    if let Some(k) = map.get(&(what, device)) {
        return Ok(k.clone());
    }
    let opts = CompileOptions::for_device(device).name(file);
    let arch = opts.resolved_arch();
    let ptx = {
        let mut c = COMPILED.get_or_init(Default::default).lock().map_err(|_| poisoned())?;
        match c.get(&(what, arch.clone())) {
            Some(p) => p.clone(),
            None => {
                let t = std::time::Instant::now();
                let p =
                    Arc::new(compile(&source(), &opts).map_err(|e| e.during(format!("compiling the {what} kernels")))?);
                tracing::info!(target: "mscclpp::collectives", "compiled the {what} kernels for {arch} in {:?}", t.elapsed());
                c.insert((what, arch), p.clone());
                p
            }
        }
    };
    let module = KernelModule::load(device, &ptx)?;
    let mut by_name = HashMap::new();
    for name in names() {
        let k = module.function(&name)?;
        by_name.insert(name, k);
    }
    let mut keyed = vec![None; COLLECTIVES.len() * Algorithm::ALL.len() * DataType::ALL.len()];
    for coll in COLLECTIVES {
        for algo in Algorithm::ALL {
            for d in DataType::ALL {
                if let (Some(slot), Some(k)) =
                    (keyed.get_mut(key(coll, algo, d)), by_name.get(&kernel_name(coll, algo, d)))
                {
                    *slot = Some(k.clone());
                }
            }
        }
    }
    let k = Arc::new(Kernels { what, by_name, keyed, _module: module });
    map.insert((what, device), k.clone());
    Ok(k)
}

/// The collective kernels for GPU `device`.
pub(crate) fn kernels(device: u32) -> Result<Arc<Kernels>> {
    load("collective", "collectives.cu", device, source, all_kernel_names)
}

/// Launches `kernel` with `args`, as a programmatic dependent launch when `blocks` is at most
/// `programmatic_blocks` (`Collectives::programmatic_blocks`; every entry of collectives.cu
/// waits for its predecessor first, `pdl_enter`).
///
/// # Safety
/// Every pointer in `args` is valid for what the kernel does with it (the input readable and the
/// output writable for their sizes, the scratch table, state and error words live) until the
/// launch finishes on `stream`.
pub(crate) unsafe fn launch(
    kernel: &Kernel,
    blocks: u32,
    threads: u32,
    stream: &Stream,
    args: &CollArgs,
    programmatic_blocks: u32,
) -> Result<()> {
    let programmatic = blocks <= programmatic_blocks;
    let mut a = CollArgs { pdl: programmatic as u64, ..*args };
    let mut params = [(&mut a as *mut CollArgs).cast::<c_void>()];
    let (grid, block) = ((blocks, 1, 1), (threads, 1, 1));
    // SAFETY: the kernel takes one CollArgs by value (the CUDA struct is generated from the same
    // field list, checked by a test); `a` lives until the launch call returns (the driver copies
    // it); the caller guarantees the pointers inside. Every kernel of this module starts with
    // griddepcontrol.wait (pdl_enter), which a programmatic launch requires.
    unsafe {
        if programmatic {
            kernel.launch_programmatic(grid, block, 0, stream, &mut params)
        } else {
            kernel.launch(grid, block, 0, stream, &mut params)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_keys_are_distinct_slots() {
        let n = COLLECTIVES.len() * Algorithm::ALL.len() * DataType::ALL.len();
        let mut seen = vec![false; n];
        for c in COLLECTIVES {
            for a in Algorithm::ALL {
                for d in DataType::ALL {
                    let k = key(c, a, d);
                    assert!(k < n && !seen[k], "{c:?} {a:?} {d:?}");
                    seen[k] = true;
                }
            }
        }
    }

    #[test]
    fn generated_struct_matches_the_rust_layout_field_by_field() {
        assert_eq!(std::mem::size_of::<CollArgs>(), ARG_FIELDS.len() * 8 + INLINE_PEERS * 8);
        assert_eq!(std::mem::offset_of!(CollArgs, scratch), ARG_FIELDS.len() * 8);
        let offsets = [
            std::mem::offset_of!(CollArgs, input),
            std::mem::offset_of!(CollArgs, output),
            std::mem::offset_of!(CollArgs, nbytes),
            std::mem::offset_of!(CollArgs, peers),
            std::mem::offset_of!(CollArgs, state),
            std::mem::offset_of!(CollArgs, expected),
            std::mem::offset_of!(CollArgs, err),
            std::mem::offset_of!(CollArgs, abort),
            std::mem::offset_of!(CollArgs, timeout_ns),
            std::mem::offset_of!(CollArgs, rank),
            std::mem::offset_of!(CollArgs, nranks),
            std::mem::offset_of!(CollArgs, sig),
            std::mem::offset_of!(CollArgs, root),
            std::mem::offset_of!(CollArgs, op),
            std::mem::offset_of!(CollArgs, acc32),
            std::mem::offset_of!(CollArgs, pkt_off),
            std::mem::offset_of!(CollArgs, pkt_half),
            std::mem::offset_of!(CollArgs, sig_pkt_off),
            std::mem::offset_of!(CollArgs, sig_off),
            std::mem::offset_of!(CollArgs, inbox_off),
            std::mem::offset_of!(CollArgs, simple_off),
            std::mem::offset_of!(CollArgs, simple_round),
            std::mem::offset_of!(CollArgs, pdl),
        ];
        let src = source();
        let body = src.split("struct CollArgs {\n").nth(1).and_then(|s| s.split("};").next()).unwrap();
        let mut fields: Vec<&str> = body.lines().map(|l| l.trim()).filter(|l| !l.is_empty()).collect();
        assert_eq!(fields.pop(), Some(format!("mscclpp::u64 scratch[{INLINE_PEERS}];").as_str()));
        assert_eq!(fields.len(), offsets.len());
        for (i, (line, off)) in fields.iter().zip(offsets).enumerate() {
            assert_eq!(off, i * 8, "field {i} of CollArgs");
            assert_eq!(*line, format!("mscclpp::u64 {};", ARG_FIELDS[i]), "field {i}");
        }
        // The kernels use every field, and the state block matches the CUDA one (4 u32s).
        for f in ARG_FIELDS {
            assert!(KERNELS.contains(&format!("a.{f}")), "the kernels never read CollArgs.{f}");
        }
        assert!(KERNELS.contains("struct CollState {\n  u32 flag;") && STATE_BYTES == 16);
    }

    #[test]
    fn every_kernel_name_is_defined_in_the_source() {
        let names = all_kernel_names();
        assert_eq!(names.len(), 3 * 5 + 2 * 5 + 5 + 4);
        for n in &names {
            let (prefix, ty) = n.rsplit_once('_').unwrap();
            let (coll, algo) = prefix.split_once('_').unwrap();
            let defined = if ty == "any" {
                KERNELS.contains(&format!("\nANY_TYPE({coll}, {algo})"))
            } else {
                KERNELS.contains(&format!("\nALL_TYPES({coll}, {algo})"))
            };
            assert!(defined, "{n} is not defined in kernels.cu");
        }
    }
}

//! Where each operation runs: natively on mscclpp's collectives, on a real NCCL loaded at run
//! time, or nowhere (an error naming what is missing). Pure functions of the call and the
//! settings, so every decision is unit-tested.
//!
//! | variable | meaning |
//! |---|---|
//! | `MSCCLPP_ENABLE_NCCL_FALLBACK` | `1`/`true`/`yes`/`on`: load a real NCCL at communicator init and send it what has no native path (default off) |
//! | `MSCCLPP_NCCL_LIB_PATH` | the NCCL library to load (default `libnccl.so.2`) |
//! | `MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION` | comma list of operations always sent to NCCL (`allreduce,allgather,reducescatter,broadcast,reduce,send,recv,alltoall,gather,scatter`, `all`; an `nccl` prefix is allowed) |

use std::fmt;

use mscclpp_collectives::{DataType, ReduceOp};

use crate::abi::*;

/// The operations the router knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `ncclAllReduce`.
    AllReduce,
    /// `ncclAllGather`.
    AllGather,
    /// `ncclReduceScatter`.
    ReduceScatter,
    /// `ncclBroadcast` / `ncclBcast`.
    Broadcast,
    /// `ncclReduce`.
    Reduce,
    /// `ncclSend`.
    Send,
    /// `ncclRecv`.
    Recv,
    /// `ncclAlltoAll`.
    AllToAll,
    /// `ncclGather`.
    Gather,
    /// `ncclScatter`.
    Scatter,
}

impl Op {
    /// Every operation.
    pub const ALL: [Op; 10] = [
        Op::AllReduce,
        Op::AllGather,
        Op::ReduceScatter,
        Op::Broadcast,
        Op::Reduce,
        Op::Send,
        Op::Recv,
        Op::AllToAll,
        Op::Gather,
        Op::Scatter,
    ];
    /// The lower-case name used in `MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION`.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "allreduce",
            Op::AllGather => "allgather",
            Op::ReduceScatter => "reducescatter",
            Op::Broadcast => "broadcast",
            Op::Reduce => "reduce",
            Op::Send => "send",
            Op::Recv => "recv",
            Op::AllToAll => "alltoall",
            Op::Gather => "gather",
            Op::Scatter => "scatter",
        }
    }
    /// The C function's name (`ncclAllReduce`), for messages.
    pub fn c_name(self) -> &'static str {
        match self {
            Op::AllReduce => "ncclAllReduce",
            Op::AllGather => "ncclAllGather",
            Op::ReduceScatter => "ncclReduceScatter",
            Op::Broadcast => "ncclBroadcast",
            Op::Reduce => "ncclReduce",
            Op::Send => "ncclSend",
            Op::Recv => "ncclRecv",
            Op::AllToAll => "ncclAlltoAll",
            Op::Gather => "ncclGather",
            Op::Scatter => "ncclScatter",
        }
    }
    /// Whether it moves data point to point (the host-staged path here).
    pub fn is_p2p(self) -> bool {
        matches!(self, Op::Send | Op::Recv | Op::AllToAll | Op::Gather | Op::Scatter)
    }
    /// Whether it reduces.
    pub fn reduces(self) -> bool {
        matches!(self, Op::AllReduce | Op::ReduceScatter | Op::Reduce)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Turns the NCCL fallback on (MSCCL++'s name).
pub const ENABLE_FALLBACK_VAR: &str = "MSCCLPP_ENABLE_NCCL_FALLBACK";
/// The real NCCL the fallback loads (MSCCL++'s name).
pub const LIB_PATH_VAR: &str = "MSCCLPP_NCCL_LIB_PATH";
/// Operations always sent to the fallback (MSCCL++'s name).
pub const FORCE_VAR: &str = "MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION";

/// The settings read from the environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// `MSCCLPP_ENABLE_NCCL_FALLBACK`.
    pub fallback_enabled: bool,
    /// `MSCCLPP_NCCL_LIB_PATH`.
    pub lib_path: String,
    /// `MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION`, parsed.
    pub forced: Vec<Op>,
    /// Names in the forced list that are no operation (reported once).
    pub unknown_forced: Vec<String>,
}

/// The default NCCL library name.
pub const DEFAULT_LIB: &str = "libnccl.so.2";

fn truthy(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
}

impl Settings {
    /// Reads the three variables through `get` (the environment, or a fake in tests).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Settings {
        let fallback_enabled = get(ENABLE_FALLBACK_VAR).is_some_and(|v| truthy(&v));
        let lib_path = get(LIB_PATH_VAR).filter(|v| !v.trim().is_empty()).unwrap_or_else(|| DEFAULT_LIB.to_string());
        let (forced, unknown_forced) = parse_forced(&get(FORCE_VAR).unwrap_or_default());
        Settings { fallback_enabled, lib_path, forced, unknown_forced }
    }
    /// The process's settings.
    pub fn current() -> Settings {
        Settings::from_env(|k| std::env::var(k).ok())
    }
}

/// Parses a forced-operation list: comma or space separated, case-insensitive, an optional
/// `nccl` prefix, `all` for every operation. Returns the operations and the unknown names.
pub fn parse_forced(s: &str) -> (Vec<Op>, Vec<String>) {
    let mut ops = Vec::new();
    let mut unknown = Vec::new();
    for w in s.split([',', ' ', ';']).map(str::trim).filter(|w| !w.is_empty()) {
        let l = w.to_ascii_lowercase();
        let l = l.strip_prefix("nccl").unwrap_or(&l);
        let l = if l == "bcast" { "broadcast" } else { l };
        if l == "all" {
            for o in Op::ALL {
                if !ops.contains(&o) {
                    ops.push(o);
                }
            }
        } else if let Some(o) = Op::ALL.into_iter().find(|o| o.name() == l) {
            if !ops.contains(&o) {
                ops.push(o);
            }
        } else {
            unknown.push(w.to_string());
        }
    }
    (ops, unknown)
}

/// The native element type for a reduction on `dt`, or why there is none.
pub fn native_reduce_type(dt: ncclDataType_t) -> Result<DataType, String> {
    match dt {
        ncclFloat32 => Ok(DataType::F32),
        ncclFloat16 => Ok(DataType::F16),
        ncclBfloat16 => Ok(DataType::Bf16),
        ncclInt32 => Ok(DataType::I32),
        ncclUint32 => Ok(DataType::U32),
        _ => Err(format!("native reductions take float32, float16, bfloat16, int32 and uint32, not {}", type_name(dt))),
    }
}

/// The native reduction for `op`, or why there is none.
pub fn native_op(op: ncclRedOp_t) -> Result<ReduceOp, String> {
    match op {
        ncclSum => Ok(ReduceOp::Sum),
        ncclProd => Ok(ReduceOp::Prod),
        ncclMax => Ok(ReduceOp::Max),
        ncclMin => Ok(ReduceOp::Min),
        ncclAvg => Ok(ReduceOp::Avg),
        o if o >= ncclNumOps => Err(format!(
            "reduction {o} is a PreMulSum made by ncclRedOpCreatePreMulSum, which the native collectives do not implement"
        )),
        o => Err(format!("reduction {o} is not an ncclRedOp_t")),
    }
}

/// Bytes per element of `dt`, or `None` for a value that is no `ncclDataType_t`.
pub fn type_size(dt: ncclDataType_t) -> Option<usize> {
    match dt {
        ncclInt8 | ncclUint8 | ncclFloat8e4m3 | ncclFloat8e5m2 => Some(1),
        ncclFloat16 | ncclBfloat16 => Some(2),
        ncclInt32 | ncclUint32 | ncclFloat32 => Some(4),
        ncclInt64 | ncclUint64 | ncclFloat64 => Some(8),
        _ => None,
    }
}

/// The header's name of `dt`.
pub fn type_name(dt: ncclDataType_t) -> String {
    match dt {
        ncclInt8 => "ncclInt8".into(),
        ncclUint8 => "ncclUint8".into(),
        ncclInt32 => "ncclInt32".into(),
        ncclUint32 => "ncclUint32".into(),
        ncclInt64 => "ncclInt64".into(),
        ncclUint64 => "ncclUint64".into(),
        ncclFloat16 => "ncclFloat16".into(),
        ncclFloat32 => "ncclFloat32".into(),
        ncclFloat64 => "ncclFloat64".into(),
        ncclBfloat16 => "ncclBfloat16".into(),
        ncclFloat8e4m3 => "ncclFloat8e4m3".into(),
        ncclFloat8e5m2 => "ncclFloat8e5m2".into(),
        d => format!("data type {d}"),
    }
}

/// How a data-moving (non-reducing) collective of `nbytes` is run natively: as this many
/// elements of a 4- or 2-byte type (the collectives move words, whatever the caller's type).
/// `None` when `nbytes` is odd.
pub fn as_words(nbytes: usize) -> Option<(DataType, usize)> {
    if nbytes.is_multiple_of(4) {
        Some((DataType::U32, nbytes / 4))
    } else if nbytes.is_multiple_of(2) {
        Some((DataType::F16, nbytes / 2))
    } else {
        None
    }
}

/// Whether the native path can serve one call (the communicator's native side being up is
/// checked separately): `Err` says why not.
pub fn native_support(op: Op, dt: ncclDataType_t, red: ncclRedOp_t, count: usize) -> Result<(), String> {
    let es = type_size(dt).ok_or_else(|| format!("{} is not an ncclDataType_t", type_name(dt)))?;
    if op.reduces() {
        native_reduce_type(dt)?;
        native_op(red)?;
        return Ok(());
    }
    if op.is_p2p() {
        return Ok(()); // bytes, any type
    }
    match as_words(count.saturating_mul(es)) {
        Some(_) => Ok(()),
        None => Err(format!(
            "{op} of {count} elements of {} is {} bytes, odd: the native collectives move 2- or 4-byte words",
            type_name(dt),
            count.saturating_mul(es)
        )),
    }
}

/// Where a call goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// mscclpp's collectives (or the host-staged point-to-point path).
    Native,
    /// The real NCCL.
    Fallback,
    /// Nowhere: `ncclInvalidUsage` with this message.
    Refuse(String),
}

/// The decision for `op`: `native` is `Ok` when the native path serves this call (its side of
/// the communicator is up and the call is supported), else why not; `fallback` is `Ok` when a
/// real NCCL communicator is there, else why not.
pub fn route(op: Op, forced: &[Op], native: Result<(), String>, fallback: Result<(), String>) -> Route {
    if forced.contains(&op) {
        return match fallback {
            Ok(()) => Route::Fallback,
            Err(why) => Route::Refuse(format!(
                "{op}: MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION sends it to NCCL, but there is no NCCL: {why}"
            )),
        };
    }
    match (native, fallback) {
        (Ok(()), _) => Route::Native,
        (Err(_), Ok(())) => Route::Fallback,
        (Err(n), Err(f)) => Route::Refuse(format!("{op}: no native path ({n}) and no NCCL fallback ({f})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_from_env() {
        let s = Settings::from_env(|_| None);
        assert!(!s.fallback_enabled);
        assert_eq!(s.lib_path, DEFAULT_LIB);
        assert!(s.forced.is_empty());
        let s = Settings::from_env(|k| match k {
            "MSCCLPP_ENABLE_NCCL_FALLBACK" => Some("TRUE".into()),
            "MSCCLPP_NCCL_LIB_PATH" => Some("/opt/nccl/libnccl.so.2".into()),
            "MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION" => Some("ncclAllGather, send,bogus".into()),
            _ => None,
        });
        assert!(s.fallback_enabled);
        assert_eq!(s.lib_path, "/opt/nccl/libnccl.so.2");
        assert_eq!(s.forced, vec![Op::AllGather, Op::Send]);
        assert_eq!(s.unknown_forced, vec!["bogus".to_string()]);
        for off in ["0", "false", "no", ""] {
            let s = Settings::from_env(|k| (k == "MSCCLPP_ENABLE_NCCL_FALLBACK").then(|| off.to_string()));
            assert!(!s.fallback_enabled, "{off:?}");
        }
    }

    #[test]
    fn forced_all_and_bcast() {
        assert_eq!(parse_forced("all").0, Op::ALL.to_vec());
        assert_eq!(parse_forced("ncclBcast;REDUCE").0, vec![Op::Broadcast, Op::Reduce]);
        assert_eq!(parse_forced("allreduce,allreduce").0, vec![Op::AllReduce]);
    }

    #[test]
    fn routing_decisions() {
        let no = || Err::<(), String>("no".into());
        // native first
        assert_eq!(route(Op::AllReduce, &[], Ok(()), Ok(())), Route::Native);
        assert_eq!(route(Op::AllReduce, &[], Ok(()), no()), Route::Native);
        // forced to NCCL
        assert_eq!(route(Op::AllReduce, &[Op::AllReduce], Ok(()), Ok(())), Route::Fallback);
        assert_eq!(route(Op::AllGather, &[Op::AllReduce], Ok(()), Ok(())), Route::Native);
        match route(Op::AllReduce, &[Op::AllReduce], Ok(()), Err("MSCCLPP_ENABLE_NCCL_FALLBACK is off".into())) {
            Route::Refuse(m) => assert!(m.contains("MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION") && m.contains("is off")),
            r => panic!("{r:?}"),
        }
        // unsupported natively
        assert_eq!(route(Op::Reduce, &[], Err("int8".into()), Ok(())), Route::Fallback);
        match route(Op::Reduce, &[], Err("int8 sum".into()), Err("no libnccl.so.2".into())) {
            Route::Refuse(m) => {
                assert_eq!(m, "reduce: no native path (int8 sum) and no NCCL fallback (no libnccl.so.2)");
            }
            r => panic!("{r:?}"),
        }
    }

    #[test]
    fn native_support_matrix() {
        for dt in [ncclFloat32, ncclFloat16, ncclBfloat16, ncclInt32, ncclUint32] {
            for red in [ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg] {
                assert!(native_support(Op::AllReduce, dt, red, 7).is_ok());
                assert!(native_support(Op::Reduce, dt, red, 7).is_ok());
            }
        }
        for dt in [ncclInt8, ncclUint8, ncclInt64, ncclUint64, ncclFloat64, ncclFloat8e4m3, ncclFloat8e5m2] {
            let e = native_support(Op::AllReduce, dt, ncclSum, 8).unwrap_err();
            assert!(e.contains(&type_name(dt)), "{e}");
            // data movement takes any type of an even byte count
            assert!(native_support(Op::AllGather, dt, 0, 8).is_ok());
            assert!(native_support(Op::Send, dt, 0, 3).is_ok());
        }
        assert!(native_support(Op::AllGather, ncclInt8, 0, 3).unwrap_err().contains("odd"));
        assert!(native_support(Op::AllReduce, ncclFloat32, ncclNumOps, 1).unwrap_err().contains("PreMulSum"));
        assert!(native_support(Op::AllReduce, ncclFloat32, -1, 1).unwrap_err().contains("not an ncclRedOp_t"));
        assert!(native_support(Op::AllReduce, 99, 0, 1).unwrap_err().contains("data type 99"));
        // NCCL's Max is 2 and Min 3 (the collectives' own order differs)
        assert_eq!(native_op(ncclMax), Ok(ReduceOp::Max));
        assert_eq!(native_op(ncclMin), Ok(ReduceOp::Min));
        assert_eq!(as_words(6), Some((DataType::F16, 3)));
        assert_eq!(as_words(8), Some((DataType::U32, 2)));
        assert_eq!(as_words(0), Some((DataType::U32, 0)));
    }
}

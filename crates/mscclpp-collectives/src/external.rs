//! Algorithms from outside this crate (an MSCCL++ execution plan run by `mscclpp-executor`, a
//! user's own kernel) registered with [`Collectives`](crate::Collectives) next to the built-in
//! ones: [`ExternalAlgorithm`] describes one (collective, world size, ranks per node, message
//! size range, in place or out of place) and launches it; [`choose`] is the pure rule that
//! decides, per call, whether one of them runs instead of the built-in selection.
//!
//! This crate does not depend on the executor: the executor implements the trait
//! (`mscclpp_executor::PlanAlgorithm`).
//!
//! `unsafe` here is the trait's launch method, which takes raw device pointers (as the
//! collective calls themselves do).
#![allow(unsafe_code)]

use std::sync::Arc;

use mscclpp::gpu::Stream;
use mscclpp::{Error, Result};

use crate::comm::CallOptions;
use crate::types::{Collective, DataType, ReduceOp};

/// An algorithm that [`Collectives`](crate::Collectives) can run instead of its built-in ones.
///
/// The metadata says which calls it serves; the selector ([`choose`]) runs it for a call of its
/// [`collective`](Self::collective) on a communicator of [`world_size`](Self::world_size) ranks
/// with [`ranks_per_node`](Self::ranks_per_node) ranks per host, whose message size is in
/// [`size_range`](Self::size_range) and whose placement (in place or not) it supports, unless
/// [`CallOptions::algorithm`] forces a built-in algorithm. The *message size* is the bytes of the
/// send buffer, except for AllGather where it is the receive buffer's (as MSCCL++'s executor
/// compares a plan's `min_message_size`/`max_message_size`).
///
/// Broadcast is not served by external algorithms (their root is fixed by the algorithm, not
/// the call): registering one is refused.
///
/// ```no_run
/// use std::sync::Arc;
/// use mscclpp::gpu::Stream;
/// use mscclpp_collectives::{Collective, DataType, ExternalAlgorithm, ReduceOp};
///
/// struct Mine;
/// impl ExternalAlgorithm for Mine {
///     fn name(&self) -> &str { "my_allreduce" }
///     fn collective(&self) -> Collective { Collective::AllReduce }
///     fn world_size(&self) -> usize { 8 }
///     fn ranks_per_node(&self) -> usize { 8 }
///     fn size_range(&self) -> (u64, u64) { (1 << 20, 64 << 20) }
///     fn in_place(&self) -> bool { true }
///     fn out_of_place(&self) -> bool { false }
///     unsafe fn launch(&self, _rank: usize, _send: u64, _recv: u64, _send_bytes: u64, _recv_bytes: u64,
///                      _dtype: DataType, _op: Option<ReduceOp>, _stream: &Stream) -> mscclpp::Result<()> {
///         Ok(()) // launch the kernel here
///     }
/// }
/// // On every rank, in the same order: coll.register_algorithm(Arc::new(Mine))?;
/// # let _: Arc<dyn ExternalAlgorithm> = Arc::new(Mine);
/// ```
pub trait ExternalAlgorithm: Send + Sync {
    /// A name unique among the algorithms registered with one communicator (what
    /// [`CallOptions::external`] names).
    fn name(&self) -> &str;
    /// The collective it implements.
    fn collective(&self) -> Collective;
    /// The number of ranks it is written for.
    fn world_size(&self) -> usize;
    /// Ranks per node (host) it is written for.
    fn ranks_per_node(&self) -> usize;
    /// Message sizes it serves, in bytes: `[min, max)` (see the trait's documentation for what
    /// the message size is).
    fn size_range(&self) -> (u64, u64);
    /// Whether it runs in place (AllReduce: `send == recv`; AllGather: `send == recv + rank *
    /// send bytes`; ReduceScatter: `recv == send + rank * recv bytes`).
    fn in_place(&self) -> bool;
    /// Whether it runs out of place.
    fn out_of_place(&self) -> bool;
    /// Whether it serves this element type and reduction (`None` for collectives that do not
    /// reduce). Default: every one.
    fn supports(&self, dtype: DataType, op: Option<ReduceOp>) -> bool {
        let _ = (dtype, op);
        true
    }
    /// Launches the algorithm on `stream` for this rank: `send_bytes` bytes at `send` into
    /// `recv_bytes` bytes at `recv`.
    ///
    /// # Errors
    /// Whatever the algorithm cannot do; errors of the launch.
    ///
    /// # Safety
    /// `send` and `recv` are device memory of the communicator's GPU, `send_bytes` and
    /// `recv_bytes` long, that stay valid (and `send` unchanged) until the call finishes on
    /// `stream`; every rank makes the same call.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        send_bytes: u64,
        recv_bytes: u64,
        dtype: DataType,
        op: Option<ReduceOp>,
        stream: &Stream,
    ) -> Result<()>;
    /// The error its kernels reported, if any (called by
    /// [`Collectives::check`](crate::Collectives::check)). Default: none.
    ///
    /// # Errors
    /// The failure an earlier launch reported.
    fn check(&self) -> Result<()> {
        Ok(())
    }
}

/// A name of a registered algorithm, as [`CallOptions`] carries it (a hash, so that the options
/// stay `Copy`); see [`CallOptions::external`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExternalId(u64);

impl ExternalId {
    /// The id of the algorithm named `name`.
    pub fn of(name: &str) -> ExternalId {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        ExternalId(h)
    }
}

/// What [`choose`] needs to know about a call and the communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallShape {
    /// The collective.
    pub collective: Collective,
    /// Ranks of the communicator.
    pub world_size: usize,
    /// Ranks on this rank's host.
    pub ranks_per_node: usize,
    /// The message size (send bytes; receive bytes for AllGather).
    pub message_bytes: u64,
    /// Whether the call is in place.
    pub in_place: bool,
    /// The element type.
    pub dtype: DataType,
    /// The reduction, for collectives that reduce.
    pub op: Option<ReduceOp>,
}

/// Why `a` cannot serve `call`, or `None` when it can.
pub fn mismatch(a: &dyn ExternalAlgorithm, call: &CallShape) -> Option<String> {
    let (min, max) = a.size_range();
    if a.collective() != call.collective {
        Some(format!("it implements {}, not {}", a.collective(), call.collective))
    } else if a.world_size() != call.world_size {
        Some(format!("it is written for {} ranks, the communicator has {}", a.world_size(), call.world_size))
    } else if a.ranks_per_node() != call.ranks_per_node {
        Some(format!(
            "it is written for {} ranks per node, the communicator has {}",
            a.ranks_per_node(),
            call.ranks_per_node
        ))
    } else if call.message_bytes < min || call.message_bytes >= max {
        Some(format!("it serves messages of [{min}, {max}) bytes, the call's is {}", call.message_bytes))
    } else if call.in_place && !a.in_place() {
        Some("it does not run in place".into())
    } else if !call.in_place && !a.out_of_place() {
        Some("it does not run out of place".into())
    } else if !a.supports(call.dtype, call.op) {
        Some(match call.op {
            Some(op) => format!("it does not serve {} with {op}", call.dtype),
            None => format!("it does not serve {}", call.dtype),
        })
    } else {
        None
    }
}

/// Which registered algorithm serves a call, if any: none when `opts` forces a built-in
/// [`Algorithm`](crate::Algorithm); the one `opts` names ([`CallOptions::external`]), which must
/// serve the call; otherwise the first registered (in registration order) that serves it.
///
/// # Errors
/// `InvalidUsage` when `opts` names both a built-in and an external algorithm, names one that is
/// not registered, or names one that cannot serve the call (the message says why).
pub fn choose<'a>(
    registered: &'a [Arc<dyn ExternalAlgorithm>],
    call: &CallShape,
    opts: &CallOptions,
) -> Result<Option<&'a Arc<dyn ExternalAlgorithm>>> {
    match (opts.algorithm, opts.external) {
        (Some(a), Some(_)) => Err(Error::invalid_usage(format!(
            "the call options name both the built-in algorithm {a} and an external one"
        ))),
        (Some(_), None) => Ok(None),
        (None, Some(id)) => {
            let a = registered
                .iter()
                .find(|a| ExternalId::of(a.name()) == id)
                .ok_or_else(|| Error::invalid_usage("the call options name an algorithm that is not registered"))?;
            match mismatch(a.as_ref(), call) {
                None => Ok(Some(a)),
                Some(why) => {
                    Err(Error::invalid_usage(format!("the algorithm {:?} cannot serve this call: {why}", a.name())))
                }
            }
        }
        (None, None) => Ok(registered.iter().find(|a| mismatch(a.as_ref(), call).is_none())),
    }
}

/// The bytes every rank sends at registration: the algorithm's metadata, which every rank
/// compares with its peers'.
pub(crate) fn descriptor(a: &dyn ExternalAlgorithm) -> String {
    let (min, max) = a.size_range();
    format!(
        "{:?} {} world {} per-node {} sizes [{min}, {max}) in-place {} out-of-place {}",
        a.name(),
        a.collective(),
        a.world_size(),
        a.ranks_per_node(),
        a.in_place(),
        a.out_of_place()
    )
}

/// Checks an algorithm before registration (on every rank, before the exchange).
pub(crate) fn check_registrable(
    a: &dyn ExternalAlgorithm,
    registered: &[Arc<dyn ExternalAlgorithm>],
) -> std::result::Result<(), String> {
    let (min, max) = a.size_range();
    if a.collective() == Collective::Broadcast {
        Err("Broadcast cannot be served by an external algorithm".into())
    } else if a.name().is_empty() {
        Err("an external algorithm needs a name".into())
    } else if min >= max {
        Err(format!("its size range [{min}, {max}) is empty"))
    } else if !a.in_place() && !a.out_of_place() {
        Err("it runs neither in place nor out of place".into())
    } else if a.ranks_per_node() == 0 || a.world_size() == 0 || !a.world_size().is_multiple_of(a.ranks_per_node()) {
        Err(format!("{} ranks per node does not divide a world of {} ranks", a.ranks_per_node(), a.world_size()))
    } else if let Some(o) = registered.iter().find(|o| ExternalId::of(o.name()) == ExternalId::of(a.name())) {
        Err(format!("an algorithm named {:?} is already registered", o.name()))
    } else {
        Ok(())
    }
}

/// Compares every rank's registration descriptor (`None`: that rank's local check failed, with
/// its reason) and says which rank differs from rank 0's, if any.
pub(crate) fn agreement(all: &[std::result::Result<String, String>]) -> Result<()> {
    for (r, d) in all.iter().enumerate() {
        if let Err(why) = d {
            return Err(Error::invalid_usage(format!("rank {r} refused the algorithm: {why}")).with_peer(r));
        }
    }
    let first = all.first().and_then(|d| d.as_ref().ok());
    for (r, d) in all.iter().enumerate().skip(1) {
        if d.as_ref().ok() != first {
            return Err(Error::invalid_usage(format!(
                "ranks registered different algorithms: rank 0 {}, rank {r} {}",
                first.map_or("nothing", |s| s.as_str()),
                d.as_ref().map_or("nothing", |s| s.as_str())
            ))
            .with_peer(r));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Algorithm;

    struct Fake {
        name: &'static str,
        coll: Collective,
        world: usize,
        per_node: usize,
        range: (u64, u64),
        in_place: bool,
        out_of_place: bool,
    }

    impl ExternalAlgorithm for Fake {
        fn name(&self) -> &str {
            self.name
        }
        fn collective(&self) -> Collective {
            self.coll
        }
        fn world_size(&self) -> usize {
            self.world
        }
        fn ranks_per_node(&self) -> usize {
            self.per_node
        }
        fn size_range(&self) -> (u64, u64) {
            self.range
        }
        fn in_place(&self) -> bool {
            self.in_place
        }
        fn out_of_place(&self) -> bool {
            self.out_of_place
        }
        fn supports(&self, dtype: DataType, op: Option<ReduceOp>) -> bool {
            dtype != DataType::F16 && op != Some(ReduceOp::Prod)
        }
        unsafe fn launch(
            &self,
            _: usize,
            _: u64,
            _: u64,
            _: u64,
            _: u64,
            _: DataType,
            _: Option<ReduceOp>,
            _: &Stream,
        ) -> Result<()> {
            Ok(())
        }
    }

    fn fake(name: &'static str, range: (u64, u64)) -> Fake {
        Fake { name, coll: Collective::AllReduce, world: 8, per_node: 8, range, in_place: true, out_of_place: true }
    }

    fn call(bytes: u64) -> CallShape {
        CallShape {
            collective: Collective::AllReduce,
            world_size: 8,
            ranks_per_node: 8,
            message_bytes: bytes,
            in_place: true,
            dtype: DataType::I32,
            op: Some(ReduceOp::Sum),
        }
    }

    fn names(r: Result<Option<&Arc<dyn ExternalAlgorithm>>>) -> Option<String> {
        r.unwrap().map(|a| a.name().to_string())
    }

    #[test]
    fn selection_by_size_world_layout_and_placement() {
        let reg: Vec<Arc<dyn ExternalAlgorithm>> = vec![
            Arc::new(fake("small", (0, 1 << 10))),
            Arc::new(fake("mid", (1 << 10, 1 << 20))),
            Arc::new(fake("all", (0, u64::MAX))),
            Arc::new(Fake { per_node: 4, ..fake("two_nodes", (0, u64::MAX)) }),
            Arc::new(Fake { coll: Collective::AllGather, in_place: false, ..fake("ag_oop", (0, u64::MAX)) }),
        ];
        let none = CallOptions::default();
        // Size ranges are [min, max); the first registered that serves wins.
        assert_eq!(names(choose(&reg, &call(0), &none)).as_deref(), Some("small"));
        assert_eq!(names(choose(&reg, &call(1023), &none)).as_deref(), Some("small"));
        assert_eq!(names(choose(&reg, &call(1024), &none)).as_deref(), Some("mid"));
        assert_eq!(names(choose(&reg, &call(1 << 20), &none)).as_deref(), Some("all"));
        // Ranks per node and world size must match.
        let two = CallShape { ranks_per_node: 4, ..call(1 << 30) };
        assert_eq!(names(choose(&reg, &two, &none)).as_deref(), Some("two_nodes"));
        assert_eq!(names(choose(&reg, &CallShape { world_size: 4, ..call(8) }, &none)), None);
        // Type and reduction support.
        assert_eq!(names(choose(&reg, &CallShape { dtype: DataType::F16, ..call(8) }, &none)), None);
        assert_eq!(names(choose(&reg, &CallShape { op: Some(ReduceOp::Prod), ..call(8) }, &none)), None);
        // Collective and placement.
        let ag = CallShape { collective: Collective::AllGather, op: None, ..call(64) };
        assert_eq!(names(choose(&reg, &ag, &none)), None);
        assert_eq!(names(choose(&reg, &CallShape { in_place: false, ..ag }, &none)).as_deref(), Some("ag_oop"));
        assert_eq!(names(choose(&reg, &CallShape { collective: Collective::ReduceScatter, ..call(8) }, &none)), None);
        // Nothing registered: nothing chosen.
        assert_eq!(names(choose(&[], &call(8), &none)), None);
    }

    #[test]
    fn options_force_builtin_or_name_an_external() {
        let reg: Vec<Arc<dyn ExternalAlgorithm>> =
            vec![Arc::new(fake("small", (0, 1 << 10))), Arc::new(fake("all", (0, u64::MAX)))];
        // A forced built-in algorithm wins over every registered one.
        assert_eq!(names(choose(&reg, &call(8), &CallOptions::algorithm(Algorithm::Packet))), None);
        // By name, even where another would be chosen first.
        assert_eq!(names(choose(&reg, &call(8), &CallOptions::external("all"))).as_deref(), Some("all"));
        // A named one that cannot serve the call, or is not registered, is an error.
        let e = choose(&reg, &call(1 << 20), &CallOptions::external("small")).map(|_| ()).unwrap_err();
        assert!(e.message().contains("cannot serve") && e.message().contains("[0, 1024)"), "{e}");
        let e = choose(&reg, &call(8), &CallOptions::external("nope")).map(|_| ()).unwrap_err();
        assert!(e.message().contains("not registered"), "{e}");
        let both = CallOptions { external: Some(ExternalId::of("all")), ..CallOptions::algorithm(Algorithm::Simple) };
        let e = choose(&reg, &call(8), &both).map(|_| ()).unwrap_err();
        assert!(e.message().contains("both"), "{e}");
    }

    #[test]
    fn registration_checks_and_agreement() {
        let reg: Vec<Arc<dyn ExternalAlgorithm>> = vec![Arc::new(fake("small", (0, 1 << 10)))];
        assert!(check_registrable(&fake("other", (0, 8)), &reg).is_ok());
        for (bad, what) in [
            (fake("small", (0, 8)), "already registered"),
            (fake("", (0, 8)), "needs a name"),
            (fake("empty", (8, 8)), "empty"),
            (Fake { coll: Collective::Broadcast, ..fake("b", (0, 8)) }, "Broadcast"),
            (Fake { in_place: false, out_of_place: false, ..fake("p", (0, 8)) }, "neither"),
            (Fake { per_node: 3, ..fake("p", (0, 8)) }, "does not divide"),
        ] {
            let e = check_registrable(&bad, &reg).unwrap_err();
            assert!(e.contains(what), "{e}");
        }
        let d = descriptor(&fake("x", (0, 8)));
        let same = vec![Ok(d.clone()); 4];
        assert!(agreement(&same).is_ok());
        // A rank with another size range is named.
        let mut other = same.clone();
        other[2] = Ok(descriptor(&fake("x", (0, 16))));
        let e = agreement(&other).unwrap_err();
        assert_eq!(e.peer(), Some(2));
        assert!(e.message().contains("different algorithms"), "{e}");
        // A rank that refused it locally is named with its reason.
        let mut refused = same;
        refused[3] = Err("an algorithm named \"x\" is already registered".into());
        let e = agreement(&refused).unwrap_err();
        assert_eq!(e.peer(), Some(3));
        assert!(e.message().contains("already registered"), "{e}");
    }
}

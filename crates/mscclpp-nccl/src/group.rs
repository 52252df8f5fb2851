//! `ncclGroupStart`/`ncclGroupEnd`: per thread, calls between them are queued and run at the
//! outermost `ncclGroupEnd`: communicator inits first (in parallel, so one thread can build
//! several ranks), then the calls sent to the real NCCL (inside one real group), then the native
//! collectives in call order, then the point-to-point transfers: on the device path one kernel per communicator holding all
//! of its group's sends, receives and copies (they run at once, so pairs never deadlock), on the
//! host-staged path every send before any receive. Outside a group every call runs at once, as a group of one.

use std::cell::RefCell;
use std::sync::Arc;

use crate::abi::*;
use crate::comm::{Call, Comm, Handle, InitArgs, Prim, exec_p2p};
use crate::error::{Failure, Res};
use crate::forward;
use crate::route::Route;

/// A queued call.
pub enum Queued {
    /// Build a communicator into a pending handle.
    Init {
        /// The handle the caller already holds.
        handle: &'static Handle,
        /// How to build it.
        args: InitArgs,
    },
    /// A collective or point-to-point call.
    Call {
        /// On this communicator.
        comm: Arc<Comm>,
        /// The call.
        call: Call,
    },
}

#[derive(Default)]
struct Group {
    depth: usize,
    queue: Vec<Queued>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

/// `ncclGroupStart`.
pub fn start() {
    GROUP.with(|g| g.borrow_mut().depth += 1);
}

/// Whether this thread is inside a group.
pub fn active() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

/// How many calls this thread has queued.
pub fn queued() -> usize {
    GROUP.with(|g| g.borrow().queue.len())
}

/// `ncclGroupEnd`: at the outermost level, runs the queue.
///
/// # Errors
/// `ncclInvalidUsage` without a matching start; the first failure of the queued calls (calls
/// refused by the router fail the whole group before anything runs).
pub fn end() -> Res {
    let q = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Failure::usage("ncclGroupEnd: no ncclGroupStart is open on this thread"));
        }
        g.depth -= 1;
        Ok(if g.depth == 0 { Some(std::mem::take(&mut g.queue)) } else { None })
    })?;
    match q {
        Some(q) => run(q),
        None => Ok(()),
    }
}

/// Closes the current group level without running it; at the outermost level its queue is
/// dropped (`ncclGroupSimulateEnd`). Pending inits in it fail their handles.
///
/// # Errors
/// `ncclInvalidUsage` without an open group.
pub fn discard() -> Res {
    let q = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Failure::usage("ncclGroupSimulateEnd: no ncclGroupStart is open on this thread"));
        }
        g.depth -= 1;
        Ok(if g.depth == 0 { std::mem::take(&mut g.queue) } else { Vec::new() })
    })?;
    for x in q {
        if let Queued::Init { handle, .. } = x {
            handle.set(Err(Failure::usage("its group ended with ncclGroupSimulateEnd, which runs nothing")));
        }
    }
    Ok(())
}

/// Queues `q` inside a group, or runs it now.
pub fn submit(q: Queued) -> Res {
    let q = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 {
            g.queue.push(q);
            None
        } else {
            Some(q)
        }
    });
    match q {
        Some(q) => run(vec![q]),
        None => Ok(()),
    }
}

/// Runs a group's calls (see the module documentation for the order).
pub fn run(q: Vec<Queued>) -> Res {
    let mut inits = Vec::new();
    let mut calls = Vec::new();
    for x in q {
        match x {
            Queued::Init { handle, args } => inits.push((handle, args)),
            Queued::Call { comm, call } => calls.push((comm, call)),
        }
    }
    let mut first: Res = Ok(());
    if !inits.is_empty() {
        let results: Vec<Res> = std::thread::scope(|s| {
            let hs: Vec<_> = inits
                .into_iter()
                .map(|(h, a)| {
                    s.spawn(move || {
                        if let Some(d) = a.device {
                            let _ = crate::mem::bind(d);
                        }
                        let r = Comm::init(a);
                        let out = r.as_ref().map(|_| ()).map_err(Clone::clone);
                        h.set(r);
                        out
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| Err(Failure::new(ncclInternalError, "ncclCommInitRank: panicked")))
                })
                .collect()
        });
        for r in results {
            first = first.and(r);
        }
    }
    first?;
    // Route everything first: a refused call fails the group before anything moves.
    let mut routed = Vec::with_capacity(calls.len());
    for (comm, call) in calls {
        comm.live_with(|| call.describe(&comm))?;
        match comm.route(call.op, call.dt, call.red, call.count) {
            Route::Refuse(m) => return Err(Failure::usage(format!("{m} (rank {} of {})", comm.rank, comm.nranks))),
            r => routed.push((comm, call, r)),
        }
    }
    // The real NCCL's calls, in one real group so its Send/Recv pairs cannot deadlock either.
    let fb: Vec<_> = routed.iter().filter(|(_, _, r)| *r == Route::Fallback).collect();
    if let Some((c0, _, _)) = fb.first() {
        let n = c0.real("a group of calls")?.nccl;
        forward!(n, "ncclGroupStart", ())?;
        let mut r = Ok(());
        for (c, call, _) in &fb {
            r = r.and_then(|_| c.run_fallback(call));
        }
        let e = forward!(n, "ncclGroupEnd", ());
        r.and(e)?;
    }
    // Point-to-point primitives per communicator, in call order.
    let mut per_comm: Vec<(Arc<Comm>, Vec<Prim>)> = Vec::new();
    for (comm, call, r) in &routed {
        if *r != Route::Native {
            continue;
        }
        if call.op.is_p2p() {
            let prims = comm.p2p_prims(call)?;
            match per_comm.iter_mut().find(|(c, _)| Arc::ptr_eq(c, comm)) {
                Some((_, v)) => v.extend(prims),
                None => per_comm.push((comm.clone(), prims)),
            }
        } else {
            comm.run_native(call)?;
        }
    }
    // The device path: one kernel per communicator with all of its group's sends, receives
    // and copies (asynchronous, so several ranks driven by one thread cannot block each
    // other). The rest runs host-staged.
    let mut host: Vec<(Arc<Comm>, Prim)> = Vec::new();
    for (comm, prims) in per_comm {
        match &comm.device_p2p {
            Ok(d) => comm.exec_p2p_device(d, &prims)?,
            Err(_) => host.extend(prims.into_iter().map(|p| (comm.clone(), p))),
        }
    }
    exec_p2p(&host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unbalanced_end_fails() {
        let e = end().unwrap_err();
        assert_eq!(e.code, ncclInvalidUsage);
        assert!(e.message.contains("no ncclGroupStart"));
        start();
        start();
        assert!(active());
        end().unwrap();
        assert!(active());
        end().unwrap();
        assert!(!active());
    }
}

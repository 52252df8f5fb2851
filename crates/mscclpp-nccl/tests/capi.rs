//! The C API on CPU: communicators over a real TCP bootstrap with ranks as threads (no GPU: the
//! native collectives are down, so every call that needs them must fail with
//! `ncclInvalidUsage` and a message naming what is missing), argument errors, groups.
//! No NCCL fallback in this process (the variables are unset).

use std::ffi::{CStr, c_int, c_void};
use std::ptr::null_mut;

use mscclpp_nccl::abi::*;
use mscclpp_nccl::exports::*;

fn last() -> String {
    // SAFETY: returns a NUL-terminated string owned by the library.
    unsafe { CStr::from_ptr(ncclGetLastError(null_mut())) }.to_string_lossy().into_owned()
}

fn unique_id() -> ncclUniqueId {
    let mut id = ncclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
    // SAFETY: a valid out pointer.
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, ncclSuccess);
    id
}

/// Runs `f(rank, comm)` on `n` ranks as threads after ncclCommInitRank.
fn with_ranks<T: Send>(n: usize, f: impl Fn(usize, ncclComm_t) -> T + Sync) -> Vec<T> {
    let id = unique_id();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                s.spawn(move || {
                    let mut c: ncclComm_t = null_mut();
                    // SAFETY: valid out pointer, id from ncclGetUniqueId.
                    let rc = unsafe { ncclCommInitRank(&mut c, n as c_int, id, r as c_int) };
                    assert_eq!(rc, ncclSuccess, "rank {r}: {}", last());
                    let out = f(r, c as ncclComm_t);
                    // SAFETY: our communicator.
                    assert_eq!(unsafe { ncclCommDestroy(c) }, ncclSuccess);
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

// Error messages are process-wide (as in NCCL), so tests that read them run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn version_and_error_strings() {
    let mut v = 0;
    // SAFETY: valid pointers throughout.
    unsafe {
        assert_eq!(ncclGetVersion(&mut v), ncclSuccess);
        assert_eq!(v, 23102);
        assert_eq!(CStr::from_ptr(ncclGetErrorString(ncclSuccess)).to_str().unwrap(), "no error");
        assert!(CStr::from_ptr(ncclGetErrorString(ncclInvalidUsage)).to_str().unwrap().starts_with("invalid usage"));
        assert_eq!(CStr::from_ptr(pncclGetErrorString(99)).to_str().unwrap(), "unknown result code");
    }
}

#[test]
fn bad_arguments_fail_with_messages() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut c: ncclComm_t = null_mut();
    let id = unique_id();
    // SAFETY: the library checks each bad argument before using it.
    unsafe {
        assert_eq!(ncclGetVersion(std::ptr::null_mut()), ncclInvalidArgument);
        assert!(last().contains("version is NULL"), "{}", last());
        assert_eq!(ncclCommInitRank(&mut c, 2, id, 5), ncclInvalidArgument);
        assert!(last().contains("rank 5 of 2 is not valid"), "{}", last());
        let mut cfg = ncclConfig_t::initializer();
        cfg.magic = 0;
        assert_eq!(ncclCommInitRankConfig(&mut c, 1, id, 0, &mut cfg), ncclInvalidArgument);
        assert!(last().contains("NCCL_CONFIG_INITIALIZER"), "{}", last());
        let junk = ncclUniqueId { internal: [7; NCCL_UNIQUE_ID_BYTES] };
        assert_eq!(ncclCommInitRank(&mut c, 1, junk, 0), ncclInvalidArgument);
        assert!(last().contains("not one of this library's"), "{}", last());
        let mut n = 0;
        assert_eq!(ncclCommCount(null_mut(), &mut n), ncclInvalidArgument);
        assert!(last().contains("ncclCommCount: the communicator is NULL"), "{}", last());
        let fake = [0u64; 4];
        assert_eq!(ncclCommCount(fake.as_ptr() as ncclComm_t, &mut n), ncclInvalidArgument);
        assert!(last().contains("not a communicator of this library"), "{}", last());
        assert_eq!(ncclGroupEnd(), ncclInvalidUsage);
        assert!(last().contains("no ncclGroupStart"), "{}", last());
    }
}

#[test]
fn init_query_and_unsupported_calls_over_tcp() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let got = with_ranks(3, |r, c| {
        let (mut n, mut me, mut dev) = (0, 0, -1);
        let mut v = 0u64;
        let mut ae = -1;
        // SAFETY: c is a live communicator; out pointers valid.
        unsafe {
            assert_eq!(ncclCommCount(c, &mut n), ncclSuccess);
            assert_eq!(ncclCommUserRank(c, &mut me), ncclSuccess);
            assert_eq!(ncclCommCuDevice(c, &mut dev), ncclSuccess);
            assert_eq!(ncclCommGetAsyncError(c, &mut ae), ncclSuccess);
            assert_eq!(ncclCommMemStats(c, 3, &mut v), ncclSuccess);
            assert_eq!(ncclCommMemStats(c, 9, &mut v), ncclInvalidArgument);
        }
        assert_eq!((n, me as usize, dev, ae, v), (3, r, 0, ncclSuccess, 0));
        // No GPU and no fallback: every operation is refused, naming both.
        let p = 0x1000 as *mut c_void;
        let check = |rc: ncclResult_t, what: &str| {
            assert_eq!(rc, ncclInvalidUsage, "{what}");
            let m = last();
            assert!(
                m.contains(what)
                    && m.contains("no native path")
                    && m.contains("no NCCL fallback (rank 0: MSCCLPP_ENABLE_NCCL_FALLBACK is not set)"),
                "{m}"
            );
        };
        // SAFETY: refused before any pointer is used.
        unsafe {
            check(ncclAllReduce(p, p, 4, ncclFloat32, ncclSum, c, null_mut()), "allreduce");
            check(ncclAllGather(p, p, 4, ncclFloat32, c, null_mut()), "allgather");
            check(ncclReduceScatter(p, p, 4, ncclFloat32, ncclSum, c, null_mut()), "reducescatter");
            check(ncclBroadcast(p, p, 4, ncclFloat32, 0, c, null_mut()), "broadcast");
            check(ncclReduce(p, p, 4, ncclFloat32, ncclSum, 0, c, null_mut()), "reduce");
            check(ncclAllReduce(p, p, 4, ncclInt8, ncclSum, c, null_mut()), "ncclInt8");
            check(ncclAllReduce(p, p, 4, ncclFloat32, 77, c, null_mut()), "PreMulSum");
            check(ncclAllGather(p, p, 3, ncclInt8, c, null_mut()), "odd");
            check(ncclSend(p, 4, ncclFloat32, 1, c, null_mut()), "send");
            check(ncclAlltoAll(p, p, 4, ncclFloat32, c, null_mut()), "alltoall");
        }
        // SAFETY: refused at argument checks.
        unsafe {
            assert_eq!(ncclBroadcast(p, p, 4, ncclFloat32, 3, c, null_mut()), ncclInvalidArgument);
            assert!(last().contains("root 3 is not a rank"), "{}", last());
            assert_eq!(ncclSend(p, 4, ncclFloat32, -1, c, null_mut()), ncclInvalidArgument);
            assert!(last().contains("peer -1"), "{}", last());
            assert_eq!(ncclAllReduce(p, p, 4, 42, ncclSum, c, null_mut()), ncclInvalidArgument);
            assert!(last().contains("data type 42"), "{}", last());
        }
        // Forward-only functions without NCCL.
        let mut op = 0;
        let mut h: ncclParamHandle_t = null_mut();
        // SAFETY: refused before use.
        unsafe {
            assert_eq!(ncclRedOpCreatePreMulSum(&mut op, p, ncclFloat32, ncclScalarHostImmediate, c), ncclInvalidUsage);
            assert!(last().contains("ncclRedOpCreatePreMulSum") && last().contains("no NCCL fallback"), "{}", last());
            assert_eq!(ncclCommSuspend(c, 1), ncclInvalidUsage);
            assert!(last().contains("ncclCommSuspend"), "{}", last());
            assert_eq!(ncclSignal(0, 0, 0, 0, c, null_mut()), ncclInvalidUsage);
            assert!(last().contains("ncclSignal"), "{}", last());
            assert_eq!(ncclParamBind(&mut h, c"NCCL_DEBUG".as_ptr()), ncclInvalidUsage);
            assert!(last().contains("ncclParamBind") && last().contains("MSCCLPP_ENABLE_NCCL_FALLBACK"), "{}", last());
            // An existing rank passes rank -1 (checked before anything is exchanged).
            let mut g: ncclComm_t = null_mut();
            assert_eq!(ncclCommGrow(c, 4, std::ptr::null(), 3, &mut g, null_mut()), ncclInvalidArgument);
            assert!(last().contains("rank -1"), "{}", last());
            assert_eq!(ncclCommGrow(c, 4, std::ptr::null(), -1, null_mut(), null_mut()), ncclInvalidArgument);
            assert!(last().contains("newcomm is NULL"), "{}", last());
            assert_eq!(ncclRedOpDestroy(ncclSum, c), ncclInvalidArgument);
        }
        r
    });
    assert_eq!(got, vec![0, 1, 2]);
}

#[test]
fn split_over_tcp() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // 4 ranks: even/odd colors, keys reverse the order; rank 3 opts out.
    let got = with_ranks(4, |r, c| {
        let color = if r == 3 { NCCL_SPLIT_NOCOLOR } else { (r % 2) as c_int };
        let mut nc: ncclComm_t = null_mut();
        // SAFETY: live communicator, valid out pointer.
        assert_eq!(unsafe { ncclCommSplit(c, color, 10 - r as c_int, &mut nc, null_mut()) }, ncclSuccess, "{}", last());
        if nc.is_null() {
            return (r, -1, -1);
        }
        let (mut n, mut me) = (0, 0);
        // SAFETY: the new communicator.
        unsafe {
            assert_eq!(ncclCommCount(nc, &mut n), ncclSuccess);
            assert_eq!(ncclCommUserRank(nc, &mut me), ncclSuccess);
            assert_eq!(ncclCommDestroy(nc), ncclSuccess);
            // destroyed handles answer, never crash
            assert_eq!(ncclCommCount(nc, &mut n), ncclInvalidUsage);
        }
        assert!(last().contains("destroyed"), "{}", last());
        (r, n, me)
    });
    assert_eq!(got, vec![(0, 2, 1), (1, 1, 0), (2, 2, 0), (3, -1, -1)]);
}

#[test]
fn init_inside_a_group_from_one_thread() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let id = unique_id();
    let mut comms = [null_mut(); 3];
    // SAFETY: valid pointers; the handles are filled at ncclGroupEnd.
    unsafe {
        assert_eq!(ncclGroupStart(), ncclSuccess);
        for (r, c) in comms.iter_mut().enumerate() {
            assert_eq!(ncclCommInitRank(c, 3, id, r as c_int), ncclSuccess);
        }
        let mut n = 0;
        assert_eq!(ncclCommCount(comms[0], &mut n), ncclInvalidUsage);
        assert!(last().contains("still being built"), "{}", last());
        let mut ae = 0;
        assert_eq!(ncclCommGetAsyncError(comms[0], &mut ae), ncclSuccess);
        assert_eq!(ae, ncclInProgress);
        assert_eq!(ncclGroupEnd(), ncclSuccess, "{}", last());
        for (r, c) in comms.iter().enumerate() {
            let mut me = -1;
            assert_eq!(ncclCommUserRank(*c, &mut me), ncclSuccess);
            assert_eq!(me as usize, r);
        }
        // abort: the handle then answers "destroyed or aborted"
        assert_eq!(ncclCommAbort(comms[0]), ncclSuccess);
        assert_eq!(ncclCommCount(comms[0], &mut n), ncclInvalidUsage);
        assert!(last().contains("destroyed or aborted"), "{}", last());
        for c in &comms[1..] {
            assert_eq!(ncclCommDestroy(*c), ncclSuccess);
        }
    }
}

#[test]
fn simulate_end_drops_the_group() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut si = ncclSimInfo_t {
        size: std::mem::size_of::<ncclSimInfo_t>(),
        magic: 0x74685283,
        version: 23102,
        estimatedTime: -1.0,
    };
    // SAFETY: valid pointers.
    unsafe {
        assert_eq!(ncclGroupSimulateEnd(&mut si), ncclInvalidUsage);
        assert!(last().contains("no ncclGroupStart"), "{}", last());
        assert_eq!(ncclGroupStart(), ncclSuccess);
        assert_eq!(ncclGroupSimulateEnd(&mut si), ncclInvalidUsage);
        assert!(last().contains("no performance model"), "{}", last());
        assert_eq!(ncclGroupEnd(), ncclInvalidUsage); // the group is closed
    }
}

/// Size and rank of a grown communicator, and the size of a split of it with one color (a
/// collective call of all its ranks: the new communicator works); destroys both.
fn use_grown(nc: ncclComm_t) -> (c_int, c_int, c_int) {
    let (mut n, mut me, mut sn) = (0, 0, 0);
    let mut sc: ncclComm_t = null_mut();
    // SAFETY: a live communicator and valid out pointers; both destroyed at the end.
    unsafe {
        assert_eq!(ncclCommCount(nc, &mut n), ncclSuccess);
        assert_eq!(ncclCommUserRank(nc, &mut me), ncclSuccess);
        assert_eq!(ncclCommSplit(nc, 0, me, &mut sc, null_mut()), ncclSuccess, "{}", last());
        assert_eq!(ncclCommCount(sc, &mut sn), ncclSuccess);
        assert_eq!(ncclCommDestroy(sc), ncclSuccess);
        assert_eq!(ncclCommDestroy(nc), ncclSuccess);
    }
    (n, me, sn)
}

/// ncclCommGrow: 3 existing ranks (rank 1 made the id) and 2 new ones form a communicator of
/// 5; existing ranks keep their ranks; the new one works (a split over it); a second id while
/// one is unconsumed is refused; the old communicator keeps working.
#[test]
fn grow_adds_ranks() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (tx, rx) = std::sync::mpsc::channel::<ncclUniqueId>();
    let rx = std::sync::Mutex::new(rx);
    std::thread::scope(|s| {
        // The new ranks 3 and 4: they get the id from rank 1 (as a launcher would hand it out).
        let new_ranks: Vec<_> = (3..5)
            .map(|r| {
                let rx = &rx;
                s.spawn(move || {
                    let id = rx.lock().unwrap().recv().unwrap();
                    let mut nc: ncclComm_t = null_mut();
                    // SAFETY: a NULL comm (a new rank), the id, a valid out pointer.
                    let rc = unsafe { ncclCommGrow(null_mut(), 5, &id, r, &mut nc, null_mut()) };
                    assert_eq!(rc, ncclSuccess, "new rank {r}: {}", last());
                    use_grown(nc)
                })
            })
            .collect();
        let got = with_ranks(3, |r, c| {
            let mut id = ncclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
            if r == 1 {
                // SAFETY: live communicator, valid out pointer.
                unsafe {
                    assert_eq!(ncclCommGetUniqueId(c, &mut id), ncclSuccess, "{}", last());
                    let mut again = id;
                    assert_eq!(ncclCommGetUniqueId(c, &mut again), ncclInvalidUsage);
                    assert!(last().contains("not consumed"), "{}", last());
                }
                tx.send(id).unwrap();
                tx.send(id).unwrap();
            }
            let mut nc: ncclComm_t = null_mut();
            let idp: *const ncclUniqueId = if r == 1 { &id } else { std::ptr::null() };
            // SAFETY: live communicator; the id only on the rank that made it.
            let rc = unsafe { ncclCommGrow(c, 5, idp, -1, &mut nc, null_mut()) };
            assert_eq!(rc, ncclSuccess, "existing rank {r}: {}", last());
            let got = use_grown(nc);
            let mut old = 0;
            // SAFETY: the old communicator still answers.
            assert_eq!(unsafe { ncclCommCount(c, &mut old) }, ncclSuccess);
            assert_eq!(old, 3);
            got
        });
        assert_eq!(got, vec![(5, 0, 5), (5, 1, 5), (5, 2, 5)]);
        let new: Vec<_> = new_ranks.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(new, vec![(5, 3, 5), (5, 4, 5)]);
    });
}

/// ncclCommGrow refusals that need the existing ranks' exchange: no rank passes the id, or a
/// rank passes an id its communicator did not make; every existing rank fails at once, naming
/// the rank and why.
#[test]
fn grow_refuses_a_missing_or_foreign_id() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let foreign = unique_id();
    let got = with_ranks(2, |r, c| {
        let mut nc: ncclComm_t = null_mut();
        // SAFETY: live communicator, valid out pointer.
        let rc = unsafe { ncclCommGrow(c, 3, std::ptr::null(), -1, &mut nc, null_mut()) };
        let none = (rc, last());
        // Rank 0 passes an id of ncclGetUniqueId, not of ncclCommGetUniqueId.
        let idp: *const ncclUniqueId = if r == 0 { &foreign } else { std::ptr::null() };
        // SAFETY: as above.
        let rc = unsafe { ncclCommGrow(c, 3, idp, -1, &mut nc, null_mut()) };
        let wrong = (rc, last());
        (none, wrong)
    });
    for (r, (none, wrong)) in got.iter().enumerate() {
        assert_eq!(none.0, ncclInvalidArgument, "rank {r}: {}", none.1);
        assert!(none.1.contains("no existing rank passed the unique id"), "rank {r}: {}", none.1);
        assert_eq!(wrong.0, ncclInvalidArgument, "rank {r}: {}", wrong.1);
        assert!(wrong.1.contains("rank 0: the unique id was not made by ncclCommGetUniqueId"), "rank {r}: {}", wrong.1);
    }
}

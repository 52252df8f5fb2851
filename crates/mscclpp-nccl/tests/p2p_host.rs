//! Groups and the host-staged point-to-point path on CPU: real TCP bootstrap, ranks as threads,
//! host memory standing in for device memory (`HostMem`). Receives posted before sends in a
//! group, rings, AlltoAll, Gather/Scatter, self-sends; nothing moves before `ncclGroupEnd`.

use std::sync::Arc;

use mscclpp::TcpBootstrap;
use mscclpp_nccl::abi::*;
use mscclpp_nccl::comm::{Call, Comm, InitArgs};
use mscclpp_nccl::group::{self, Queued};
use mscclpp_nccl::mem::HostMem;
use mscclpp_nccl::route::{Op, Settings};

fn ranks<T: Send>(n: usize, f: impl Fn(Arc<Comm>) -> T + Sync) -> Vec<T> {
    let id = TcpBootstrap::create_unique_id().unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (f, id) = (&f, id.clone());
                s.spawn(move || {
                    let mut a = InitArgs::new(r, n, id);
                    a.mem = Some(Arc::new(HostMem));
                    a.native = false; // no GPU collectives; the p2p path runs on HostMem
                    a.settings = Settings::default();
                    f(Comm::init(a).unwrap())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn call(op: Op, send: &[u32], recv: &mut [u32], count: usize, peer: i32) -> Call {
    Call {
        op,
        send: send.as_ptr() as u64,
        recv: recv.as_mut_ptr() as u64,
        count,
        dt: ncclUint32,
        red: 0,
        peer,
        stream: 0,
    }
}

#[test]
fn ring_in_a_group_with_receives_first() {
    let n = 4;
    let got = ranks(n, |c| {
        let r = c.rank;
        let send: Vec<u32> = (0..100).map(|i| (r * 1000 + i) as u32).collect();
        let mut recv = vec![0u32; 100];
        group::start();
        let prev = ((r + n - 1) % n) as i32;
        let next = ((r + 1) % n) as i32;
        group::submit(Queued::Call { comm: c.clone(), call: call(Op::Recv, &[], &mut recv, 100, prev) }).unwrap();
        group::submit(Queued::Call { comm: c.clone(), call: call(Op::Send, &send, &mut [], 100, next) }).unwrap();
        assert_eq!(group::queued(), 2);
        assert!(recv.iter().all(|&x| x == 0), "nothing moves before ncclGroupEnd");
        group::end().unwrap();
        (r, recv)
    });
    for (r, recv) in got {
        let p = (r + n - 1) % n;
        assert_eq!(recv, (0..100).map(|i| (p * 1000 + i) as u32).collect::<Vec<_>>());
    }
}

#[test]
fn all_to_all_gather_scatter_and_self() {
    let n = 3;
    let k = 5;
    ranks(n, |c| {
        let r = c.rank;
        // AlltoAll outside a group: chunk p of rank r is r*10+p
        let send: Vec<u32> = (0..n * k).map(|i| (r * 10 + i / k) as u32).collect();
        let mut recv = vec![0u32; n * k];
        group::submit(Queued::Call { comm: c.clone(), call: call(Op::AllToAll, &send, &mut recv, k, 0) }).unwrap();
        let want: Vec<u32> = (0..n * k).map(|i| ((i / k) * 10 + r) as u32).collect();
        assert_eq!(recv, want);
        // Gather to 1, then Scatter from 2
        let mine = vec![r as u32 + 7; k];
        let mut all = vec![0u32; n * k];
        group::submit(Queued::Call { comm: c.clone(), call: call(Op::Gather, &mine, &mut all, k, 1) }).unwrap();
        if r == 1 {
            assert_eq!(all, (0..n * k).map(|i| (i / k) as u32 + 7).collect::<Vec<_>>());
        }
        let src: Vec<u32> = (0..n * k).map(|i| (i / k * 3) as u32).collect();
        let mut part = vec![0u32; k];
        group::submit(Queued::Call { comm: c.clone(), call: call(Op::Scatter, &src, &mut part, k, 2) }).unwrap();
        assert_eq!(part, vec![(r * 3) as u32; k]);
        // a send to itself pairs with the receive in the same group
        let mut back = vec![0u32; k];
        group::start();
        group::submit(Queued::Call { comm: c.clone(), call: call(Op::Send, &mine, &mut [], k, r as i32) }).unwrap();
        group::submit(Queued::Call { comm: c.clone(), call: call(Op::Recv, &[], &mut back, k, r as i32) }).unwrap();
        group::end().unwrap();
        assert_eq!(back, mine);
        // a receive from itself with no send first fails, naming it
        let e = group::submit(Queued::Call { comm: c.clone(), call: call(Op::Recv, &[], &mut back, k, r as i32) })
            .unwrap_err();
        assert_eq!(e.code, ncclInvalidUsage);
        assert!(e.message.contains("no ncclSend to itself"), "{}", e.message);
    });
}

#[test]
fn size_mismatch_is_reported() {
    let got = ranks(2, |c| {
        let data = vec![1u32; 8];
        let mut buf = vec![0u32; 4];
        if c.rank == 0 {
            group::submit(Queued::Call { comm: c.clone(), call: call(Op::Send, &data, &mut [], 8, 1) })
                .map_err(|e| e.message)
        } else {
            group::submit(Queued::Call { comm: c.clone(), call: call(Op::Recv, &[], &mut buf, 4, 0) })
                .map_err(|e| e.message)
        }
    });
    assert!(got[0].is_ok());
    let m = got[1].clone().unwrap_err();
    assert!(m.contains("rank 0 sent 32 bytes") && m.contains("ncclRecv of 16 bytes from rank 0"), "{m}");
}

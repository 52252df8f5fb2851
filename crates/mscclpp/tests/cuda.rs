//! GPU tests: run on a machine with a CUDA GPU with `--ignored` (see `scripts/gpu-bundle.sh`).
//! Two processes share GPU 0 when there is only one.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::gpu::{Pair, gpu_for};
use common::{Rank, pattern, spawn_ranks};
use mscclpp::{
    Bootstrap, Buffer, Context, Device, DeviceBuffer, EndpointConfig, ErrorKind, RegisteredMemory, Transport,
};

const T: Duration = Duration::from_secs(60);

fn ipc_cfg(dev: u32) -> EndpointConfig {
    EndpointConfig::new(Transport::CudaIpc).device(Device::Gpu(dev))
}

/// Ethernet over 127.0.0.1 with GPU `dev`'s memory.
fn eth_gpu_cfg(dev: u32) -> EndpointConfig {
    EndpointConfig::new(Transport::Ethernet).ethernet_interface("127.0.0.1").device(Device::Gpu(dev))
}

/// The shared connection suite (`common/suite.rs`) on CUDA IPC: two (four) processes, GPU
/// buffers on GPU `rank % device_count`, Host2DeviceSemaphores.
mod contract {
    use crate::common;
    use crate::common::suite::{Harness, Memory, Mode};
    use crate::connection_suite;
    use mscclpp::{EndpointConfig, Transport};

    fn config(queue: Option<usize>) -> EndpointConfig {
        let mut c = EndpointConfig::new(Transport::CudaIpc);
        c.max_write_queue_size = queue;
        c
    }

    static CUDA_IPC: Harness = Harness {
        transport: Transport::CudaIpc,
        mode: Mode::Processes,
        prepare: |_| {},
        ib_device: None,
        config,
        atomics: true,
        cpu_atomics_coherent: false,
        memory: Memory::Gpu,
        detects_peer_gone: true,
        local_destination_allowed: true,
    };

    connection_suite!(&CUDA_IPC, #[ignore = "needs a CUDA GPU"]);
}

/// The same suite with kernel copies of up to 64 KiB and lingering set
/// (`cuda_ipc_kernel_copy_linger` 100 us): the connection then has a stream of its own and
/// tracks completion for a kernel that may linger. The suite's host-issued writes are lone
/// writes, which never start a lingering kernel (a proxied putWithSignal does): the lingering
/// kernel itself is tested by `conn::linger`'s GPU test and `port_channel_over_cuda_ipc_lingering_kernel_copies`.
mod contract_lingering_kernel_copies {
    use crate::common;
    use crate::common::suite::{Harness, Memory, Mode};
    use crate::connection_suite;
    use mscclpp::{EndpointConfig, Transport};

    fn config(queue: Option<usize>) -> EndpointConfig {
        let mut c = EndpointConfig::new(Transport::CudaIpc)
            .cuda_ipc_kernel_copy_max(64 << 10)
            .cuda_ipc_kernel_copy_linger(std::time::Duration::from_micros(100));
        c.max_write_queue_size = queue;
        c
    }

    static CUDA_IPC_LINGER: Harness = Harness {
        transport: Transport::CudaIpc,
        mode: Mode::Processes,
        prepare: |_| {},
        ib_device: None,
        config,
        atomics: true,
        cpu_atomics_coherent: false,
        memory: Memory::Gpu,
        detects_peer_gone: true,
        local_destination_allowed: true,
    };

    connection_suite!(&CUDA_IPC_LINGER, #[ignore = "needs a CUDA GPU"]);
}

/// This rank's side of a pair joined over `cfg` (see `common::gpu::pair`).
fn pair(r: &Rank, cfg: EndpointConfig, len: usize) -> Pair {
    common::gpu::pair(Arc::new(r.bootstrap(T)), r.rank, cfg, len)
}

/// CUDA IPC writes of 1 B .. 1 GiB at varied offsets between two processes, each verified; the
/// imported mapping is released when the last handle goes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_ipc_writes_all_sizes() {
    const CAP: usize = (1 << 30) + (1 << 20);
    if let Some(r) = Rank::from_env() {
        let p = pair(&r, ipc_cfg(gpu_for(r.rank)), CAP);
        let sizes = [1usize, 7, 4096, 65537, (1 << 20) + 3, 16 << 20, 256 << 20, 1 << 30];
        let src = DeviceBuffer::new(p.comm.context(), gpu_for(r.rank), CAP, Transport::CudaIpc.into()).unwrap();
        for (i, &len) in sizes.iter().enumerate() {
            let off = (i * 4099) % (CAP - len);
            if r.rank == 0 {
                let data = pattern(i as u64, len);
                src.write(3, &data).unwrap();
                p.conn.write(&p.remote, off as u64, src.memory(), 3, len as u64).unwrap();
                p.sem.signal().unwrap();
                p.conn.flush(T).unwrap();
            } else {
                p.sem.wait(T).unwrap();
                let mut got = vec![0u8; len];
                p.local.read(off, &mut got).unwrap();
                assert!(got == pattern(i as u64, len), "size {len} at offset {off} differs");
            }
            p.bs.barrier().unwrap();
        }
        if r.rank == 0 {
            assert!(mscclpp::bench::ipc_mapped_count() >= 1, "the peer's buffer should be mapped");
            let Pair { conn, remote, sem, .. } = p;
            drop((conn, remote, sem));
            assert_eq!(mscclpp::bench::ipc_mapped_count(), 0, "mappings must be released with the last handle");
            println!("RESULT ipc mapping released after the last handle");
        } else {
            p.bs.barrier().unwrap();
            return;
        }
        p.bs.barrier().unwrap();
        return;
    }
    spawn_ranks("cuda_ipc_writes_all_sizes", 2, &[]).assert_success();
}

/// CUDA IPC writes through the kernel copy (`cuda_ipc_kernel_copy_max` 64 KiB) between two
/// processes: sizes on both sides of the 16-byte path, the block's width (512 x 16 B) and the
/// limit (65537 B goes to the copy engine), aligned and misaligned; each lands exactly, and the
/// 64 bytes before and after it stay untouched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_ipc_kernel_copies_land_exactly() {
    const CAP: usize = 1 << 20;
    const GUARD: usize = 64;
    if let Some(r) = Rank::from_env() {
        let dev = gpu_for(r.rank);
        let p = pair(&r, ipc_cfg(dev).cuda_ipc_kernel_copy_max(64 << 10), CAP);
        let src = DeviceBuffer::new(p.comm.context(), dev, CAP, Transport::CudaIpc.into()).unwrap();
        let sizes = [1usize, 3, 15, 16, 17, 4096, 8192, 8208, 8193, 65535, 65536, 65537];
        let mut cases = 0;
        for (i, &len) in sizes.iter().enumerate() {
            for (soff, doff) in [(0usize, 4096usize), (3, 4096 + 16 * 7), (16, 4096 + 5)] {
                if r.rank == 1 {
                    p.local.write(0, &vec![0u8; CAP]).unwrap();
                }
                p.bs.barrier().unwrap();
                let seed = (i * 3 + soff) as u64;
                if r.rank == 0 {
                    src.write(soff, &pattern(seed, len)).unwrap();
                    p.conn.write(&p.remote, doff as u64, src.memory(), soff as u64, len as u64).unwrap();
                    p.sem.signal().unwrap();
                    p.conn.flush(T).unwrap();
                } else {
                    p.sem.wait(T).unwrap();
                    let mut got = vec![0u8; len + 2 * GUARD];
                    p.local.read(doff - GUARD, &mut got).unwrap();
                    assert!(got[GUARD..GUARD + len] == pattern(seed, len), "{len} B from {soff} to {doff} differs");
                    assert!(
                        got[..GUARD].iter().chain(&got[GUARD + len..]).all(|&b| b == 0),
                        "{len} B from {soff} to {doff} wrote outside its range"
                    );
                    cases += 1;
                }
                p.bs.barrier().unwrap();
            }
        }
        if r.rank == 1 {
            println!("RESULT kernel copies: {cases} writes checked, each exact with its guards untouched");
        }
        return;
    }
    spawn_ranks("cuda_ipc_kernel_copies_land_exactly", 2, &[]).assert_success();
}

/// Many writes each followed by a signal, issued back to back: whenever the waiter sees token k,
/// the data of write k is there.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_ipc_token_never_overtakes_data() {
    const SLOT: usize = 4 << 20;
    const N: usize = 48;
    if let Some(r) = Rank::from_env() {
        let p = pair(&r, ipc_cfg(gpu_for(r.rank)), SLOT * N);
        if r.rank == 0 {
            let src = DeviceBuffer::new(p.comm.context(), gpu_for(0), SLOT * N, Transport::CudaIpc.into()).unwrap();
            for i in 0..N {
                src.write(i * SLOT, &pattern(100 + i as u64, SLOT)).unwrap();
            }
            for i in 0..N {
                p.conn.write(&p.remote, (i * SLOT) as u64, src.memory(), (i * SLOT) as u64, SLOT as u64).unwrap();
                p.sem.signal().unwrap();
            }
            p.conn.flush(T).unwrap();
        } else {
            let mut checked = 0;
            while checked < N {
                let tok = p.sem.inbound_token().unwrap() as usize;
                // Everything up to the token must be complete.
                while checked < tok.min(N) {
                    let mut got = vec![0u8; SLOT];
                    p.local.read(checked * SLOT, &mut got).unwrap();
                    assert!(got == pattern(100 + checked as u64, SLOT), "token {tok} arrived before data {checked}");
                    checked += 1;
                }
            }
        }
        p.bs.barrier().unwrap();
        return;
    }
    spawn_ranks("cuda_ipc_token_never_overtakes_data", 2, &[]).assert_success();
}

/// Atomic adds from both processes into one GPU word: rank 0 through CUDA IPC, rank 1 through a
/// connection to itself (the same-process pointer path), at the same time.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_ipc_atomic_add_from_both_processes() {
    const N: i64 = 2000;
    if let Some(r) = Rank::from_env() {
        let p = pair(&r, ipc_cfg(gpu_for(r.rank)), 4096);
        // A self-connection on rank 1 (tag 5), to reach its own buffer.
        let self_conn =
            if r.rank == 1 { Some(p.comm.connect(&ipc_cfg(gpu_for(1)), 1, 5).unwrap().wait().unwrap()) } else { None };
        p.bs.barrier().unwrap();
        if r.rank == 0 {
            for _ in 0..N {
                p.conn.atomic_add(&p.remote, 8, 3).unwrap();
            }
            p.conn.flush(T).unwrap();
        } else {
            let c = self_conn.as_ref().unwrap();
            for _ in 0..N {
                c.atomic_add(p.local.memory(), 8, 4).unwrap();
            }
            c.flush(T).unwrap();
        }
        p.bs.barrier().unwrap();
        if r.rank == 1 {
            assert_eq!(p.local.read_u64(8).unwrap() as i64, 7 * N);
        }
        p.bs.barrier().unwrap();
        return;
    }
    spawn_ranks("cuda_ipc_atomic_add_from_both_processes", 2, &[]).assert_success();
}

/// flush with a short timeout behind a long copy returns Timeout; a longer one then succeeds.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_ipc_flush_times_out_behind_long_copies() {
    if let Some(r) = Rank::from_env() {
        let len = 1usize << 30;
        let p = pair(&r, ipc_cfg(gpu_for(r.rank)), len);
        if r.rank == 0 {
            let src = DeviceBuffer::new(p.comm.context(), gpu_for(0), len, Transport::CudaIpc.into()).unwrap();
            for _ in 0..200 {
                p.conn.write(&p.remote, 0, src.memory(), 0, len as u64).unwrap();
            }
            let t0 = Instant::now();
            let e = p.conn.flush(Duration::from_millis(1)).unwrap_err();
            let el = t0.elapsed();
            assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
            assert_eq!(e.peer(), Some(1), "{e}");
            assert!(el < Duration::from_millis(200), "{el:?}");
            println!("RESULT {e} (after {el:?})");
            p.conn.flush(T).unwrap();
            assert_eq!(p.conn.outstanding(), 0);
        }
        p.bs.barrier().unwrap();
        return;
    }
    spawn_ranks("cuda_ipc_flush_times_out_behind_long_copies", 2, &[]).assert_success();
}

/// One process, two contexts on one GPU: the connection uses the pointer itself (no IPC mapping).
#[test]
#[ignore = "needs a CUDA GPU"]
fn same_process_cuda_ipc_uses_the_pointer() {
    let (a, b) = (Context::new(), Context::new());
    let ea = a.create_endpoint(&ipc_cfg(0)).unwrap();
    let eb = b.create_endpoint(&ipc_cfg(0)).unwrap();
    let ca = a.connect(&ea, &mscclpp::Endpoint::deserialize(&eb.serialize()).unwrap()).unwrap();
    let _cb = b.connect(&eb, &mscclpp::Endpoint::deserialize(&ea.serialize()).unwrap()).unwrap();
    let src = DeviceBuffer::new(&a, 0, 1 << 20, Transport::CudaIpc.into()).unwrap();
    let dst = DeviceBuffer::new(&b, 0, 1 << 20, Transport::CudaIpc.into()).unwrap();
    let dst_seen_by_a = RegisteredMemory::deserialize(&dst.memory().serialize()).unwrap();
    src.write(0, &pattern(5, 1 << 20)).unwrap();
    ca.write(&dst_seen_by_a, 0, src.memory(), 0, 1 << 20).unwrap();
    ca.atomic_add(&dst_seen_by_a, 0, 1).unwrap();
    ca.flush(T).unwrap();
    let mut want = pattern(5, 1 << 20);
    let w = u64::from_le_bytes(want[..8].try_into().unwrap()).wrapping_add(1);
    want[..8].copy_from_slice(&w.to_le_bytes());
    assert!(dst.to_vec().unwrap() == want);
    assert_eq!(mscclpp::bench::ipc_mapped_count(), 0, "same-process memory must not be IPC-mapped");
}

/// Ethernet with GPU memory on both sides, and mixed host/GPU, byte-exact.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ethernet_with_gpu_memory() {
    const CAP: usize = (64 << 20) + 4096;
    if let Some(r) = Rank::from_env() {
        let p = pair(&r, eth_gpu_cfg(gpu_for(r.rank)), CAP);
        let peer = 1 - r.rank;
        let host = Buffer::new(p.comm.context(), CAP, Transport::Ethernet.into()).unwrap();
        p.comm.send_memory(host.memory(), peer, 3).unwrap();
        let remote_host = p.comm.recv_memory(peer, 3).unwrap().wait().unwrap();
        let gsrc = DeviceBuffer::new(p.comm.context(), gpu_for(r.rank), CAP, Transport::Ethernet.into()).unwrap();
        let hsrc = Buffer::new(p.comm.context(), CAP, Transport::Ethernet.into()).unwrap();
        let psrc = mscclpp::gpu::PinnedBuffer::new(p.comm.context(), gpu_for(r.rank), CAP, Transport::Ethernet.into())
            .unwrap();
        // (source: 0 GPU, 1 host, 2 pinned host; destination on the GPU)
        let cases = [(0u8, true), (1, true), (0, false), (2, true)];
        for (ci, (sk, dg)) in cases.iter().enumerate() {
            let sg = sk == &0;
            for (si, &len) in [1usize, (4 << 20) + 5, (64 << 20) + 3].iter().enumerate() {
                let seed = (ci * 10 + si) as u64;
                let off = 17 * (si + 1);
                if r.rank == 0 {
                    let data = pattern(seed, len);
                    let src: &RegisteredMemory = match sk {
                        0 => {
                            gsrc.write(1, &data).unwrap();
                            gsrc.memory()
                        }
                        1 => {
                            hsrc.write(1, &data).unwrap();
                            hsrc.memory()
                        }
                        _ => {
                            psrc.write(1, &data).unwrap();
                            psrc.memory()
                        }
                    };
                    let dst = if *dg { &p.remote } else { &remote_host };
                    p.conn.write(dst, off as u64, src, 1, len as u64).unwrap();
                    p.conn.flush(T).unwrap();
                }
                p.bs.barrier().unwrap();
                if r.rank == 1 {
                    let mut got = vec![0u8; len];
                    if *dg {
                        p.local.read(off, &mut got).unwrap()
                    } else {
                        host.read(off, &mut got).unwrap()
                    }
                    assert!(got == pattern(seed, len), "case src={sk} (gpu: {sg}) dst_gpu={dg} size {len} differs");
                }
                p.bs.barrier().unwrap();
            }
        }
        return;
    }
    spawn_ranks("ethernet_with_gpu_memory", 2, &[]).assert_success();
}

/// Ethernet with many small writes in flight, GPU and host sources and destinations mixed,
/// overlapping, with a few large ones (the staging pipeline) among them, then a burst into GPU
/// memory only (1 MiB, empty and small writes, more than a 4 MiB staging buffer holds,
/// contiguous runs): the cases a receiver that queues copies to the GPU and waits for them late
/// (branch `eth-gather`) must get right. After each phase rank 0 signals without a flush,
/// alternately a token into host memory and a GPU semaphore, and rank 1, having seen it, finds
/// the burst's last writes landed (read one by one, latest first) and both destinations equal to
/// the writes applied in order.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ethernet_small_gpu_writes_land_in_order_before_the_signal() {
    const CAP: usize = 8 << 20;
    const PHASES: u64 = 6;
    const PER_PHASE: u64 = 600;
    if let Some(r) = Rank::from_env() {
        let dev = gpu_for(r.rank);
        let p = pair(&r, eth_gpu_cfg(dev), CAP);
        let peer = 1 - r.rank;
        let host = Buffer::new(p.comm.context(), CAP, Transport::Ethernet.into()).unwrap();
        host.write(0, &vec![0u8; CAP]).unwrap();
        p.comm.send_memory(host.memory(), peer, 3).unwrap();
        let remote_host = p.comm.recv_memory(peer, 3).unwrap().wait().unwrap();
        // A word in host memory that rank 0 adds to after each even phase (a token into host
        // memory on the same connection).
        let flag = Buffer::new(p.comm.context(), 8, Transport::Ethernet.into()).unwrap();
        flag.write(0, &[0u8; 8]).unwrap();
        p.comm.send_memory(flag.memory(), peer, 4).unwrap();
        let remote_flag = p.comm.recv_memory(peer, 4).unwrap().wait().unwrap();
        let (gdata, hdata) = (pattern(1, CAP), pattern(2, CAP));
        let gsrc = DeviceBuffer::new(p.comm.context(), dev, CAP, Transport::Ethernet.into()).unwrap();
        let hsrc = Buffer::new(p.comm.context(), CAP, Transport::Ethernet.into()).unwrap();
        gsrc.write(0, &gdata).unwrap();
        hsrc.write(0, &hdata).unwrap();
        p.bs.barrier().unwrap();
        // The model: both destinations as the writes leave them, in order.
        let (mut gimg, mut himg) = (vec![0u8; CAP], vec![0u8; CAP]);
        let mut next = common::splitmix(0x5eed);
        let sizes = [1usize, 3, 8, 17, 100, 1000, 4096, 65537, (1 << 20) + 1, (2 << 20) + 7];
        for phase in 0..PHASES {
            for _ in 0..PER_PHASE {
                let v = next();
                // Mostly small; one in 50 through the pipeline.
                let len =
                    if v.is_multiple_of(50) { sizes[8 + (v / 50 % 2) as usize] } else { sizes[(v / 7 % 8) as usize] };
                let (from_gpu, to_gpu) = ((v >> 20) & 1 == 0, (v >> 21) & 1 == 0);
                let src_off = (next() as usize) % (CAP - len);
                let dst_off = (next() as usize) % (CAP - len);
                let data = if from_gpu { &gdata } else { &hdata };
                let img = if to_gpu { &mut gimg } else { &mut himg };
                img[dst_off..dst_off + len].copy_from_slice(&data[src_off..src_off + len]);
                if r.rank == 0 {
                    let src = if from_gpu { gsrc.memory() } else { hsrc.memory() };
                    let dst = if to_gpu { &p.remote } else { &remote_host };
                    p.conn.write(dst, dst_off as u64, src, src_off as u64, len as u64).unwrap();
                }
            }
            // Then a burst into GPU memory only, the kind a missing wait would leave in flight
            // when the token lands: 1 MiB writes (the largest gathered; 8 of them overflow the
            // sender's gather buffer), empty writes, and 3.5 MiB of small ones (the receiver's
            // gather buffers fill and switch).
            let mut burst = Vec::new();
            for i in 0..360u64 {
                let v = next();
                let len = match i {
                    0..8 => 1 << 20,
                    8..10 => 0,
                    _ if v.is_multiple_of(3) => 1 + (v % 100) as usize,
                    _ => 16 << 10,
                };
                let src_off = (next() as usize) % (CAP - len);
                let dst_off = (next() as usize) % (CAP - len);
                gimg[dst_off..dst_off + len].copy_from_slice(&gdata[src_off..src_off + len]);
                burst.push((dst_off, len));
                if r.rank == 0 {
                    p.conn.write(&p.remote, dst_off as u64, gsrc.memory(), src_off as u64, len as u64).unwrap();
                }
            }
            // Contiguous runs (one copy for many writes on either side): both sides
            // contiguous, only the source, only the destination; 64 writes of 1-4 KiB each.
            for (src_step, dst_step) in [(true, true), (true, false), (false, true)] {
                let (mut src_off, mut dst_off) = ((next() as usize) % (CAP / 2), (next() as usize) % (CAP / 2));
                for _ in 0..64 {
                    let len = 1024 + (next() % 3072) as usize;
                    gimg[dst_off..dst_off + len].copy_from_slice(&gdata[src_off..src_off + len]);
                    burst.push((dst_off, len));
                    if r.rank == 0 {
                        p.conn.write(&p.remote, dst_off as u64, gsrc.memory(), src_off as u64, len as u64).unwrap();
                    }
                    src_off += if src_step { len } else { len + 4096 };
                    dst_off += if dst_step { len } else { len + 4096 };
                }
            }
            let host_token = phase % 2 == 0;
            if r.rank == 0 {
                if host_token { p.conn.atomic_add(&remote_flag, 0, 1).unwrap() } else { p.sem.signal().unwrap() }
            } else {
                if host_token {
                    let want = phase / 2 + 1;
                    let t0 = Instant::now();
                    let word = || {
                        let mut b = [0u8; 8];
                        flag.read(0, &mut b).unwrap();
                        u64::from_le_bytes(b)
                    };
                    while word() < want {
                        assert!(t0.elapsed() < T, "the host token of phase {phase} never came");
                        std::thread::yield_now();
                    }
                } else {
                    p.sem.wait(T).unwrap()
                }
                // The last writes first, each read on its own (a copy still queued would be
                // caught before it lands), then everything.
                for &(off, len) in burst.iter().rev().take(64) {
                    let mut got = vec![0u8; len];
                    p.local.read(off, &mut got).unwrap();
                    assert!(
                        got[..] == gimg[off..off + len],
                        "phase {phase} (host token: {host_token}): a {len}-byte write at {off} had not landed"
                    );
                }
                let (mut g, mut h) = (vec![0u8; CAP], vec![0u8; CAP]);
                p.local.read(0, &mut g).unwrap();
                host.read(0, &mut h).unwrap();
                let first_diff = |a: &[u8], b: &[u8]| a.iter().zip(b).position(|(x, y)| x != y);
                assert_eq!(
                    first_diff(&g, &gimg),
                    None,
                    "GPU destination after phase {phase} (host token: {host_token})"
                );
                assert_eq!(
                    first_diff(&h, &himg),
                    None,
                    "host destination after phase {phase} (host token: {host_token})"
                );
            }
            p.bs.barrier().unwrap();
        }
        if r.rank == 0 {
            p.conn.flush(T).unwrap();
        }
        p.bs.barrier().unwrap();
        return;
    }
    spawn_ranks("ethernet_small_gpu_writes_land_in_order_before_the_signal", 2, &[]).assert_success();
}

/// Ethernet with GPU memory: small writes that nothing follows (no token, no flush: packets a
/// kernel would poll for) still land. Rank 0 writes 8 bytes at a time, each into a fresh place,
/// and rank 1 polls its GPU memory until each has arrived (bounded); then rounds of scattered
/// ones at once, the same way: 17, 64 and 300 out of order are more than the receiver lands at
/// once when its input runs dry (it waits `DRY_GRACE` for the holes between them to fill), so
/// they land when the input has stayed dry that long.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ethernet_small_gpu_writes_with_nothing_after_them_land() {
    const CAP: usize = 1 << 20;
    if let Some(r) = Rank::from_env() {
        let dev = gpu_for(r.rank);
        let p = pair(&r, eth_gpu_cfg(dev), CAP);
        let data = pattern(7, CAP);
        let src = DeviceBuffer::new(p.comm.context(), dev, CAP, Transport::Ethernet.into()).unwrap();
        src.write(0, &data).unwrap();
        p.bs.barrier().unwrap();
        // Rounds of 1, 2, 3, 17, 64 and 300 writes of 8 bytes at scattered offsets (none
        // overlapping).
        let mut next = common::splitmix(0x10e);
        for (round, count) in [1usize, 2, 3, 17, 64, 300].into_iter().enumerate() {
            let t_round = Instant::now();
            let offs: Vec<usize> = (0..count).map(|_| (next() as usize % (CAP / 64)) * 64).collect();
            if r.rank == 0 {
                for &o in &offs {
                    p.conn.write(&p.remote, o as u64, src.memory(), o as u64, 8).unwrap();
                }
            } else {
                for &o in &offs {
                    let t0 = Instant::now();
                    let mut got = [0u8; 8];
                    loop {
                        p.local.read(o, &mut got).unwrap();
                        if got[..] == data[o..o + 8] {
                            break;
                        }
                        assert!(
                            t0.elapsed() < T,
                            "round {round}: the 8-byte write at {o} never landed (nothing followed it)"
                        );
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
                println!(
                    "RESULT round of {count} writes with nothing after them: all landed {:?} after the round began",
                    t_round.elapsed()
                );
            }
            p.bs.barrier().unwrap();
        }
        if r.rank == 0 {
            p.conn.flush(T).unwrap();
        }
        p.bs.barrier().unwrap();
        return;
    }
    spawn_ranks("ethernet_small_gpu_writes_with_nothing_after_them_land", 2, &[]).assert_success();
}

/// Ethernet, a waiter that returns with writes still waiting to land: a rank connected to
/// itself (a CPU endpoint, so a `Host2HostSemaphore` whose waits apply incoming frames
/// themselves) signals, then writes 300 scattered 8-byte pieces of GPU memory into GPU memory
/// with nothing after them. The wait may apply the token and go on to receive the writes, which
/// wait to land (out of order, the input dry); it returns with its signal, and the receiver
/// thread must still land them. Twenty rounds, each polled until every piece arrived (bounded).
#[test]
#[ignore = "needs a CUDA GPU"]
fn ethernet_writes_a_waiter_received_after_its_signal_land() {
    use mscclpp::{Communicator, Host2HostSemaphore, TcpBootstrap};
    const CAP: usize = 1 << 20;
    let dev = gpu_for(0);
    let id = TcpBootstrap::create_unique_id().unwrap();
    let bs = Arc::new(TcpBootstrap::config(0, 1).timeout(T).initialize(&id).unwrap());
    let comm = Communicator::new(bs);
    let dst = DeviceBuffer::new(comm.context(), dev, CAP, Transport::Ethernet.into()).unwrap();
    dst.fill(0, CAP, 0).unwrap();
    let src = DeviceBuffer::new(comm.context(), dev, CAP, Transport::Ethernet.into()).unwrap();
    comm.send_memory(dst.memory(), 0, 0).unwrap();
    let remote = comm.recv_memory(0, 0).unwrap();
    let config = EndpointConfig::new(Transport::Ethernet).ethernet_interface("127.0.0.1");
    let conn = comm.connect(&config, 0, 0).unwrap().wait().unwrap();
    let remote = remote.wait().unwrap();
    let sem = Host2HostSemaphore::new(comm.build_semaphore(&conn, 0, 0).unwrap().wait().unwrap()).unwrap();
    let mut next = common::splitmix(0x3a17);
    let mut slowest = Duration::ZERO;
    for round in 0..20u64 {
        let data = pattern(round, CAP);
        src.write(0, &data).unwrap();
        let offs: Vec<usize> = (0..300).map(|_| (next() as usize % (CAP / 64)) * 64).collect();
        sem.signal().unwrap();
        for &o in &offs {
            conn.write(&remote, o as u64, src.memory(), o as u64, 8).unwrap();
        }
        sem.wait(T).unwrap();
        let t0 = Instant::now();
        let mut got = vec![0u8; CAP];
        loop {
            dst.read(0, &mut got).unwrap();
            if offs.iter().all(|&o| got[o..o + 8] == data[o..o + 8]) {
                break;
            }
            assert!(t0.elapsed() < T, "round {round}: writes after the signal never landed (nothing followed them)");
            std::thread::sleep(Duration::from_millis(1));
        }
        slowest = slowest.max(t0.elapsed());
    }
    conn.flush(T).unwrap();
    println!(
        "RESULT 20 rounds of a signal then 300 scattered writes: each round landed within {slowest:?} of the wait's return"
    );
}

/// Ethernet into GPU memory with tokens arriving faster than one GPU round trip each: the
/// receiver holds the tokens already buffered behind one another and applies them in one round
/// (`HeldTokens` in `recv.rs`). Rank 0 sends 20,000 rounds of an 8-byte write (slot i mod 64,
/// value i + 1) then a signal; after every 97th signal an add to a word in rank 1's host memory;
/// every 10th round an add, a write and an add to a GPU word of its own (the write must land
/// between the adds, not after a held add merged with the next). Rank 1 reads, over and over
/// while they come, the host word, then the semaphore's token, then the 64 slots: the token is
/// at least 97 times the host word (tokens visible in the order sent), and every slot holds at
/// least the last value written to it before the signal the token counts (writes land before
/// their signal). At the end the counts are exact, every round's GPU word is its write plus one,
/// and rank 1 counted every GPU token (it prints how many rounds applied them).
#[test]
#[ignore = "needs a CUDA GPU"]
fn ethernet_tokens_behind_each_other_keep_their_order_and_promises() {
    const N: u64 = 20_000;
    const SLOTS: u64 = 64;
    const HOST_EVERY: u64 = 97;
    const WORD_EVERY: u64 = 10;
    /// The GPU words' offset in rank 1's buffer (after the slots; one per 10th round).
    const WORDS: u64 = SLOTS * 8;
    const CAP: usize = (N as usize + 1) * 8;
    if let Some(r) = Rank::from_env() {
        let dev = gpu_for(r.rank);
        let p = pair(&r, eth_gpu_cfg(dev), CAP);
        let peer = 1 - r.rank;
        let flag = Buffer::new(p.comm.context(), 8, Transport::Ethernet.into()).unwrap();
        flag.write(0, &[0u8; 8]).unwrap();
        p.comm.send_memory(flag.memory(), peer, 4).unwrap();
        let remote_flag = p.comm.recv_memory(peer, 4).unwrap().wait().unwrap();
        // Source word i holds i + 1.
        let src = DeviceBuffer::new(p.comm.context(), dev, CAP, Transport::Ethernet.into()).unwrap();
        let values: Vec<u8> = (0..CAP as u64 / 8).flat_map(|i| (i + 1).to_le_bytes()).collect();
        src.write(0, &values).unwrap();
        p.bs.barrier().unwrap();
        if r.rank == 0 {
            for i in 0..N {
                p.conn.write(&p.remote, (i % SLOTS) * 8, src.memory(), i * 8, 8).unwrap();
                p.sem.signal().unwrap();
                if (i + 1) % HOST_EVERY == 0 {
                    p.conn.atomic_add(&remote_flag, 0, 1).unwrap();
                }
                if i % WORD_EVERY == 0 {
                    let word = WORDS + i / WORD_EVERY * 8;
                    p.conn.atomic_add(&p.remote, word, 1).unwrap();
                    p.conn.write(&p.remote, word, src.memory(), i * 8, 8).unwrap();
                    p.conn.atomic_add(&p.remote, word, 1).unwrap();
                }
            }
            p.conn.flush(T).unwrap();
        } else {
            let counts0 = mscclpp::bench::ethernet_staging_counts();
            let t0 = Instant::now();
            let mut looks = 0u64;
            let mut slots = vec![0u8; (SLOTS * 8) as usize];
            loop {
                let mut b = [0u8; 8];
                flag.read(0, &mut b).unwrap();
                let f = u64::from_le_bytes(b);
                let t = p.sem.inbound_token().unwrap();
                assert!(t >= f * HOST_EVERY, "host word {f} visible before signal {} (token {t})", f * HOST_EVERY);
                p.local.read(0, &mut slots).unwrap();
                for s in 0..SLOTS.min(t) {
                    // The last write to slot s before signal t (round i wrote value i + 1).
                    let last = s + SLOTS * ((t - 1 - s) / SLOTS);
                    let got = u64::from_le_bytes(slots[(s * 8) as usize..(s * 8 + 8) as usize].try_into().unwrap());
                    assert!(
                        got > last && got % SLOTS == (s + 1) % SLOTS,
                        "token {t}: slot {s} holds {got}, not yet round {last}'s write (value {})",
                        last + 1
                    );
                }
                looks += 1;
                if t == N && f == N / HOST_EVERY {
                    break;
                }
                assert!(t <= N, "token {t} past the {N} signals sent");
                assert!(t0.elapsed() < T, "after {:?}: token {t} of {N}, host word {f}", t0.elapsed());
            }
            let c = mscclpp::bench::ethernet_staging_counts();
            // Every signal and every add into GPU memory went through the receiver's token path.
            assert_eq!(c.gpu_tokens - counts0.gpu_tokens, N + 2 * N / WORD_EVERY, "GPU tokens counted");
            println!(
                "RESULT {N} signals behind writes: all seen in order in {:?} ({looks} looks); {} GPU tokens applied in {} \
                 rounds, {:.1} us of waiting a round",
                t0.elapsed(),
                c.gpu_tokens - counts0.gpu_tokens,
                c.token_rounds - counts0.token_rounds,
                (c.token_wait - counts0.token_wait).as_secs_f64() * 1e6
                    / (c.token_rounds - counts0.token_rounds).max(1) as f64
            );
        }
        p.bs.barrier().unwrap();
        if r.rank == 1 {
            let mut words = vec![0u8; (N / WORD_EVERY * 8) as usize];
            p.local.read(WORDS as usize, &mut words).unwrap();
            for (j, w) in words.chunks_exact(8).enumerate() {
                let i = j as u64 * WORD_EVERY;
                let got = u64::from_le_bytes(w.try_into().unwrap());
                assert_eq!(got, i + 2, "round {i}'s GPU word: its write (value {}) then one add", i + 1);
            }
        }
        p.bs.barrier().unwrap();
        return;
    }
    let job = spawn_ranks("ethernet_tokens_behind_each_other_keep_their_order_and_promises", 2, &[]);
    job.assert_success();
    job.relay_results();
    assert!(job.stdout(1).contains("RESULT"), "rank 1 never reached its checks:\n{}", job.stdout(1));
}

/// Host2DeviceSemaphore signalled over CUDA IPC and over Ethernet: the GPU token counts the
/// signals and the handle points at it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn host_to_device_semaphore_over_ipc_and_ethernet() {
    if let Some(r) = Rank::from_env() {
        let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
        for cfg in [ipc_cfg(gpu_for(r.rank)), eth_gpu_cfg(gpu_for(r.rank))] {
            let t = cfg.transport;
            let p = common::gpu::pair(bs.clone(), r.rank, cfg, 4096);
            if r.rank == 0 {
                for _ in 0..5 {
                    p.sem.signal().unwrap();
                }
                p.conn.flush(T).unwrap();
            } else {
                for _ in 0..5 {
                    p.sem.wait(T).unwrap();
                }
                assert_eq!(p.sem.inbound_token().unwrap(), 5, "{t}");
                let h = p.sem.device_handle();
                assert_ne!(h.inbound_token, 0);
                assert_ne!(h.inbound_token, h.expected_inbound_token);
                let e = p.sem.wait(Duration::from_millis(50)).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
                println!("RESULT H2D semaphore over {t}: 5 signals seen; extra wait: {e}");
            }
            p.bs.barrier().unwrap();
        }
        return;
    }
    spawn_ranks("host_to_device_semaphore_over_ipc_and_ethernet", 2, &[]).assert_success();
}

/// Probe for the slow small GPU writes over Ethernet (~0.4 ms per round trip with two processes
/// on one GPU): a TCP ping-pong of 8 bytes between the two processes, plain, then with each hop
/// passing the bytes through GPU memory (an 8-byte host-to-device and device-to-host copy in the
/// process that holds the ball), then with only rank 0 doing the copies. Asserts the bytes that
/// went through the GPU; prints the medians for the note (times are measured, never asserted).
#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_two_processes_taking_turns_on_one_gpu() {
    use std::io::{Read, Write};
    if let Some(r) = Rank::from_env() {
        let bs = r.bootstrap(Duration::from_secs(30));
        let ctx = mscclpp::Context::new();
        let buf = mscclpp::gpu::DeviceBuffer::new(&ctx, gpu_for(r.rank), 8, mscclpp::TransportFlags::NONE).unwrap();
        let mut sock = if r.rank == 0 {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            bs.send(1, 5, l.local_addr().unwrap().to_string().as_bytes()).unwrap();
            l.accept().unwrap().0
        } else {
            let a = String::from_utf8(bs.recv(0, 5).unwrap()).unwrap();
            std::net::TcpStream::connect(a).unwrap()
        };
        sock.set_nodelay(true).unwrap();
        let mut rtts = Vec::new();
        for (mode, who) in
            [("plain TCP", [false, false]), ("both through the GPU", [true, true]), ("rank 0 only", [true, false])]
        {
            let gpu = who[r.rank];
            let mut v = Vec::new();
            for i in 0..400u64 {
                let t0 = Instant::now();
                let mut ball = [0u8; 8];
                if r.rank == 0 {
                    ball = i.to_le_bytes();
                    sock.write_all(&ball).unwrap();
                    sock.read_exact(&mut ball).unwrap();
                } else {
                    sock.read_exact(&mut ball).unwrap();
                }
                if gpu {
                    buf.write(0, &ball).unwrap();
                    ball = buf.read_u64(0).unwrap().to_le_bytes();
                }
                assert_eq!(u64::from_le_bytes(ball), i, "the ball changed on its way ({mode})");
                if r.rank == 1 {
                    sock.write_all(&ball).unwrap();
                }
                v.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            v.sort_by(|a, b| a.total_cmp(b));
            rtts.push((mode, v[v.len() / 2]));
        }
        if r.rank == 0 {
            for (mode, us) in rtts {
                println!("PROBE 8-byte round trip, {mode}: {us:.1} us (median of 400)");
            }
        }
        bs.barrier().unwrap();
        return;
    }
    let job = spawn_ranks("probe_two_processes_taking_turns_on_one_gpu", 2, &[]);
    job.assert_success();
    for l in job.stdout(0).lines().filter_map(|l| l.find("PROBE").map(|i| &l[i..])) {
        println!("{l}");
    }
}

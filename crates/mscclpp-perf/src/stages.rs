//! `mscclpp-perf device`, where a PortChannel hop's time goes (issue 25 item 2).
//!
//! Two ranks of this process ping-pong 4-byte `putWithSignal` triggers over CUDA IPC, as the
//! PortChannel ping-pong row does without its flush, but each rank's FIFO is served by an
//! instrumented proxy ([`StageHandler`]: the built-in handler's calls for one `putWithSignal`,
//! `Connection::write` then the semaphore's `update_and_sync`, with a host timestamp before,
//! between and after them) and the kernels stamp `%globaltimer` around each push and wait. One
//! hop from the pushing kernel to the peer's returning wait is cut into five contiguous stages:
//!
//! | stage | from | to | clock |
//! |---|---|---|---|
//! | push | push called | push returned | GPU |
//! | pickup | push returned | the proxy has the trigger | GPU -> host |
//! | copy issue | (proxy) | `Connection::write` returned | host |
//! | token issue | | `update_and_sync` returned | host |
//! | land + poll | | the peer's wait returned | host -> GPU |
//!
//! Their sum is the hop, measured on the GPU clock alone. The two stages that cross clocks use
//! an offset between the host clock and `%globaltimer` estimated NTP-style (a kernel and a host
//! thread bounce a counter through mapped host memory; the offset is the midpoint of the
//! fastest bounces), so each of them is uncertain by up to half the fastest bounce (printed);
//! their sum is not.
//!
//! The instrumented handler makes the built-in handler's connection calls for a
//! `putWithSignal` in the same order, with one difference: it signals at once, inside the
//! trigger's handling, where the built-in handler owes the signal until the batch ends (a
//! nanosecond-scale step later for a lone trigger, as here).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mscclpp::device::compile::Kernel;
use mscclpp::device::fifo::Fifo;
use mscclpp::device::proxy::{HandlerResult, Proxy, ProxyHandler, ProxyOptions, TriggerContext};
use mscclpp::device::trigger::{ProxyTrigger, Request, decode};
use mscclpp::gpu::{PinnedBuffer, Stream};
use mscclpp::{Connection, DeviceBuffer, Host2DeviceSemaphore, RegisteredMemory, TransportFlags};

use crate::kern::{args, clear, e, elapsed_ns, launch, row};

/// Rounds of the ping-pong (the first [`SKIP`] are not counted).
const ROUNDS: usize = 10_000;
const SKIP: usize = 200;
/// Counter bounces of the clock calibration.
const BOUNCES: usize = 4000;

/// Host timestamps of one trigger (ns since the run's base instant): the handler got it, the
/// copy was issued, the token write was issued.
type HostStamps = [u64; 3];

/// The instrumented proxy handler: one connection, one destination, one source, one semaphore.
pub(crate) struct StageHandler {
    conn: Connection,
    dst: RegisteredMemory,
    src: RegisteredMemory,
    sem: Host2DeviceSemaphore,
    base: Instant,
    log: Vec<HostStamps>,
    out: Arc<Mutex<Vec<HostStamps>>>,
}

impl StageHandler {
    fn ns(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }
}

impl ProxyHandler for StageHandler {
    fn handle(&mut self, trigger: ProxyTrigger, _cx: &TriggerContext<'_>) -> mscclpp::Result<HandlerResult> {
        let got = self.ns();
        let Request::Ops { put, signal, .. } = decode(trigger)? else {
            return Err(mscclpp::Error::invalid_usage("the stage proxy serves put and signal triggers only"));
        };
        if let Some(p) = put {
            self.conn.write(&self.dst, p.dst_off as u64, &self.src, p.src_off as u64, p.size as u64)?;
        }
        let written = self.ns();
        if signal {
            self.sem.signal()?;
        }
        let signalled = self.ns();
        if self.log.len() < self.log.capacity() {
            self.log.push([got, written, signalled]);
        }
        Ok(HandlerResult::Continue)
    }

    fn close(&mut self) -> mscclpp::Result<()> {
        if let Ok(mut out) = self.out.lock() {
            *out = std::mem::take(&mut self.log);
        }
        Ok(())
    }
}

/// One rank's part: its connection to the peer, the peer's buffer, its own source, and a
/// semaphore of its own (fresh: its counts start at zero).
pub(crate) struct StageRank<'a> {
    pub conn: &'a Connection,
    pub remote: &'a RegisteredMemory,
    pub src: &'a RegisteredMemory,
    pub sem: Host2DeviceSemaphore,
}

/// Kernels: `clock_echo`, `stage_ping`, `stage_pong` (in `device.rs`'s source).
pub(crate) struct StageKernels<'a> {
    pub echo: &'a Kernel,
    pub ping: &'a Kernel,
    pub pong: &'a Kernel,
}

/// The host clock minus the GPU clock, and the uncertainty of that estimate (ns), from
/// bounces `(gpu_sent, gpu_back, host_seen)`: the midpoint of the fastest tenth of the bounces
/// (their median offset), uncertain by half the slowest of that tenth (plus a step of the
/// GPU clock, printed beside it). `None` without bounces.
pub(crate) fn clock_offset(bounces: &[(u64, u64, u64)]) -> Option<(i64, u64)> {
    let mut by_rtt: Vec<(u64, i64)> = bounces
        .iter()
        .filter(|(a, b, _)| b >= a)
        .map(|&(a, b, h)| (b - a, h as i64 - (a / 2 + b / 2 + (a % 2 + b % 2) / 2) as i64))
        .collect();
    if by_rtt.is_empty() {
        return None;
    }
    by_rtt.sort_unstable();
    let keep = (by_rtt.len() / 10).max(1);
    let mut offs: Vec<i64> = by_rtt[..keep].iter().map(|&(_, o)| o).collect();
    offs.sort_unstable();
    // The median's bounce may be any of those kept: bound it by the slowest of them.
    Some((offs[offs.len() / 2], by_rtt[keep - 1].0.div_ceil(2)))
}

/// One hop's stages in ns (see the module documentation), from the pushing kernel's
/// `(push called, push returned)`, the proxy's host stamps and the peer's wait return, with
/// `offset` = host clock - GPU clock. Negative spans (clock offset error) are kept: averages
/// stay unbiased.
pub(crate) fn hop(push: (u64, u64), host: HostStamps, seen: u64, offset: i64) -> [f64; 6] {
    // In integers relative to the push's start: %globaltimer counts nanoseconds since the epoch
    // (~1.7e18), where an f64 steps by 256 ns.
    let a = push.0 as i64;
    let gpu = |g: u64| (g as i64).wrapping_sub(a) as f64;
    let host_at = |h: u64| (h as i64).wrapping_sub(offset).wrapping_sub(a) as f64;
    let (b, got, written, signalled, seen) =
        (gpu(push.1), host_at(host[0]), host_at(host[1]), host_at(host[2]), gpu(seen));
    [b, got - b, written - got, signalled - written, seen - signalled, seen]
}

/// The names of [`hop`]'s stages, with the clocks they are read on.
pub(crate) const STAGES: [&str; 6] = [
    "push (GPU)",
    "push -> proxy has the trigger (GPU -> host)",
    "proxy: Connection::write issued (host)",
    "proxy: update_and_sync issued (host)",
    "token issued -> peer's wait returns (host -> GPU)",
    "one hop, total (GPU)",
];

/// Mean and median of each column.
pub(crate) fn summarize(hops: &[[f64; 6]]) -> Vec<(f64, f64)> {
    (0..6)
        .map(|k| {
            let mut v: Vec<f64> = hops.iter().map(|h| h[k]).collect();
            v.sort_by(f64::total_cmp);
            let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
            (mean, v.get(v.len() / 2).copied().unwrap_or(f64::NAN))
        })
        .collect()
}

/// Runs the calibration and the instrumented ping-pong on `dev`; prints the stage table.
/// `builtin_rtt_us`: the built-in proxy's ping-pong without a flush, measured before in this run.
pub(crate) fn run(
    dev: u32,
    ctx: &mscclpp::Context,
    k: &StageKernels<'_>,
    ranks: [StageRank<'_>; 2],
    builtin_rtt_us: f64,
    timeout: Duration,
) -> Result<(), String> {
    let tns = timeout.as_nanos() as u64;
    let base = Instant::now();
    let ns = || base.elapsed().as_nanos() as u64;

    // 1. The clock offset: the kernel writes i to d2h and waits for i in h2d; the host thread
    // stamps the moment it sees i and answers.
    let words = PinnedBuffer::new(ctx, dev, 64, TransportFlags::NONE).map_err(e)?;
    let stamps = DeviceBuffer::new(ctx, dev, BOUNCES * 16, TransportFlags::NONE).map_err(e)?;
    let out = DeviceBuffer::new(ctx, dev, 24, TransportFlags::NONE).map_err(e)?;
    clear(&out)?;
    let stream = Stream::new(dev).map_err(e)?;
    let (d2h, h2d) = (words.atomic_u64(0).map_err(e)?, words.atomic_u64(8).map_err(e)?);
    let (mut p_d2h, mut p_h2d) = (words.as_ptr() as u64, words.as_ptr() as u64 + 8);
    let (mut n, mut t, mut st, mut o) = (BOUNCES as i32, tns, stamps.device_ptr(), out.device_ptr());
    launch(k.echo, 1, 1, &stream, &mut args![p_d2h, p_h2d, n, t, st, o])?;
    let mut host = Vec::with_capacity(BOUNCES);
    let deadline = Instant::now() + timeout;
    for i in 1..=BOUNCES as u64 {
        // Acquire/Release: the GPU's volatile store and load of mapped memory; the orderings
        // only keep the host side from reordering its stamp around the load and the store.
        while d2h.load(Ordering::Acquire) < i {
            if Instant::now() > deadline {
                return Err("clock calibration: the kernel stopped answering".into());
            }
            std::hint::spin_loop();
        }
        host.push(ns());
        h2d.store(i, Ordering::Release);
    }
    stream.synchronize(timeout * 2).map_err(e)?;
    if out.read_u64(8).map_err(e)? != 0 {
        return Err("clock calibration: the kernel's wait timed out".into());
    }
    let step = out.read_u64(16).map_err(e)?;
    let gpu = read_u64s(&stamps, BOUNCES * 2)?;
    let bounces: Vec<(u64, u64, u64)> = (0..BOUNCES).map(|i| (gpu[2 * i], gpu[2 * i + 1], host[i])).collect();
    let (offset, unc) = clock_offset(&bounces).ok_or("clock calibration: no bounce")?;

    // 2. The instrumented ping-pong: a FIFO and a stage proxy per rank.
    let mut proxies = Vec::new();
    let mut fifos = Vec::new();
    let mut logs = Vec::new();
    let mut sem_handles = Vec::new();
    for r in ranks {
        let fifo = Arc::new(Fifo::new(ctx, dev, 512).map_err(e)?);
        let log = Arc::new(Mutex::new(Vec::new()));
        sem_handles.push(r.sem.device_handle());
        let handler = StageHandler {
            conn: r.conn.clone(),
            dst: r.remote.clone(),
            src: r.src.clone(),
            sem: r.sem,
            base,
            log: Vec::with_capacity(ROUNDS),
            out: log.clone(),
        };
        let opts = ProxyOptions { device: Some(dev), idle_backoff: false };
        proxies.push(Proxy::start(fifo.clone(), handler, opts).map_err(e)?);
        fifos.push(fifo);
        logs.push(log);
    }
    let streams = [Stream::new(dev).map_err(e)?, Stream::new(dev).map_err(e)?];
    let outs = [
        DeviceBuffer::new(ctx, dev, 16, TransportFlags::NONE).map_err(e)?,
        DeviceBuffer::new(ctx, dev, 16, TransportFlags::NONE).map_err(e)?,
    ];
    let times = [
        DeviceBuffer::new(ctx, dev, ROUNDS * 24, TransportFlags::NONE).map_err(e)?,
        DeviceBuffer::new(ctx, dev, ROUNDS * 24, TransportFlags::NONE).map_err(e)?,
    ];
    for i in 0..2 {
        clear(&outs[i])?;
        let kern = if i == 0 { k.ping } else { k.pong };
        let (mut f, mut s, mut sz, mut n, mut t, mut ts, mut o) = (
            fifos[i].device_handle(),
            sem_handles[i],
            4u64,
            ROUNDS as i32,
            tns,
            times[i].device_ptr(),
            outs[i].device_ptr(),
        );
        launch(kern, 1, 1, &streams[i], &mut args![f, s, sz, n, t, ts, o])?;
    }
    // Longer than the kernels' own limit, so that a stuck wait reports from the kernel and
    // nothing is freed under a running kernel.
    for s in &streams {
        s.synchronize(timeout * 2).map_err(e)?;
    }
    let rtt = elapsed_ns(&outs[0], "stage ping")? / 1e3 / ROUNDS as f64;
    elapsed_ns(&outs[1], "stage pong")?;
    for mut p in proxies {
        p.stop().map_err(e)?;
    }
    let host: Vec<Vec<HostStamps>> = logs.iter().map(|l| l.lock().map(|v| v.clone()).unwrap_or_default()).collect();
    if host.iter().any(|h| h.len() < ROUNDS) {
        return Err(format!(
            "stage proxies logged {} and {} triggers, not {ROUNDS} each",
            host[0].len(),
            host[1].len()
        ));
    }
    // ping: (push called, push returned, wait returned); pong: (wait returned, push called,
    // push returned), per round.
    let ping = read_u64s(&times[0], ROUNDS * 3)?;
    let pong = read_u64s(&times[1], ROUNDS * 3)?;
    let mut hops = Vec::with_capacity(2 * ROUNDS);
    for i in SKIP..ROUNDS {
        let p = &ping[3 * i..3 * i + 3];
        let q = &pong[3 * i..3 * i + 3];
        hops.push(hop((p[0], p[1]), host[0][i], q[0], offset));
        hops.push(hop((q[1], q[2]), host[1][i], p[2], offset));
    }
    let sum = summarize(&hops);
    row(format!(
        "PortChannel hop, where the time goes (4 B putWithSignal, CUDA IPC, no flush; instrumented proxy; {} hops; \
         globaltimer step {step} ns; host/GPU clock offset +-{:.2} us):",
        hops.len(),
        unc as f64 / 1e3
    ));
    row(format!("  {:<52} {:>9} {:>9}", "stage", "mean us", "median us"));
    for (name, (mean, median)) in STAGES.iter().zip(&sum) {
        row(format!("  {name:<52} {:>9.3} {:>9.3}", mean / 1e3, median / 1e3));
    }
    row(format!(
        "  round trip: {rtt:.2} us with the instrumented proxy; {builtin_rtt_us:.2} us with the built-in proxy (no flush, same run)"
    ));
    Ok(())
}

/// The first `n` little-endian u64 of `b`.
fn read_u64s(b: &DeviceBuffer, n: usize) -> Result<Vec<u64>, String> {
    let mut bytes = vec![0u8; n * 8];
    b.read(0, &mut bytes).map_err(e)?;
    Ok(bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_offset_is_the_midpoint_of_the_fastest_bounces() {
        // Host clock = GPU clock + 5000 ns. Most bounces are slow and lopsided (the host saw the
        // counter late); the fastest are symmetric around the host's stamp.
        let mut b = Vec::new();
        for i in 0..100u64 {
            let a = 1_000_000 + i * 10_000;
            if i % 10 == 0 {
                b.push((a, a + 800, a + 400 + 5000));
            } else {
                b.push((a, a + 3000 + i, a + 2500 + 5000));
            }
        }
        let (off, unc) = clock_offset(&b).unwrap();
        assert_eq!(off, 5000);
        assert_eq!(unc, 400);
        assert_eq!(clock_offset(&[]), None);
        // A bounce whose return precedes its send (a broken stamp) is ignored.
        assert_eq!(clock_offset(&[(10, 5, 7)]), None);
    }

    #[test]
    fn a_hop_is_cut_into_contiguous_stages_that_add_up() {
        // GPU: push 100..350, the peer's wait returns at 9100. Host (offset 1000): got 1400,
        // written 3400, signalled 4400, i.e. GPU 400, 2400, 3400.
        let h = hop((100, 350), [1400, 3400, 4400], 9100, 1000);
        assert_eq!(h, [250.0, 50.0, 2000.0, 1000.0, 5700.0, 9000.0]);
        assert_eq!(h[..5].iter().sum::<f64>(), h[5]);
        // Real %globaltimer values (ns since the epoch) keep nanosecond resolution.
        let t = 1_764_900_000_123_456_789u64;
        let big = hop((t + 100, t + 350), [t + 1400, t + 3400, t + 4400], t + 9100, 1000);
        assert_eq!(big, [250.0, 50.0, 2000.0, 1000.0, 5700.0, 9000.0]);
        let s = summarize(&[h, [1.0, 2.0, 3.0, 4.0, 5.0, 15.0], [7.0; 6]]);
        assert_eq!(s[0].1, 7.0, "median of 250, 1, 7");
        assert_eq!(s[5].0, (9000.0 + 15.0 + 7.0) / 3.0);
    }
}

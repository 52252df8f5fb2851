//! What the device benchmarks (`device.rs`, `memchan.rs`, `procs.rs`) share: error text,
//! kernel arguments, launches and row printing.

use std::io::Write;

use mscclpp::device::compile::Kernel;
use mscclpp::gpu::Stream;

/// Any error as the benchmark's error text.
pub(crate) fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// Kernel arguments: the address of each (mutable) local, as `Kernel::launch` takes them.
macro_rules! args {
    ($($a:expr),* $(,)?) => { [$( (&mut $a) as *mut _ as *mut std::ffi::c_void ),*] };
}
pub(crate) use args;

/// Launches `k` on a 1-D grid.
pub(crate) fn launch(
    k: &Kernel,
    grid: u32,
    block: u32,
    stream: &Stream,
    args: &mut [*mut std::ffi::c_void],
) -> Result<(), String> {
    // SAFETY: each call passes arguments matching its kernel's parameters: values, or device
    // addresses of buffers that stay alive until the stream is synchronized below them.
    unsafe { k.launch((grid, 1, 1), (block, 1, 1), 0, stream, args) }.map_err(e)
}

/// Prints a row now (rows appear as they finish, also through a pipe).
pub(crate) fn row(s: String) {
    println!("{s}");
    let _ = std::io::stdout().flush();
}

/// `1 KiB`, `64 MiB`, `1 GiB`.
pub(crate) fn human(n: usize) -> String {
    match n {
        n if n >= 1 << 30 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

/// Zeroes a kernel's 16-byte result (`out[0]` = elapsed ns, `out[1]` = timed out) before a launch.
pub(crate) fn clear(out: &mscclpp::DeviceBuffer) -> Result<(), String> {
    out.fill(0, 16, 0).map_err(e)
}

/// A kernel's elapsed ns (`out[0]`) once it ran; an error naming `what` if it reported a
/// timed-out wait or flush (`out[1]`).
pub(crate) fn elapsed_ns(out: &mscclpp::DeviceBuffer, what: &str) -> Result<f64, String> {
    if out.read_u64(8).map_err(e)? != 0 {
        return Err(format!("{what}: a device wait or flush timed out (peer or proxy not answering)"));
    }
    Ok(out.read_u64(0).map_err(e)? as f64)
}

/// Two ranks of this process (threads joined by a loopback bootstrap, waits bounded by
/// `timeout`): runs `setup(rank, bootstrap)` on each and returns their results in rank order.
pub(crate) fn two_local_ranks<T: Send>(
    timeout: std::time::Duration,
    setup: impl Fn(usize, std::sync::Arc<dyn mscclpp::Bootstrap>) -> Result<T, String> + Sync,
) -> Result<Vec<T>, String> {
    local_ranks(2, timeout, setup)
}

/// `n` ranks of this process (threads joined by a loopback bootstrap, waits bounded by
/// `timeout`): runs `setup(rank, bootstrap)` on each and returns their results in rank order,
/// or every failed rank's error (in rank order, one per line).
pub(crate) fn local_ranks<T: Send>(
    n: usize,
    timeout: std::time::Duration,
    setup: impl Fn(usize, std::sync::Arc<dyn mscclpp::Bootstrap>) -> Result<T, String> + Sync,
) -> Result<Vec<T>, String> {
    let (root, id) = mscclpp::RootServer::start(n, timeout).map_err(e)?;
    let setup = &setup;
    let ranks = std::thread::scope(|sc| {
        // Says where every rank is when none moves on for a while (crate::watch).
        let watch = crate::watch::Watch::start(sc, n, crate::watch::limit_for(timeout));
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let id = id.clone();
                sc.spawn(move || -> Result<T, String> {
                    // What the watcher shows once this thread is done (a panic unwinds through it).
                    struct Done(usize, &'static str);
                    impl Drop for Done {
                        fn drop(&mut self) {
                            crate::watch::set(self.0, self.1);
                        }
                    }
                    let mut done = Done(rank, "panicked");
                    let r = mscclpp::TcpBootstrap::config(rank, n)
                        .timeout(timeout)
                        .initialize(&id)
                        .map_err(e)
                        .and_then(|bs| setup(rank, std::sync::Arc::new(bs)));
                    done.1 = if r.is_ok() { "returned" } else { "returned an error (printed at the end)" };
                    r
                })
            })
            .collect();
        // Join every thread before looking at any result; every failed rank's error is kept (the
        // first one is often the cause, the others' timeouts its consequence).
        let mut ok = Vec::with_capacity(n);
        let mut errs = Vec::new();
        for h in hs {
            match h.join() {
                Ok(Ok(t)) => ok.push(t),
                Ok(Err(m)) => errs.push(m),
                Err(_) => errs.push("a rank thread panicked".to_string()),
            }
        }
        drop(watch);
        if errs.is_empty() { Ok(ok) } else { Err(errs.join("\n  ")) }
    })?;
    drop(root);
    Ok(ranks)
}

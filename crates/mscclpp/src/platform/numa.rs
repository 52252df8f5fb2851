//! NUMA: which node a PCI device sits on, and binding the calling thread to a node's CPUs.

use crate::error::{Error, ErrorKind, Result};

/// Parses a Linux cpulist such as `0-3,8,10-11`.
pub(crate) fn parse_cpulist(s: &str) -> Result<Vec<usize>> {
    let mut v = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let bad = || Error::internal(format!("malformed cpulist {s:?}"));
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if b < a || b - a > 65536 {
                    return Err(bad());
                }
                v.extend(a..=b);
            }
            None => v.push(part.parse().map_err(|_| bad())?),
        }
    }
    Ok(v)
}

/// The NUMA node of a PCI device given its bus id (`0000:17:00.0`), or `None` when the system
/// does not say (`-1` or no sysfs entry).
pub fn pci_numa_node(bus_id: &str) -> Option<u32> {
    let p = format!("/sys/bus/pci/devices/{}/numa_node", bus_id.to_ascii_lowercase());
    std::fs::read_to_string(p).ok()?.trim().parse::<i32>().ok().and_then(|n| u32::try_from(n).ok())
}

/// Binds the calling thread to the CPUs of NUMA node `node`.
pub fn bind_thread_to_node(node: u32) -> Result<()> {
    bind_thread_to_cpus(&node_cpus(node)?).map_err(|e| e.during(format!("binding to NUMA node {node}")))
}

/// The CPUs of NUMA node `node`.
fn node_cpus(node: u32) -> Result<Vec<usize>> {
    let list = std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist"))
        .map_err(|e| Error::io(format!("reading the CPU list of NUMA node {node}"), e))?;
    parse_cpulist(&list)
}

/// Binds the calling thread to `cpus`.
fn bind_thread_to_cpus(cpus: &[usize]) -> Result<()> {
    let mut set = nix::sched::CpuSet::new();
    for &c in cpus {
        set.set(c).map_err(|e| Error::new(ErrorKind::System, format!("cpu {c} out of range: {e}")))?;
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .map_err(|e| Error::new(ErrorKind::System, format!("sched_setaffinity failed: {e}")))
}

/// How many NUMA nodes the system lists (`/sys/devices/system/node/nodeN`); 0 when it does not
/// say.
pub fn numa_node_count() -> usize {
    std::fs::read_dir("/sys/devices/system/node").map_or(0, |d| {
        d.filter_map(|e| e.ok())
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.strip_prefix("node").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
            .count()
    })
}

/// Runs `f` on a short-lived thread bound to the CPUs of NUMA node `node` and returns its
/// result, so that memory `f` allocates and touches first lands on that node, while the calling
/// thread's own binding stays as it was. Where the binding fails, `f` still runs on that thread
/// (the memory is then placed as the kernel likes; logged at debug level).
///
/// # Errors
/// `f`'s error; `Internal` when `f` panics.
pub(crate) fn run_on_node<T: Send>(node: u32, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let cpus = node_cpus(node).unwrap_or_else(|e| {
        tracing::debug!(target: "mscclpp::gpu", "allocating without NUMA placement: {e}");
        Vec::new()
    });
    run_on_cpus(&cpus, f).map_err(|e| e.during(format!("allocating on NUMA node {node}")))
}

/// [`run_on_node`] with the CPUs given (none: no binding).
fn run_on_cpus<T: Send>(cpus: &[usize], f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(move || {
            if !cpus.is_empty()
                && let Err(e) = bind_thread_to_cpus(cpus)
            {
                tracing::debug!(target: "mscclpp::gpu", "allocating without NUMA placement: {e}");
            }
            f()
        })
        .join()
        .map_err(|_| Error::internal("the thread allocating memory panicked"))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n").unwrap(), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist("").unwrap(), Vec::<usize>::new());
        assert!(parse_cpulist("3-1").is_err());
        assert!(parse_cpulist("a").is_err());
    }

    #[test]
    fn bind_to_node0_where_it_exists() {
        if std::path::Path::new("/sys/devices/system/node/node0/cpulist").exists() {
            bind_thread_to_node(0).unwrap();
        }
        assert!(bind_thread_to_node(4096).is_err());
        assert_eq!(pci_numa_node("ffff:ff:ff.f"), None);
    }

    /// The closure runs on a thread bound to the CPUs given; the caller's binding is untouched;
    /// an unknown node still runs the closure; its error comes back with context.
    #[test]
    fn run_on_cpus_binds_a_helper_thread_only() {
        let affinity = || -> Result<Vec<usize>> {
            let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
                .map_err(|e| Error::new(ErrorKind::System, e.to_string()))?;
            Ok((0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect())
        };
        let before = affinity().unwrap();
        let first = before[0];
        assert_eq!(run_on_cpus(&[first], affinity).unwrap(), vec![first]);
        assert_eq!(affinity().unwrap(), before, "the caller's binding changed");
        assert_eq!(run_on_cpus(&[], affinity).unwrap(), before, "no CPUs: no binding");
        assert_eq!(run_on_node(4096, || Ok(7)).unwrap(), 7);
        let e = run_on_node(0, || -> Result<()> { Err(Error::internal("from f")) }).unwrap_err();
        assert!(e.to_string().contains("from f") && e.to_string().contains("NUMA node 0"), "{e}");
        if std::path::Path::new("/sys/devices/system/node/node0").exists() {
            assert!(numa_node_count() >= 1);
        }
    }
}

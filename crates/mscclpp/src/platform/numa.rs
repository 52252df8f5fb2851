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
    let list = std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist"))
        .map_err(|e| Error::io(format!("reading the CPU list of NUMA node {node}"), e))?;
    let cpus = parse_cpulist(&list)?;
    let mut set = nix::sched::CpuSet::new();
    for c in cpus {
        set.set(c).map_err(|e| Error::new(ErrorKind::System, format!("cpu {c} out of range: {e}")))?;
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .map_err(|e| Error::new(ErrorKind::System, format!("sched_setaffinity to node {node} failed: {e}")))
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
}

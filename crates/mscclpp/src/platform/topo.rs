//! Which RDMA NIC is closest to a GPU, from the PCIe tree in sysfs.
//!
//! Both devices resolve to their place in `/sys/devices` (a GPU through
//! `/sys/bus/pci/devices/<bus id>`, a NIC through `/sys/class/infiniband/<name>/device`). The
//! distance is the number of PCIe links from each up to their closest common ancestor: 2 under
//! one switch, more through the root complex, most across root complexes (NCCL's PIX, PXB, PHB,
//! SYS). Ties keep enumeration order. NICs without a PCIe path (soft-RoCE) come last.

use std::path::{Path, PathBuf};

/// A NIC with its distance to the GPU (`None`: not on the PCIe tree) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ranked {
    pub(crate) name: String,
    pub(crate) distance: Option<usize>,
    pub(crate) why: String,
}

fn resolve(p: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(p).ok()
}

/// The sysfs path of the PCI device `bus_id` (`0000:17:00.0`; case-insensitive).
pub(crate) fn pci_device(sysfs: &Path, bus_id: &str) -> Option<PathBuf> {
    resolve(&sysfs.join("bus/pci/devices").join(bus_id.to_ascii_lowercase()))
}

/// The sysfs path of the PCI function behind RDMA device `nic`.
pub(crate) fn nic_device(sysfs: &Path, nic: &str) -> Option<PathBuf> {
    resolve(&sysfs.join("class/infiniband").join(nic).join("device"))
}

/// Links from `a` and `b` up to their closest common ancestor, and that ancestor.
pub(crate) fn distance(a: &Path, b: &Path) -> (usize, PathBuf) {
    let ca: Vec<_> = a.components().collect();
    let cb: Vec<_> = b.components().collect();
    let common = ca.iter().zip(&cb).take_while(|(x, y)| x == y).count();
    let ancestor: PathBuf = ca[..common].iter().collect();
    (ca.len() - common + cb.len() - common, ancestor)
}

fn kind(d: usize, ancestor: &Path) -> &'static str {
    let top = ancestor.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if top.starts_with("pci") {
        "through the root complex"
    } else if top == "devices" || top.is_empty() {
        "across root complexes (through the CPU interconnect)"
    } else if d <= 2 {
        "under the same PCIe switch"
    } else {
        "through PCIe switches"
    }
}

/// `nics` ordered from closest to the GPU at `gpu_bus_id` to farthest, each with its reason.
pub(crate) fn rank_nics(sysfs: &Path, gpu_bus_id: &str, nics: &[String]) -> Vec<Ranked> {
    let gpu = pci_device(sysfs, gpu_bus_id);
    let mut v: Vec<(usize, Ranked)> = nics
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let r = match (&gpu, nic_device(sysfs, n)) {
                (Some(g), Some(p)) => {
                    let (d, anc) = distance(g, &p);
                    Ranked {
                        name: n.clone(),
                        distance: Some(d),
                        why: format!("{d} PCIe links from GPU {gpu_bus_id}, {} ({})", kind(d, &anc), anc.display()),
                    }
                }
                (None, _) => Ranked {
                    name: n.clone(),
                    distance: None,
                    why: format!("the GPU {gpu_bus_id} is not in {}", sysfs.join("bus/pci/devices").display()),
                },
                (_, None) => {
                    Ranked { name: n.clone(), distance: None, why: "not a PCIe device (software RDMA?)".to_string() }
                }
            };
            (i, r)
        })
        .collect();
    v.sort_by_key(|(i, r)| (r.distance.unwrap_or(usize::MAX), *i));
    v.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A sysfs tree: GPU 0000:02:00.0 under switch 0000:01:00.0 below root port 0000:00:01.0;
    /// nic_far on another root complex, nic_rc on another root port of the same root complex,
    /// nic_near beside the GPU under its switch, and soft0 with no PCIe device.
    fn tree() -> PathBuf {
        let root =
            std::env::temp_dir().join(format!("mscclpp-topo-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = std::fs::remove_dir_all(&root);
        let dev = |p: &str| {
            let d = root.join("devices").join(p);
            std::fs::create_dir_all(&d).unwrap();
            d
        };
        let gpu = dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0");
        let near = dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0");
        let rc = dev("pci0000:00/0000:00:02.0/0000:03:00.0");
        let far = dev("pci0000:80/0000:80:01.0/0000:81:00.0");
        std::fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
        symlink(&gpu, root.join("bus/pci/devices/0000:02:00.0")).unwrap();
        for (n, p) in [("nic_far", &far), ("nic_rc", &rc), ("nic_near", &near)] {
            std::fs::create_dir_all(root.join("class/infiniband").join(n)).unwrap();
            symlink(p, root.join("class/infiniband").join(n).join("device")).unwrap();
        }
        std::fs::create_dir_all(root.join("class/infiniband/soft0")).unwrap();
        root
    }

    #[test]
    fn closest_nic_first() {
        let root = tree();
        let nics: Vec<String> = ["soft0", "nic_far", "nic_rc", "nic_near"].iter().map(|s| s.to_string()).collect();
        let r = rank_nics(&root, "0000:02:00.0", &nics);
        let names: Vec<&str> = r.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(names, ["nic_near", "nic_rc", "nic_far", "soft0"]);
        assert_eq!(r[0].distance, Some(2));
        assert!(r[0].why.contains("same PCIe switch"), "{}", r[0].why);
        assert_eq!(r[1].distance, Some(5));
        assert!(r[1].why.contains("root complex"), "{}", r[1].why);
        assert_eq!(r[2].distance, Some(7));
        assert!(r[2].why.contains("across root complexes"), "{}", r[2].why);
        assert_eq!(r[3].distance, None);
        // Upper-case bus ids (as CUDA prints them) resolve too.
        assert_eq!(rank_nics(&root, "0000:02:00.0".to_uppercase().as_str(), &nics)[0].name, "nic_near");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn unknown_gpu_keeps_enumeration_order() {
        let root = tree();
        let nics: Vec<String> = ["nic_far", "nic_near"].iter().map(|s| s.to_string()).collect();
        let r = rank_nics(&root, "0000:99:00.0", &nics);
        assert_eq!(r.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(), ["nic_far", "nic_near"]);
        assert!(r[0].why.contains("not in"), "{}", r[0].why);
        std::fs::remove_dir_all(&root).unwrap();
    }
}

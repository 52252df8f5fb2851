//! The CUDA device header kernels include: its text, its name, where it lives, and its ABI
//! version.
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The device header's text (`include/mscclpp_rs/device.cuh` in this crate).
pub const DEVICE_HEADER: &str = include_str!("../../include/mscclpp_rs/device.cuh");

/// The name kernels include the header by.
pub const HEADER_NAME: &str = "mscclpp_rs/device.cuh";

/// The layout/protocol version of the header and these handles (`MSCCLPP_RS_ABI_VERSION`).
pub const ABI_VERSION: u32 = 1;

/// The crate's include directory at build time (holds `mscclpp_rs/device.cuh`); pass it to nvcc
/// as `-I`. It exists only where the crate's source does: otherwise use [`write_header`].
pub fn include_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/include"))
}

/// Writes the header to `dir/mscclpp_rs/device.cuh` (creating the directories) and returns that
/// path; `dir` is then an include directory for nvcc.
///
/// # Errors
/// `System` when the directory or file cannot be written.
pub fn write_header(dir: &Path) -> Result<PathBuf> {
    let path = dir.join(HEADER_NAME);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
    }
    std::fs::write(&path, DEVICE_HEADER).map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_abi_version_matches() {
        assert!(DEVICE_HEADER.contains(&format!("#define MSCCLPP_RS_ABI_VERSION {ABI_VERSION}\n")));
        // The file at include_dir()/HEADER_NAME, read when this test was built (so the test
        // passes wherever its binary runs): the path nvcc users get holds the embedded header.
        const AT_INCLUDE_DIR: &str =
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/include/mscclpp_rs/device.cuh"));
        assert_eq!(
            include_dir().join(HEADER_NAME),
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/include/mscclpp_rs/device.cuh"))
        );
        assert_eq!(AT_INCLUDE_DIR, DEVICE_HEADER);
    }

    #[test]
    fn write_header_writes_the_header() {
        let dir = std::env::temp_dir().join(format!("mscclpp-header-{}", std::process::id()));
        let p = write_header(&dir).unwrap();
        assert_eq!(p, dir.join("mscclpp_rs").join("device.cuh"));
        assert_eq!(std::fs::read_to_string(&p).unwrap(), DEVICE_HEADER);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

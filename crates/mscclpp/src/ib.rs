//! InfiniBand / RoCE: the public face of `platform::verbs` (libibverbs loaded at run time, the ABI
//! declared by hand) and, with the cargo feature `ib-fake`, an in-process test provider.

pub use crate::platform::verbs::devices;

/// The in-process verbs provider for tests (cargo feature `ib-fake`): RC semantics with real
/// memory effects inside one process, and fault injection. Nothing selects it but [`install`].
///
/// ```
/// # fn main() -> mscclpp::Result<()> {
/// mscclpp::ib::fake::install()?;
/// assert!(mscclpp::ib::devices()?.contains(&"fake0".to_string()));
/// # Ok(()) }
/// ```
#[cfg(feature = "ib-fake")]
pub mod fake {
    use crate::error::{Error, Result};
    pub use crate::platform::verbs::fake::{FakeStats, RETRY_WINDOW};

    /// Makes the test provider this process's verbs library. Call it before any IB use; a second
    /// call is a no-op. Fails when the real libibverbs was loaded first.
    pub fn install() -> Result<()> {
        crate::platform::verbs::install(crate::platform::verbs::fake::table())
    }

    /// Adds a fake RDMA device (two exist from the start: `fake0`, `fake1`). Use one per test
    /// to keep injected faults apart.
    pub fn add_device(name: &str) {
        crate::platform::verbs::fake::add_device(name)
    }

    /// Breaks (`true`) or mends the link of a fake device: work requests of its queue pairs get
    /// no answer and, after [`RETRY_WINDOW`], complete with "retry counter exceeded".
    pub fn set_link_broken(device: &str, broken: bool) -> Result<()> {
        known(device, crate::platform::verbs::fake::set_link_broken(device, broken))
    }

    /// Makes memory registration on a fake device fail (`true`), as on a machine where neither
    /// dma-buf nor nvidia-peermem can register GPU memory, or work again.
    pub fn set_refuse_registration(device: &str, refuse: bool) -> Result<()> {
        known(device, crate::platform::verbs::fake::set_refuse_registration(device, refuse))
    }

    /// Makes a fake device report RDMA atomics (`true`, the default) or none, as a NIC without
    /// them (IB endpoints then fall back to HostNoAtomic mode).
    pub fn set_atomics(device: &str, atomics: bool) -> Result<()> {
        known(device, crate::platform::verbs::fake::set_atomics(device, atomics))
    }

    fn known(device: &str, found: bool) -> Result<()> {
        if found { Ok(()) } else { Err(Error::invalid_usage(format!("no fake RDMA device {device:?}"))) }
    }

    /// Counters of the provider (CQ overflows, refused posts, ...).
    pub fn stats() -> FakeStats {
        crate::platform::verbs::fake::stats()
    }
}

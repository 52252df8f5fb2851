//! The IB transport on a real RDMA device (a NIC, or soft-RoCE `rxe0` in the qemu machine of
//! `scripts/rxe-vm.sh`), between processes: the shared connection suite. Ignored by default;
//! run with `--ignored` where `ibv_devices` lists a device (`MSCCLPP_HCA_DEVICES` picks it).

mod common;

use common::harnesses;
use common::suite::{Harness, Mode};
use mscclpp::{EndpointConfig, IbMode};

fn ib_config(queue: Option<usize>) -> EndpointConfig {
    let mut c = harnesses::ib_config(queue);
    // Lost packets are resent after ~67 ms (not ~1 s): a dead peer shows within a second.
    c.ib.timeout = 14;
    c
}

/// IB's capabilities as on the test provider, between processes on the machine's own device.
static RDMA: Harness =
    Harness { mode: Mode::Processes, prepare: |_| {}, ib_device: None, config: ib_config, ..harnesses::FAKE_IB };

connection_suite!(&RDMA, #[ignore = "needs an RDMA device"]);

fn no_atomic_config(queue: Option<usize>) -> EndpointConfig {
    let mut c = ib_config(queue);
    c.ib.mode = IbMode::HostNoAtomic;
    c
}

/// The suite in HostNoAtomic mode: every signal is a write-with-immediate that must land after
/// the writes before it, byte-exact.
mod no_atomic {
    use super::*;
    use crate::common;

    static RDMA_NO_ATOMIC: Harness = Harness { config: no_atomic_config, atomics: false, ..RDMA };

    connection_suite!(&RDMA_NO_ATOMIC, #[ignore = "needs an RDMA device"]);
}

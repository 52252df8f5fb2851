//! The transports under test that several test binaries share: Ethernet over loopback and IB on
//! the in-process test provider, with host memory. A binary that needs a variant takes one of
//! these and changes fields (`Harness { mode: Mode::Processes, ..ETHERNET }`).

use mscclpp::ib::fake;
use mscclpp::{Context, EndpointConfig, Transport};

use super::suite::{Harness, Memory, Mode};

/// Ethernet on 127.0.0.1 with an optional write-queue bound.
pub fn eth_config(queue: Option<usize>) -> EndpointConfig {
    let mut c = EndpointConfig::new(Transport::Ethernet).ethernet_interface("127.0.0.1");
    c.max_write_queue_size = queue;
    c
}

/// IB0 with an optional write-queue bound.
pub fn ib_config(queue: Option<usize>) -> EndpointConfig {
    let mut c = EndpointConfig::new(Transport::IB0);
    c.max_write_queue_size = queue;
    c
}

/// Installs the in-process IB test provider (its device `fake0`).
pub fn install_fake(_: &Context) {
    fake::install().unwrap();
}

/// Ethernet over loopback, host memory, ranks as threads of one process.
pub const ETHERNET: Harness = Harness {
    transport: Transport::Ethernet,
    mode: Mode::Threads,
    prepare: |_| {},
    ib_device: None,
    config: eth_config,
    atomics: true,
    cpu_atomics_coherent: true,
    memory: Memory::Host,
    detects_peer_gone: true,
    local_destination_allowed: false,
};

/// IB on the test provider's `fake0`, host memory, ranks as threads of one process.
pub const FAKE_IB: Harness = Harness {
    transport: Transport::IB0,
    mode: Mode::Threads,
    prepare: install_fake,
    ib_device: Some("fake0"),
    config: ib_config,
    atomics: true,
    cpu_atomics_coherent: false,
    memory: Memory::Host,
    detects_peer_gone: true,
    local_destination_allowed: false,
};

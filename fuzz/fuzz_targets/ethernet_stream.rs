//! `ethernet_stream` of `mscclpp::fuzzing`: arbitrary bytes from a peer, cut into pieces, fed to
//! the Ethernet receiver core (frames) or sender core (records): nothing panics, and nothing
//! outside registered memory is ever let through.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run ethernet_stream` (from the repository root, or `fuzz/`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| mscclpp::fuzzing::check("ethernet_stream", data));

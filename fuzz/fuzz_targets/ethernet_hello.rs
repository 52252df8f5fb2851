//! The `ethernet_hello` form of `mscclpp::fuzzing` (the Ethernet transport's peer-facing bytes): decoding
//! never panics, and what decodes re-encodes to the same bytes.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run ethernet_hello` (from the repository root, or `fuzz/`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| mscclpp::fuzzing::check("ethernet_hello", data));

//! `mscclpp::fuzzing::check("bootstrap_readiness", ..)`: decoding never panics and what decodes re-encodes the same.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run bootstrap_readiness` (from the repository root, or `fuzz/`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| mscclpp::fuzzing::check("bootstrap_readiness", data));

//! Fuzzes the `registered_memory` decoder: see `mscclpp::fuzzing::check`.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run registered_memory` (from the repository root, or `fuzz/`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mscclpp::fuzzing::check("registered_memory", data));

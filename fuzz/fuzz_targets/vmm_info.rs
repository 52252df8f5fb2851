//! Fuzzes the `vmm_info` decoder: see `mscclpp::fuzzing::check`.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run vmm_info` (from the repository root, or `fuzz/`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mscclpp::fuzzing::check("vmm_info", data));

//! Fuzzes the `text_specs` decoder: see `mscclpp::fuzzing::check`.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run text_specs` (from the repository root, or `fuzz/`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mscclpp::fuzzing::check("text_specs", data));

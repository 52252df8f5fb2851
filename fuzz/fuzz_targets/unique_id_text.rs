//! Fuzzes the `unique_id_text` decoder: see `mscclpp::fuzzing::check`.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run unique_id_text` (from the repository root, or `fuzz/`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mscclpp::fuzzing::check("unique_id_text", data));

//! Fuzzes the collectives' setup checks on peer messages: see `mscclpp_collectives::fuzz_check`
//! (no panic on any bytes; messages are accepted exactly when their agreements match).
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run collectives_setup` (from the repository root, or `fuzz/`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mscclpp_collectives::fuzz_check(data));

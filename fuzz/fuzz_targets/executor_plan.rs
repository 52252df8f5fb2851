//! Fuzzes MSCCL++ execution-plan loading: see `mscclpp_executor::fuzz_check` (no panic on any
//! bytes; a plan that loads round-trips through its JSON).
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run executor_plan` (from the repository root, or `fuzz/`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mscclpp_executor::fuzz_check(data));

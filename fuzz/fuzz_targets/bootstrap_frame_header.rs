//! `mscclpp::fuzzing::check("bootstrap_frame_header", ..)`: decoding never panics and what decodes re-encodes the same.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run bootstrap_frame_header` (from the repository root, or `fuzz/`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| mscclpp::fuzzing::check("bootstrap_frame_header", data));

//! Every decoder of bytes that come from peers must return a value or an error, never panic.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run decode` (from the repository root, or `fuzz/`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = mscclpp::RegisteredMemory::deserialize(data) {
        // What decodes must re-encode to the same bytes.
        assert_eq!(m.serialize(), data);
    }
    if let Ok(e) = mscclpp::Endpoint::deserialize(data) {
        assert_eq!(e.serialize(), data);
    }
    let _ = mscclpp::UniqueId::from_bytes(data);
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = s.parse::<mscclpp::UniqueId>();
        let _ = s.parse::<mscclpp::Transport>();
        let _ = mscclpp::net::parse_addr_spec(s);
    }
});

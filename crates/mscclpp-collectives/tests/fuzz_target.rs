//! The `collectives_setup` fuzz target exists, calls [`mscclpp_collectives::fuzz_check`] and is
//! listed in fuzz/Cargo.toml (as `mscclpp`'s `every_form_has_a_fuzz_target` checks for its forms).

#[test]
fn collectives_setup_has_a_fuzz_target() {
    let fuzz = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz");
    let manifest = std::fs::read_to_string(format!("{fuzz}/Cargo.toml")).unwrap();
    let src = std::fs::read_to_string(format!("{fuzz}/fuzz_targets/collectives_setup.rs")).unwrap();
    assert!(src.contains("mscclpp_collectives::fuzz_check(data)"), "the target does not call fuzz_check");
    assert!(manifest.contains("name = \"collectives_setup\""), "fuzz/Cargo.toml has no [[bin]] collectives_setup");
    assert!(manifest.contains("path = \"fuzz_targets/collectives_setup.rs\""));
    assert!(manifest.contains("mscclpp-collectives = { path = \"../crates/mscclpp-collectives\" }"));
    // What the target runs, on a few seeds: empty, junk, alike and differing setup messages, a
    // message without its agreement line, places with and without a block count.
    mscclpp_collectives::fuzz_check(b"");
    mscclpp_collectives::fuzz_check(&[0x80; 64]);
    mscclpp_collectives::fuzz_check(b"h/0|4\nsizes 1\xffh/1|2\nsizes 1");
    mscclpp_collectives::fuzz_check(b"h/0|4\nsizes 1\xffh/1|2\nsizes 2");
    mscclpp_collectives::fuzz_check(b"h/0\nsizes 1\xffh/1");
    mscclpp_collectives::fuzz_check(b"\n\xff\n\xff\xff");
}

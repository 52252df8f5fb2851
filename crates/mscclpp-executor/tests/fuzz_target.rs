//! The `executor_plan` fuzz target exists, calls [`mscclpp_executor::fuzz_check`] and is listed
//! in fuzz/Cargo.toml (as `mscclpp`'s `every_form_has_a_fuzz_target` checks for its forms).

#[test]
fn executor_plan_has_a_fuzz_target() {
    let fuzz = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz");
    let manifest = std::fs::read_to_string(format!("{fuzz}/Cargo.toml")).unwrap();
    let src = std::fs::read_to_string(format!("{fuzz}/fuzz_targets/executor_plan.rs")).unwrap();
    assert!(src.contains("mscclpp_executor::fuzz_check(data)"), "the target does not call fuzz_check");
    assert!(manifest.contains("name = \"executor_plan\""), "fuzz/Cargo.toml has no [[bin]] executor_plan");
    assert!(manifest.contains("path = \"fuzz_targets/executor_plan.rs\""));
    assert!(manifest.contains("mscclpp-executor = { path = \"../crates/mscclpp-executor\" }"));
    // What the target runs, on a few seeds: empty, junk, a generated plan.
    mscclpp_executor::fuzz_check(b"");
    mscclpp_executor::fuzz_check(&[0xff; 64]);
    let plan = mscclpp_executor::generate::all(3).remove(0);
    mscclpp_executor::fuzz_check(plan.to_json().as_bytes());
    // Peer size messages: all alike, one differing, one cut short.
    mscclpp_executor::fuzz_check(&[[7u8; 16], [7u8; 16]].concat());
    mscclpp_executor::fuzz_check(&[[7u8; 16], [8u8; 16]].concat());
    mscclpp_executor::fuzz_check(&[7u8; 20]);
}

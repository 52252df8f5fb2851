//! `bench/exec_breakdown_inputs.h` carries the interpreter's source for the breakdown bench
//! (`bench/exec_breakdown.cu`): it must be the executor's current one.

#[test]
fn breakdown_inputs_carry_the_current_kernel_source() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/exec_breakdown_inputs.h");
    let h = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let src = mscclpp_executor::device::source();
    let body = src.strip_prefix("#include \"mscclpp_rs/device.cuh\"").expect("the source opens with its include");
    assert!(h.contains(body), "{path} is stale: cargo run -p mscclpp-executor --example dump_breakdown_inputs");
}

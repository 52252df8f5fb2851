//! Prints the CUDA source of the collective kernels exactly as NVRTC compiles it (the argument
//! struct generated from the Rust definition, then the kernels), for nvcc-built measurement
//! tools such as `bench/allpair_real.cu`:
//!
//! ```sh
//! cargo run -p mscclpp-collectives --example kernel_source > collectives_generated.cu
//! ```
fn main() {
    print!("{}", mscclpp_collectives::kernel_source());
}

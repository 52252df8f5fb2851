//! Runs the examples a user reads first.

#[test]
fn two_ranks_ethernet_example_runs() {
    // Integration tests live in target/<profile>/deps; examples in target/<profile>/examples.
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap().join("examples");
    let bin = dir.join("two_ranks_ethernet");
    if !bin.exists() {
        // `cargo test` builds examples, `cargo test --test examples` does not: build it.
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut c = std::process::Command::new(cargo);
        c.args(["build", "-p", "mscclpp", "--example", "two_ranks_ethernet"]);
        if dir.to_string_lossy().contains("/release/") {
            c.arg("--release");
        }
        assert!(c.status().unwrap().success(), "building the example failed");
    }
    assert!(bin.exists(), "example not built at {}", bin.display());
    let out = std::process::Command::new(&bin).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("rank 1 received: hello from rank 0"), "{stdout}");
    assert!(stdout.contains("two_ranks_ethernet: OK"), "{stdout}");
}

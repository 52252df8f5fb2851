//! Runs the examples a user reads first.

use std::path::PathBuf;
use std::process::Command;

/// The path of example `name`, (re)built first: `cargo test --test examples` does not build
/// examples, and a stale binary would test old code (a no-op when it is up to date).
fn example(name: &str) -> PathBuf {
    // Integration tests live in target/<profile>/deps; examples in target/<profile>/examples.
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap().join("examples");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut c = Command::new(cargo);
    c.args(["build", "-p", "mscclpp", "--example", name]);
    if dir.to_string_lossy().contains("/release/") {
        c.arg("--release");
    }
    assert!(c.status().unwrap().success(), "building the example failed");
    let bin = dir.join(name);
    assert!(bin.exists(), "example not built at {}", bin.display());
    bin
}

#[test]
fn two_ranks_ethernet_example_runs() {
    let out = Command::new(example("two_ranks_ethernet")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("rank 1 received: hello from rank 0"), "{stdout}");
    assert!(stdout.contains("two_ranks_ethernet: OK"), "{stdout}");
}

/// The lines of `text` between a line containing `begin` and one containing `end`, trimmed.
fn block<'a>(text: &'a str, begin: &str, end: &str) -> Vec<&'a str> {
    let lines: Vec<&str> = text.lines().collect();
    let a = lines.iter().position(|l| l.contains(begin)).unwrap_or_else(|| panic!("no {begin:?}"));
    let b = a + 1 + lines[a + 1..].iter().position(|l| l.contains(end)).unwrap_or_else(|| panic!("no {end:?}"));
    lines[a + 1..b].iter().map(|l| l.trim()).collect()
}

#[test]
fn readme_first_program_is_the_example_and_runs() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("../../README.md")).unwrap();
    let readme = &readme[readme.find("## A first program").expect("README has no first program")..];
    let example_src = std::fs::read_to_string(root.join("examples/first_program.rs")).unwrap();
    let snippet = block(readme, "```rust", "```");
    let code = block(&example_src, "// README begin", "// README end");
    assert_eq!(snippet, code, "the README's first program differs from examples/first_program.rs");
    let out = Command::new(example("first_program")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("rank 1 received: hello from rank 0"), "{stdout}");
    assert!(stdout.contains("first_program: OK"), "{stdout}");
}

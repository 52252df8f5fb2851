//! The module layers of `docs/design.md`, checked on the source: every `crate::` path in a
//! module of `src/` (comments aside, tests included) names a module of the same or a lower layer
//! or vocabulary (error, transport, sync, env, identity: usable by every layer, platform
//! included, and importing no platform module themselves), and modules above vocabulary form no
//! import circle. A new top-level module must be added to
//! [`LAYERS`] (the test says so).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules of `src/` by layer, lowest first.
const LAYERS: &[(&str, &[&str])] = &[
    ("platform", &["platform"]),
    ("vocabulary", &["error", "transport", "sync", "env", "identity", "logging"]),
    ("resources", &["context", "memory", "buffer", "wire", "net"]),
    ("connections", &["conn"]),
    ("setup", &["bootstrap", "communicator", "launcher"]),
    ("sync and device side", &["semaphore", "device"]),
    // Public re-export modules and test entry points: nothing inside the crate may import them.
    ("public facades", &["gpu", "ib", "fuzzing", "bench"]),
];

/// The layer every other may use.
const VOCABULARY: usize = 1;

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, ms)| ms.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The source without comments (line comments, doc comments and block comments), so that doc
/// links do not count as imports. String literals are kept: a `//` inside one is rare in this
/// crate and would only hide a path, never invent one.
fn strip_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let b = src.as_bytes();
    let (mut i, mut depth, mut in_str) = (0, 0usize, false);
    while i < b.len() {
        if depth > 0 {
            if b[i..].starts_with(b"*/") {
                depth -= 1;
                i += 2;
            } else if b[i..].starts_with(b"/*") {
                depth += 1;
                i += 2;
            } else {
                i += 1;
            }
            continue;
        }
        if in_str {
            if b[i] == b'\\' {
                out.push(b[i] as char);
                i += 1;
            } else if b[i] == b'"' {
                in_str = false;
            }
        } else if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        } else if b[i..].starts_with(b"/*") {
            depth = 1;
            i += 2;
            continue;
        } else if b[i] == b'"' && (i == 0 || b[i - 1] != b'\'') {
            in_str = true;
        }
        if i < b.len() {
            out.push(b[i] as char);
        }
        i += 1;
    }
    out
}

/// Items re-exported at the crate root (`pub use module::...::{A, B as C};` in lib.rs), by the
/// name they have there, with the top-level module they come from.
fn root_items(lib: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    let lib = strip_comments(lib);
    for stmt in lib.split(';') {
        let Some(at) = stmt.find("pub use ") else { continue };
        let body: String = stmt[at + 8..].split_whitespace().collect::<Vec<_>>().join(" ");
        let module = body.split("::").next().unwrap_or_default().trim().to_string();
        let names = match (body.find('{'), body.rfind('}')) {
            (Some(a), Some(z)) => body[a + 1..z].to_string(),
            _ => body.rsplit("::").next().unwrap_or_default().to_string(),
        };
        for n in names.split(',') {
            let n = n.trim();
            let name = n.rsplit(" as ").next().unwrap_or(n).trim();
            if !name.is_empty() {
                map.insert(name.to_string(), module.clone());
            }
        }
    }
    map
}

/// Top-level modules named by `crate::` paths in `code` (`crate::x`, `crate::{x, y::z}`,
/// `crate::Item` through the root re-exports).
fn referenced(code: &str, roots: &BTreeMap<String, String>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let ident = |s: &str| -> String { s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect() };
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + 7..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue; // `mycrate::`, `$crate::`
        }
        let names: Vec<String> = if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            group[..end].split(',').map(|p| ident(p.trim())).collect()
        } else {
            vec![ident(rest)]
        };
        for n in names.into_iter().filter(|n| !n.is_empty()) {
            match roots.get(&n) {
                Some(m) => found.insert(m.clone()),
                None => found.insert(n),
            };
        }
    }
    found
}

#[test]
fn imports_follow_the_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let roots = root_items(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut problems = Vec::new();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        if rel == "lib.rs" {
            continue;
        }
        let module = rel.split('/').next().unwrap().trim_end_matches(".rs").to_string();
        let Some(mine) = layer_of(&module) else {
            problems.push(format!("{rel}: module `{module}` has no layer: add it to LAYERS in tests/layers.rs"));
            continue;
        };
        let code = strip_comments(&std::fs::read_to_string(f).unwrap());
        for target in referenced(&code, &roots) {
            if target == module {
                continue;
            }
            match layer_of(&target) {
                None => problems.push(format!("{rel}: `crate::{target}` is not in the layer table")),
                Some(theirs) if theirs == VOCABULARY && mine != VOCABULARY => {}
                Some(theirs) if theirs > mine || (mine == VOCABULARY && theirs != VOCABULARY) => {
                    problems.push(format!(
                        "{rel} ({}) imports crate::{target} ({}): a higher layer, or platform from vocabulary",
                        LAYERS[mine].0, LAYERS[theirs].0
                    ))
                }
                Some(_) => {
                    edges.entry(module.clone()).or_default().insert(target);
                }
            }
        }
    }
    // Circles between modules of one layer, above vocabulary (vocabulary types may be shared).
    for (a, targets) in &edges {
        for b in targets {
            if a < b && layer_of(a) > Some(VOCABULARY) && edges.get(b).is_some_and(|t| t.contains(a)) {
                problems.push(format!("`{a}` and `{b}` import each other"));
            }
        }
    }
    assert!(problems.is_empty(), "layer violations:\n  {}", problems.join("\n  "));
}

#[test]
fn the_checker_sees_paths_and_skips_comments() {
    let roots = root_items("pub use memory::{IbMrInfo, RegisteredMemory};\npub use conn::ethernet::INLINE_LIMIT as X;");
    assert_eq!(roots.get("RegisteredMemory").map(String::as_str), Some("memory"));
    assert_eq!(roots.get("X").map(String::as_str), Some("conn"));
    let code = strip_comments(
        "use crate::conn::Connection; // crate::semaphore\n/* crate::bootstrap */ let x = crate::RegisteredMemory::new;\nuse crate::{gpu, sync::lock};",
    );
    let found = referenced(&code, &roots);
    let want: BTreeSet<String> = ["conn", "memory", "gpu", "sync"].iter().map(|s| s.to_string()).collect();
    assert_eq!(found, want);
}

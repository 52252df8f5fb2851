//! The module layers of `docs/design.md`, checked on the source: every `crate::` path in a
//! module of `src/` (comments aside, tests included) names a module of the same or a lower layer
//! or vocabulary (error, transport, sync, env, identity: usable by every layer, platform
//! included, and importing no platform module themselves), and modules above vocabulary form no
//! import circle. A new top-level module must be added to
//! [`LAYERS`] (the test says so).
//!
//! `device` is the one public module whose submodules sit on different layers: its primitives
//! (handles, trigger codec, FIFO, token pool, NVRTC compile) come below the semaphores, its
//! channels and proxy above them, and `device/mod.rs` itself only re-exports (a facade). So the
//! unit there is `device::<submodule>`, and `super::<submodule>` paths inside `device/` count as
//! imports too. A new file under `device/` must be added to [`LAYERS`] as well.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules of `src/` by layer, lowest first.
const LAYERS: &[(&str, &[&str])] = &[
    ("platform", &["platform"]),
    ("vocabulary", &["error", "transport", "sync", "env", "identity", "logging"]),
    ("resources", &["context", "memory", "buffer", "wire", "net"]),
    ("connections", &["conn"]),
    ("setup", &["bootstrap", "communicator", "launcher"]),
    // What kernels and semaphores build on: the header, the `#[repr(C)]` handles, the trigger
    // codec, the FIFO, the GPU token pool, NVRTC.
    (
        "device primitives",
        &[
            "device::header",
            "device::handles",
            "device::trigger",
            "device::fifo",
            "device::token_pool",
            "device::compile",
        ],
    ),
    ("semaphores", &["semaphore"]),
    // Channels depend on semaphores (as in MSCCL++), never the other way.
    ("channels and proxy", &["device::memory_channel", "device::port_channel", "device::proxy"]),
    // Public re-export modules and test entry points: nothing inside the crate may import them
    // (`device` is `device/mod.rs`: crate code names the submodule that defines an item).
    ("public facades", &["device", "gpu", "ib", "fuzzing", "bench"]),
];

/// The layer every other may use.
const VOCABULARY: usize = 1;

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, ms)| ms.contains(&module))
}

/// The layer unit of a source file (path relative to `src/`): its top-level module, or
/// `device::<submodule>` for files below `src/device/` other than `device/mod.rs`.
fn unit_of(rel: &str) -> String {
    let mut parts = rel.split('/');
    let top = parts.next().unwrap_or_default().trim_end_matches(".rs");
    match (top, parts.next()) {
        ("device", Some(sub)) if sub != "mod.rs" => format!("device::{}", sub.trim_end_matches(".rs")),
        _ => top.to_string(),
    }
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
        let mut segments = body.split("::").map(str::trim);
        let mut module = segments.next().unwrap_or_default().to_string();
        if module == "device"
            && let Some(sub) = segments.next().filter(|s| layer_of(&format!("device::{s}")).is_some())
        {
            module = format!("device::{sub}");
        }
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

/// Layer units named by `crate::` paths in `code` (`crate::x`, `crate::{x, y::z}`,
/// `crate::Item` through the root re-exports, `crate::device::sub::...` as `device::sub`), and,
/// with `in_device`, by `super::sub` paths that name a submodule of `device` (from any depth of
/// `src/device/`; `super::` paths naming anything else are items of the file's own module, as in
/// `use super::*` of a test module, and stay out).
fn referenced(code: &str, roots: &BTreeMap<String, String>, in_device: bool) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let ident = |s: &str| -> String { s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect() };
    let is_device_unit = |n: &str| layer_of(&format!("device::{n}")).is_some();
    // The names after `prefix`: one path, or the first segment of each path in a `{...}` group.
    let paths_after = |rest: &str| -> Vec<String> {
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            group[..end].split(',').map(|p| p.trim().to_string()).collect()
        } else {
            vec![rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect()]
        }
    };
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + 7..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue; // `mycrate::`, `$crate::`
        }
        for path in paths_after(rest) {
            let n = ident(&path);
            if n.is_empty() {
                continue;
            }
            if n == "device" {
                let sub = path.strip_prefix("device::").map(ident).unwrap_or_default();
                if is_device_unit(&sub) {
                    found.insert(format!("device::{sub}"));
                    continue;
                }
            }
            match roots.get(&n) {
                Some(m) => found.insert(m.clone()),
                None => found.insert(n),
            };
        }
    }
    if in_device {
        let mut rest = code;
        while let Some(at) = rest.find("super::") {
            let before = rest[..at].chars().last();
            rest = &rest[at + 7..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let tail = rest.trim_start_matches("super::");
            for path in paths_after(tail) {
                let n = ident(&path);
                if is_device_unit(&n) {
                    found.insert(format!("device::{n}"));
                }
            }
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
        let module = unit_of(&rel);
        let Some(mine) = layer_of(&module) else {
            problems.push(format!("{rel}: module `{module}` has no layer: add it to LAYERS in tests/layers.rs"));
            continue;
        };
        let code = strip_comments(&std::fs::read_to_string(f).unwrap());
        for target in referenced(&code, &roots, rel.starts_with("device/")) {
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
    let roots = root_items(
        "pub use memory::{IbMrInfo, RegisteredMemory};\npub use conn::ethernet::INLINE_LIMIT as X;\n\
         pub use device::memory_channel::{BaseMemoryChannel, MemoryChannel};",
    );
    assert_eq!(roots.get("RegisteredMemory").map(String::as_str), Some("memory"));
    assert_eq!(roots.get("X").map(String::as_str), Some("conn"));
    assert_eq!(roots.get("MemoryChannel").map(String::as_str), Some("device::memory_channel"));
    let code = strip_comments(
        "use crate::conn::Connection; // crate::semaphore\n/* crate::bootstrap */ let x = crate::RegisteredMemory::new;\nuse crate::{gpu, sync::lock};",
    );
    let found = referenced(&code, &roots, false);
    let want: BTreeSet<String> = ["conn", "memory", "gpu", "sync"].iter().map(|s| s.to_string()).collect();
    assert_eq!(found, want);
}

#[test]
fn the_checker_sees_device_submodules() {
    let roots = root_items("pub use device::memory_channel::{BaseMemoryChannel, MemoryChannel};");
    let code = strip_comments(
        "use crate::device::handles::X;\nuse crate::device::Fifo;\nuse crate::{device::proxy::P, semaphore};\n\
         use super::fifo::Fifo;\nuse super::super::trigger::{self, T};\nuse super::*;\nsuper::check(1);\n\
         let c = crate::MemoryChannel::new;",
    );
    let want: BTreeSet<String> = [
        "device::handles",
        "device",
        "device::proxy",
        "semaphore",
        "device::fifo",
        "device::trigger",
        "device::memory_channel",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(referenced(&code, &roots, true), want);
    assert!(!referenced(&code, &roots, false).contains("device::fifo"), "super:: counts only inside device/");
    assert_eq!(unit_of("device/mod.rs"), "device");
    assert_eq!(unit_of("device/fifo.rs"), "device::fifo");
    assert_eq!(unit_of("device/proxy/handler.rs"), "device::proxy");
    assert_eq!(unit_of("semaphore.rs"), "semaphore");
    assert_eq!(unit_of("conn/ethernet/core.rs"), "conn");
}

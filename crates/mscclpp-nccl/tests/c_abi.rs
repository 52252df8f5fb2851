//! The ABI against the real `nccl.h` of the `nvidia-nccl-cu13` wheel (2.31.2): a C program
//! compiled with `cc` prints every size, offset and constant, compared with `mscclpp_nccl::abi`;
//! and the set of functions the built `libmscclpp_nccl.so` exports equals the set the header
//! declares.
//!
//! The header comes from `MSCCLPP_NCCL_INCLUDE` (the folder holding `nccl.h`), else
//! `/tmp/mscclpp-nccl/nvidia/nccl/include` (where `.ci/run` unpacks the wheel). Without it the
//! tests say so and pass, unless `MSCCLPP_TEST_NCCL_HEADER=1` (CI), where they fail.

use std::collections::BTreeSet;
use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::process::Command;

use mscclpp_nccl::abi::*;

fn include_dir() -> Option<PathBuf> {
    let d = std::env::var_os("MSCCLPP_NCCL_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/mscclpp-nccl/nvidia/nccl/include"));
    if d.join("nccl.h").is_file() {
        return Some(d);
    }
    let required = std::env::var("MSCCLPP_TEST_NCCL_HEADER").is_ok_and(|v| v == "1");
    assert!(!required, "MSCCLPP_TEST_NCCL_HEADER=1 but {} has no nccl.h", d.display());
    eprintln!("skipped: no nccl.h in {} (set MSCCLPP_NCCL_INCLUDE)", d.display());
    None
}

const PROGRAM: &str = r#"
#include <stdio.h>
#include <stddef.h>
#include "nccl.h"
#define S(t) printf("sizeof %s %zu\n", #t, sizeof(t));
#define O(t, f) printf("offsetof %s.%s %zu\n", #t, #f, offsetof(t, f));
#define C(x) printf("const %s %lld\n", #x, (long long)(x));
int main(void) {
  S(ncclUniqueId) S(ncclConfig_t) S(ncclCollConfig_t) S(ncclSimInfo_t) S(ncclWaitSignalDesc_t)
  S(ncclResult_t) S(ncclDataType_t) S(ncclRedOp_t) S(ncclComm_t) S(ncclWindow_t)
  O(ncclConfig_t, size) O(ncclConfig_t, magic) O(ncclConfig_t, version) O(ncclConfig_t, blocking)
  O(ncclConfig_t, cgaClusterSize) O(ncclConfig_t, minCTAs) O(ncclConfig_t, maxCTAs) O(ncclConfig_t, netName)
  O(ncclConfig_t, splitShare) O(ncclConfig_t, trafficClass) O(ncclConfig_t, commName) O(ncclConfig_t, collnetEnable)
  O(ncclConfig_t, CTAPolicy) O(ncclConfig_t, shrinkShare) O(ncclConfig_t, nvlsCTAs) O(ncclConfig_t, nChannelsPerNetPeer)
  O(ncclConfig_t, nvlinkCentricSched) O(ncclConfig_t, graphUsageMode) O(ncclConfig_t, numRmaCtx) O(ncclConfig_t, maxP2pPeers)
  O(ncclConfig_t, graphStreamOrdering) O(ncclConfig_t, launchOrderImplicit) O(ncclConfig_t, numRmaSig)
  O(ncclConfig_t, rmaEagerInit) O(ncclConfig_t, hostCftMode)
  O(ncclCollConfig_t, ext) O(ncclCollConfig_t, minCTAs) O(ncclCollConfig_t, algSelection)
  O(ncclCollConfig_t, forceAlgSelection) O(ncclCollConfig_t, CTAPolicy) O(ncclCollConfig_t, userProfilerTag)
  O(ncclSimInfo_t, estimatedTime) O(ncclWaitSignalDesc_t, ctx)
  C(ncclSuccess) C(ncclUnhandledCudaError) C(ncclSystemError) C(ncclInternalError) C(ncclInvalidArgument)
  C(ncclInvalidUsage) C(ncclRemoteError) C(ncclInProgress) C(ncclTimeout) C(ncclNumResults)
  C(ncclInt8) C(ncclUint8) C(ncclInt32) C(ncclUint32) C(ncclInt64) C(ncclUint64) C(ncclFloat16) C(ncclFloat32)
  C(ncclFloat64) C(ncclBfloat16) C(ncclFloat8e4m3) C(ncclFloat8e5m2) C(ncclNumTypes)
  C(ncclSum) C(ncclProd) C(ncclMax) C(ncclMin) C(ncclAvg) C(ncclNumOps) C(ncclMaxRedOp)
  C(ncclScalarDevice) C(ncclScalarHostImmediate)
  C(NCCL_UNIQUE_ID_BYTES) C(NCCL_API_MAGIC) C(NCCL_CONFIG_UNDEF_INT) C(NCCL_SPLIT_NOCOLOR) C(NCCL_VERSION_CODE)
  C(NCCL_MAJOR) C(NCCL_MINOR) C(NCCL_PATCH)
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  printf("init size %zu\ninit magic %u\ninit version %u\ninit blocking %d\ninit hostCftMode %d\n",
         c.size, c.magic, c.version, c.blocking, c.hostCftMode);
  return 0;
}
"#;

/// Compiles and runs the program; returns its `key value` lines.
fn c_facts(inc: &std::path::Path) -> Vec<(String, i128)> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nccl-abi");
    std::fs::create_dir_all(dir.join("stub")).unwrap();
    // nccl.h includes the CUDA runtime headers: stand-ins with the one type it uses.
    std::fs::write(
        dir.join("stub/cuda_runtime.h"),
        "#define CUDART_VERSION 13000\ntypedef struct CUstream_st* cudaStream_t;\n",
    )
    .unwrap();
    std::fs::write(dir.join("stub/cuda_fp16.h"), "").unwrap();
    std::fs::write(dir.join("stub/cuda_bf16.h"), "").unwrap();
    std::fs::write(dir.join("abi.c"), PROGRAM).unwrap();
    let exe = dir.join("abi");
    let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .arg("-I")
        .arg(dir.join("stub"))
        .arg("-I")
        .arg(inc)
        .arg(dir.join("abi.c"))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("running cc");
    assert!(out.status.success(), "cc failed: {}", String::from_utf8_lossy(&out.stderr));
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    String::from_utf8(run.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let mut w = l.rsplitn(2, ' ');
            let v: i128 = w.next().unwrap().parse().unwrap();
            (w.next().unwrap().to_string(), v)
        })
        .collect()
}

#[test]
fn layout_and_constants_match_the_header() {
    let Some(inc) = include_dir() else { return };
    let facts = c_facts(&inc);
    let get = |k: &str| facts.iter().find(|(n, _)| n == k).unwrap_or_else(|| panic!("{k} missing")).1;
    let init = ncclConfig_t::initializer();
    let rust: Vec<(&str, i128)> = vec![
        ("sizeof ncclUniqueId", size_of::<ncclUniqueId>() as i128),
        ("sizeof ncclConfig_t", size_of::<ncclConfig_t>() as i128),
        ("sizeof ncclCollConfig_t", size_of::<ncclCollConfig_t>() as i128),
        ("sizeof ncclSimInfo_t", size_of::<ncclSimInfo_t>() as i128),
        ("sizeof ncclWaitSignalDesc_t", size_of::<ncclWaitSignalDesc_t>() as i128),
        ("sizeof ncclResult_t", size_of::<ncclResult_t>() as i128),
        ("sizeof ncclDataType_t", size_of::<ncclDataType_t>() as i128),
        ("sizeof ncclRedOp_t", size_of::<ncclRedOp_t>() as i128),
        ("sizeof ncclComm_t", size_of::<ncclComm_t>() as i128),
        ("sizeof ncclWindow_t", size_of::<ncclWindow_t>() as i128),
        ("offsetof ncclConfig_t.size", offset_of!(ncclConfig_t, size) as i128),
        ("offsetof ncclConfig_t.magic", offset_of!(ncclConfig_t, magic) as i128),
        ("offsetof ncclConfig_t.version", offset_of!(ncclConfig_t, version) as i128),
        ("offsetof ncclConfig_t.blocking", offset_of!(ncclConfig_t, blocking) as i128),
        ("offsetof ncclConfig_t.cgaClusterSize", offset_of!(ncclConfig_t, cgaClusterSize) as i128),
        ("offsetof ncclConfig_t.minCTAs", offset_of!(ncclConfig_t, minCTAs) as i128),
        ("offsetof ncclConfig_t.maxCTAs", offset_of!(ncclConfig_t, maxCTAs) as i128),
        ("offsetof ncclConfig_t.netName", offset_of!(ncclConfig_t, netName) as i128),
        ("offsetof ncclConfig_t.splitShare", offset_of!(ncclConfig_t, splitShare) as i128),
        ("offsetof ncclConfig_t.trafficClass", offset_of!(ncclConfig_t, trafficClass) as i128),
        ("offsetof ncclConfig_t.commName", offset_of!(ncclConfig_t, commName) as i128),
        ("offsetof ncclConfig_t.collnetEnable", offset_of!(ncclConfig_t, collnetEnable) as i128),
        ("offsetof ncclConfig_t.CTAPolicy", offset_of!(ncclConfig_t, CTAPolicy) as i128),
        ("offsetof ncclConfig_t.shrinkShare", offset_of!(ncclConfig_t, shrinkShare) as i128),
        ("offsetof ncclConfig_t.nvlsCTAs", offset_of!(ncclConfig_t, nvlsCTAs) as i128),
        ("offsetof ncclConfig_t.nChannelsPerNetPeer", offset_of!(ncclConfig_t, nChannelsPerNetPeer) as i128),
        ("offsetof ncclConfig_t.nvlinkCentricSched", offset_of!(ncclConfig_t, nvlinkCentricSched) as i128),
        ("offsetof ncclConfig_t.graphUsageMode", offset_of!(ncclConfig_t, graphUsageMode) as i128),
        ("offsetof ncclConfig_t.numRmaCtx", offset_of!(ncclConfig_t, numRmaCtx) as i128),
        ("offsetof ncclConfig_t.maxP2pPeers", offset_of!(ncclConfig_t, maxP2pPeers) as i128),
        ("offsetof ncclConfig_t.graphStreamOrdering", offset_of!(ncclConfig_t, graphStreamOrdering) as i128),
        ("offsetof ncclConfig_t.launchOrderImplicit", offset_of!(ncclConfig_t, launchOrderImplicit) as i128),
        ("offsetof ncclConfig_t.numRmaSig", offset_of!(ncclConfig_t, numRmaSig) as i128),
        ("offsetof ncclConfig_t.rmaEagerInit", offset_of!(ncclConfig_t, rmaEagerInit) as i128),
        ("offsetof ncclConfig_t.hostCftMode", offset_of!(ncclConfig_t, hostCftMode) as i128),
        ("offsetof ncclCollConfig_t.ext", offset_of!(ncclCollConfig_t, ext) as i128),
        ("offsetof ncclCollConfig_t.minCTAs", offset_of!(ncclCollConfig_t, minCTAs) as i128),
        ("offsetof ncclCollConfig_t.algSelection", offset_of!(ncclCollConfig_t, algSelection) as i128),
        ("offsetof ncclCollConfig_t.forceAlgSelection", offset_of!(ncclCollConfig_t, forceAlgSelection) as i128),
        ("offsetof ncclCollConfig_t.CTAPolicy", offset_of!(ncclCollConfig_t, CTAPolicy) as i128),
        ("offsetof ncclCollConfig_t.userProfilerTag", offset_of!(ncclCollConfig_t, userProfilerTag) as i128),
        ("offsetof ncclSimInfo_t.estimatedTime", offset_of!(ncclSimInfo_t, estimatedTime) as i128),
        ("offsetof ncclWaitSignalDesc_t.ctx", offset_of!(ncclWaitSignalDesc_t, ctx) as i128),
        ("const ncclSuccess", ncclSuccess as i128),
        ("const ncclUnhandledCudaError", ncclUnhandledCudaError as i128),
        ("const ncclSystemError", ncclSystemError as i128),
        ("const ncclInternalError", ncclInternalError as i128),
        ("const ncclInvalidArgument", ncclInvalidArgument as i128),
        ("const ncclInvalidUsage", ncclInvalidUsage as i128),
        ("const ncclRemoteError", ncclRemoteError as i128),
        ("const ncclInProgress", ncclInProgress as i128),
        ("const ncclTimeout", ncclTimeout as i128),
        ("const ncclNumResults", ncclNumResults as i128),
        ("const ncclInt8", ncclInt8 as i128),
        ("const ncclUint8", ncclUint8 as i128),
        ("const ncclInt32", ncclInt32 as i128),
        ("const ncclUint32", ncclUint32 as i128),
        ("const ncclInt64", ncclInt64 as i128),
        ("const ncclUint64", ncclUint64 as i128),
        ("const ncclFloat16", ncclFloat16 as i128),
        ("const ncclFloat32", ncclFloat32 as i128),
        ("const ncclFloat64", ncclFloat64 as i128),
        ("const ncclBfloat16", ncclBfloat16 as i128),
        ("const ncclFloat8e4m3", ncclFloat8e4m3 as i128),
        ("const ncclFloat8e5m2", ncclFloat8e5m2 as i128),
        ("const ncclNumTypes", ncclNumTypes as i128),
        ("const ncclSum", ncclSum as i128),
        ("const ncclProd", ncclProd as i128),
        ("const ncclMax", ncclMax as i128),
        ("const ncclMin", ncclMin as i128),
        ("const ncclAvg", ncclAvg as i128),
        ("const ncclNumOps", ncclNumOps as i128),
        ("const ncclMaxRedOp", ncclMaxRedOp as i128),
        ("const ncclScalarDevice", ncclScalarDevice as i128),
        ("const ncclScalarHostImmediate", ncclScalarHostImmediate as i128),
        ("const NCCL_UNIQUE_ID_BYTES", NCCL_UNIQUE_ID_BYTES as i128),
        ("const NCCL_API_MAGIC", NCCL_API_MAGIC as i128),
        ("const NCCL_CONFIG_UNDEF_INT", NCCL_CONFIG_UNDEF_INT as i128),
        ("const NCCL_SPLIT_NOCOLOR", NCCL_SPLIT_NOCOLOR as i128),
        ("const NCCL_VERSION_CODE", NCCL_VERSION_CODE as i128),
        ("const NCCL_MAJOR", NCCL_MAJOR as i128),
        ("const NCCL_MINOR", NCCL_MINOR as i128),
        ("const NCCL_PATCH", NCCL_PATCH as i128),
        ("init size", init.size as i128),
        ("init magic", init.magic as i128),
        ("init version", init.version as i128),
        ("init blocking", init.blocking as i128),
        ("init hostCftMode", init.hostCftMode as i128),
    ];
    let mut bad = Vec::new();
    for (k, v) in &rust {
        if get(k) != *v {
            bad.push(format!("{k}: header {} vs Rust {v}", get(k)));
        }
    }
    assert!(bad.is_empty(), "ABI mismatches:\n{}", bad.join("\n"));
    assert_eq!(facts.len(), rust.len(), "every printed fact is compared");
    // mscclpp's UniqueId fits in the 128 bytes
    const { assert!(mscclpp::UniqueId::BYTES <= NCCL_UNIQUE_ID_BYTES) };
}

/// The host functions `nccl.h` declares (`ncclResult_t`, `const char*` or `void` functions).
fn header_functions(inc: &std::path::Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(inc.join("nccl.h")).unwrap();
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let l = line.trim_start();
        for ret in ["ncclResult_t", "const char*", "void"] {
            if let Some(rest) = l.strip_prefix(ret) {
                let rest = rest.trim_start();
                let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                let after = rest[name.len()..].trim_start();
                if (name.starts_with("nccl") || name.starts_with("pnccl")) && after.starts_with('(') {
                    out.insert(name);
                }
            }
        }
    }
    out
}

fn cdylib() -> PathBuf {
    // target/<profile>/deps/c_abi-<hash>: cargo test builds the cdylib beside it in deps/ (it
    // copies it up to target/<profile>/ only on cargo build).
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().join("libmscclpp_nccl.so")
}

#[test]
fn exported_symbols_equal_the_header_functions() {
    let Some(inc) = include_dir() else { return };
    let declared = header_functions(&inc);
    assert_eq!(
        declared.len(),
        144,
        "nccl.h 2.31.2 declares 72 functions (71 and the deprecated ncclResetDebugInit) under two names each"
    );
    let so = cdylib();
    assert!(so.is_file(), "{} not built", so.display());
    let nm = Command::new("nm").args(["-D", "--defined-only"]).arg(&so).output().expect("running nm (binutils)");
    assert!(nm.status.success());
    let exported: BTreeSet<String> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (_, kind, name) = (w.next()?, w.next()?, w.next()?);
            (kind == "T" && (name.starts_with("nccl") || name.starts_with("pnccl"))).then(|| name.to_string())
        })
        .collect();
    let missing: Vec<_> = declared.difference(&exported).collect();
    let extra: Vec<_> = exported.difference(&declared).collect();
    assert!(missing.is_empty() && extra.is_empty(), "missing {missing:?}, not in the header {extra:?}");
}

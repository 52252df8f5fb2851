//! A job started by a real launcher (mpirun, srun, torchrun) or in network namespaces: each rank
//! re-runs its test binary, reads its rank and root from the launcher's variables
//! (`mscclpp::launcher::LaunchInfo`), and every pair of ranks exchanges data over Ethernet.
#![allow(dead_code)]

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use mscclpp::launcher::LaunchInfo;
use mscclpp::{
    Bootstrap, Buffer, Communicator, Connection, EndpointConfig, Host2HostSemaphore, RegisteredMemory, Transport,
};

/// Set (to the test's name) in the environment of the ranks a launcher starts.
pub const CHILD_VAR: &str = "MSCCLPP_LAUNCHED_TEST";

/// The launcher's view when this process is a rank of test `name`.
pub fn child(name: &str) -> Option<LaunchInfo> {
    if std::env::var(CHILD_VAR).ok()? != name {
        return None;
    }
    Some(LaunchInfo::from_env().expect("launcher variables").expect("started by a launcher"))
}

/// The arguments that make this test binary run only test `name`.
pub fn test_args(name: &str) -> Vec<String> {
    ["--exact", name, "--nocapture", "--test-threads=1", "--include-ignored"].iter().map(|s| s.to_string()).collect()
}

/// A port nobody listens on now (bound and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Whether `program` runs (`program --version` or the like succeeds).
pub fn have(program: &str, arg: &str) -> bool {
    Command::new(program).arg(arg).output().is_ok_and(|o| o.status.success())
}

/// Whether this process runs as root (mpirun then needs `--allow-run-as-root`).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

/// A launcher test cannot run here: CI (`MSCCLPP_TEST_LAUNCHERS=1`, set by `.ci/run`) fails,
/// elsewhere the test says so and passes.
pub fn unavailable(what: &str) {
    if std::env::var("MSCCLPP_TEST_LAUNCHERS").is_ok_and(|v| v == "1") {
        panic!("{what} (MSCCLPP_TEST_LAUNCHERS=1 asks for it)");
    }
    eprintln!("SKIPPED: {what}");
}

/// One rank's connections, its buffer and the peers' buffers.
pub struct Mesh {
    pub bs: Arc<dyn Bootstrap>,
    /// Where this rank's bootstrap listens for peers.
    pub listen: std::net::SocketAddr,
    pub comm: Communicator,
    pub buf: Buffer,
    pub conns: Vec<Option<Connection>>,
    pub remote: Vec<Option<RegisteredMemory>>,
    pub sems: Vec<Option<Host2HostSemaphore>>,
}

/// Bootstraps from the launcher's variables and connects every pair over Ethernet (interface:
/// the library's choice, `MSCCLPP_SOCKET_IFNAME` included), with a buffer of `slot * size` bytes.
pub fn mesh(info: &LaunchInfo, slot: usize, timeout: Duration) -> Mesh {
    mesh_with(info, slot, timeout, &EndpointConfig::new(Transport::Ethernet))
}

/// [`mesh`] with the endpoint config given (an Ethernet interface, say).
pub fn mesh_with(info: &LaunchInfo, slot: usize, timeout: Duration, cfg: &EndpointConfig) -> Mesh {
    let tcp = info.bootstrap(timeout).expect("bootstrap from the launcher's variables");
    let listen = tcp.listen_addr();
    let bs: Arc<dyn Bootstrap> = Arc::new(tcp);
    let (rank, n) = (bs.rank(), bs.size());
    assert_eq!((rank, n), (info.rank, info.size));
    let comm = Communicator::new(bs.clone());
    let buf = Buffer::new(comm.context(), slot * n, Transport::Ethernet.into()).unwrap();
    // (A sibling of `common` in the binaries that include it: they all have `mod common`.)
    let crate::common::Links { conns, remote, sems } =
        crate::common::connect_all(&comm, rank, n, cfg, buf.memory(), |s| Host2HostSemaphore::new(s).unwrap());
    bs.barrier().unwrap();
    Mesh { bs, listen, comm, buf, conns, remote, sems }
}

/// Each rank writes `slot` bytes of its own pattern into its slot of every peer's buffer, signals,
/// waits for every peer's signal and checks every slot; returns this rank's summary line.
pub fn all_pairs_exchange(m: &Mesh, slot: usize, timeout: Duration) -> String {
    let (rank, n) = (m.bs.rank(), m.bs.size());
    let src = Buffer::new(m.comm.context(), slot, Transport::Ethernet.into()).unwrap();
    src.write(0, &crate::common::pattern(rank as u64 + 1, slot)).unwrap();
    for p in (0..n).filter(|p| *p != rank) {
        let conn = m.conns[p].as_ref().unwrap();
        conn.write(m.remote[p].as_ref().unwrap(), (rank * slot) as u64, src.memory(), 0, slot as u64).unwrap();
        m.sems[p].as_ref().unwrap().signal().unwrap();
        conn.flush(timeout).unwrap_or_else(|e| panic!("rank {rank}: flush to rank {p}: {e}"));
    }
    for p in (0..n).filter(|p| *p != rank) {
        m.sems[p].as_ref().unwrap().wait(timeout).unwrap_or_else(|e| panic!("rank {rank}: wait for rank {p}: {e}"));
        let mut got = vec![0u8; slot];
        m.buf.read(p * slot, &mut got).unwrap();
        assert!(got == crate::common::pattern(p as u64 + 1, slot), "rank {rank}: the slot of rank {p} differs");
    }
    m.bs.barrier().unwrap();
    format!("rank {rank} of {n}: exchanged {slot} B with {} peers, all exact", n - 1)
}

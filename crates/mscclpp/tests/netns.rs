//! Several hosts on one machine: network namespaces joined by veth pairs through bridges, each a
//! "host" with its own addresses, host name and `MSCCLPP_HOSTID`, its rank a process inside it
//! (`ip netns exec`). Every host has two networks, `ctl0` (10.78.0.0/24, fd78::/64) and `dat0`
//! (10.77.0.0/24, fd77::/64); the host names `node0`, `node1`, ... (and `node0-v6`, ... for the
//! IPv6 addresses) resolve (through `/etc/netns/<ns>/hosts`, which `ip netns exec` mounts over
//! `/etc/hosts`) to the `ctl0` addresses, and `MASTER_ADDR=node0` unless a test says otherwise.
//!
//! Added latency: `tc netem` where the kernel has it; otherwise (CI's and this machine's
//! Firecracker VM kernel has no `sch_netem`) a userspace wire between TUN devices `wire0`
//! (10.79.0.0/24) with a relay thread in the test process ([`tun_wire`]); `tbf` only where
//! neither works.
//!
//! Needs root (CI runs as root). Where a namespace cannot be created the tests say so and pass;
//! anything that fails after that fails the test. Namespaces are deleted when a test ends, also
//! when it fails; names carry the test's pid and a counter, so parallel tests do not collide.

mod common;
#[path = "common/launched.rs"]
mod launched;
#[path = "common/tun_wire.rs"]
mod tun_wire;

use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use launched::{CHILD_VAR, all_pairs_exchange, child, mesh, mesh_with, test_args};
use mscclpp::{Buffer, EndpointConfig, ErrorKind, Transport};

const T: Duration = Duration::from_secs(60);

/// Runs a command, or returns its stderr as the error.
fn run(args: &[&str]) -> Result<(), String> {
    let o = Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim()))
    }
}

/// The hosts of one test, their namespaces and the switch namespace holding the two bridges.
struct Net {
    hosts: Vec<String>,
    switch: String,
}

impl Net {
    /// `n` hosts, or `Ok(None)` (after saying why) when namespaces cannot be created here.
    fn new(n: usize) -> Result<Option<Net>, String> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let id = format!("{:x}{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let switch = format!("mscsw{id}");
        if let Err(e) = run(&["ip", "netns", "add", &switch]) {
            eprintln!("SKIPPED: cannot create a network namespace here (needs root and ip): {e}");
            return Ok(None);
        }
        let mut net = Net { hosts: Vec::new(), switch };
        let sw = net.switch.clone();
        for br in ["ctlbr", "datbr"] {
            run(&["ip", "-n", &sw, "link", "add", br, "type", "bridge"])?;
            run(&["ip", "-n", &sw, "link", "set", br, "up"])?;
        }
        let hosts_file: String =
            (0..n).map(|i| format!("10.78.0.{} node{i}\nfd78::{} node{i}-v6\n", i + 1, i + 1)).collect();
        for i in 0..n {
            let ns = format!("msch{id}x{i}");
            run(&["ip", "netns", "add", &ns])?;
            net.hosts.push(ns.clone());
            let etc = format!("/etc/netns/{ns}");
            std::fs::create_dir_all(&etc).map_err(|e| format!("{etc}: {e}"))?;
            std::fs::write(format!("{etc}/hosts"), format!("127.0.0.1 localhost\n{hosts_file}"))
                .map_err(|e| format!("{etc}/hosts: {e}"))?;
            run(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            for (net_name, subnet, br) in [("ctl", 78, "ctlbr"), ("dat", 77, "datbr")] {
                // Created in the root namespace under unique names, then moved and renamed.
                let (a, b) = (format!("m{id}{net_name}{i}a"), format!("m{id}{net_name}{i}b"));
                let (a, b) = (a[a.len().saturating_sub(15)..].to_string(), b[b.len().saturating_sub(15)..].to_string());
                run(&["ip", "link", "add", &a, "type", "veth", "peer", "name", &b])?;
                run(&["ip", "link", "set", &a, "netns", &ns])?;
                run(&["ip", "link", "set", &b, "netns", &sw])?;
                let ifname = format!("{net_name}0");
                run(&["ip", "-n", &ns, "link", "set", &a, "name", &ifname])?;
                run(&["ip", "-n", &ns, "addr", "add", &format!("10.{subnet}.0.{}/24", i + 1), "dev", &ifname])?;
                // IPv6 too (no duplicate-address wait), fd<subnet>::<host>.
                let v6 = format!("fd{subnet}::{}/64", i + 1);
                run(&["ip", "-n", &ns, "addr", "add", &v6, "dev", &ifname, "nodad"])?;
                run(&["ip", "-n", &ns, "link", "set", &ifname, "up"])?;
                run(&["ip", "-n", &sw, "link", "set", &b, "master", br])?;
                run(&["ip", "-n", &sw, "link", "set", &b, "up"])?;
            }
        }
        Ok(Some(net))
    }

    /// Runs `cmd` inside host `i`'s namespace.
    fn exec(&self, i: usize, cmd: &[&str]) -> Result<(), String> {
        let mut args = vec!["ip", "netns", "exec", &self.hosts[i]];
        args.extend_from_slice(cmd);
        run(&args)
    }

    /// Starts rank `i` of test `name` in host `i` for every host, and waits (at most `limit`).
    fn job(&self, name: &str, env: &[(&str, &str)], limit: Duration) -> Vec<Output> {
        let n = self.hosts.len();
        let kids: Vec<Child> = (0..n)
            .map(|i| {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &self.hosts[i]])
                    .arg(std::env::current_exe().unwrap())
                    .args(test_args(name))
                    .env(CHILD_VAR, name)
                    .env("RANK", i.to_string())
                    .env("WORLD_SIZE", n.to_string())
                    .env("MASTER_ADDR", "node0")
                    .env("MASTER_PORT", "29400")
                    .env("MSCCLPP_HOSTID", format!("node{i}"))
                    .env("MSCCLPP_NS_HOST", i.to_string())
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                for (k, v) in env {
                    c.env(k, v);
                }
                c.spawn().unwrap()
            })
            .collect();
        let deadline = Instant::now() + limit;
        kids.into_iter()
            .map(|mut c| {
                mscclpp::bench::wait_exit(&mut c, deadline.saturating_duration_since(Instant::now())).unwrap();
                let _ = c.kill();
                c.wait_with_output().unwrap()
            })
            .collect()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace deletes its veth ends (and so their peers).
        for ns in self.hosts.iter().chain(std::iter::once(&self.switch)) {
            let _ = run(&["ip", "netns", "del", ns]);
            let _ = std::fs::remove_dir_all(format!("/etc/netns/{ns}"));
        }
    }
}

/// Every rank succeeded; returns their stdout joined.
fn all_ok(outs: &[Output]) -> String {
    let mut text = String::new();
    for (r, o) in outs.iter().enumerate() {
        text += &format!(
            "=== rank {r}: {}\n{}\n--- stderr\n{}\n",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    assert!(outs.iter().all(|o| o.status.success()), "{text}");
    println!("{text}");
    text
}

/// This rank's host number (the namespace it runs in).
fn host() -> usize {
    std::env::var("MSCCLPP_NS_HOST").unwrap().parse().unwrap()
}

/// An interface counter of this namespace (`ip netns exec` mounts its own `/sys`).
fn counter(iface: &str, what: &str) -> u64 {
    let p = format!("/sys/class/net/{iface}/statistics/{what}");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}")).trim().parse().unwrap()
}

#[test]
fn three_hosts_bootstrap_by_name_and_exchange_over_ethernet() {
    const NAME: &str = "three_hosts_bootstrap_by_name_and_exchange_over_ethernet";
    if let Some(info) = child(NAME) {
        assert_eq!(info.root.as_ref().unwrap().spec, "node0:29400");
        let m = mesh(&info, 1 << 20, T);
        // One rank per host: the bootstrap tells hosts apart by MSCCLPP_HOSTID.
        assert_eq!(m.bs.ranks_per_node(), 1);
        let hashes = m.bs.all_gather(&mscclpp::host_hash().to_le_bytes()).unwrap();
        assert!(hashes.iter().enumerate().all(|(i, a)| hashes[i + 1..].iter().all(|b| a != b)), "host ids differ");
        println!("{}", all_pairs_exchange(&m, 1 << 20, T));
        return;
    }
    let Some(net) = Net::new(3).unwrap() else { return };
    let text = all_ok(&net.job(NAME, &[], T * 2));
    for r in 0..3 {
        assert!(text.contains(&format!("rank {r} of 3: exchanged 1048576 B with 2 peers, all exact")), "{text}");
    }
}

#[test]
fn socket_ifname_picks_the_network_data_goes_over() {
    const NAME: &str = "socket_ifname_picks_the_network_data_goes_over";
    const LEN: usize = 16 << 20;
    if let Some(info) = child(NAME) {
        let want = std::env::var("MSCCLPP_SOCKET_IFNAME").unwrap();
        let other = if want == "dat" { "ctl0" } else { "dat0" };
        let m = mesh(&info, LEN, T);
        let before = (counter(&format!("{want}0"), "tx_bytes"), counter(other, "tx_bytes"));
        println!("{}", all_pairs_exchange(&m, LEN, T));
        let after = (counter(&format!("{want}0"), "tx_bytes"), counter(other, "tx_bytes"));
        let (on, off) = (after.0 - before.0, after.1 - before.1);
        println!("host {}: {want}0 sent {on} B, {other} sent {off} B", host());
        assert!(on >= LEN as u64, "{want}0 carried only {on} B of a {LEN} B write");
        assert!(off < (LEN / 16) as u64, "{other} carried {off} B though MSCCLPP_SOCKET_IFNAME={want}");
        return;
    }
    let Some(net) = Net::new(2).unwrap() else { return };
    for want in ["dat", "ctl"] {
        let text = all_ok(&net.job(NAME, &[("MSCCLPP_SOCKET_IFNAME", want)], T * 2));
        assert!(text.contains(&format!("{want}0 sent")), "{text}");
    }
}

#[test]
fn a_link_taken_down_mid_transfer_is_an_error_naming_the_peer() {
    const NAME: &str = "a_link_taken_down_mid_transfer_is_an_error_naming_the_peer";
    const CHUNK: usize = 4 << 20;
    const SLOTS: usize = 16;
    if let Some(info) = child(NAME) {
        // Bootstrap over ctl0 (MSCCLPP_SOCKET_IFNAME=ctl), data over dat0, whose link goes down.
        let cfg = EndpointConfig::new(Transport::Ethernet).ethernet_interface("dat0");
        let m = mesh_with(&info, CHUNK * SLOTS / 2, T, &cfg);
        let flush_limit = Duration::from_secs(2);
        if info.rank == 0 {
            let conn = m.conns[1].as_ref().unwrap();
            let dst = m.remote[1].as_ref().unwrap();
            let src = Buffer::new(m.comm.context(), CHUNK * SLOTS, Transport::Ethernet.into()).unwrap();
            for k in 0..SLOTS {
                src.write(k * CHUNK, &common::pattern(k as u64, CHUNK)).unwrap();
            }
            // Chunk 0 arrives while the link is up.
            conn.write(dst, 0, src.memory(), 0, CHUNK as u64).unwrap();
            conn.flush(T).unwrap();
            let is_down = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            // The link goes down once the stream below has issued its first chunk.
            let (streaming, started) = std::sync::mpsc::channel::<()>();
            let down = std::thread::spawn({
                let is_down = is_down.clone();
                move || {
                    let _ = started.recv();
                    run(&["ip", "link", "set", "dat0", "down"]).unwrap();
                    is_down.store(true, Ordering::SeqCst);
                }
            });
            // Then a stream of chunks (chunk k to slot k % SLOTS, each slot's content always the
            // same) until a flush fails; the link goes down while it runs.
            let (mut flushed, mut issued, mut err) = (1, 1, None);
            let start = Instant::now();
            for k in 1.. {
                let off = ((k % SLOTS) * CHUNK) as u64;
                if let Err(e) = conn.write(dst, off, src.memory(), off, CHUNK as u64) {
                    err = Some((e, Duration::ZERO));
                    break;
                }
                issued = k + 1;
                if k == 1 {
                    let _ = streaming.send(());
                }
                let t0 = Instant::now();
                match conn.flush(flush_limit) {
                    Ok(()) => flushed = k + 1,
                    Err(e) => {
                        err = Some((e, t0.elapsed()));
                        break;
                    }
                }
                if is_down.load(Ordering::SeqCst) && start.elapsed() > T {
                    break;
                }
            }
            drop(streaming);
            down.join().unwrap();
            let (e, waited) = err.expect("the transfer went on with the link down");
            println!("after {flushed} flushed chunks: {e} (after {waited:?})");
            assert_eq!(e.peer(), Some(1), "{e}");
            assert!(matches!(e.kind(), ErrorKind::Timeout | ErrorKind::Remote | ErrorKind::System), "{e}");
            assert!(
                waited <= flush_limit + Duration::from_secs(10),
                "the flush took {waited:?} with a {flush_limit:?} limit"
            );
            // Later operations also fail, naming the peer, rather than claim success.
            let e2 = conn.flush(Duration::from_millis(200)).unwrap_err();
            assert_eq!(e2.peer(), Some(1), "{e2}");
            // The link comes back: TCP retransmits, the stream resumes, and a flush covers every
            // write issued, the one that timed out included.
            run(&["ip", "link", "set", "dat0", "up"]).unwrap();
            let t0 = Instant::now();
            conn.flush(T).unwrap_or_else(|e| panic!("flush after the link came back: {e}"));
            println!("link up again: the flush covering all {issued} chunks succeeded after {:?}", t0.elapsed());
            m.bs.send(1, 7, &(flushed as u64).to_le_bytes()).unwrap();
            m.bs.send(1, 8, &(issued as u64).to_le_bytes()).unwrap();
        } else {
            let n = u64::from_le_bytes(m.bs.recv(0, 7).unwrap().try_into().unwrap()) as usize;
            let issued = u64::from_le_bytes(m.bs.recv(0, 8).unwrap().try_into().unwrap()) as usize;
            // Every chunk issued (chunk k to slot k % SLOTS, the same bytes each time) is there,
            // exactly: the ones flushed before the link went down and the rest after it came back.
            for k in 0..issued.min(SLOTS) {
                let mut got = vec![0u8; CHUNK];
                m.buf.read(k * CHUNK, &mut got).unwrap();
                assert!(got == common::pattern(k as u64, CHUNK), "chunk {k} differs ({n} flushed before the failure)");
            }
            println!("rank 1: all {issued} chunks exact ({n} flushed before the link went down)");
        }
        m.bs.barrier().unwrap();
        return;
    }
    let Some(net) = Net::new(2).unwrap() else { return };
    let text = all_ok(&net.job(NAME, &[("MSCCLPP_SOCKET_IFNAME", "ctl")], T * 2));
    assert!(text.contains("chunks exact"), "{text}");
}

/// Adds latency between two hosts, 20 ms each way: with `tc netem` on `dat0` where the kernel has
/// it; otherwise (the Firecracker VM kernel CI and this machine run has no `sch_netem`) with a
/// userspace wire, TUN devices `wire0` (10.79.0.0/24) joined by a relay thread that holds every
/// packet 20 ms and passes at most 200 Mbit/s each way ([`tun_wire`]); only where neither works,
/// with `tbf` rate limiting on `dat0` (no latency). Bootstrap and connections go over the shaped
/// link. Checked: every write + signal round trip takes at least two one-way delays (physics, not
/// our speed); a flush or wait shorter than the round trip times out naming the peer, no earlier
/// than asked, and a longer one succeeds; several MiB arrive exact both ways; write + flush
/// never beats the link's rate; and (wire) the relay carried the bytes.
#[test]
fn added_latency_keeps_timeouts_and_data_right() {
    const NAME: &str = "added_latency_keeps_timeouts_and_data_right";
    const LEN: usize = 4 << 20;
    const DELAY: Duration = Duration::from_millis(20);
    /// The TUN wire's rate, bits per second each way.
    const WIRE_RATE: u64 = 200_000_000;
    /// Shorter than any round trip (and than 4 MiB at the tbf rate).
    const SHORT: Duration = Duration::from_millis(5);
    if let Some(info) = child(NAME) {
        let var = |k: &str| std::env::var(k).unwrap();
        let iface = var("MSCCLPP_NS_IFACE");
        let delay = Duration::from_millis(var("MSCCLPP_NS_DELAY_MS").parse().unwrap());
        // The most bytes per second a write + flush can reach over the link (0: no bound).
        let max_rate: f64 = var("MSCCLPP_NS_MAX_RATE").parse().unwrap();
        let cfg = EndpointConfig::new(Transport::Ethernet).ethernet_interface(iface.as_str());
        let m = mesh_with(&info, LEN, T, &cfg);
        let subnet = var("MSCCLPP_NS_SUBNET");
        assert!(m.listen.ip().to_string().starts_with(&subnet), "the bootstrap listens on {}, not {subnet}x", m.listen);
        let tx0 = counter(&iface, "tx_bytes");
        let peer = 1 - info.rank;
        let conn = m.conns[peer].as_ref().unwrap();
        let sem = m.sems[peer].as_ref().unwrap();
        let dst = m.remote[peer].as_ref().unwrap();
        let small = Buffer::new(m.comm.context(), 8, Transport::Ethernet.into()).unwrap();
        let word = |k: u64| {
            let mut w = [0u8; 8];
            m.buf.read(0, &mut w).unwrap();
            assert_eq!(u64::from_le_bytes(w), k, "the 8 B written before the signal");
        };
        let send = |k: u64| {
            small.write(0, &k.to_le_bytes()).unwrap();
            conn.write(dst, 0, small.memory(), 0, 8).unwrap();
            sem.signal().unwrap();
        };
        // Runs `op`, which must time out naming the peer and not before SHORT; returns the error
        // and how long it waited.
        let times_out = |what: &str, op: &dyn Fn() -> mscclpp::Result<()>| {
            let t0 = Instant::now();
            let e = op().unwrap_err();
            let waited = t0.elapsed();
            assert_eq!((e.kind(), e.peer()), (ErrorKind::Timeout, Some(peer)), "{e}");
            assert!(waited >= SHORT, "the {SHORT:?} {what} gave up after {waited:?}");
            (e, waited)
        };
        if delay > Duration::ZERO {
            // Write + signal round trips: rank 0 writes k, rank 1 sees it and writes k + 1000 back.
            let mut rtts = Vec::new();
            for k in 0..5 {
                if info.rank == 0 {
                    let t0 = Instant::now();
                    send(k);
                    sem.wait(T).unwrap();
                    rtts.push(t0.elapsed());
                    word(k + 1000);
                } else {
                    sem.wait(T).unwrap();
                    word(k);
                    send(k + 1000);
                }
            }
            if info.rank == 0 {
                let min = *rtts.iter().min().unwrap();
                println!("write + signal round trips over {iface}: {rtts:?}, min {min:?}");
                assert!(min >= 2 * delay, "a round trip of {min:?} over a link delayed {delay:?} each way");
                // A flush shorter than the round trip its acknowledgement needs times out,
                // naming the peer, and not before its time; a longer one succeeds.
                send(5);
                let (e, waited) = times_out("flush", &|| conn.flush(SHORT));
                conn.flush(T).unwrap();
                sem.wait(T).unwrap();
                println!("the {SHORT:?} flush: {e} (after {waited:?}); a {T:?} flush succeeded");
                // So does a wait for the answer to a signal.
                send(6);
                let (e, waited) = times_out("wait", &|| sem.wait(SHORT));
                sem.wait(T).unwrap();
                word(1006);
                println!("the {SHORT:?} wait: {e} (after {waited:?}); a {T:?} wait succeeded");
            } else {
                for k in 5..7 {
                    sem.wait(T).unwrap();
                    word(k);
                    send(k + 1000);
                }
            }
        }
        // 4 MiB one way, timed: a flush returns only once the peer applied the data, so no
        // faster than the link allows.
        if info.rank == 0 {
            let src = Buffer::new(m.comm.context(), LEN, Transport::Ethernet.into()).unwrap();
            src.write(0, &common::pattern(9, LEN)).unwrap();
            let t0 = Instant::now();
            conn.write(dst, 0, src.memory(), 0, LEN as u64).unwrap();
            sem.signal().unwrap();
            let (e, _) = times_out("flush", &|| conn.flush(SHORT));
            conn.flush(T).unwrap();
            let el = t0.elapsed();
            let rate = LEN as f64 / el.as_secs_f64();
            println!("4 MiB over {iface}: {:.2} MB/s ({el:?}); the {SHORT:?} flush: {e}", rate / 1e6);
            assert!(el >= 2 * delay, "{el:?} for a write and flush over a link delayed {delay:?} each way");
            assert!(max_rate == 0.0 || rate <= max_rate, "{rate:.0} B/s over a link of at most {max_rate:.0} B/s");
        } else {
            // The signal comes after 4 MiB on the shaped link: a short wait times out.
            let (e, _) = times_out("wait", &|| sem.wait(SHORT));
            sem.wait(T).unwrap();
            let mut got = vec![0u8; LEN];
            m.buf.read(0, &mut got).unwrap();
            assert!(got == common::pattern(9, LEN), "the data differs");
            println!("rank 1: 4 MiB exact; the {SHORT:?} wait: {e}");
        }
        // Then 4 MiB both ways at once.
        println!("{}", all_pairs_exchange(&m, LEN, T));
        let sent = counter(&iface, "tx_bytes") - tx0;
        println!("host {}: {iface} sent {sent} B", host());
        assert!(sent >= LEN as u64, "{iface} carried only {sent} B of this host's {LEN} B writes");
        m.bs.barrier().unwrap();
        return;
    }
    let Some(net) = Net::new(2).unwrap() else { return };
    // Declared after `net`, so dropped (relay stopped, devices gone) before the namespaces are.
    let mut wire = None;
    let netem = |h: usize| net.exec(h, &["tc", "qdisc", "add", "dev", "dat0", "root", "netem", "delay", "20ms"]);
    // What the ranks are told: the interfaces to bootstrap over (a prefix) and to connect over,
    // the root, the subnet the bootstrap must listen on, the most bytes per second a write can
    // reach over the link (0: no bound) and its delay each way.
    let env = |ifname: &str, master: &str, iface: &str, subnet: &str, max_rate: u64, delay: Duration| {
        [
            ("MSCCLPP_SOCKET_IFNAME", ifname.to_string()),
            ("MASTER_ADDR", master.to_string()),
            ("MSCCLPP_NS_IFACE", iface.to_string()),
            ("MSCCLPP_NS_SUBNET", subnet.to_string()),
            ("MSCCLPP_NS_MAX_RATE", max_rate.to_string()),
            ("MSCCLPP_NS_DELAY_MS", delay.as_millis().to_string()),
        ]
    };
    let (shaping, env) = match netem(0) {
        Ok(()) => {
            netem(1).unwrap();
            ("netem", env("dat", "10.77.0.1", "dat0", "10.77.0.", 0, DELAY))
        }
        Err(netem_err) => {
            // A queue of 4096 packets holds the bandwidth-delay product (1 MB) and TCP's
            // slow-start overshoot, so nothing is dropped here (1000 dropped a few hundred:
            // retransmitted, the data still exact, the transfer slower).
            let cfg = tun_wire::WireConfig { delay: DELAY, rate_bits: Some(WIRE_RATE), queue_packets: 4096, mtu: 1500 };
            let (ns0, ns1) = (net.hosts[0].as_str(), net.hosts[1].as_str());
            match tun_wire::Wire::new([ns0, ns1], "wire0", ["10.79.0.1/24", "10.79.0.2/24"], cfg) {
                Ok(w) => {
                    eprintln!("tc netem is not available here ({netem_err}); a TUN wire adds the latency");
                    wire = Some(w);
                    ("wire", env("wire", "10.79.0.1", "wire0", "10.79.0.", WIRE_RATE / 8, DELAY))
                }
                Err(wire_err) => {
                    eprintln!("neither tc netem ({netem_err}) nor a TUN wire ({wire_err}) here: tbf, no latency");
                    for h in 0..2 {
                        let tbf = ["tc", "qdisc", "add", "dev", "dat0", "root", "tbf", "rate", "40mbit"];
                        net.exec(h, &[&tbf[..], &["burst", "32kb", "latency", "400ms"]].concat()).unwrap();
                    }
                    // Bootstrap over ctl0; 5 MB/s, +10% for tbf's burst and the clock.
                    ("tbf", env("ctl", "node0", "dat0", "10.78.0.", 5_500_000, Duration::ZERO))
                }
            }
        }
    };
    println!(
        "link: {shaping} (netem: 20 ms each way on dat0; wire: 20 ms each way and 200 Mbit/s on TUN wire0; \
         tbf: 40 Mbit/s on dat0)"
    );
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let text = all_ok(&net.job(NAME, &env, T * 2));
    assert!(text.contains("rank 1: 4 MiB exact"), "{text}");
    if shaping != "tbf" {
        assert!(text.contains("round trips over"), "{text}");
    }
    if let Some(w) = &wire {
        let s = w.stats();
        println!("wire 0->1: {}\nwire 1->0: {}", s[0], s[1]);
        assert_eq!(w.failure(), None, "the relay stopped");
        // Rank 0 sent 8 MiB (one way, then the exchange), rank 1 4 MiB, all through the relay.
        assert!(s[0].bytes >= 2 * LEN as u64 && s[1].bytes >= LEN as u64, "the relay carried too little: {s:?}");
        for d in s {
            assert!(d.max_packet <= 1500, "a {} B packet on a wire with MTU 1500", d.max_packet);
            assert_eq!(d.write_errors, 0, "{s:?}");
        }
    }
}

#[test]
fn ipv6_hosts_bootstrap_by_literal_and_by_name() {
    const NAME: &str = "ipv6_hosts_bootstrap_by_literal_and_by_name";
    if let Some(info) = child(NAME) {
        let m = mesh(&info, 1 << 20, T);
        let addr = m.listen;
        assert!(addr.is_ipv6(), "MSCCLPP_SOCKET_FAMILY=AF_INET6, yet the bootstrap listens on {addr}");
        println!(
            "{} (root {}, listening on {addr})",
            all_pairs_exchange(&m, 1 << 20, T),
            info.root.as_ref().unwrap().spec
        );
        return;
    }
    let Some(net) = Net::new(2).unwrap() else { return };
    for master in ["fd78::1", "node0-v6"] {
        let env = [("MASTER_ADDR", master), ("MSCCLPP_SOCKET_FAMILY", "AF_INET6"), ("MSCCLPP_SOCKET_IFNAME", "dat")];
        let text = all_ok(&net.job(NAME, &env, T * 2));
        assert!(text.contains("rank 1 of 2: exchanged 1048576 B with 1 peers, all exact"), "{text}");
    }
}

/// The TUN wire itself ([`tun_wire`], the latency test's stand-in for netem): a burst of 100
/// numbered UDP datagrams from host 0 to host 1 through a wire with a 200 ms delay and a
/// 32-packet queue. Every datagram that arrives spent at least the delay on the way, they arrive
/// in the order sent, the relay's counters account for every one (delivered or dropped as the
/// queue overflowed), and dropping the wire deletes its devices.
#[test]
fn tun_wire_delays_every_packet_in_order_and_counts_drops() {
    const N: u64 = 100;
    const DELAY: Duration = Duration::from_millis(200);
    let Some(net) = Net::new(2).unwrap() else { return };
    let cfg = tun_wire::WireConfig { delay: DELAY, rate_bits: None, queue_packets: 32, mtu: 1500 };
    let (ns0, ns1) = (net.hosts[0].clone(), net.hosts[1].clone());
    let wire = match tun_wire::Wire::new([&ns0, &ns1], "wire0", ["10.79.0.1/24", "10.79.0.2/24"], cfg) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("SKIPPED: no TUN wire here: {e}");
            return;
        }
    };
    let udp = |ns: &str, addr: &'static str| {
        tun_wire::in_netns(ns, move || std::net::UdpSocket::bind(addr).map_err(|e| format!("bind {addr}: {e}")))
    };
    let rx = udp(&ns1, "10.79.0.2:9000").unwrap();
    let tx = udp(&ns0, "10.79.0.1:0").unwrap();
    rx.set_read_timeout(Some(DELAY * 3)).unwrap();
    // Each datagram: its number and when it was sent (nanoseconds after `base`).
    let base = Instant::now();
    for k in 0..N {
        let sent = base.elapsed().as_nanos() as u64;
        tx.send_to(&[k.to_le_bytes(), sent.to_le_bytes()].concat(), "10.79.0.2:9000").unwrap();
    }
    let mut got = Vec::new();
    let mut b = [0u8; 64];
    // Until nothing more comes for three delays.
    while let Ok(n) = rx.recv(&mut b) {
        let arrived = base.elapsed();
        assert_eq!(n, 16);
        let k = u64::from_le_bytes(b[..8].try_into().unwrap());
        let sent = Duration::from_nanos(u64::from_le_bytes(b[8..16].try_into().unwrap()));
        assert!(arrived - sent >= DELAY, "datagram {k} took {:?} over a wire delaying {DELAY:?}", arrived - sent);
        got.push(k);
    }
    let s = wire.stats();
    println!("{} of {N} datagrams arrived ({got:?}); wire 0->1: {}; 1->0: {}", got.len(), s[0], s[1]);
    assert!(got.windows(2).all(|w| w[0] < w[1]), "out of order: {got:?}");
    assert_eq!(s[0].packets, got.len() as u64, "{s:?}");
    assert_eq!(s[0].packets + s[0].dropped, N, "{s:?}");
    // The burst takes well under the delay, so the queue fills: 32 held, the rest dropped.
    assert_eq!(s[0].max_queue, 32, "{s:?}");
    assert!(s[0].dropped > 0, "{s:?}");
    assert_eq!((s[0].write_errors, s[1].packets), (0, 0), "{s:?}");
    drop(wire);
    for ns in [&ns0, &ns1] {
        assert!(run(&["ip", "-n", ns, "link", "show", "wire0"]).is_err(), "wire0 left in {ns}");
    }
}

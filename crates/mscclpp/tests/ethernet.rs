//! The Ethernet transport between real processes on loopback: the shared connection suite
//! (`common/suite.rs`) and Ethernet's own tests.

mod common;

use std::time::{Duration, Instant};

use common::Rank;
use common::harnesses;
use common::suite::{Harness, Mode, T, setup};
use mscclpp::{Buffer, ErrorKind, Transport};

static ETHERNET: Harness = Harness { mode: Mode::Processes, ..harnesses::ETHERNET };

connection_suite!(&ETHERNET);

/// flush returns Timeout (naming the peer) when the peer stops reading.
#[test]
fn flush_times_out_when_peer_stalls() {
    if let Some(r) = Rank::from_env() {
        let s = setup(&r, &ETHERNET, 64 << 20, None);
        if r.rank == 1 {
            // Stop this process (not kill) so its sockets stay open but nothing is read.
            s.bs.barrier().unwrap();
            let _ = std::process::Command::new("kill").args(["-STOP", &std::process::id().to_string()]).status();
            return;
        }
        s.bs.barrier().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let conn = s.conns[1].as_ref().unwrap();
        let src = Buffer::new(s.comm.context(), 64 << 20, Transport::Ethernet.into()).unwrap();
        conn.write(s.remote[1].as_ref().unwrap(), 0, src.memory(), 0, 64 << 20).unwrap();
        let t0 = Instant::now();
        let e = conn.flush(Duration::from_millis(500)).unwrap_err();
        let el = t0.elapsed();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert_eq!(e.peer(), Some(1));
        assert!(e.to_string().contains("not yet applied"), "{e}");
        // the structured detail, not only the text
        assert_eq!((e.operation(), e.transport()), (Some("flush"), Some(Transport::Ethernet)), "{e}");
        assert!(e.outstanding().is_some_and(|n| n >= 1), "{e}: outstanding {:?}", e.outstanding());
        assert!(el < Duration::from_secs(2), "{el:?}");
        println!("{e}");
        std::process::exit(0);
    }
    let job = common::spawn_some("flush_times_out_when_peer_stalls", 2, &[0, 1], T, &[], Duration::from_secs(8));
    let (_, o) = &job.outputs[0];
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
}

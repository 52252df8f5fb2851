//! The README's "A first program", whole: two ranks as two threads of one process, over Ethernet.
//!
//! The lines between the `README` markers are the README's snippet, word for word
//! (`tests/examples.rs` checks that they match and runs this program).

use std::sync::Arc;
use std::time::Duration;

use mscclpp::{Bootstrap, Buffer, Communicator, EndpointConfig, Host2HostSemaphore, TcpBootstrap, Transport, UniqueId};

fn rank_main(rank: usize, unique_id: &UniqueId) -> mscclpp::Result<()> {
    let peer = 1 - rank;
    // README begin
    let bs = Arc::new(TcpBootstrap::initialize(rank, 2, unique_id)?);
    let comm = Communicator::new(bs.clone());
    let buf = Buffer::new(comm.context(), 1 << 20, Transport::Ethernet.into())?;
    comm.send_memory(buf.memory(), peer, 0)?;
    let conn = comm.connect(&EndpointConfig::new(Transport::Ethernet), peer, 0)?.wait()?;
    let peer_buf = comm.recv_memory(peer, 0)?.wait()?;
    let sem = Host2HostSemaphore::new(comm.build_semaphore(&conn, peer, 0)?.wait()?)?;
    if rank == 0 {
        let src = Buffer::new(comm.context(), 64, Transport::Ethernet.into())?;
        src.write(0, b"hello from rank 0")?;
        conn.write(&peer_buf, 0, src.memory(), 0, 17)?; // asynchronous
        sem.signal()?; // lands after the write
        conn.flush(Duration::from_secs(5))?; // or Timeout naming the peer
    } else {
        sem.wait(Duration::from_secs(5))?; // the write has landed
        let mut got = [0u8; 17];
        buf.read(0, &mut got)?;
        println!("rank 1 received: {}", String::from_utf8_lossy(&got));
    }
    bs.barrier()?;
    // README end
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let id = TcpBootstrap::create_unique_id()?;
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let id = id.clone();
            std::thread::spawn(move || rank_main(rank, &id))
        })
        .collect();
    for (rank, t) in ranks.into_iter().enumerate() {
        t.join().map_err(|_| format!("rank {rank} panicked"))??;
    }
    println!("first_program: OK");
    Ok(())
}

//! Two ranks over Ethernet: bootstrap, register a buffer, connect, write, signal, wait, verify.
//!
//! Run it with `cargo run --example two_ranks_ethernet`: it starts both ranks as child processes
//! of itself. Under a launcher, set `RANK`, `WORLD_SIZE=2` and `MSCCLPP_UNIQUE_ID` yourself.

use std::sync::Arc;
use std::time::Duration;

use mscclpp::{
    Bootstrap, Buffer, Communicator, EndpointConfig, Host2HostSemaphore, RootServer, TcpBootstrap, Transport, UniqueId,
};

fn rank_main(rank: usize, id: &UniqueId) -> mscclpp::Result<()> {
    let timeout = Duration::from_secs(30);
    // 1. Bootstrap: find the other rank.
    let bootstrap = Arc::new(TcpBootstrap::config(rank, 2).timeout(timeout).initialize(id)?);
    let comm = Communicator::new(bootstrap.clone());
    let peer = 1 - rank;

    // 2. Register a buffer that the peer may write into, and tell the peer about it.
    let buffer = Buffer::new(comm.context(), 1 << 20, Transport::Ethernet.into())?;
    comm.send_memory(buffer.memory(), peer, 0)?;
    let peer_buffer = comm.recv_memory(peer, 0)?;

    // 3. Connect over TCP (loopback here) and build a semaphore on the connection.
    let config = EndpointConfig::new(Transport::Ethernet).ethernet_interface("127.0.0.1");
    let connection = comm.connect(&config, peer, 0)?.wait()?;
    let peer_buffer = peer_buffer.wait()?;
    let semaphore = Host2HostSemaphore::new(comm.build_semaphore(&connection, peer, 0)?.wait()?)?;

    // 4. Rank 0 writes a message into rank 1's buffer and signals; rank 1 waits and reads it.
    if rank == 0 {
        let source = Buffer::new(comm.context(), 1 << 20, Transport::Ethernet.into())?;
        source.write(0, b"hello from rank 0")?;
        connection.write(&peer_buffer, 100, source.memory(), 0, 17)?;
        semaphore.signal()?; // lands after the write
        connection.flush(timeout)?;
        semaphore.wait(timeout)?; // rank 1 has read it
    } else {
        semaphore.wait(timeout)?;
        let mut got = [0u8; 17];
        buffer.read(100, &mut got)?;
        assert_eq!(&got, b"hello from rank 0");
        println!("rank 1 received: {}", String::from_utf8_lossy(&got));
        semaphore.signal()?;
        connection.flush(timeout)?;
    }
    bootstrap.barrier()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let (Ok(rank), Ok(id)) = (std::env::var("RANK"), std::env::var("MSCCLPP_UNIQUE_ID")) {
        return Ok(rank_main(rank.parse()?, &id.parse()?)?);
    }
    // Launcher: a root for two ranks, and this program twice.
    let (root, id) = RootServer::start(2, Duration::from_secs(30))?;
    let me = std::env::current_exe()?;
    let children: Vec<_> = (0..2)
        .map(|r| {
            std::process::Command::new(&me)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("MSCCLPP_UNIQUE_ID", id.to_string())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    for mut c in children {
        if !c.wait()?.success() {
            return Err("a rank failed".into());
        }
    }
    root.join();
    println!("two_ranks_ethernet: OK");
    Ok(())
}

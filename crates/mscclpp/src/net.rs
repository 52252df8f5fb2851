//! Interface choice and address parsing shared by the bootstrap and the Ethernet transport.
//!
//! The order follows MSCCL++ (itself from NCCL): interfaces named by `MSCCLPP_SOCKET_IFNAME` if set;
//! otherwise InfiniBand (`ib*`) interfaces first, then any other interface but `docker*` and
//! loopback, then `docker*`, and loopback last. `MSCCLPP_SOCKET_FAMILY` restricts the family.
//! IPv6 link-local addresses are skipped (they need a scope to be dialled).

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::env::{IfnameFilter, SocketFamily};
use crate::error::{Error, ErrorKind, Result};
use crate::sync::{Backoff, BackoffPolicy, Deadline};

/// One address of one network interface.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Interface {
    /// The interface name, such as `eth0`.
    pub name: String,
    /// One of its addresses.
    pub addr: IpAddr,
}

fn rank_of(name: &str) -> u8 {
    if name.starts_with("ib") {
        0
    } else if name.starts_with("docker") {
        2
    } else if name == "lo" || name.starts_with("lo:") {
        3
    } else {
        1
    }
}

/// Orders and filters raw `(name, addr)` pairs by the rules above.
pub(crate) fn order_interfaces(
    raw: Vec<Interface>,
    filter: Option<&IfnameFilter>,
    family: Option<SocketFamily>,
) -> Vec<Interface> {
    let mut v: Vec<Interface> = raw
        .into_iter()
        .filter(|i| match i.addr {
            IpAddr::V4(_) => family != Some(SocketFamily::Inet6),
            IpAddr::V6(a) => {
                family != Some(SocketFamily::Inet) && !a.is_loopback() && (a.segments()[0] & 0xffc0) != 0xfe80
            }
        })
        .filter(|i| filter.is_none_or(|f| f.matches(&i.name)))
        .collect();
    // stable: within a class keep the system's order, IPv4 before IPv6
    v.sort_by_key(|i| (rank_of(&i.name), i.addr.is_ipv6()));
    v
}

fn system_interfaces() -> Result<Vec<Interface>> {
    let addrs =
        nix::ifaddrs::getifaddrs().map_err(|e| Error::new(ErrorKind::System, format!("getifaddrs failed: {e}")))?;
    let mut out = Vec::new();
    for a in addrs {
        if !a.flags.contains(nix::net::if_::InterfaceFlags::IFF_UP) {
            continue;
        }
        let Some(sa) = a.address else { continue };
        let ip = if let Some(v4) = sa.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = sa.as_sockaddr_in6() {
            IpAddr::V6(v6.ip())
        } else {
            continue;
        };
        out.push(Interface { name: a.interface_name, addr: ip });
    }
    Ok(out)
}

/// The usable interfaces of this machine, best first, honouring the `MSCCLPP_SOCKET_*` variables.
///
/// # Errors
/// A bad variable, or no interface left after filtering.
pub fn find_interfaces() -> Result<Vec<Interface>> {
    let env = crate::env::env()?;
    let v = order_interfaces(system_interfaces()?, env.socket_ifname.as_ref(), env.socket_family);
    if v.is_empty() {
        return Err(Error::new(
            ErrorKind::System,
            format!(
                "no usable network interface found (MSCCLPP_SOCKET_IFNAME={:?}, MSCCLPP_SOCKET_FAMILY={:?})",
                std::env::var("MSCCLPP_SOCKET_IFNAME").unwrap_or_default(),
                std::env::var("MSCCLPP_SOCKET_FAMILY").unwrap_or_default()
            ),
        ));
    }
    Ok(v)
}

/// Resolves an interface name or an IP address to an IP address of this machine.
pub fn resolve_interface(spec: &str) -> Result<IpAddr> {
    if let Ok(ip) = spec.parse::<IpAddr>() {
        return Ok(ip);
    }
    let all = system_interfaces()?;
    let v =
        order_interfaces(all, Some(&IfnameFilter { exclude: false, exact: true, names: vec![spec.to_string()] }), None);
    v.first()
        .map(|i| i.addr)
        .ok_or_else(|| Error::invalid_usage(format!("no interface named {spec:?} with a usable address")))
}

/// Parses `"[iface:]ip:port"` (IPv6 as `[addr]:port`) into an address; with an interface prefix,
/// the address must belong to... nothing: the prefix only names where to listen when this rank is
/// the root, as in MSCCL++.
pub(crate) fn parse_addr_spec(spec: &str) -> Result<(Option<String>, SocketAddr)> {
    let s = spec.trim();
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok((None, a));
    }
    if let Some((iface, rest)) = s.split_once(':')
        && let Ok(a) = rest.parse::<SocketAddr>()
    {
        return Ok((Some(iface.to_string()), a));
    }
    Err(Error::invalid_usage(format!("{spec:?} is not an address of the form [iface:]ip:port")))
}

/// The unspecified-address placeholder used where no address applies.
pub(crate) const NO_ADDR: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);

/// Encodes a socket address as family byte, 16 address bytes and the port.
pub(crate) fn put_addr(w: &mut crate::wire::Writer, a: &SocketAddr) {
    match a.ip() {
        IpAddr::V4(ip) => {
            w.u8(4);
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&ip.octets());
            w.raw(&b);
        }
        IpAddr::V6(ip) => {
            w.u8(6);
            w.raw(&ip.octets());
        }
    }
    w.u16(a.port());
}

/// Decodes what [`put_addr`] wrote.
pub(crate) fn get_addr(r: &mut crate::wire::Reader<'_>) -> Result<SocketAddr> {
    let fam = r.u8()?;
    let b: [u8; 16] = r.array()?;
    let port = r.u16()?;
    let ip = match fam {
        4 if b[4..].iter().any(|&x| x != 0) => return Err(r.err("IPv4 address with non-zero padding")),
        4 => IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3])),
        6 => IpAddr::V6(b.into()),
        f => return Err(r.err(format!("unknown address family {f}"))),
    };
    Ok(SocketAddr::new(ip, port))
}

/// A socket address alone on the wire is the 19 bytes [`put_addr`] writes (inside the endpoint,
/// the UniqueId and the bootstrap messages); checked on its own so every form that embeds it
/// inherits a canonical address.
impl crate::wire::WireForm for SocketAddr {
    const WHAT: &'static str = "socket address";
    fn to_wire(&self) -> Vec<u8> {
        let mut w = crate::wire::Writer::default();
        put_addr(&mut w, self);
        w.finish()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let mut r = crate::wire::Reader::bare(bytes, Self::WHAT);
        let a = get_addr(&mut r)?;
        r.finish()?;
        Ok(a)
    }
}

/// Connects to `addr`, retrying refused or unreachable attempts until `deadline`.
pub(crate) fn connect_retry(addr: SocketAddr, deadline: Instant, what: &str) -> Result<TcpStream> {
    let deadline = Deadline::at(deadline);
    let mut backoff = Backoff::new(BackoffPolicy::RETRY);
    let mut last: Option<std::io::Error> = None;
    loop {
        let left = deadline.remaining();
        if left.is_zero() {
            let why = last.map(|e| e.to_string()).unwrap_or_else(|| "no attempt finished".into());
            return Err(Error::new(ErrorKind::Timeout, format!("could not connect to {what} at {addr} ({why})")));
        }
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => {
                last = Some(e);
                backoff.snooze(&deadline);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn i(name: &str, a: &str) -> Interface {
        Interface { name: name.into(), addr: a.parse().unwrap() }
    }

    #[test]
    fn order_puts_loopback_last_and_ib_first() {
        let raw = vec![
            i("lo", "127.0.0.1"),
            i("lo", "::1"),
            i("docker0", "172.17.0.1"),
            i("eth0", "fe80::1"),
            i("eth0", "fd00::2"),
            i("eth0", "192.0.2.2"),
            i("ib0", "10.0.0.1"),
        ];
        let v = order_interfaces(raw.clone(), None, None);
        let names: Vec<String> = v.iter().map(|x| format!("{}/{}", x.name, x.addr)).collect();
        assert_eq!(names, ["ib0/10.0.0.1", "eth0/192.0.2.2", "eth0/fd00::2", "docker0/172.17.0.1", "lo/127.0.0.1"]);
        let f = IfnameFilter::parse("lo").unwrap();
        assert_eq!(order_interfaces(raw.clone(), Some(&f), None), vec![i("lo", "127.0.0.1")]);
        let v6 = order_interfaces(raw, None, Some(SocketFamily::Inet6));
        assert_eq!(v6, vec![i("eth0", "fd00::2")]);
    }

    proptest::proptest! {
        #[test]
        fn socket_addr_wire_form(ip in proptest::prelude::any::<IpAddr>(), port: u16,
                                 junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40)) {
            crate::wire::check::check_value(&SocketAddr::new(ip, port));
            crate::wire::check::check_bytes::<SocketAddr>(&junk);
        }
    }

    #[test]
    fn socket_addr_refuses_bad_family_and_padding() {
        use crate::wire::WireForm;
        let mut b = "10.0.0.1:80".parse::<SocketAddr>().unwrap().to_wire();
        assert_eq!(b.len(), 19);
        b[0] = 5;
        assert!(SocketAddr::from_wire(&b).unwrap_err().to_string().contains("unknown address family 5"));
        b[0] = 4;
        b[10] = 1;
        assert!(SocketAddr::from_wire(&b).unwrap_err().to_string().contains("padding"));
    }

    #[test]
    fn addr_specs() {
        assert_eq!(parse_addr_spec("127.0.0.1:80").unwrap(), (None, "127.0.0.1:80".parse().unwrap()));
        assert_eq!(parse_addr_spec("eth0:10.1.2.3:9").unwrap(), (Some("eth0".into()), "10.1.2.3:9".parse().unwrap()));
        assert_eq!(parse_addr_spec("[::1]:5").unwrap().1, "[::1]:5".parse().unwrap());
        assert!(parse_addr_spec("nonsense").is_err());
        assert!(parse_addr_spec("1.2.3.4").is_err());
    }

    #[test]
    fn this_machine_has_an_interface() {
        let v = find_interfaces().unwrap();
        assert!(!v.is_empty());
        assert_eq!(resolve_interface("lo").unwrap(), "127.0.0.1".parse::<IpAddr>().unwrap());
        assert!(resolve_interface("no-such-if0").is_err());
    }
}

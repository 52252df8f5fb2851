//! Interface choice and address parsing shared by the bootstrap and the Ethernet transport.
//!
//! The order follows MSCCL++ (itself from NCCL): interfaces named by `MSCCLPP_SOCKET_IFNAME` if set;
//! otherwise InfiniBand (`ib*`) interfaces first, then any other interface but `docker*` and
//! loopback, then `docker*`, and loopback last. `MSCCLPP_SOCKET_FAMILY` restricts the family.
//! IPv6 link-local addresses are skipped (they need a scope to be dialled).

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::Duration;

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

/// Parses `"[iface:]host:port"` into an address, honouring `MSCCLPP_SOCKET_FAMILY`.
///
/// `host` is an IPv4 address, an IPv6 address in brackets (`[::1]:port`) or a host name
/// (`localhost`, this machine's name), resolved through the system resolver. The interface
/// prefix only names where to listen when this rank is the root, as in MSCCL++. See
/// [`parse_addr_spec_with`] for the rules.
///
/// # Errors
/// A malformed spec, a name that does not resolve, or one with no address of the family asked.
pub fn parse_addr_spec(spec: &str) -> Result<(Option<String>, SocketAddr)> {
    parse_addr_spec_with(spec, crate::env::env()?.socket_family)
}

/// [`parse_addr_spec`] with the family given rather than read from `MSCCLPP_SOCKET_FAMILY`.
///
/// A literal address must be of `family` (when one is given). A name is resolved with
/// [`ToSocketAddrs`]; of its addresses, those of `family` are kept, and without a family the
/// first IPv4 address is taken if there is one (every rank then picks the same address, as the
/// interface order does), else the first IPv6 address.
///
/// # Errors
/// As for [`parse_addr_spec`]; the message names the spec and, for a name, the resolver's error.
pub fn parse_addr_spec_with(spec: &str, family: Option<SocketFamily>) -> Result<(Option<String>, SocketAddr)> {
    let s = spec.trim();
    let form = || {
        Error::invalid_usage(format!(
            "{spec:?} is not an address of the form [iface:]host:port (host: a name, an IPv4 address or \
             [IPv6 address])"
        ))
    };
    let (iface, host, port) = if let Ok(a) = s.parse::<SocketAddr>() {
        (None, a.ip().to_string(), a.port())
    } else {
        let (left, port) = s.rsplit_once(':').ok_or_else(form)?;
        let port: u16 = port.parse().map_err(|_| form())?;
        let (iface, host) = if let Some(l) = left.strip_suffix(']') {
            let (pre, h) = l.rsplit_once('[').ok_or_else(form)?;
            let iface = match pre {
                "" => None,
                p => Some(p.strip_suffix(':').filter(|i| !i.is_empty() && !i.contains(':')).ok_or_else(form)?),
            };
            h.parse::<std::net::Ipv6Addr>().map_err(|_| form())?;
            (iface, h)
        } else {
            match left.split_once(':') {
                Some((i, h)) if !i.is_empty() && !h.contains(':') => (Some(i), h),
                Some(_) => return Err(form()),
                None => (None, left),
            }
        };
        if host.is_empty() || host.contains(['[', ']', ' ']) {
            return Err(form());
        }
        (iface.map(str::to_string), host.to_string(), port)
    };
    let ok_family = |a: &SocketAddr| match family {
        Some(SocketFamily::Inet) => a.is_ipv4(),
        Some(SocketFamily::Inet6) => a.is_ipv6(),
        None => true,
    };
    let fam_name = match family {
        Some(SocketFamily::Inet) => "AF_INET",
        Some(SocketFamily::Inet6) => "AF_INET6",
        None => "any",
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        let a = SocketAddr::new(ip, port);
        if !ok_family(&a) {
            return Err(Error::invalid_usage(format!(
                "address {ip} in {spec:?} is not of the family MSCCLPP_SOCKET_FAMILY={fam_name} asks for"
            )));
        }
        return Ok((iface, a));
    }
    let all: Vec<SocketAddr> = (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| Error::invalid_usage(format!("cannot resolve host name {host:?} in {spec:?}: {e}")))?
        .collect();
    let kept: Vec<&SocketAddr> = all.iter().filter(|a| ok_family(a)).collect();
    let pick = kept.iter().find(|a| a.is_ipv4()).or_else(|| kept.first());
    match pick {
        Some(a) => Ok((iface, **a)),
        None if all.is_empty() => {
            Err(Error::invalid_usage(format!("host name {host:?} in {spec:?} resolves to no address")))
        }
        None => Err(Error::invalid_usage(format!(
            "host name {host:?} in {spec:?} resolves only to {} (MSCCLPP_SOCKET_FAMILY={fam_name})",
            all.iter().map(|a| a.ip().to_string()).collect::<Vec<_>>().join(", ")
        ))),
    }
}

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
pub(crate) fn connect_retry(addr: SocketAddr, deadline: Deadline, what: &str) -> Result<TcpStream> {
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

/// A listener whose accept thread can be stopped by a flag alone: [`next`](Self::next) waits in
/// `poll` for at most [`STOP_CHECK`](Self::STOP_CHECK) at a time and looks at the flag in between.
/// A connection to oneself is then only the fast way to wake it (it can fail, e.g. on an
/// address taken off its interface), never the only one. The listener is non-blocking, so a
/// connection gone between the poll and the accept cannot block it either.
pub(crate) struct StoppableListener {
    listener: TcpListener,
    polled: bool,
}

impl StoppableListener {
    /// How long the accept thread may sleep before it looks at its stop flag.
    pub(crate) const STOP_CHECK: Duration = Duration::from_millis(100);

    pub(crate) fn new(listener: TcpListener) -> Self {
        // Without O_NONBLOCK (never seen) accepts block as before and only the wake-up
        // connection stops the thread.
        let polled = listener.set_nonblocking(true).is_ok();
        StoppableListener { listener, polled }
    }

    /// The next incoming connection (a blocking socket), an accept error for the caller to log
    /// and pace, or `None` once `stop()` says so.
    pub(crate) fn next(&self, stop: impl Fn() -> bool) -> Option<std::io::Result<TcpStream>> {
        loop {
            if stop() {
                return None;
            }
            if self.polled && !readable(&self.listener, Self::STOP_CHECK) {
                continue;
            }
            match self.listener.accept() {
                // Accepted sockets do not inherit O_NONBLOCK on Linux; be explicit.
                Ok((s, _)) => return Some(s.set_nonblocking(false).map(|()| s)),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => {}
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// The listening address.
    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// Whether the socket has something to read (or an error or end; for a listener: a connection
/// waits), waiting up to `timeout`.
pub(crate) fn readable(s: &impl std::os::fd::AsFd, timeout: Duration) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
    let mut fds = [PollFd::new(s.as_fd(), PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::from(ms)) {
        Ok(n) => n > 0,
        // Interrupted: let the caller look again.
        Err(_) => false,
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
        let p = |s: &str| parse_addr_spec_with(s, None);
        assert_eq!(p("127.0.0.1:80").unwrap(), (None, "127.0.0.1:80".parse().unwrap()));
        assert_eq!(p("eth0:10.1.2.3:9").unwrap(), (Some("eth0".into()), "10.1.2.3:9".parse().unwrap()));
        assert_eq!(p("[::1]:5").unwrap(), (None, "[::1]:5".parse().unwrap()));
        assert_eq!(p("eth0:[fd00::2]:7").unwrap(), (Some("eth0".into()), "[fd00::2]:7".parse().unwrap()));
        for bad in ["nonsense", "1.2.3.4", "host:", ":80", "host:99999", "::1:5", "a:b:c:5", "[::1:5", "[nope]:5"] {
            let err = p(bad).unwrap_err();
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn host_names_resolve() {
        // localhost: an IPv4 loopback address is preferred when no family is asked
        let (i, a) = parse_addr_spec_with("localhost:1234", None).unwrap();
        assert_eq!((i, a.port()), (None, 1234));
        assert!(a.ip().is_loopback(), "{a}");
        let (i, a) = parse_addr_spec_with("lo:localhost:9", Some(SocketFamily::Inet)).unwrap();
        assert_eq!(i.as_deref(), Some("lo"));
        assert!(a.is_ipv4() && a.ip().is_loopback(), "{a}");
        // this machine's own name
        let me = nix::unistd::gethostname().unwrap().into_string().unwrap();
        let (_, a) = parse_addr_spec_with(&format!("{me}:80"), None).unwrap();
        assert_eq!(a.port(), 80);
        // a name that does not resolve names itself
        let err = parse_addr_spec_with("no-such-host.invalid:80", None).unwrap_err();
        assert!(err.to_string().contains("cannot resolve host name \"no-such-host.invalid\""), "{err}");
        assert_eq!(err.kind(), ErrorKind::InvalidUsage);
    }

    #[test]
    fn family_filtering() {
        let v6 = Some(SocketFamily::Inet6);
        let v4 = Some(SocketFamily::Inet);
        assert!(parse_addr_spec_with("[::1]:5", v6).is_ok());
        let err = parse_addr_spec_with("[::1]:5", v4).unwrap_err();
        assert!(err.to_string().contains("AF_INET"), "{err}");
        let err = parse_addr_spec_with("127.0.0.1:5", v6).unwrap_err();
        assert!(err.to_string().contains("AF_INET6"), "{err}");
        // a name with addresses of the other family only: the error lists what it resolved to
        match "localhost:5".to_socket_addrs().map(|v| v.collect::<Vec<_>>()) {
            Ok(v) if v.iter().all(|a| a.is_ipv4()) => {
                let err = parse_addr_spec_with("localhost:5", v6).unwrap_err();
                assert!(err.to_string().contains("resolves only to 127."), "{err}");
            }
            Ok(v) => {
                let (_, a) = parse_addr_spec_with("localhost:5", v6).unwrap();
                assert!(a.is_ipv6() && v.contains(&a), "{a}");
            }
            Err(e) => panic!("localhost does not resolve here: {e}"),
        }
    }

    #[test]
    fn this_machine_has_an_interface() {
        let v = find_interfaces().unwrap();
        assert!(!v.is_empty());
        assert_eq!(resolve_interface("lo").unwrap(), "127.0.0.1".parse::<IpAddr>().unwrap());
        assert!(resolve_interface("no-such-if0").is_err());
    }
}

//! [`UniqueId`]: what a job's ranks share to find each other, and its byte and text forms.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::net::{get_addr, put_addr};
use crate::wire::{Reader, WireForm, Writer};

const ID_MAGIC: &[u8; 4] = b"MSID";
/// The `UniqueId` form's version (the messages between ranks have their own, in `proto`).
const VERSION: u16 = 1;

/// What a job's ranks share to find each other: the root's address and a 128-bit secret drawn
/// from the OS. Create it on one process, pass it to every rank (MPI broadcast, a file, an
/// environment variable through `Display`/`FromStr`), then call [`TcpBootstrap::initialize`](super::TcpBootstrap::initialize).
///
/// C++ MSCCL++: `UniqueId` (128 bytes, as here).
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    pub(super) root: SocketAddr,
    pub(super) secret: [u8; 16],
    /// The root runs in a [`RootServer`](super::RootServer), not in rank 0.
    pub(super) external_root: bool,
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // never print the secret
        f.debug_struct("UniqueId").field("root", &self.root).field("external_root", &self.external_root).finish()
    }
}

impl UniqueId {
    /// Size of [`to_bytes`](Self::to_bytes).
    pub const BYTES: usize = 128;

    /// The root's address.
    pub fn root_addr(&self) -> SocketAddr {
        self.root
    }

    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new(ID_MAGIC, VERSION);
        put_addr(&mut w, &self.root);
        w.raw(&self.secret);
        w.u8(self.external_root as u8);
        w.finish()
    }

    /// A fixed-size form, for MPI broadcasts (zero-padded).
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        let e = self.encode();
        out[..e.len()].copy_from_slice(&e);
        out
    }

    /// Reads [`to_bytes`](Self::to_bytes) output, or a prefix of it that keeps every field (at
    /// most [`BYTES`](Self::BYTES) bytes; whatever follows the fields must be zero padding).
    ///
    /// # Errors
    /// `InvalidUsage` for anything else (never panics).
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        if b.len() > Self::BYTES {
            return Err(Error::invalid_usage(format!("a UniqueId is at most {} bytes, not {}", Self::BYTES, b.len())));
        }
        let mut r = Reader::new(b, "UniqueId", ID_MAGIC, VERSION)?;
        let id = Self::read_fields(&mut r)?;
        if r.rest().iter().any(|&x| x != 0) {
            return Err(Error::invalid_usage("malformed UniqueId: non-zero bytes after the fields"));
        }
        Ok(id)
    }

    fn read_fields(r: &mut Reader<'_>) -> Result<UniqueId> {
        let root = get_addr(r)?;
        let secret = r.array()?;
        let external_root = match r.u8()? {
            0 => false,
            1 => true,
            x => return Err(r.err(format!("bad root flag {x}"))),
        };
        Ok(UniqueId { root, secret, external_root })
    }
}

impl WireForm for UniqueId {
    const WHAT: &'static str = "UniqueId";
    fn to_wire(&self) -> Vec<u8> {
        self.encode()
    }
    /// The unpadded form: nothing may follow it.
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, Self::WHAT, ID_MAGIC, VERSION)?;
        let id = Self::read_fields(&mut r)?;
        r.finish()?;
        Ok(id)
    }
}

/// The checks of the padded byte form ([`UniqueId::from_bytes`]): never panics, and what decodes
/// is a prefix of its own padded encoding (so the padding was zero and nothing else varies).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check_padded(bytes: &[u8]) {
    if let Ok(id) = UniqueId::from_bytes(bytes) {
        assert_eq!(&id.to_bytes()[..bytes.len()], bytes, "UniqueId::from_bytes accepted bytes it does not write");
    }
}

/// The checks of the text form (`FromStr`): never panics, and what parses prints as text that
/// parses to the same id (text is lenient about case and surrounding space, so only the value is
/// canonical).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn check_text(s: &str) {
    if let Ok(id) = s.parse::<UniqueId>() {
        let again = id.to_string();
        assert_eq!(again.parse::<UniqueId>().ok().as_ref(), Some(&id), "UniqueId text {again:?} does not parse back");
    }
}

impl fmt::Display for UniqueId {
    /// Hex text, for environment variables and command lines.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.encode() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for UniqueId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if !s.len().is_multiple_of(2) || !s.is_ascii() {
            return Err(Error::invalid_usage("a UniqueId in text is an even number of hex digits"));
        }
        let bytes: Result<Vec<u8>> = (0..s.len())
            .step_by(2)
            .map(|i| {
                u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| Error::invalid_usage("bad hex digit in UniqueId"))
            })
            .collect();
        UniqueId::from_bytes(&bytes?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_text_and_bytes_round_trip() {
        let id = UniqueId { root: "10.1.2.3:4567".parse().unwrap(), secret: [7; 16], external_root: true };
        let t = id.to_string();
        assert_eq!(t.parse::<UniqueId>().unwrap(), id);
        assert_eq!(UniqueId::from_bytes(&id.to_bytes()[..]).unwrap(), id);
        assert!("zz".parse::<UniqueId>().is_err());
        assert!(UniqueId::from_bytes(&[0u8; 128]).is_err());
        assert!(!format!("{id:?}").contains("7, 7"), "Debug must not print the secret");
    }

    proptest::proptest! {
        #[test]
        fn unique_id_wire_form(ip in proptest::prelude::any::<std::net::IpAddr>(), port: u16, secret: [u8; 16], ext: bool,
                               junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let id = UniqueId { root: SocketAddr::new(ip, port), secret, external_root: ext };
            crate::wire::check::check_value(&id);
            crate::wire::check::check_bytes::<UniqueId>(&junk);
        }
    }

    #[test]
    fn unique_id_padding_must_be_zero() {
        let id = UniqueId { root: "10.1.2.3:4567".parse().unwrap(), secret: [7; 16], external_root: false };
        let mut b = id.to_bytes();
        assert_eq!(UniqueId::from_bytes(&b[..60]).unwrap(), id);
        b[127] = 1;
        assert!(UniqueId::from_bytes(&b).unwrap_err().to_string().contains("non-zero bytes after"));
        let mut long = id.to_bytes().to_vec();
        long.push(0);
        assert!(UniqueId::from_bytes(&long).is_err());
        // Text is lenient about case and surrounding space, strict about everything else.
        assert_eq!(format!(" {} ", id.to_string().to_uppercase()).parse::<UniqueId>().unwrap(), id);
        assert_eq!(format!("{id}00").parse::<UniqueId>().unwrap(), id);
        assert!(format!("{id}01").parse::<UniqueId>().is_err());
    }

    proptest::proptest! {
        #[test]
        fn unique_id_padded_and_text_forms(ip in proptest::prelude::any::<std::net::IpAddr>(), port: u16,
                                           secret: [u8; 16], ext: bool, cut in 0usize..=128,
                                           junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..160)) {
            let id = UniqueId { root: SocketAddr::new(ip, port), secret, external_root: ext };
            let padded = id.to_bytes();
            let fields = crate::wire::WireForm::to_wire(&id).len();
            proptest::prop_assert_eq!(UniqueId::from_bytes(&padded[..cut]).is_ok(), cut >= fields);
            check_padded(&padded[..cut]);
            check_padded(&junk);
            check_text(&id.to_string());
            check_text(&String::from_utf8_lossy(&junk));
        }
    }
}

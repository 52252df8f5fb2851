//! Bounds-checked little-endian encoding for the objects that travel between ranks.
//!
//! Every serialized object starts with a 4-byte magic and a 2-byte version, and every
//! variable-length field has an explicit length. [`Reader`] checks each read against what is left,
//! so decoding any byte string returns an error or a value and never panics.

use crate::error::{Error, Result};

#[cfg(any(test, feature = "fuzzing"))]
pub(crate) mod check;

/// A form that travels between ranks or arrives from a peer: it encodes to bytes, and decoding any
/// byte string gives a value or an error, never a panic.
///
/// Every peer-facing form implements it, so one generic property test ([`check`]) and one fuzz
/// registry (`crate::fuzzing`) cover all of them. Encodings are canonical: what decodes re-encodes
/// to the same bytes.
#[allow(dead_code)] // each form implements it as it moves into `wire`
pub(crate) trait WireForm: Sized {
    /// Names the form in errors and test reports ("serialized Endpoint").
    const WHAT: &'static str;
    /// The bytes the peer receives.
    fn to_wire(&self) -> Vec<u8>;
    /// Decodes exactly one form from `bytes` (nothing may be left over).
    ///
    /// # Errors
    /// `InvalidUsage` (or `Remote` where the form is a peer's message) naming [`Self::WHAT`] and the
    /// byte offset, for any input that is not a well-formed encoding.
    fn from_wire(bytes: &[u8]) -> Result<Self>;
}

/// Appends little-endian fields to a byte vector.
#[derive(Default)]
pub(crate) struct Writer {
    pub(crate) buf: Vec<u8>,
}

impl Writer {
    /// Starts an object with its magic and version.
    pub(crate) fn new(magic: &[u8; 4], version: u16) -> Writer {
        let mut w = Writer { buf: Vec::with_capacity(128) };
        w.buf.extend_from_slice(magic);
        w.u16(version);
        w
    }
    pub(crate) fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn raw(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }
    /// A `u32` length, then the bytes.
    pub(crate) fn bytes(&mut self, b: &[u8]) -> Result<()> {
        let n = u32::try_from(b.len()).map_err(|_| Error::invalid_usage("field longer than 4 GiB"))?;
        self.u32(n);
        self.raw(b);
        Ok(())
    }
    pub(crate) fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads little-endian fields, failing cleanly at the end of the input.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Checks the magic and version of a `what` and positions after them.
    pub(crate) fn new(buf: &'a [u8], what: &'static str, magic: &[u8; 4], version: u16) -> Result<Reader<'a>> {
        let mut r = Reader { buf, what, pos: 0 };
        let m = r.array::<4>()?;
        if &m != magic {
            return Err(r.err(format!("wrong magic {m:02x?} (expected {magic:02x?}); these bytes are not a {what}")));
        }
        let v = r.u16()?;
        if v != version {
            return Err(r.err(format!("version {v} is not supported (this build reads version {version})")));
        }
        Ok(r)
    }

    /// Reads a form without a magic of its own (a field type such as a socket address, when it is
    /// decoded alone).
    pub(crate) fn bare(buf: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { buf, what, pos: 0 }
    }

    pub(crate) fn err(&self, why: impl std::fmt::Display) -> Error {
        Error::invalid_usage(format!("malformed {} at byte {}: {why}", self.what, self.pos))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(self.err(format!("needs {n} more bytes, {left} left")));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(crate) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// A `u32` length, then that many bytes.
    pub(crate) fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    /// Everything not read yet (for fixed-size forms with padding).
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }
    /// Fails if bytes are left over.
    pub(crate) fn finish(self) -> Result<()> {
        if self.pos != self.buf.len() {
            return Err(self.err(format!("{} trailing bytes", self.buf.len() - self.pos)));
        }
        Ok(())
    }
}

/// A message with a `u32` little-endian length in front, as every handshake and root message is
/// sent.
pub(crate) fn length_prefixed(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// Reads one [`length_prefixed`] message of at most `max` bytes; `what` names it in errors.
pub(crate) fn read_length_prefixed(s: &mut impl std::io::Read, max: usize, what: &str) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(|e| Error::io(format!("reading {what}"), e))?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(Error::remote(format!("{what} of {len} bytes is longer than {max}")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(|e| Error::io(format!("reading {what}"), e))?;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let mut w = Writer::new(b"TEST", 1);
        w.u8(7);
        w.u16(0x1234);
        w.u32(0xdead_beef);
        w.u64(u64::MAX - 1);
        w.bytes(b"hello").unwrap();
        let b = w.finish();
        let mut r = Reader::new(&b, "test", b"TEST", 1).unwrap();
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.u16().unwrap(), 0x1234);
        assert_eq!(r.u32().unwrap(), 0xdead_beef);
        assert_eq!(r.u64().unwrap(), u64::MAX - 1);
        assert_eq!(r.bytes().unwrap(), b"hello");
        r.finish().unwrap();
        for cut in 0..b.len() {
            let res = (|| {
                let mut r = Reader::new(&b[..cut], "test", b"TEST", 1)?;
                r.u8()?;
                r.u16()?;
                r.u32()?;
                r.u64()?;
                r.bytes()?;
                r.finish()
            })();
            assert!(res.is_err(), "cut at {cut} decoded");
        }
        assert!(Reader::new(&b, "test", b"TEST", 2).is_err());
        assert!(Reader::new(&b, "test", b"TESX", 1).is_err());
    }

    #[test]
    fn length_prefixed_messages() {
        let m = length_prefixed(b"abc");
        assert_eq!(read_length_prefixed(&mut &m[..], 3, "m").unwrap(), b"abc");
        assert!(read_length_prefixed(&mut &m[..], 2, "m").unwrap_err().to_string().contains("longer than 2"));
        assert!(read_length_prefixed(&mut &m[..5], 3, "m").is_err());
    }
}

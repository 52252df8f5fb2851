//! The one property check every [`WireForm`] runs (unit tests with proptest, and the fuzz targets).
#![allow(dead_code)] // until every form uses it

use super::WireForm;

/// Checks one encoded value: it decodes and re-encodes to the same bytes, every strict prefix is
/// refused, and every single-byte change either is refused or decodes to a form that re-encodes to
/// exactly the changed bytes. Panics (this is test code) with the form's name on a violation.
pub(crate) fn check_value<T: WireForm>(value: &T) {
    let bytes = value.to_wire();
    let back = T::from_wire(&bytes).unwrap_or_else(|e| panic!("{}: own encoding refused: {e}", T::WHAT));
    assert_eq!(back.to_wire(), bytes, "{}: round trip changed the bytes", T::WHAT);
    for cut in 0..bytes.len() {
        assert!(T::from_wire(&bytes[..cut]).is_err(), "{}: prefix of {cut}/{} bytes decoded", T::WHAT, bytes.len());
    }
    let mut flipped = bytes.clone();
    for i in 0..bytes.len() {
        for mask in [0x01u8, 0x80, 0xff] {
            flipped[i] ^= mask;
            check_bytes::<T>(&flipped);
            flipped[i] ^= mask;
        }
    }
}

/// Checks arbitrary bytes: decoding never panics, and what decodes re-encodes to the same bytes.
pub(crate) fn check_bytes<T: WireForm>(bytes: &[u8]) {
    if let Ok(v) = T::from_wire(bytes) {
        assert_eq!(v.to_wire(), bytes, "{}: accepted bytes that do not re-encode the same", T::WHAT);
    }
}

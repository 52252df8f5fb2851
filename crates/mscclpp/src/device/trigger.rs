//! The trigger codec: the one place that knows how a kernel's 16-byte request is laid out.
//!
//! Bit fields are MSCCL++'s (`fst`: size 0..31, srcOffset 32..63; `snd`: dstOffset 0..31,
//! srcMemoryId 32..40, dstMemoryId 41..49, type 50..52, semaphoreId 53..62, bit 63 the FIFO's
//! commit bit). Types follow MSCCL++ HEAD's OR-able flags ([`TRIGGER_DATA`] 1 = put,
//! [`TRIGGER_FLAG`] 2 = signal, [`TRIGGER_SYNC`] 4 = flush) plus type 0 = atomicAdd with the
//! signed 64-bit operand in `fst`.
//!
//! [`decode`] accepts every type 0..=7 (5 = put then flush, 6 = signal then flush are legal
//! OR-ings) and refuses, with an `InvalidUsage` error the proxy records, what no encoder produces:
//! a signal or flush trigger (no data bit) whose put fields are not all zero, and an atomicAdd
//! whose source memory ID is not zero. A put of zero bytes is legal (it does nothing but keeps
//! its place in the order). Bit 63 is ignored: it belongs to the FIFO, which clears it on poll.
use crate::error::{Error, Result};

/// Type flag: a put (copy `size` bytes from the source to the destination memory).
pub const TRIGGER_DATA: u64 = 1;
/// Type flag: a signal of the channel's semaphore (after the puts before it).
pub const TRIGGER_FLAG: u64 = 2;
/// Type flag: a flush (wait for every earlier request on the connection).
pub const TRIGGER_SYNC: u64 = 4;
/// Type 0: an atomic add of `fst` (as `i64`) to a 64-bit word of the destination memory.
pub const TRIGGER_ATOMIC_ADD: u64 = 0;

/// Largest semaphore ID a trigger can carry (10 bits).
pub const MAX_SEMAPHORE_ID: u32 = (1 << 10) - 1;
/// Largest memory ID a trigger can carry (9 bits).
pub const MAX_MEMORY_ID: u32 = (1 << 9) - 1;

const SND_SRC_MEM: u32 = 32;
const SND_DST_MEM: u32 = 41;
const SND_TYPE: u32 = 50;
const SND_SEM: u32 = 53;
/// The FIFO's lap-parity commit bit in `snd`.
pub const COMMIT_BIT: u64 = 1 << 63;

/// One request from a kernel to the proxy: MSCCL++'s `ProxyTrigger` (16 bytes, align 16).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(C, align(16))]
pub struct ProxyTrigger {
    /// First word: size and source offset, or an atomicAdd's operand.
    pub fst: u64,
    /// Second word: destination offset, memory IDs, type, semaphore ID, commit bit.
    pub snd: u64,
}

/// A copy between two memories registered with a proxy service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Put {
    /// Source memory ID (at most [`MAX_MEMORY_ID`]).
    pub src_mem: u32,
    /// Offset into the source memory.
    pub src_off: u32,
    /// Destination memory ID (at most [`MAX_MEMORY_ID`]).
    pub dst_mem: u32,
    /// Offset into the destination memory.
    pub dst_off: u32,
    /// Bytes to copy.
    pub size: u32,
}

/// A decoded trigger: what the proxy must do. `#[non_exhaustive]`: new trigger types add
/// variants, so a `match` needs a `_` arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Request {
    /// Flag types: in this order, an optional put, a signal, a flush, on semaphore `sem_id`'s connection.
    Ops {
        /// The semaphore (and so the connection) the request is for.
        sem_id: u32,
        /// The put, when the data flag is set.
        put: Option<Put>,
        /// Signal the semaphore's peer after the put.
        signal: bool,
        /// Flush the connection after the rest.
        flush: bool,
    },
    /// Type 0: add `value` to the 64-bit word at `dst_off` of memory `dst_mem`.
    AtomicAdd {
        /// The semaphore (and so the connection) the request is for.
        sem_id: u32,
        /// Destination memory ID.
        dst_mem: u32,
        /// Offset of the 64-bit word in the destination memory.
        dst_off: u32,
        /// The signed operand.
        value: i64,
    },
}

fn check_ids(sem_id: u32, mems: &[u32]) -> Result<()> {
    if sem_id > MAX_SEMAPHORE_ID {
        return Err(Error::invalid_usage(format!(
            "semaphore ID {sem_id} does not fit a trigger (at most {MAX_SEMAPHORE_ID})"
        )));
    }
    if let Some(m) = mems.iter().find(|m| **m > MAX_MEMORY_ID) {
        return Err(Error::invalid_usage(format!("memory ID {m} does not fit a trigger (at most {MAX_MEMORY_ID})")));
    }
    Ok(())
}

impl ProxyTrigger {
    /// The raw constructor (as MSCCL++'s): every field at its bit position, with no checks beyond
    /// masking to the field widths. Prefer the checked encoders below.
    pub const fn from_fields(
        ty: u64,
        dst_mem: u32,
        dst_off: u32,
        src_mem: u32,
        src_off: u32,
        size: u32,
        sem_id: u32,
    ) -> Self {
        let fst = ((src_off as u64) << 32) | size as u64;
        let snd = (((sem_id & MAX_SEMAPHORE_ID) as u64) << SND_SEM)
            | ((ty & 7) << SND_TYPE)
            | (((dst_mem & MAX_MEMORY_ID) as u64) << SND_DST_MEM)
            | (((src_mem & MAX_MEMORY_ID) as u64) << SND_SRC_MEM)
            | dst_off as u64;
        ProxyTrigger { fst, snd }
    }

    fn ops(ty: u64, sem_id: u32, p: Put) -> Result<Self> {
        check_ids(sem_id, &[p.src_mem, p.dst_mem])?;
        Ok(Self::from_fields(ty, p.dst_mem, p.dst_off, p.src_mem, p.src_off, p.size, sem_id))
    }

    /// A put (type 1).
    ///
    /// # Errors
    /// `InvalidUsage` when an ID does not fit its field.
    pub fn put(sem_id: u32, p: Put) -> Result<Self> {
        Self::ops(TRIGGER_DATA, sem_id, p)
    }
    /// A signal (type 2).
    ///
    /// # Errors
    /// `InvalidUsage` when `sem_id` does not fit its field.
    pub fn signal(sem_id: u32) -> Result<Self> {
        Self::ops(TRIGGER_FLAG, sem_id, Put::default())
    }
    /// A flush (type 4).
    ///
    /// # Errors
    /// `InvalidUsage` when `sem_id` does not fit its field.
    pub fn flush(sem_id: u32) -> Result<Self> {
        Self::ops(TRIGGER_SYNC, sem_id, Put::default())
    }
    /// A put then a signal (type 3).
    ///
    /// # Errors
    /// `InvalidUsage` when an ID does not fit its field.
    pub fn put_with_signal(sem_id: u32, p: Put) -> Result<Self> {
        Self::ops(TRIGGER_DATA | TRIGGER_FLAG, sem_id, p)
    }
    /// A put, a signal and a flush (type 7).
    ///
    /// # Errors
    /// `InvalidUsage` when an ID does not fit its field.
    pub fn put_with_signal_and_flush(sem_id: u32, p: Put) -> Result<Self> {
        Self::ops(TRIGGER_DATA | TRIGGER_FLAG | TRIGGER_SYNC, sem_id, p)
    }
    /// An atomic add of `value` to the 64-bit word at `dst_off` of `dst_mem` (type 0).
    ///
    /// # Errors
    /// `InvalidUsage` when an ID does not fit its field.
    pub fn atomic_add(sem_id: u32, dst_mem: u32, dst_off: u32, value: i64) -> Result<Self> {
        check_ids(sem_id, &[dst_mem])?;
        let mut t = Self::from_fields(TRIGGER_ATOMIC_ADD, dst_mem, dst_off, 0, 0, 0, sem_id);
        t.fst = value as u64;
        Ok(t)
    }

    /// `size` (fst bits 0..31).
    pub const fn size(&self) -> u32 {
        self.fst as u32
    }
    /// `srcOffset` (fst bits 32..63).
    pub const fn src_offset(&self) -> u32 {
        (self.fst >> 32) as u32
    }
    /// `dstOffset` (snd bits 0..31).
    pub const fn dst_offset(&self) -> u32 {
        self.snd as u32
    }
    /// `srcMemoryId` (snd bits 32..40).
    pub const fn src_memory_id(&self) -> u32 {
        ((self.snd >> SND_SRC_MEM) as u32) & MAX_MEMORY_ID
    }
    /// `dstMemoryId` (snd bits 41..49).
    pub const fn dst_memory_id(&self) -> u32 {
        ((self.snd >> SND_DST_MEM) as u32) & MAX_MEMORY_ID
    }
    /// `type` (snd bits 50..52).
    pub const fn trigger_type(&self) -> u64 {
        (self.snd >> SND_TYPE) & 7
    }
    /// `semaphoreId` (snd bits 53..62).
    pub const fn semaphore_id(&self) -> u32 {
        ((self.snd >> SND_SEM) as u32) & MAX_SEMAPHORE_ID
    }
}

/// Decodes a popped trigger (see the module documentation for what is refused).
///
/// # Errors
/// `InvalidUsage` naming both words and what is wrong; never panics.
pub fn decode(t: ProxyTrigger) -> Result<Request> {
    let ty = t.trigger_type();
    let sem_id = t.semaphore_id();
    let bad = |why: &str| Err(Error::invalid_usage(format!("bad trigger (fst={:#x}, snd={:#x}): {why}", t.fst, t.snd)));
    if ty == TRIGGER_ATOMIC_ADD {
        if t.src_memory_id() != 0 {
            return bad("an atomicAdd (type 0) with a nonzero source memory ID");
        }
        return Ok(Request::AtomicAdd {
            sem_id,
            dst_mem: t.dst_memory_id(),
            dst_off: t.dst_offset(),
            value: t.fst as i64,
        });
    }
    let put = if ty & TRIGGER_DATA != 0 {
        Some(Put {
            src_mem: t.src_memory_id(),
            src_off: t.src_offset(),
            dst_mem: t.dst_memory_id(),
            dst_off: t.dst_offset(),
            size: t.size(),
        })
    } else {
        if t.fst != 0 || t.snd & ((1 << SND_TYPE) - 1) != 0 {
            return bad("a signal/flush without the data flag carries put fields");
        }
        None
    };
    Ok(Request::Ops { sem_id, put, signal: ty & TRIGGER_FLAG != 0, flush: ty & TRIGGER_SYNC != 0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn put(src_mem: u32, src_off: u32, dst_mem: u32, dst_off: u32, size: u32) -> Put {
        Put { src_mem, src_off, dst_mem, dst_off, size }
    }

    #[test]
    fn every_field_sits_at_its_bit_position() {
        // Each field set to 1 alone, then to all ones alone (MSCCL++'s table, notes 1.1).
        let one = |ty, dm, doff, sm, soff, sz, sem| ProxyTrigger::from_fields(ty, dm, doff, sm, soff, sz, sem);
        assert_eq!(one(0, 0, 0, 0, 0, 1, 0), ProxyTrigger { fst: 1, snd: 0 });
        assert_eq!(one(0, 0, 0, 0, 1, 0, 0), ProxyTrigger { fst: 1 << 32, snd: 0 });
        assert_eq!(one(0, 0, 1, 0, 0, 0, 0), ProxyTrigger { fst: 0, snd: 1 });
        assert_eq!(one(0, 0, 0, 1, 0, 0, 0), ProxyTrigger { fst: 0, snd: 1 << 32 });
        assert_eq!(one(0, 1, 0, 0, 0, 0, 0), ProxyTrigger { fst: 0, snd: 1 << 41 });
        assert_eq!(one(1, 0, 0, 0, 0, 0, 0), ProxyTrigger { fst: 0, snd: 1 << 50 });
        assert_eq!(one(0, 0, 0, 0, 0, 0, 1), ProxyTrigger { fst: 0, snd: 1 << 53 });
        let m = u32::MAX;
        assert_eq!(one(0, 0, 0, 0, 0, m, 0).fst, 0xffff_ffff);
        assert_eq!(one(0, 0, 0, 0, m, 0, 0).fst, 0xffff_ffff_0000_0000);
        assert_eq!(one(0, 0, m, 0, 0, 0, 0).snd, 0xffff_ffff);
        assert_eq!(one(0, 0, 0, m, 0, 0, 0).snd, 0x1ff << 32);
        assert_eq!(one(0, m, 0, 0, 0, 0, 0).snd, 0x1ff << 41);
        assert_eq!(one(u64::MAX, 0, 0, 0, 0, 0, 0).snd, 0x7 << 50);
        assert_eq!(one(0, 0, 0, 0, 0, 0, m).snd, 0x3ff << 53);
        // Every field at its maximum leaves only the commit bit clear.
        assert_eq!(one(7, m, m, m, m, m, m), ProxyTrigger { fst: u64::MAX, snd: !COMMIT_BIT });
    }

    #[test]
    fn each_encoder_decodes_to_its_request() {
        let p = put(3, 0x10, 511, 0x20, 4096);
        let ops = |put, signal, flush| Request::Ops { sem_id: 1023, put, signal, flush };
        assert_eq!(decode(ProxyTrigger::put(1023, p).unwrap()).unwrap(), ops(Some(p), false, false));
        assert_eq!(decode(ProxyTrigger::signal(1023).unwrap()).unwrap(), ops(None, true, false));
        assert_eq!(decode(ProxyTrigger::flush(1023).unwrap()).unwrap(), ops(None, false, true));
        assert_eq!(decode(ProxyTrigger::put_with_signal(1023, p).unwrap()).unwrap(), ops(Some(p), true, false));
        assert_eq!(
            decode(ProxyTrigger::put_with_signal_and_flush(1023, p).unwrap()).unwrap(),
            ops(Some(p), true, true)
        );
        let a = ProxyTrigger::atomic_add(5, 7, 64, -3).unwrap();
        assert_eq!(a.fst, (-3i64) as u64);
        assert_eq!(decode(a).unwrap(), Request::AtomicAdd { sem_id: 5, dst_mem: 7, dst_off: 64, value: -3 });
        // MSCCL++'s type numbers.
        assert_eq!(ProxyTrigger::put(0, p).unwrap().trigger_type(), 1);
        assert_eq!(ProxyTrigger::signal(0).unwrap().trigger_type(), 2);
        assert_eq!(ProxyTrigger::put_with_signal(0, p).unwrap().trigger_type(), 3);
        assert_eq!(ProxyTrigger::flush(0).unwrap().trigger_type(), 4);
        assert_eq!(ProxyTrigger::put_with_signal_and_flush(0, p).unwrap().trigger_type(), 7);
    }

    #[test]
    fn every_type_decodes_and_the_commit_bit_is_ignored() {
        for ty in 1..8u64 {
            let data = ty & 1 != 0;
            let t = if data {
                ProxyTrigger::from_fields(ty, 2, 3, 4, 5, 6, 7)
            } else {
                ProxyTrigger::from_fields(ty, 0, 0, 0, 0, 0, 7)
            };
            let want = Request::Ops {
                sem_id: 7,
                put: data.then_some(put(4, 5, 2, 3, 6)),
                signal: ty & 2 != 0,
                flush: ty & 4 != 0,
            };
            assert_eq!(decode(t).unwrap(), want, "type {ty}");
            assert_eq!(decode(ProxyTrigger { snd: t.snd | COMMIT_BIT, ..t }).unwrap(), want, "type {ty}");
        }
        // The all-zero trigger is an atomicAdd of 0; legal.
        assert_eq!(
            decode(ProxyTrigger::default()).unwrap(),
            Request::AtomicAdd { sem_id: 0, dst_mem: 0, dst_off: 0, value: 0 }
        );
    }

    #[test]
    fn meaningless_triggers_are_errors() {
        // A signal/flush with put fields, for every put field and each non-data type.
        for ty in [2u64, 4, 6] {
            for (f, t) in [
                ("size", ProxyTrigger::from_fields(ty, 0, 0, 0, 0, 1, 0)),
                ("srcOffset", ProxyTrigger::from_fields(ty, 0, 0, 0, 1, 0, 0)),
                ("dstOffset", ProxyTrigger::from_fields(ty, 0, 1, 0, 0, 0, 0)),
                ("srcMemoryId", ProxyTrigger::from_fields(ty, 0, 0, 1, 0, 0, 0)),
                ("dstMemoryId", ProxyTrigger::from_fields(ty, 1, 0, 0, 0, 0, 0)),
            ] {
                let e = decode(t).unwrap_err();
                assert_eq!(e.kind(), crate::ErrorKind::InvalidUsage, "type {ty} {f}");
                assert!(e.message().contains("put fields"), "{e}");
            }
        }
        let mut a = ProxyTrigger::atomic_add(0, 1, 0, 9).unwrap();
        a.snd |= 1 << 32;
        assert!(decode(a).unwrap_err().message().contains("source memory ID"));
    }

    #[test]
    fn encoders_refuse_ids_that_do_not_fit() {
        let p = put(0, 0, 0, 0, 0);
        assert!(ProxyTrigger::signal(1024).is_err());
        assert!(ProxyTrigger::put(0, Put { src_mem: 512, ..p }).is_err());
        assert!(ProxyTrigger::put_with_signal(0, Put { dst_mem: 512, ..p }).is_err());
        assert!(ProxyTrigger::atomic_add(0, 512, 0, 1).is_err());
        assert!(ProxyTrigger::put_with_signal_and_flush(1023, Put { src_mem: 511, dst_mem: 511, ..p }).is_ok());
    }

    proptest! {
        #[test]
        fn ops_round_trip(sem in 0..=MAX_SEMAPHORE_ID, sm in 0..=MAX_MEMORY_ID, dm in 0..=MAX_MEMORY_ID,
                          so: u32, doff: u32, size: u32, kind in 0..3usize, commit: bool) {
            let p = put(sm, so, dm, doff, size);
            let (t, signal, flush) = match kind {
                0 => (ProxyTrigger::put(sem, p).unwrap(), false, false),
                1 => (ProxyTrigger::put_with_signal(sem, p).unwrap(), true, false),
                _ => (ProxyTrigger::put_with_signal_and_flush(sem, p).unwrap(), true, true),
            };
            prop_assert_eq!(t.snd & COMMIT_BIT, 0);
            let t = ProxyTrigger { snd: t.snd | if commit { COMMIT_BIT } else { 0 }, ..t };
            prop_assert_eq!(decode(t).unwrap(), Request::Ops { sem_id: sem, put: Some(p), signal, flush });
            prop_assert_eq!((t.size(), t.src_offset(), t.dst_offset()), (size, so, doff));
            prop_assert_eq!((t.src_memory_id(), t.dst_memory_id(), t.semaphore_id()), (sm, dm, sem));
        }

        #[test]
        fn atomic_add_round_trip(sem in 0..=MAX_SEMAPHORE_ID, dm in 0..=MAX_MEMORY_ID, off: u32, value: i64) {
            let t = ProxyTrigger::atomic_add(sem, dm, off, value).unwrap();
            prop_assert_eq!(t.snd & COMMIT_BIT, 0);
            prop_assert_eq!(decode(t).unwrap(), Request::AtomicAdd { sem_id: sem, dst_mem: dm, dst_off: off, value });
        }

        #[test]
        fn decode_never_panics_and_what_decodes_re_encodes(fst: u64, snd: u64) {
            let t = ProxyTrigger { fst, snd };
            let clean = ProxyTrigger { fst, snd: snd & !COMMIT_BIT };
            match decode(t) {
                Ok(Request::AtomicAdd { sem_id, dst_mem, dst_off, value }) =>
                    prop_assert_eq!(ProxyTrigger::atomic_add(sem_id, dst_mem, dst_off, value).unwrap(), clean),
                Ok(Request::Ops { sem_id, put, signal, flush }) => {
                    let ty = u64::from(put.is_some()) | (u64::from(signal) << 1) | (u64::from(flush) << 2);
                    let p = put.unwrap_or_default();
                    prop_assert_eq!(
                        ProxyTrigger::from_fields(ty, p.dst_mem, p.dst_off, p.src_mem, p.src_off, p.size, sem_id),
                        clean
                    );
                }
                Err(e) => prop_assert_eq!(e.kind(), crate::ErrorKind::InvalidUsage),
            }
        }
    }
}

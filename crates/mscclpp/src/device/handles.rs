//! The device handles a kernel receives, as `#[repr(C)]` structs byte-identical to
//! `mscclpp_rs/device.cuh` (and to MSCCL++'s own handles). Device addresses are `u64`.
//!
//! Sizes and offsets are asserted at compile time here; the `device_header` test compiles the
//! header with the host C++ compiler and compares every size and offset with [`layout_table`].
use std::mem::{align_of, offset_of, size_of};

use super::trigger::ProxyTrigger;

/// The device side of a [`Fifo`](super::fifo::Fifo): where kernels push triggers.
///
/// C++: `FifoDeviceHandle` (56 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct FifoDeviceHandle {
    /// Device address of the trigger ring (mapped pinned host memory, `size` slots of 16 bytes).
    pub triggers: u64,
    /// Device address of the head counter (device memory).
    pub head: u64,
    /// Device address of the tail word (mapped pinned host memory); the next word is the proxy's
    /// error word (0 = running fine).
    pub tail: u64,
    /// Device address of the kernels' cached copy of the tail (device memory).
    pub tail_cache: u64,
    /// Slots in the ring, a power of two (`int` in C++).
    pub size: i32,
    /// Padding (C++ pads `size` to 8 bytes); always 0.
    pub _pad: u32,
    /// `size - 1`.
    pub size_mask: u64,
    /// `log2(size)`.
    pub size_shift: u64,
}

/// What a GPU kernel needs to wait on a [`Host2DeviceSemaphore`](crate::Host2DeviceSemaphore):
/// the inbound token (written by the peer) and the expected count (kept by the waiting kernel).
/// Copy it to the GPU by value.
///
/// C++: `Host2DeviceSemaphoreDeviceHandle` (16 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Host2DeviceSemaphoreDeviceHandle {
    /// Device address of the inbound token.
    pub inbound_token: u64,
    /// Device address of the expected-token counter.
    pub expected_inbound_token: u64,
}

/// The device side of a semaphore one GPU signals directly in another's memory (CUDA IPC).
///
/// C++: `MemoryDevice2DeviceSemaphoreDeviceHandle` (24 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct MemoryDevice2DeviceSemaphoreDeviceHandle {
    /// Device address of the local token the peer signals.
    pub inbound_token: u64,
    /// Device address (mapped by CUDA IPC) of the peer's token this side signals.
    pub remote_inbound_token: u64,
    /// Device address of the expected-token counter (device memory).
    pub expected_inbound_token: u64,
}

/// A PortChannel's device side without fixed memories.
///
/// C++: `BasePortChannelDeviceHandle` (88 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BasePortChannelDeviceHandle {
    /// The semaphore's ID in its proxy service (`semaphoreId_`).
    pub semaphore_id: u32,
    /// Padding; always 0.
    pub _pad: u32,
    /// The semaphore the peer's proxy signals (`semaphore_`).
    pub semaphore: Host2DeviceSemaphoreDeviceHandle,
    /// The proxy service's FIFO (`fifo_`).
    pub fifo: FifoDeviceHandle,
    /// Device address of the connection's flush-done position (mapped pinned host memory,
    /// `flushDonePos_`).
    pub flush_done_pos: u64,
}

/// A PortChannel's device side between two fixed memories.
///
/// C++: `PortChannelDeviceHandle` (96 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct PortChannelDeviceHandle {
    /// The base handle (offsets 0..88).
    pub base: BasePortChannelDeviceHandle,
    /// The destination memory's ID in the proxy service (`dst_`).
    pub dst: u32,
    /// The source memory's ID in the proxy service (`src_`).
    pub src: u32,
}

/// A MemoryChannel's device side without fixed memories (semaphore only).
///
/// C++: `BaseMemoryChannelDeviceHandle` (24 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BaseMemoryChannelDeviceHandle {
    /// The semaphore (`semaphore_`).
    pub semaphore: MemoryDevice2DeviceSemaphoreDeviceHandle,
}

/// A MemoryChannel's device side.
///
/// C++: `MemoryChannelDeviceHandle` (48 bytes; its first 24 bytes are `BaseMemoryChannelDeviceHandle`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct MemoryChannelDeviceHandle {
    /// The semaphore (`semaphore_`).
    pub semaphore: MemoryDevice2DeviceSemaphoreDeviceHandle,
    /// Device address of the peer's memory, mapped here (`dst_`).
    pub dst: u64,
    /// Device address of the local memory (`src_`).
    pub src: u64,
    /// Device address of the local packet buffer, or 0 (`packetBuffer_`).
    pub packet_buffer: u64,
}

/// An LL packet of 16 bytes: two data words, each followed by its flag.
///
/// C++: `LL16Packet` (16 bytes, align 16).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub struct LL16Packet {
    /// First data word.
    pub data1: u32,
    /// Flag of the first word.
    pub flag1: u32,
    /// Second data word.
    pub data2: u32,
    /// Flag of the second word.
    pub flag2: u32,
}

/// An LL packet of 8 bytes: one data word and its flag.
///
/// C++: `LL8Packet` (8 bytes, align 8).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(8))]
pub struct LL8Packet {
    /// The data word.
    pub data: u32,
    /// Its flag.
    pub flag: u32,
}

const _: () = {
    assert!(size_of::<ProxyTrigger>() == 16 && align_of::<ProxyTrigger>() == 16);
    assert!(size_of::<FifoDeviceHandle>() == 56);
    assert!(offset_of!(FifoDeviceHandle, head) == 8);
    assert!(offset_of!(FifoDeviceHandle, tail) == 16);
    assert!(offset_of!(FifoDeviceHandle, tail_cache) == 24);
    assert!(offset_of!(FifoDeviceHandle, size) == 32);
    assert!(offset_of!(FifoDeviceHandle, size_mask) == 40);
    assert!(offset_of!(FifoDeviceHandle, size_shift) == 48);
    assert!(size_of::<Host2DeviceSemaphoreDeviceHandle>() == 16);
    assert!(offset_of!(Host2DeviceSemaphoreDeviceHandle, expected_inbound_token) == 8);
    assert!(size_of::<MemoryDevice2DeviceSemaphoreDeviceHandle>() == 24);
    assert!(offset_of!(MemoryDevice2DeviceSemaphoreDeviceHandle, remote_inbound_token) == 8);
    assert!(offset_of!(MemoryDevice2DeviceSemaphoreDeviceHandle, expected_inbound_token) == 16);
    assert!(size_of::<BasePortChannelDeviceHandle>() == 88);
    assert!(offset_of!(BasePortChannelDeviceHandle, semaphore) == 8);
    assert!(offset_of!(BasePortChannelDeviceHandle, fifo) == 24);
    assert!(offset_of!(BasePortChannelDeviceHandle, flush_done_pos) == 80);
    assert!(size_of::<PortChannelDeviceHandle>() == 96);
    assert!(offset_of!(PortChannelDeviceHandle, dst) == 88);
    assert!(offset_of!(PortChannelDeviceHandle, src) == 92);
    assert!(size_of::<BaseMemoryChannelDeviceHandle>() == 24);
    assert!(size_of::<MemoryChannelDeviceHandle>() == 48);
    assert!(offset_of!(MemoryChannelDeviceHandle, dst) == 24);
    assert!(offset_of!(MemoryChannelDeviceHandle, src) == 32);
    assert!(offset_of!(MemoryChannelDeviceHandle, packet_buffer) == 40);
    assert!(size_of::<LL16Packet>() == 16 && align_of::<LL16Packet>() == 16);
    assert!(size_of::<LL8Packet>() == 8 && align_of::<LL8Packet>() == 8);
};

/// One row of [`layout_table`]: `(C++ struct, C++ member or "sizeof"/"alignof", Rust value)`.
pub type LayoutRow = (&'static str, &'static str, usize);

/// Every size, alignment and member offset of the handles, named as in the C++ header: what the
/// layout test compares with the host C++ compiler's view of `mscclpp_rs/device.cuh`.
/// Members of a base struct are listed on the struct that declares them.
pub fn layout_table() -> Vec<LayoutRow> {
    macro_rules! rows {
        ($v:ident, $t:ident, [$($cpp:literal => $f:ident),*]) => {{
            $v.push((stringify!($t), "sizeof", size_of::<$t>()));
            $v.push((stringify!($t), "alignof", align_of::<$t>()));
            $($v.push((stringify!($t), $cpp, offset_of!($t, $f)));)*
        }};
    }
    let mut v = Vec::new();
    rows!(v, ProxyTrigger, ["fst" => fst, "snd" => snd]);
    rows!(v, FifoDeviceHandle, [
        "triggers" => triggers, "head" => head, "tail" => tail, "tailCache" => tail_cache,
        "size" => size, "sizeMask" => size_mask, "sizeShift" => size_shift
    ]);
    rows!(v, Host2DeviceSemaphoreDeviceHandle, [
        "inboundToken" => inbound_token, "expectedInboundToken" => expected_inbound_token
    ]);
    rows!(v, MemoryDevice2DeviceSemaphoreDeviceHandle, [
        "inboundToken" => inbound_token, "remoteInboundToken" => remote_inbound_token,
        "expectedInboundToken" => expected_inbound_token
    ]);
    rows!(v, BasePortChannelDeviceHandle, [
        "semaphoreId_" => semaphore_id, "semaphore_" => semaphore, "fifo_" => fifo,
        "flushDonePos_" => flush_done_pos
    ]);
    rows!(v, PortChannelDeviceHandle, ["dst_" => dst, "src_" => src]);
    rows!(v, BaseMemoryChannelDeviceHandle, ["semaphore_" => semaphore]);
    rows!(v, MemoryChannelDeviceHandle, [
        "semaphore_" => semaphore, "dst_" => dst, "src_" => src, "packetBuffer_" => packet_buffer
    ]);
    rows!(v, LL16Packet, ["data1" => data1, "flag1" => flag1, "data2" => data2, "flag2" => flag2]);
    rows!(v, LL8Packet, ["data" => data, "flag" => flag]);
    v
}

impl FifoDeviceHandle {
    /// The handle's bytes, as a kernel argument or for a copy to device memory.
    pub fn to_bytes(&self) -> [u8; 56] {
        as_bytes(self)
    }
}

impl Host2DeviceSemaphoreDeviceHandle {
    /// The handle's bytes, as a kernel argument or for a copy to device memory.
    pub fn to_bytes(&self) -> [u8; 16] {
        as_bytes(self)
    }
}

impl BasePortChannelDeviceHandle {
    /// The handle's bytes, as a kernel argument or for a copy to device memory.
    pub fn to_bytes(&self) -> [u8; 88] {
        as_bytes(self)
    }
}

impl PortChannelDeviceHandle {
    /// The handle's bytes, as a kernel argument or for a copy to device memory.
    pub fn to_bytes(&self) -> [u8; 96] {
        as_bytes(self)
    }
}

impl MemoryDevice2DeviceSemaphoreDeviceHandle {
    /// The handle's bytes, as a kernel argument or for a copy to device memory.
    pub fn to_bytes(&self) -> [u8; 24] {
        as_bytes(self)
    }
}

impl BaseMemoryChannelDeviceHandle {
    /// The handle's bytes, as a kernel argument or for a copy to device memory.
    pub fn to_bytes(&self) -> [u8; 24] {
        as_bytes(self)
    }
}

impl MemoryChannelDeviceHandle {
    /// The handle's bytes, as a kernel argument or for a copy to device memory.
    pub fn to_bytes(&self) -> [u8; 48] {
        as_bytes(self)
    }
}

/// The bytes of a padding-free `#[repr(C)]` handle, field by field in native byte order.
fn as_bytes<T: Fields, const N: usize>(t: &T) -> [u8; N] {
    let mut out = [0u8; N];
    t.put(&mut out, 0);
    out
}

/// Writes a handle's fields at their offsets (safe code; the padding stays zero).
trait Fields {
    fn put(&self, out: &mut [u8], at: usize);
}

fn put_u64(out: &mut [u8], at: usize, v: u64) {
    out[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}
fn put_u32(out: &mut [u8], at: usize, v: u32) {
    out[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

impl Fields for Host2DeviceSemaphoreDeviceHandle {
    fn put(&self, out: &mut [u8], at: usize) {
        put_u64(out, at, self.inbound_token);
        put_u64(out, at + 8, self.expected_inbound_token);
    }
}

impl Fields for FifoDeviceHandle {
    fn put(&self, out: &mut [u8], at: usize) {
        put_u64(out, at, self.triggers);
        put_u64(out, at + offset_of!(Self, head), self.head);
        put_u64(out, at + offset_of!(Self, tail), self.tail);
        put_u64(out, at + offset_of!(Self, tail_cache), self.tail_cache);
        put_u32(out, at + offset_of!(Self, size), self.size as u32);
        put_u64(out, at + offset_of!(Self, size_mask), self.size_mask);
        put_u64(out, at + offset_of!(Self, size_shift), self.size_shift);
    }
}

impl Fields for BasePortChannelDeviceHandle {
    fn put(&self, out: &mut [u8], at: usize) {
        put_u32(out, at, self.semaphore_id);
        self.semaphore.put(out, at + offset_of!(Self, semaphore));
        self.fifo.put(out, at + offset_of!(Self, fifo));
        put_u64(out, at + offset_of!(Self, flush_done_pos), self.flush_done_pos);
    }
}

impl Fields for PortChannelDeviceHandle {
    fn put(&self, out: &mut [u8], at: usize) {
        self.base.put(out, at);
        put_u32(out, at + offset_of!(Self, dst), self.dst);
        put_u32(out, at + offset_of!(Self, src), self.src);
    }
}

impl Fields for MemoryDevice2DeviceSemaphoreDeviceHandle {
    fn put(&self, out: &mut [u8], at: usize) {
        put_u64(out, at, self.inbound_token);
        put_u64(out, at + offset_of!(Self, remote_inbound_token), self.remote_inbound_token);
        put_u64(out, at + offset_of!(Self, expected_inbound_token), self.expected_inbound_token);
    }
}

impl Fields for BaseMemoryChannelDeviceHandle {
    fn put(&self, out: &mut [u8], at: usize) {
        self.semaphore.put(out, at);
    }
}

impl Fields for MemoryChannelDeviceHandle {
    fn put(&self, out: &mut [u8], at: usize) {
        self.semaphore.put(out, at);
        put_u64(out, at + offset_of!(Self, dst), self.dst);
        put_u64(out, at + offset_of!(Self, src), self.src);
        put_u64(out, at + offset_of!(Self, packet_buffer), self.packet_buffer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_channel_bytes_put_each_field_at_its_offset() {
        let h = PortChannelDeviceHandle {
            base: BasePortChannelDeviceHandle {
                semaphore_id: 7,
                _pad: 0,
                semaphore: Host2DeviceSemaphoreDeviceHandle { inbound_token: 0x1111, expected_inbound_token: 0x2222 },
                fifo: FifoDeviceHandle {
                    triggers: 0xa,
                    head: 0xb,
                    tail: 0xc,
                    tail_cache: 0xd,
                    size: 512,
                    _pad: 0,
                    size_mask: 511,
                    size_shift: 9,
                },
                flush_done_pos: 0xfeed,
            },
            dst: 3,
            src: 4,
        };
        let b = h.to_bytes();
        let u64_at = |o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap());
        let u32_at = |o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().unwrap());
        assert_eq!(u32_at(0), 7);
        assert_eq!(u32_at(4), 0);
        assert_eq!((u64_at(8), u64_at(16)), (0x1111, 0x2222));
        assert_eq!([u64_at(24), u64_at(32), u64_at(40), u64_at(48)], [0xa, 0xb, 0xc, 0xd]);
        assert_eq!((u32_at(56), u32_at(60)), (512, 0));
        assert_eq!((u64_at(64), u64_at(72), u64_at(80)), (511, 9, 0xfeed));
        assert_eq!((u32_at(88), u32_at(92)), (3, 4));
        assert_eq!(&h.base.fifo.to_bytes()[..], &b[24..80]);
        assert_eq!(&h.base.to_bytes()[..], &b[..88]);
        assert_eq!(&h.base.semaphore.to_bytes()[..], &b[8..24]);
    }

    #[test]
    fn memory_channel_bytes_put_each_field_at_its_offset() {
        let sem = MemoryDevice2DeviceSemaphoreDeviceHandle {
            inbound_token: 0x11,
            remote_inbound_token: 0x22,
            expected_inbound_token: 0x33,
        };
        let h = MemoryChannelDeviceHandle { semaphore: sem, dst: 0x44, src: 0x55, packet_buffer: 0x66 };
        let b = h.to_bytes();
        let u64_at = |o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().unwrap());
        assert_eq!((0..6).map(|i| u64_at(8 * i)).collect::<Vec<_>>(), [0x11, 0x22, 0x33, 0x44, 0x55, 0x66]);
        assert_eq!(&sem.to_bytes()[..], &b[..24]);
        assert_eq!(BaseMemoryChannelDeviceHandle { semaphore: sem }.to_bytes(), sem.to_bytes());
    }
}

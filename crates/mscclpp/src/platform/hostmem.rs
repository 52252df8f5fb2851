//! Host memory: owned page-aligned allocations, and [`Region`], a checked window onto memory that
//! is registered with a context.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::error::{Error, Result};

/// The alignment of owned host buffers: one page, so any word in them is naturally aligned.
pub(crate) const PAGE: usize = 4096;

/// A zeroed, page-aligned heap allocation.
pub(crate) struct HostAlloc {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: HostAlloc is a uniquely owned heap block; the raw pointer carries no thread affinity.
unsafe impl Send for HostAlloc {}
// SAFETY: HostAlloc hands out only its address; all accesses go through Region, whose methods
// are sound to call from several threads at once (see Region).
unsafe impl Sync for HostAlloc {}

impl HostAlloc {
    /// Allocates `len` zeroed bytes (at least one page is reserved for `len == 0`).
    pub(crate) fn zeroed(len: usize) -> Result<HostAlloc> {
        let layout = Layout::from_size_align(len.max(1), PAGE)
            .map_err(|_| Error::invalid_usage(format!("cannot allocate {len} bytes: size too large")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::new(crate::ErrorKind::System, format!("out of memory allocating a {len}-byte host buffer"))
        })?;
        Ok(HostAlloc { ptr, layout })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        // SAFETY: ptr came from alloc_zeroed with this very layout and is freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// A window `[addr, addr + len)` of host memory that stays valid while the `Region` lives.
///
/// The invariant comes either from an owned [`HostAlloc`] kept in `keeper`, or from the caller of
/// the `unsafe` [`Region::from_raw`]. All access is bounds-checked and goes through raw pointers
/// (never `&[u8]` over the region), because peers and the owner may touch it at the same time,
/// as with any memory a NIC or DMA engine writes.
#[derive(Clone)]
pub(crate) struct Region {
    addr: usize,
    len: usize,
    _keeper: Option<Arc<dyn Send + Sync>>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region({:#x}+{})", self.addr, self.len)
    }
}

impl Region {
    /// A region over an owned allocation.
    pub(crate) fn owned(alloc: Arc<HostAlloc>, len: usize) -> Region {
        Region { addr: alloc.as_ptr() as usize, len, _keeper: Some(alloc) }
    }

    /// A region over caller-owned memory.
    ///
    /// # Safety
    /// 1. `[ptr, ptr + len)` is one allocation, valid for reads and writes, until the `Region`
    ///    and every clone of the `Arc` holding it are dropped.
    /// 2. Nothing frees or unmaps it before then.
    pub(crate) unsafe fn from_raw(ptr: *mut u8, len: usize) -> Region {
        Region { addr: ptr as usize, len, _keeper: None }
    }

    /// A region over memory that `keeper` owns.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is valid for reads and writes for as long as `keeper` lives.
    pub(crate) unsafe fn from_raw_kept(ptr: *mut u8, len: usize, keeper: Arc<dyn Send + Sync>) -> Region {
        Region { addr: ptr as usize, len, _keeper: Some(keeper) }
    }

    /// The address as a raw pointer, for DMA by the GPU (valid while `self` lives).
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    pub(crate) fn addr(&self) -> usize {
        self.addr
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Checks that `[offset, offset + n)` lies inside the region.
    pub(crate) fn check(&self, offset: u64, n: u64) -> Result<()> {
        super::check_range(offset, n, self.len as u64, "region")
    }

    fn ptr(&self, offset: u64) -> *mut u8 {
        (self.addr + offset as usize) as *mut u8
    }

    /// Copies `src` into the region at `offset`.
    pub(crate) fn write(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check(offset, src.len() as u64)?;
        // SAFETY: the range is inside the region (checked), the region is valid while self lives
        // (type invariant), and src is a distinct Rust slice, so they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr(offset), src.len()) };
        Ok(())
    }

    /// Copies from the region at `offset` into `dst`.
    pub(crate) fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len() as u64)?;
        // SAFETY: as in `write`, with the roles swapped.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `n` bytes of `src` at `src_offset` into the region at `offset` (the two ranges may
    /// be in the same allocation, even overlap).
    pub(crate) fn copy_from(&self, offset: u64, src: &Region, src_offset: u64, n: usize) -> Result<()> {
        self.check(offset, n as u64)?;
        src.check(src_offset, n as u64)?;
        // SAFETY: both ranges are inside their regions (checked), each valid while its region
        // lives (type invariant); `copy` allows the ranges to overlap.
        unsafe { std::ptr::copy(src.ptr(src_offset), self.ptr(offset), n) };
        Ok(())
    }

    /// Sets `n` bytes at `offset` to `byte`.
    pub(crate) fn fill(&self, offset: u64, n: u64, byte: u8) -> Result<()> {
        self.check(offset, n)?;
        // SAFETY: the range is inside the valid region (checked above).
        unsafe { std::ptr::write_bytes(self.ptr(offset), byte, n as usize) };
        Ok(())
    }

    /// The 8-byte word at `offset` as an atomic.
    pub(crate) fn atomic_u64(&self, offset: u64) -> Result<&AtomicU64> {
        self.check(offset, 8)?;
        let p = self.ptr(offset);
        if !(p as usize).is_multiple_of(8) {
            return Err(Error::invalid_usage(format!("offset {offset} is not 8-byte aligned for an atomic word")));
        }
        // SAFETY: p is in bounds, 8-byte aligned, and valid for the lifetime of &self (type
        // invariant); AtomicU64 has the size and alignment of u64, and every access to the word
        // made by this crate while it is shared is atomic.
        Ok(unsafe { AtomicU64::from_ptr(p.cast::<u64>()) })
    }

    /// Receives exactly `n` bytes from `stream` into the region at `offset`.
    pub(crate) fn recv_exact(&self, offset: u64, n: u64, stream: &TcpStream) -> std::io::Result<()> {
        self.check(offset, n).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let fd = stream.as_raw_fd();
        let mut done: usize = 0;
        let n = n as usize;
        while done < n {
            // SAFETY: [ptr(offset)+done, +n-done) lies inside the valid region (checked above);
            // recv writes at most that many bytes and never keeps the pointer.
            let r = unsafe { nix::libc::recv(fd, self.ptr(offset).add(done).cast(), n - done, 0) };
            if r == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            done += r as usize;
        }
        Ok(())
    }

    /// A piece of this region for [`send_vectored`]; checks the bounds.
    pub(crate) fn part(&self, offset: u64, n: u64) -> Result<IoPart<'_>> {
        self.check(offset, n)?;
        Ok(IoPart { ptr: self.ptr(offset), len: n as usize, _life: std::marker::PhantomData })
    }
}

/// Sends all of `buf` on `stream` in as few `send` calls as the kernel allows (`MSG_NOSIGNAL`: a
/// closed peer is `EPIPE`, not `SIGPIPE`).
pub(crate) fn send_all(stream: &TcpStream, buf: &[u8]) -> std::io::Result<()> {
    send_fd(stream.as_raw_fd(), buf)
}

fn send_fd(fd: std::os::fd::RawFd, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: `buf` is a live slice; send only reads `buf.len()` bytes of it.
        let r = unsafe { nix::libc::send(fd, buf.as_ptr().cast(), buf.len(), nix::libc::MSG_NOSIGNAL) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        buf = buf.get(r as usize..).unwrap_or_default();
    }
    Ok(())
}

/// A range of bytes to send: a slice, or a checked range of a live [`Region`].
pub(crate) struct IoPart<'a> {
    ptr: *const u8,
    len: usize,
    _life: std::marker::PhantomData<&'a ()>,
}

impl<'a> From<&'a [u8]> for IoPart<'a> {
    fn from(s: &'a [u8]) -> Self {
        IoPart { ptr: s.as_ptr(), len: s.len(), _life: std::marker::PhantomData }
    }
}

/// Sends all `parts`, in order, with as few `sendmsg` calls as the kernel allows (a few hundred
/// bytes in all are gathered into one buffer and go in one `send`, which costs the kernel less
/// than importing an iovec array).
pub(crate) fn send_vectored(stream: &TcpStream, parts: &[IoPart<'_>]) -> std::io::Result<()> {
    const MAX_IOV: usize = 512;
    const SMALL_IOV: usize = 8;
    const SMALL_SEND: usize = 256;
    let fd = stream.as_raw_fd();
    if parts.iter().map(|p| p.len).sum::<usize>() <= SMALL_SEND {
        let mut buf = [0u8; SMALL_SEND];
        let mut n = 0usize;
        for p in parts.iter().filter(|p| p.len > 0) {
            // SAFETY: the part is a slice or a bounds-checked range of a live Region (the IoPart
            // lifetime ties it to its owner), so `p.len` bytes at `p.ptr` are readable; the total
            // fits `buf` (checked above), a local that overlaps nothing.
            unsafe { std::ptr::copy_nonoverlapping(p.ptr, buf.as_mut_ptr().add(n), p.len) };
            n += p.len;
        }
        return send_fd(fd, buf.get(..n).unwrap_or_default());
    }
    let mut idx = 0usize; // first part not fully sent
    let mut skip = 0usize; // bytes of parts[idx] already sent
    while idx < parts.len() {
        // A few parts (a small write and its signal) need no allocation.
        let empty = nix::libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        let mut small = [empty; SMALL_IOV];
        let mut large: Vec<nix::libc::iovec> = Vec::new();
        let mut n = 0usize;
        let big = parts.len() - idx > SMALL_IOV;
        if big {
            large.reserve((parts.len() - idx).min(MAX_IOV));
        }
        for (k, p) in parts[idx..].iter().enumerate().take(MAX_IOV) {
            let off = if k == 0 { skip } else { 0 };
            if p.len > off {
                // SAFETY: off < p.len, so the pointer stays inside the part.
                let v = nix::libc::iovec { iov_base: unsafe { p.ptr.add(off) } as *mut _, iov_len: p.len - off };
                match small.get_mut(n) {
                    Some(slot) if !big => *slot = v,
                    _ => large.push(v),
                }
                n += 1;
            }
        }
        let iov: &mut [nix::libc::iovec] = if big { &mut large } else { &mut small[..n] };
        if iov.is_empty() {
            break;
        }
        // SAFETY: an all-zero msghdr is valid; we set only the iovec fields.
        let mut msg: nix::libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        // SAFETY: every iovec points into a slice or a bounds-checked range of a live Region
        // (the IoPart lifetime ties them to their owners); sendmsg only reads them.
        // MSG_NOSIGNAL turns a closed peer into EPIPE instead of SIGPIPE.
        let r = unsafe { nix::libc::sendmsg(fd, &msg, nix::libc::MSG_NOSIGNAL) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let mut sent = r as usize;
        while sent > 0 && idx < parts.len() {
            let left = parts[idx].len - skip;
            if sent >= left {
                sent -= left;
                idx += 1;
                skip = 0;
            } else {
                skip += sent;
                sent = 0;
            }
        }
        while idx < parts.len() && parts[idx].len == skip {
            idx += 1;
            skip = 0;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn copy_from_another_region_or_an_overlapping_range_of_the_same() {
        let region = |n: usize| Region::owned(Arc::new(HostAlloc::zeroed(n).unwrap()), n);
        let (a, b) = (region(64), region(64));
        let pat: Vec<u8> = (0..64).map(|i| i as u8 + 1).collect();
        a.write(0, &pat).unwrap();
        b.copy_from(10, &a, 3, 20).unwrap();
        let mut got = vec![0u8; 64];
        b.read(0, &mut got).unwrap();
        assert_eq!(&got[10..30], &pat[3..23]);
        assert!(got[..10].iter().chain(&got[30..]).all(|&x| x == 0), "bytes outside the copy changed");
        // Overlapping, within one region: as memmove.
        a.copy_from(8, &a.clone(), 0, 32).unwrap();
        a.read(0, &mut got).unwrap();
        assert_eq!(&got[8..40], &pat[0..32]);
        assert!(b.copy_from(50, &a, 0, 20).is_err(), "past the destination's end");
        assert!(b.copy_from(0, &a, 50, 20).is_err(), "past the source's end");
    }

    #[test]
    fn vectored_send_of_slices_and_regions() {
        use std::io::Read;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let big = 3 << 20;
        let r = Region::owned(Arc::new(HostAlloc::zeroed(big).unwrap()), big);
        let pat: Vec<u8> = (0..big).map(|i| (i * 7 + 3) as u8).collect();
        r.write(0, &pat).unwrap();
        let reader = std::thread::spawn(move || {
            let mut v = Vec::new();
            b.read_to_end(&mut v).unwrap();
            v
        });
        let head = b"head".to_vec();
        let parts = vec![
            IoPart::from(&head[..]),
            r.part(5, 10).unwrap(),
            IoPart::from(&b""[..]),
            r.part(0, big as u64).unwrap(),
        ];
        send_vectored(&a, &parts).unwrap();
        assert!(r.part(1, big as u64).is_err());
        drop(a);
        let got = reader.join().unwrap();
        let mut want = head.clone();
        want.extend_from_slice(&pat[5..15]);
        want.extend_from_slice(&pat);
        assert!(got == want);
    }

    /// More parts than one `sendmsg` takes (`MAX_IOV`), of mixed sizes (empty ones too): all
    /// arrive, in order, whatever cut the kernel makes.
    #[test]
    fn vectored_send_of_more_parts_than_one_call_takes() {
        use std::io::Read;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let data: Vec<Vec<u8>> =
            (0..2500usize).map(|i| (0..(i * 37) % 700).map(|j| (i * 13 + j) as u8).collect()).collect();
        let reader = std::thread::spawn(move || {
            let mut v = Vec::new();
            b.read_to_end(&mut v).unwrap();
            v
        });
        let parts: Vec<IoPart<'_>> = data.iter().map(|d| IoPart::from(&d[..])).collect();
        send_vectored(&a, &parts).unwrap();
        drop(a);
        let got = reader.join().unwrap();
        assert!(got == data.concat(), "{} bytes arrived, {} sent", got.len(), data.concat().len());
    }

    #[test]
    fn owned_region_is_zeroed_aligned_and_checked() {
        let a = Arc::new(HostAlloc::zeroed(100).unwrap());
        assert_eq!(a.as_ptr() as usize % PAGE, 0);
        let r = Region::owned(a, 100);
        let mut b = [1u8; 100];
        r.read(0, &mut b).unwrap();
        assert!(b.iter().all(|x| *x == 0));
        r.write(96, &[1, 2, 3, 4]).unwrap();
        assert!(r.write(97, &[1, 2, 3, 4]).is_err());
        assert!(r.check(u64::MAX, 2).is_err());
        r.read(96, &mut b[..4]).unwrap();
        assert_eq!(&b[..4], &[1, 2, 3, 4]);
        r.atomic_u64(8).unwrap().fetch_add(5, Ordering::SeqCst);
        assert_eq!(r.atomic_u64(8).unwrap().load(Ordering::SeqCst), 5);
        assert!(r.atomic_u64(4).is_err());
        assert!(r.atomic_u64(96).is_err());
    }
}

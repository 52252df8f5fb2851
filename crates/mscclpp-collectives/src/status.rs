//! What a rank's kernels report to its host, shared by the flat and two-level collectives: a
//! page-locked word the first failed wait writes (kind, peer), a word every wait polls for an
//! abort, and the host's own "failed" flag (kept once any failure was seen).

use std::sync::atomic::{AtomicBool, Ordering};

use mscclpp::gpu::PinnedBuffer;
use mscclpp::{Context, Result, TransportFlags};

/// The word's fields: bit 63 set, kind in bits 48.., peer in bits 32..48.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reported {
    /// Nothing reported and nothing failed before.
    Clear,
    /// Nothing in the word, but an earlier failure (or an abort) was seen.
    FailedBefore,
    /// A kernel reported `kind` about `peer` (the raw word in `code`).
    Error { kind: u64, peer: usize, code: u64 },
}

/// The error and abort words of one rank (page-locked host memory the kernels reach through its
/// unified address) and the host's failed flag.
pub(crate) struct DeviceStatus {
    words: PinnedBuffer,
    failed: AtomicBool,
}

impl DeviceStatus {
    /// Zeroed words for GPU `device`.
    pub(crate) fn new(ctx: &Context, device: u32) -> Result<DeviceStatus> {
        Ok(DeviceStatus {
            words: PinnedBuffer::new(ctx, device, 64, TransportFlags::NONE)?,
            failed: AtomicBool::new(false),
        })
    }

    /// The error word's address, for the kernels.
    pub(crate) fn error_word(&self) -> u64 {
        self.words.as_ptr() as u64
    }

    /// The abort word's address, for the kernels.
    pub(crate) fn abort_word(&self) -> u64 {
        self.words.as_ptr() as u64 + 8
    }

    /// Reads the error word (no CUDA call); a reported error marks this rank failed.
    pub(crate) fn read(&self) -> Result<Reported> {
        let mut w = [0u8; 8];
        self.words.read(0, &mut w)?;
        let code = u64::from_le_bytes(w);
        if code == 0 {
            return Ok(if self.failed.load(Ordering::Acquire) { Reported::FailedBefore } else { Reported::Clear });
        }
        self.mark_failed();
        Ok(Reported::Error { kind: (code >> 48) & 0x7fff, peer: ((code >> 32) & 0xffff) as usize, code })
    }

    /// Marks this rank failed (later calls are refused).
    pub(crate) fn mark_failed(&self) {
        self.failed.store(true, Ordering::Release);
    }

    /// Whether a failure was seen.
    pub(crate) fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Marks this rank failed and asks every running and later kernel to stop waiting.
    pub(crate) fn abort(&self) -> Result<()> {
        self.mark_failed();
        self.words.write(8, &1u64.to_le_bytes())
    }
}

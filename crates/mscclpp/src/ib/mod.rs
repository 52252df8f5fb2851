//! InfiniBand / RoCE. This build has the verbs access layer (libibverbs loaded at run time, the
//! ABI declared by hand); the IB transport itself comes with its issue.

pub(crate) mod verbs;

pub use verbs::devices;

//! Platform access: every `unsafe` operation of the crate lives under this module (and, with the
//! GPU and verbs issues, `gpu` and `ib::verbs`). Each block says why it is sound.

pub(crate) mod hostmem;
pub(crate) mod numa;

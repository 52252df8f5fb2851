//! The part of libibverbs' ABI (`<infiniband/verbs.h>`, rdma-core) the IB transport uses,
//! declared by hand as NCCL does, so the crate builds with no rdma-core headers. The structs keep
//! the provider's layout exactly; the unit test `abi_matches_the_system_header` (in `verbs/mod.rs`)
//! compiles the real header with `gcc` and checks every size and field offset below against it.
//!
//! Portions follow the OpenIB.org BSD-licensed declarations of `verbs.h`.
#![allow(non_camel_case_types, missing_docs, dead_code, unreachable_pub)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// Opaque.
#[repr(C)]
pub struct ibv_device {
    _p: [u8; 0],
}
/// Opaque (used only by pointer).
#[repr(C)]
pub struct ibv_srq {
    _p: [u8; 0],
}
/// Opaque (used only by pointer).
#[repr(C)]
pub struct ibv_ah {
    _p: [u8; 0],
}
/// Opaque (used only by pointer).
#[repr(C)]
pub struct ibv_mw {
    _p: [u8; 0],
}
/// A completion channel: `fd` becomes readable when an armed CQ gets a completion.
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `pthread_mutex_t` on x86-64 and aarch64 glibc (40 and 48 bytes; 8-aligned).
#[cfg(target_arch = "x86_64")]
#[repr(C, align(8))]
pub struct pthread_mutex_t {
    _p: [u8; 40],
}
#[cfg(not(target_arch = "x86_64"))]
#[repr(C, align(8))]
pub struct pthread_mutex_t {
    _p: [u8; 48],
}
/// `pthread_cond_t` (48 bytes, 8-aligned).
#[repr(C, align(8))]
pub struct pthread_cond_t {
    _p: [u8; 48],
}

type Fp = Option<unsafe extern "C" fn()>;

#[repr(C)]
pub struct ibv_context_ops {
    pub _compat_query_device: Fp,
    pub _compat_query_port: Fp,
    pub _compat_alloc_pd: Fp,
    pub _compat_dealloc_pd: Fp,
    pub _compat_reg_mr: Fp,
    pub _compat_rereg_mr: Fp,
    pub _compat_dereg_mr: Fp,
    pub alloc_mw: Fp,
    pub bind_mw: Fp,
    pub dealloc_mw: Fp,
    pub _compat_create_cq: Fp,
    pub poll_cq: Option<unsafe extern "C" fn(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int>,
    pub req_notify_cq: Option<unsafe extern "C" fn(cq: *mut ibv_cq, solicited_only: c_int) -> c_int>,
    pub _compat_cq_event: Fp,
    pub _compat_resize_cq: Fp,
    pub _compat_destroy_cq: Fp,
    pub _compat_create_srq: Fp,
    pub _compat_modify_srq: Fp,
    pub _compat_query_srq: Fp,
    pub _compat_destroy_srq: Fp,
    pub post_srq_recv: Fp,
    pub _compat_create_qp: Fp,
    pub _compat_query_qp: Fp,
    pub _compat_modify_qp: Fp,
    pub _compat_destroy_qp: Fp,
    pub post_send:
        Option<unsafe extern "C" fn(qp: *mut ibv_qp, wr: *mut ibv_send_wr, bad_wr: *mut *mut ibv_send_wr) -> c_int>,
    pub post_recv:
        Option<unsafe extern "C" fn(qp: *mut ibv_qp, wr: *mut ibv_recv_wr, bad_wr: *mut *mut ibv_recv_wr) -> c_int>,
    pub _compat_create_ah: Fp,
    pub _compat_destroy_ah: Fp,
    pub _compat_attach_mcast: Fp,
    pub _compat_detach_mcast: Fp,
    pub _compat_async_event: Fp,
}

#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

#[repr(C)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_uint,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

#[repr(C)]
pub struct ibv_port_attr {
    pub state: c_uint,
    pub max_mtu: c_uint,
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
    /// Added in newer rdma-core (after `port_cap_flags2`).
    pub active_speed_ex: u32,
    /// Room for fields later rdma-core versions append; the library fills at most its own size.
    pub _reserved: [u32; 8],
}

/// `union ibv_gid`: 16 raw bytes (the `global` view is two big-endian u64s, hence the 8-byte
/// alignment, which sets the size of `ibv_qp_attr`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(8))]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
    pub qp_type: c_uint,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `wr.rdma` of `ibv_send_wr`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// `wr.atomic` of `ibv_send_wr`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ibv_send_wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// `union { rdma; atomic; ud; } wr` (ud is not used; atomic is the largest member).
#[derive(Clone, Copy)]
#[repr(C)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_send_wr_rdma,
    pub atomic: ibv_send_wr_atomic,
}

/// `ibv_send_wr`; the trailing `bind_mw`/`tso` union (48 bytes) is kept as opaque bytes.
#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    /// Immediate data in network byte order (or the rkey to invalidate).
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    /// `qp_type.xrc.remote_srqn`.
    pub qp_type_xrc_remote_srqn: u32,
    pub bind_mw_or_tso: [u64; 6],
}

#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Immediate data in network byte order (or the invalidated rkey).
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

// Enum values used by the transport (verbs.h).
pub const IBV_QPT_RC: c_uint = 2;
pub const IBV_QPS_RESET: c_uint = 0;
pub const IBV_QPS_INIT: c_uint = 1;
pub const IBV_QPS_RTR: c_uint = 2;
pub const IBV_QPS_RTS: c_uint = 3;
pub const IBV_QPS_ERR: c_uint = 6;
pub const IBV_ACCESS_LOCAL_WRITE: c_uint = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_uint = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: c_uint = 1 << 2;
pub const IBV_ACCESS_REMOTE_ATOMIC: c_uint = 1 << 3;
pub const IBV_ACCESS_RELAXED_ORDERING: c_uint = 1 << 20;
pub const IBV_WR_RDMA_WRITE: c_uint = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_uint = 1;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: c_uint = 6;
pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;
pub const IBV_WC_SUCCESS: c_uint = 0;
pub const IBV_WC_RETRY_EXC_ERR: c_uint = 12;
pub const IBV_WC_REM_ACCESS_ERR: c_uint = 10;
pub const IBV_WC_WR_FLUSH_ERR: c_uint = 5;
pub const IBV_WC_RDMA_WRITE: c_uint = 1;
pub const IBV_WC_FETCH_ADD: c_uint = 4;
pub const IBV_WC_RECV: c_uint = 128;
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_uint = 129;
pub const IBV_PORT_ACTIVE: c_uint = 4;
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;
pub const IBV_ATOMIC_NONE: c_uint = 0;
pub const IBV_QP_STATE: c_int = 1;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

/// Each declared struct with its size and field offsets, as `(struct, field, offset)` rows and
/// `(struct, "sizeof", size)` rows: what the layout test compares with the C compiler's view.
pub fn layout_table() -> Vec<(&'static str, &'static str, usize)> {
    use std::mem::{offset_of, size_of};
    macro_rules! rows {
        ($v:ident, $t:ident, [$($f:ident),*]) => {{
            $v.push((stringify!($t), "sizeof", size_of::<$t>()));
            $($v.push((stringify!($t), stringify!($f), offset_of!($t, $f)));)*
        }};
    }
    let mut v = Vec::new();
    rows!(
        v,
        ibv_context_ops,
        [
            _compat_query_device,
            alloc_mw,
            poll_cq,
            req_notify_cq,
            post_srq_recv,
            post_send,
            post_recv,
            _compat_async_event
        ]
    );
    rows!(v, ibv_context, [device, ops, cmd_fd, async_fd, num_comp_vectors, mutex, abi_compat]);
    rows!(
        v,
        ibv_device_attr,
        [
            fw_ver,
            node_guid,
            max_mr_size,
            vendor_id,
            max_qp,
            max_qp_wr,
            device_cap_flags,
            max_cqe,
            max_qp_rd_atom,
            atomic_cap,
            max_srq_sge,
            max_pkeys,
            local_ca_ack_delay,
            phys_port_cnt
        ]
    );
    rows!(
        v,
        ibv_port_attr,
        [
            state,
            max_mtu,
            active_mtu,
            gid_tbl_len,
            port_cap_flags,
            pkey_tbl_len,
            lid,
            sm_lid,
            lmc,
            active_width,
            active_speed,
            phys_state,
            link_layer,
            flags,
            port_cap_flags2
        ]
    );
    rows!(v, ibv_gid, [raw]);
    rows!(v, ibv_pd, [context, handle]);
    rows!(v, ibv_comp_channel, [context, fd, refcnt]);
    rows!(v, ibv_mr, [context, pd, addr, length, handle, lkey, rkey]);
    rows!(
        v,
        ibv_cq,
        [context, channel, cq_context, handle, cqe, mutex, cond, comp_events_completed, async_events_completed]
    );
    rows!(
        v,
        ibv_qp,
        [context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num, state, qp_type, mutex, cond, events_completed]
    );
    rows!(v, ibv_sge, [addr, length, lkey]);
    rows!(
        v,
        ibv_send_wr,
        [wr_id, next, sg_list, num_sge, opcode, send_flags, imm_data, wr, qp_type_xrc_remote_srqn, bind_mw_or_tso]
    );
    rows!(v, ibv_recv_wr, [wr_id, next, sg_list, num_sge]);
    rows!(
        v,
        ibv_wc,
        [
            wr_id,
            status,
            opcode,
            vendor_err,
            byte_len,
            imm_data,
            qp_num,
            src_qp,
            wc_flags,
            pkey_index,
            slid,
            sl,
            dlid_path_bits
        ]
    );
    rows!(v, ibv_global_route, [dgid, flow_label, sgid_index, hop_limit, traffic_class]);
    rows!(v, ibv_ah_attr, [grh, dlid, sl, src_path_bits, static_rate, is_global, port_num]);
    rows!(v, ibv_qp_cap, [max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data]);
    rows!(v, ibv_qp_init_attr, [qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all]);
    rows!(
        v,
        ibv_qp_attr,
        [
            qp_state,
            cur_qp_state,
            path_mtu,
            path_mig_state,
            qkey,
            rq_psn,
            sq_psn,
            dest_qp_num,
            qp_access_flags,
            cap,
            ah_attr,
            alt_ah_attr,
            pkey_index,
            alt_pkey_index,
            en_sqd_async_notify,
            sq_draining,
            max_rd_atomic,
            max_dest_rd_atomic,
            min_rnr_timer,
            port_num,
            timeout,
            retry_cnt,
            rnr_retry,
            alt_port_num,
            alt_timeout,
            rate_limit
        ]
    );
    v
}

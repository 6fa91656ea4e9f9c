//! The part of libibverbs' binary interface this crate uses (x86_64 and aarch64
//! rdma-core, every release since the compat ops table of v17): structures laid out as
//! `<infiniband/verbs.h>` lays them out, and the constants we pass. Posting and
//! polling go through the context's ops table, as the header's inline
//! `ibv_post_send` and `ibv_poll_cq` do.

#![allow(non_camel_case_types, missing_docs)]

use std::ffi::{c_int, c_uint, c_void};

/// A device as listed by `ibv_get_device_list` (only ever used through a pointer).
#[repr(C)]
pub struct ibv_device {
    _private: [u8; 0],
}

/// Slot of `poll_cq` in [`ibv_context_ops`].
pub const OPS_POLL_CQ: usize = 11;
/// Slot of `post_send` in [`ibv_context_ops`].
pub const OPS_POST_SEND: usize = 25;

/// The provider's function table of a context (32 slots; we call two of them).
#[repr(C)]
pub struct ibv_context_ops {
    pub slots: [*mut c_void; 32],
}

/// An opened device.
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: [u8; 40],
    pub abi_compat: *mut c_void,
}

/// A protection domain.
#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

/// A registered memory region.
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

/// A completion queue.
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut c_void,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: [u8; 40],
    pub cond: [u8; 48],
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// Limits of a queue pair.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// A queue pair.
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: [u8; 40],
    pub cond: [u8; 48],
    pub events_completed: u32,
}

/// What `ibv_create_qp` is asked for.
#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

/// A global identifier (an IPv6-shaped address of a port).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

/// The global route of an address vector.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// An address vector: how to reach the remote port.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// Attributes of `ibv_modify_qp` (which ones count: the mask).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
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

/// A port's state (the compat layout `ibv_query_port` fills).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_port_attr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
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
    pub init_type: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
    pub active_speed_ex: u32,
}

/// One local range of a work request.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The remote range of an RDMA read or write.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_rdma_target {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// A send work request (the RDMA part of its unions; the rest padding).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: c_uint,
    pub imm_data: u32,
    pub rdma: ibv_rdma_target,
    /// The rest of the `wr` union (atomic: 32 bytes).
    pub wr_rest: [u64; 2],
    pub qp_type: u32,
    pub tail: [u32; 13],
}

impl Default for ibv_send_wr {
    fn default() -> Self {
        ibv_send_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_data: 0,
            rdma: ibv_rdma_target::default(),
            wr_rest: [0; 2],
            qp_type: 0,
            tail: [0; 13],
        }
    }
}

/// A work completion.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

pub const IBV_QPS_INIT: c_int = 1;
pub const IBV_QPS_RTR: c_int = 2;
pub const IBV_QPS_RTS: c_int = 3;
pub const IBV_QPS_ERR: c_int = 6;

pub const IBV_QPT_RC: c_int = 2;

pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
pub const IBV_ACCESS_REMOTE_READ: c_int = 4;

pub const IBV_WR_RDMA_WRITE: c_int = 0;
pub const IBV_WR_RDMA_READ: c_int = 4;
pub const IBV_SEND_SIGNALED: c_uint = 2;

pub const IBV_WC_SUCCESS: c_int = 0;

pub const IBV_PORT_ACTIVE: c_int = 4;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

pub const IBV_QP_STATE: c_int = 1;
pub const IBV_QP_ACCESS_FLAGS: c_int = 8;
pub const IBV_QP_PKEY_INDEX: c_int = 16;
pub const IBV_QP_PORT: c_int = 32;
pub const IBV_QP_AV: c_int = 128;
pub const IBV_QP_PATH_MTU: c_int = 256;
pub const IBV_QP_TIMEOUT: c_int = 512;
pub const IBV_QP_RETRY_CNT: c_int = 1024;
pub const IBV_QP_RNR_RETRY: c_int = 2048;
pub const IBV_QP_RQ_PSN: c_int = 4096;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 8192;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 32768;
pub const IBV_QP_SQ_PSN: c_int = 65536;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 131072;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

/// `post_send` of the ops table.
pub type PostSend =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
/// `poll_cq` of the ops table.
pub type PollCq = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;

// The layouts rdma-core has (checked against <infiniband/verbs.h> on x86_64).
const _: () = {
    assert!(std::mem::size_of::<ibv_send_wr>() == 128);
    assert!(std::mem::offset_of!(ibv_send_wr, rdma) == 40);
    assert!(std::mem::size_of::<ibv_wc>() == 48);
    assert!(std::mem::size_of::<ibv_qp_attr>() == 144);
    assert!(std::mem::offset_of!(ibv_qp_attr, ah_attr) == 56);
    assert!(std::mem::size_of::<ibv_ah_attr>() == 32);
    assert!(std::mem::size_of::<ibv_port_attr>() == 56);
    assert!(std::mem::size_of::<ibv_qp_init_attr>() == 64);
    assert!(std::mem::offset_of!(ibv_qp, qp_num) == 52);
    assert!(std::mem::offset_of!(ibv_mr, rkey) == 40);
    assert!(std::mem::offset_of!(ibv_context, ops) == 8);
    assert!(std::mem::size_of::<ibv_sge>() == 16);
};

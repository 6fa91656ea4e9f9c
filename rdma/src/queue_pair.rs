//! A reliable-connected queue pair with its own completion queue: connected once to
//! one remote queue pair, then running batches of one-sided reads and writes.
//!
//! A batch is posted as chains of work requests (one doorbell per chain, at most
//! [`QueuePair::depth`] outstanding) and completed by polling the queue pair's own
//! completion queue on the calling thread: no thread per queue pair, no shared poller.
//! A failed completion fails its item; the queue pair then flushes the rest and is
//! [`broken`](QueuePair::is_broken): the owner drops it and connects a new one. A
//! batch that outlives its deadline moves the queue pair to the error state, which
//! flushes whatever the peer never completed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::device::{Device, PORT, PortAddress};
use crate::error::RdmaError;
use crate::library::verbs;
use crate::verbs::*;

/// Work requests outstanding at once on one queue pair.
pub const DEFAULT_DEPTH: u32 = 256;
/// Longest single work request (ports take 2 GiB; items are split below this).
pub const MAX_MESSAGE: u64 = 1 << 30;
/// How long flushed completions are waited for after a deadline passed.
const FLUSH_GRACE: Duration = Duration::from_millis(200);

/// Bytes moved by successful work requests of this process since start.
static BYTES_MOVED: AtomicU64 = AtomicU64::new(0);

/// Bytes this process moved with RDMA since start (for metrics).
pub fn bytes_moved() -> u64 {
    BYTES_MOVED.load(Ordering::Relaxed)
}

/// What two queue pairs exchange to connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The queue pair number.
    pub qp_num: u32,
    /// Its first packet sequence number.
    pub psn: u32,
    /// Its port.
    pub port: PortAddress,
}

/// Direction of one work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Remote bytes into local memory.
    Read,
    /// Local bytes into remote memory.
    Write,
}

/// One one-sided transfer between a local registered range and a remote one.
#[derive(Clone, Copy, Debug)]
pub struct Work {
    /// Read or write.
    pub direction: Direction,
    /// Local address (inside a region registered on this queue pair's device).
    pub local: u64,
    /// The local region's key.
    pub lkey: u32,
    /// Bytes (at most [`MAX_MESSAGE`]).
    pub len: u64,
    /// Remote address.
    pub remote: u64,
    /// The remote region's key.
    pub rkey: u32,
}

/// Why a work request did not complete.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WorkError {
    /// It completed with an error status.
    #[error("completion error: {0}")]
    Completion(String),
    /// It was not accepted by the queue pair.
    #[error("post failed: {0}")]
    Post(String),
    /// Its deadline passed before it completed.
    #[error("no completion before the deadline")]
    Deadline,
    /// The completion queue failed (overrun).
    #[error("the completion queue failed")]
    Poll,
    /// Longer than one work request may be.
    #[error("work request of {0} bytes is over the 1 GiB limit")]
    TooLong(u64),
}

/// A queue pair and its completion queue; destroyed when dropped.
#[derive(Debug)]
pub struct QueuePair {
    device: Arc<Device>,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    qp_num: u32,
    psn: u32,
    depth: u32,
    broken: bool,
}

// SAFETY: one owner at a time uses the queue pair (`&mut self`); the verbs objects are
// thread safe and freed in Drop.
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// A queue pair on `device` with `depth` work requests outstanding at most.
    pub fn create(device: &Arc<Device>, depth: u32) -> Result<QueuePair, RdmaError> {
        let verbs = verbs()?;
        let cqe = std::ffi::c_int::try_from(depth).unwrap_or(4096);
        // SAFETY: an open context; no channel, vector 0.
        let cq = unsafe {
            (verbs.create_cq)(
                device.context,
                cqe,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(RdmaError::call("ibv_create_cq", device.name()));
        }
        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: std::ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: depth,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: an open pd and a live cq.
        let qp = unsafe { (verbs.create_qp)(device.pd, &mut init) };
        if qp.is_null() {
            let error = RdmaError::call("ibv_create_qp", device.name());
            // SAFETY: created above, used by nothing.
            unsafe { (verbs.destroy_cq)(cq) };
            return Err(error);
        }
        // SAFETY: a created queue pair.
        let qp_num = unsafe { (*qp).qp_num };
        Ok(QueuePair {
            device: Arc::clone(device),
            cq,
            qp,
            qp_num,
            psn: random_psn(),
            depth: init.cap.max_send_wr.clamp(1, depth),
            broken: false,
        })
    }

    /// What the remote queue pair needs to connect to this one.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            qp_num: self.qp_num,
            psn: self.psn,
            port: self.device.address(),
        }
    }

    /// Work requests outstanding at most.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// True once a work request failed or a deadline passed: drop it and connect anew.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Connects to `remote` (INIT, ready to receive, ready to send), allowing the
    /// remote to read and write the regions this side registered for remote reach.
    pub fn connect(&mut self, remote: &Endpoint) -> Result<(), RdmaError> {
        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            qp_access_flags: (IBV_ACCESS_LOCAL_WRITE
                | IBV_ACCESS_REMOTE_READ
                | IBV_ACCESS_REMOTE_WRITE) as u32,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
            "INIT",
        )?;
        let local = self.device.address();
        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: std::ffi::c_int::from(local.mtu.min(remote.port.mtu).max(1)),
            dest_qp_num: remote.qp_num,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            ah_attr: ibv_ah_attr {
                grh: ibv_global_route {
                    dgid: ibv_gid {
                        raw: remote.port.gid,
                    },
                    flow_label: 0,
                    sgid_index: local.gid_index,
                    hop_limit: 64,
                    traffic_class: 0,
                },
                dlid: remote.port.lid,
                sl: 0,
                src_path_bits: 0,
                static_rate: 0,
                is_global: 1,
                port_num: PORT,
            },
            ..Default::default()
        };
        self.modify(
            &mut attr,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;
        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: self.psn,
            max_rd_atomic: 16,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    fn modify(
        &mut self,
        attr: &mut ibv_qp_attr,
        mask: std::ffi::c_int,
        to: &str,
    ) -> Result<(), RdmaError> {
        let verbs = verbs()?;
        // SAFETY: a live queue pair and a fully initialized attribute block.
        let code = unsafe { (verbs.modify_qp)(self.qp, attr, mask) };
        if code != 0 {
            self.broken = true;
            let mut error = RdmaError::returned("ibv_modify_qp", self.device.name(), code);
            if let RdmaError::Call { reason, .. } = &mut error {
                reason.push_str(&format!(" (moving queue pair {} to {to})", self.qp_num));
            }
            return Err(error);
        }
        Ok(())
    }

    /// Runs `work` in order, `depth` at a time; one result per item. After a failure
    /// the queue pair is broken and every later item fails too.
    pub fn run(&mut self, work: &[Work], deadline: Instant) -> Vec<Result<(), WorkError>> {
        let mut results: Vec<Result<(), WorkError>> = Vec::with_capacity(work.len());
        let window = usize::try_from(self.depth).unwrap_or(1).max(1);
        for chunk in work.chunks(window) {
            if self.broken {
                let failure = WorkError::Completion("the queue pair failed earlier".into());
                results.extend(chunk.iter().map(|_| Err(failure.clone())));
                continue;
            }
            self.run_window(chunk, deadline, &mut results);
        }
        results
    }

    /// Posts one chain of at most `depth` requests and polls until each completed.
    fn run_window(
        &mut self,
        chunk: &[Work],
        deadline: Instant,
        results: &mut Vec<Result<(), WorkError>>,
    ) {
        let first = results.len();
        let mut sges = Vec::with_capacity(chunk.len());
        let mut outcomes: Vec<Option<Result<(), WorkError>>> = vec![None; chunk.len()];
        for (index, item) in chunk.iter().enumerate() {
            match u32::try_from(item.len) {
                Ok(length) if item.len <= MAX_MESSAGE => sges.push(ibv_sge {
                    addr: item.local,
                    length,
                    lkey: item.lkey,
                }),
                _ => {
                    outcomes[index] = Some(Err(WorkError::TooLong(item.len)));
                    sges.push(ibv_sge::default());
                }
            }
        }
        let mut requests: Vec<ibv_send_wr> = Vec::with_capacity(chunk.len());
        for (index, item) in chunk.iter().enumerate() {
            if outcomes[index].is_some() {
                continue;
            }
            requests.push(ibv_send_wr {
                wr_id: index as u64,
                sg_list: &mut sges[index],
                num_sge: 1,
                opcode: match item.direction {
                    Direction::Read => IBV_WR_RDMA_READ,
                    Direction::Write => IBV_WR_RDMA_WRITE,
                },
                send_flags: IBV_SEND_SIGNALED,
                rdma: ibv_rdma_target {
                    remote_addr: item.remote,
                    rkey: item.rkey,
                },
                ..Default::default()
            });
        }
        let posted = requests.len();
        let chain = requests.as_mut_ptr();
        for at in 1..posted {
            // SAFETY: both indices are inside `requests`, which is not moved until the
            // post returns.
            unsafe { (*chain.add(at - 1)).next = chain.add(at) };
        }
        let mut pending = posted;
        if posted > 0
            && let Err(error) = self.post(chain)
        {
            self.broken = true;
            for outcome in outcomes.iter_mut().filter(|o| o.is_none()) {
                *outcome = Some(Err(error.clone()));
            }
            pending = 0;
        }
        if pending > 0 {
            self.complete(&mut outcomes, pending, deadline);
        }
        results.extend(
            outcomes
                .into_iter()
                .map(|outcome| outcome.unwrap_or(Err(WorkError::Deadline))),
        );
        debug_assert_eq!(results.len(), first + chunk.len());
    }

    fn post(&mut self, chain: *mut ibv_send_wr) -> Result<(), WorkError> {
        // SAFETY: the context's ops table holds the provider's post_send.
        let post: PostSend = unsafe {
            std::mem::transmute::<*mut std::ffi::c_void, PostSend>(
                (*self.device.context).ops.slots[OPS_POST_SEND],
            )
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: a chain of initialized requests whose sges outlive the completions
        // (the caller polls them before returning).
        let code = unsafe { post(self.qp, chain, &mut bad) };
        if code != 0 {
            return Err(WorkError::Post(
                std::io::Error::from_raw_os_error(code).to_string(),
            ));
        }
        Ok(())
    }

    /// Polls until `pending` completions arrived or the deadline passed (then the
    /// queue pair is moved to the error state and its flushes are collected).
    fn complete(
        &mut self,
        outcomes: &mut [Option<Result<(), WorkError>>],
        mut pending: usize,
        deadline: Instant,
    ) {
        let Ok(verbs) = verbs() else { return };
        // SAFETY: the context's ops table holds the provider's poll_cq.
        let poll: PollCq = unsafe {
            std::mem::transmute::<*mut std::ffi::c_void, PollCq>(
                (*self.device.context).ops.slots[OPS_POLL_CQ],
            )
        };
        let mut completions = [ibv_wc::default(); 32];
        let mut idle_polls = 0u32;
        let mut flushing_since: Option<Instant> = None;
        while pending > 0 {
            // SAFETY: a live cq and a buffer of 32 completions.
            let got = unsafe { poll(self.cq, 32, completions.as_mut_ptr()) };
            if got < 0 {
                self.broken = true;
                for outcome in outcomes.iter_mut().filter(|o| o.is_none()) {
                    *outcome = Some(Err(WorkError::Poll));
                }
                return;
            }
            let got = usize::try_from(got).unwrap_or(0);
            for completion in &completions[..got] {
                let Some(slot) = usize::try_from(completion.wr_id)
                    .ok()
                    .and_then(|index| outcomes.get_mut(index))
                else {
                    continue;
                };
                if slot.is_some() {
                    continue;
                }
                pending -= 1;
                *slot = Some(if completion.status == IBV_WC_SUCCESS {
                    BYTES_MOVED.fetch_add(u64::from(completion.byte_len), Ordering::Relaxed);
                    Ok(())
                } else {
                    self.broken = true;
                    Err(WorkError::Completion(verbs.status_text(completion.status)))
                });
            }
            if got > 0 {
                idle_polls = 0;
                continue;
            }
            idle_polls = idle_polls.saturating_add(1);
            let now = Instant::now();
            match flushing_since {
                None if now >= deadline => {
                    self.broken = true;
                    self.enter_error_state();
                    flushing_since = Some(now);
                }
                Some(since) if now.duration_since(since) > FLUSH_GRACE => return,
                _ => {}
            }
            back_off(idle_polls);
        }
    }

    /// Moves the queue pair to the error state: outstanding requests flush.
    fn enter_error_state(&mut self) {
        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_ERR,
            ..Default::default()
        };
        let _ = self.modify(&mut attr, IBV_QP_STATE, "ERR");
    }
}

/// Spins first (a completion is usually microseconds away), then yields, then sleeps.
fn back_off(idle_polls: u32) {
    if idle_polls < 200 {
        std::hint::spin_loop();
    } else if idle_polls < 2_000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

fn random_psn() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (nanos ^ std::process::id().rotate_left(12)) & 0x00ff_ffff
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let Ok(verbs) = verbs() else { return };
        // SAFETY: created by us, destroyed once, the queue pair before its cq.
        unsafe {
            (verbs.destroy_qp)(self.qp);
            (verbs.destroy_cq)(self.cq);
        }
    }
}

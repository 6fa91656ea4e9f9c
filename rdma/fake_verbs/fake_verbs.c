/*
 * A stand-in for the RDMA verbs library (libibverbs.so.1), for tests on machines without
 * an RDMA NIC. It exports the verbs calls mooncake-rs loads, with the structs laid out as
 * rdma-core's on x86_64, and fills the context's ops table where rdma-core's inline
 * ibv_poll_cq (slot 11) and ibv_post_send (slot 25) look. One-sided transfers between
 * processes of one machine are done with process_vm_readv/process_vm_writev. The rules
 * that matter to a caller, as a real NIC would apply them:
 *
 *  - devices: FAKE_VERBS_DEVICES (0..4, default 1) devices fake_rdma0, fake_rdma1, ...;
 *    port 1 only: ACTIVE, MTU 4096, lid 1 + device index, InfiniBand link layer,
 *    max_msg_sz 2^31, one GID (index 0); like rdma-core's exported ibv_query_port it
 *    writes only the old struct's fields (up to `flags`, 48 bytes). ibv_open_device lets
 *    any process ptrace us (PR_SET_PTRACER_ANY), so peers may use process_vm_* on us;
 *  - addressing: each process publishes a table (in this library's memory) of its MRs
 *    {rkey, access, addr, length, live} and QPs {qp_num, state, access flags, live}.
 *    The GID says where: bytes 0..4 our pid, 4..12 the table's address, 12..16 the
 *    device index (all little endian). lkey == rkey == (generation << 10) | slot and
 *    qp_num == (generation << 10) | slot (kept in 24 bits, as on the wire): nonzero,
 *    unique among the process's live objects. At most 1024 MRs and 1024 QPs (ENOMEM);
 *  - ibv_reg_mr refuses a NULL address or length 0 (EINVAL), REMOTE_WRITE or
 *    REMOTE_ATOMIC without LOCAL_WRITE (EINVAL), and a range that is not all mapped
 *    readable, and writable when the access allows writes (EFAULT), as pinning would;
 *  - objects in use cannot be freed (EBUSY): a PD with MRs or QPs, a CQ with QPs, a
 *    context with PDs or CQs;
 *  - RC QPs only (EINVAL otherwise), no SRQ, no completion channel. modify_qp follows
 *    the kernel's state table for RC: RESET->INIT needs STATE|PKEY_INDEX|PORT|
 *    ACCESS_FLAGS (port 1, pkey index 0); INIT->RTR needs STATE|AV|PATH_MTU|DEST_QPN|
 *    RQ_PSN|MAX_DEST_RD_ATOMIC|MIN_RNR_TIMER, a global route (is_global 1, sgid_index
 *    0; the peer is whatever the dgid names) on port 1; RTR->RTS needs STATE|TIMEOUT|
 *    RETRY_CNT|RNR_RETRY|SQ_PSN|MAX_QP_RD_ATOMIC; INIT->INIT and RTS->RTS change only
 *    optional attributes; any state -> ERR or RESET always. A missing required bit, a
 *    bit the transition does not take, or another transition: EINVAL, nothing changed.
 *    RESET forgets the peer and drops queued work and completions without a trace;
 *  - post_send: the QP must be in RTS (EINVAL and *bad_wr otherwise; in ERR every work
 *    request is accepted and completes with WR_FLUSH_ERR). Opcodes RDMA_WRITE and
 *    RDMA_READ only, 1..max_send_sge sges (EINVAL, *bad_wr); IBV_SEND_INLINE on a write
 *    skips the lkey check, up to max_inline_data bytes (ENOMEM beyond). A send queue
 *    slot is freed only when a completion of that or a later wr of the QP is polled (an
 *    unsignaled wr lives until then); max_send_wr of them in use: ENOMEM, *bad_wr;
 *  - each wr runs synchronously inside post_send, in order. Local sges must lie in a
 *    live MR of the QP's PD with that lkey, with LOCAL_WRITE when a read lands there
 *    (else LOC_PROT_ERR). The peer's QP entry (slot dest_qp_num & 1023) must be live,
 *    have that number and be in RTR or RTS, and the peer process must exist (else
 *    RETRY_EXC_ERR); its MR entry (slot rkey & 1023) must be live with that rkey, hold
 *    the whole remote range, and it and the peer QP must allow REMOTE_WRITE / REMOTE_READ
 *    (else REM_ACCESS_ERR; a wr of 0 bytes checks no rkey). More than 2^31 bytes:
 *    LOC_LEN_ERR. A failed copy: RETRY_EXC_ERR;
 *  - completions go to the send CQ for signaled wrs (all of them with sq_sig_all) and
 *    for every error; byte_len is the wr's total length. After an error the QP is in
 *    ERR and every later wr completes with WR_FLUSH_ERR;
 *  - a CQ holds cqe completions; one more overruns it: from then on poll_cq returns -1
 *    until it is destroyed, and the QP whose completion did not fit enters ERR.
 *    Destroying (or resetting) a QP removes its completions from the CQ.
 *
 * Faults, one armed at a time: fake_verbs_inject(name, after) fires on the wr posted
 * `after` wrs from now by any QP of the process (0: the next one); FAKE_VERBS_FAULT=
 * name[@after] arms one at the first ibv_get_device_list. qp_error: the QP enters ERR
 * before the wr runs (it and the rest flush). remote_access: the wr completes with
 * REM_ACCESS_ERR without copying. retry_exceeded: it completes with RETRY_EXC_ERR, as if
 * the peer died. cq_overrun: its completion overruns the CQ. never_complete: it and every
 * later wr of that QP are accepted and never run nor complete, until the QP is moved to
 * ERR (they flush) or RESET. Counters for tests: fake_verbs_live_qps(),
 * fake_verbs_live_mrs(), fake_verbs_work_requests() (wrs accepted since load).
 *
 * Built by the tests with: cc -shared -fPIC -Wl,-Bsymbolic -Wl,-soname,libibverbs.so.1
 * -o libibverbs.so.1 (the soname makes a later dlopen("libibverbs.so.1") find it).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef PR_SET_PTRACER
#define PR_SET_PTRACER 0x59616d61
#endif
#ifndef PR_SET_PTRACER_ANY
#define PR_SET_PTRACER_ANY ((unsigned long)-1)
#endif

/* rdma-core's structs, x86_64 layout. */

struct ibv_cq;
struct ibv_qp;
struct ibv_wc;
struct ibv_send_wr;

union ibv_gid {
  uint8_t raw[16];
  struct {
    uint64_t subnet_prefix;
    uint64_t interface_id;
  } global;
};

struct ibv_device {
  void *_ops[2];
  int node_type;
  int transport_type;
  char name[64];
  char dev_name[64];
  char dev_path[256];
  char ibdev_path[256];
};

/* 32 pointers; only poll_cq (slot 11) and post_send (slot 25) are set. */
struct ibv_context_ops {
  void *_compat0[11];
  int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
  void *_compat1[13];
  int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
  void *_compat2[6];
};

struct ibv_context {
  struct ibv_device *device;
  struct ibv_context_ops ops;
  int cmd_fd;
  int async_fd;
  int num_comp_vectors;
  pthread_mutex_t mutex;
  void *abi_compat;
};

struct ibv_pd {
  struct ibv_context *context;
  uint32_t handle;
};

struct ibv_mr {
  struct ibv_context *context;
  struct ibv_pd *pd;
  void *addr;
  size_t length;
  uint32_t handle;
  uint32_t lkey;
  uint32_t rkey;
};

struct ibv_cq {
  struct ibv_context *context;
  void *channel;
  void *cq_context;
  uint32_t handle;
  int cqe;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t comp_events_completed;
  uint32_t async_events_completed;
};

struct ibv_qp_cap {
  uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data;
};

struct ibv_qp {
  struct ibv_context *context;
  void *qp_context;
  struct ibv_pd *pd;
  struct ibv_cq *send_cq;
  struct ibv_cq *recv_cq;
  void *srq;
  uint32_t handle;
  uint32_t qp_num;
  int state;
  int qp_type;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t events_completed;
};

struct ibv_qp_init_attr {
  void *qp_context;
  struct ibv_cq *send_cq;
  struct ibv_cq *recv_cq;
  void *srq;
  struct ibv_qp_cap cap;
  int qp_type;
  int sq_sig_all;
};

struct ibv_global_route {
  union ibv_gid dgid;
  uint32_t flow_label;
  uint8_t sgid_index;
  uint8_t hop_limit;
  uint8_t traffic_class;
};

struct ibv_ah_attr {
  struct ibv_global_route grh;
  uint16_t dlid;
  uint8_t sl;
  uint8_t src_path_bits;
  uint8_t static_rate;
  uint8_t is_global;
  uint8_t port_num;
};

struct ibv_qp_attr {
  int qp_state;
  int cur_qp_state;
  int path_mtu;
  int path_mig_state;
  uint32_t qkey;
  uint32_t rq_psn;
  uint32_t sq_psn;
  uint32_t dest_qp_num;
  unsigned qp_access_flags;
  struct ibv_qp_cap cap;
  struct ibv_ah_attr ah_attr;
  struct ibv_ah_attr alt_ah_attr;
  uint16_t pkey_index;
  uint16_t alt_pkey_index;
  uint8_t en_sqd_async_notify;
  uint8_t sq_draining;
  uint8_t max_rd_atomic;
  uint8_t max_dest_rd_atomic;
  uint8_t min_rnr_timer;
  uint8_t port_num;
  uint8_t timeout;
  uint8_t retry_cnt;
  uint8_t rnr_retry;
  uint8_t alt_port_num;
  uint8_t alt_timeout;
  uint32_t rate_limit;
};

struct ibv_port_attr {
  int state;
  int max_mtu;
  int active_mtu;
  int gid_tbl_len;
  uint32_t port_cap_flags;
  uint32_t max_msg_sz;
  uint32_t bad_pkey_cntr;
  uint32_t qkey_viol_cntr;
  uint16_t pkey_tbl_len;
  uint16_t lid;
  uint16_t sm_lid;
  uint8_t lmc;
  uint8_t max_vl_num;
  uint8_t sm_sl;
  uint8_t subnet_timeout;
  uint8_t init_type;
  uint8_t active_width;
  uint8_t active_speed;
  uint8_t phys_state;
  uint8_t link_layer;
  uint8_t flags;
  uint16_t port_cap_flags2;
  uint32_t active_speed_ex;
};

struct ibv_sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

struct ibv_send_wr {
  uint64_t wr_id;
  struct ibv_send_wr *next;
  struct ibv_sge *sg_list;
  int num_sge;
  int opcode;
  unsigned send_flags;
  uint32_t imm_data;
  union {
    struct {
      uint64_t remote_addr;
      uint32_t rkey;
    } rdma;
    struct {
      uint64_t remote_addr, compare_add, swap;
      uint32_t rkey;
    } atomic;
  } wr;
  uint32_t qp_type_xrc;
  uint8_t tail[52];
};

struct ibv_wc {
  uint64_t wr_id;
  int status;
  int opcode;
  uint32_t vendor_err;
  uint32_t byte_len;
  uint32_t imm_data;
  uint32_t qp_num;
  uint32_t src_qp;
  unsigned wc_flags;
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
};

_Static_assert(sizeof(union ibv_gid) == 16, "ibv_gid");
_Static_assert(sizeof(struct ibv_device) == 664, "ibv_device");
_Static_assert(sizeof(struct ibv_context_ops) == 32 * sizeof(void *), "ibv_context_ops");
_Static_assert(offsetof(struct ibv_context_ops, poll_cq) == 11 * sizeof(void *), "poll_cq slot");
_Static_assert(offsetof(struct ibv_context_ops, post_send) == 25 * sizeof(void *), "post_send slot");
_Static_assert(offsetof(struct ibv_context, ops) == 8 && sizeof(struct ibv_context) == 328, "ibv_context");
_Static_assert(sizeof(struct ibv_pd) == 16, "ibv_pd");
_Static_assert(sizeof(struct ibv_mr) == 48 && offsetof(struct ibv_mr, lkey) == 36, "ibv_mr");
_Static_assert(sizeof(struct ibv_cq) == 128, "ibv_cq");
_Static_assert(sizeof(struct ibv_qp) == 160 && offsetof(struct ibv_qp, qp_num) == 52, "ibv_qp");
_Static_assert(sizeof(struct ibv_qp_init_attr) == 64, "ibv_qp_init_attr");
_Static_assert(sizeof(struct ibv_global_route) == 24, "ibv_global_route");
_Static_assert(sizeof(struct ibv_ah_attr) == 32, "ibv_ah_attr");
_Static_assert(sizeof(struct ibv_qp_attr) == 144 && offsetof(struct ibv_qp_attr, ah_attr) == 56, "ibv_qp_attr");
_Static_assert(offsetof(struct ibv_qp_attr, port_num) == 129 && offsetof(struct ibv_qp_attr, rate_limit) == 136,
               "ibv_qp_attr tail");
_Static_assert(sizeof(struct ibv_port_attr) == 56 && offsetof(struct ibv_port_attr, port_cap_flags2) == 48, "ibv_port_attr");
_Static_assert(sizeof(struct ibv_sge) == 16, "ibv_sge");
_Static_assert(sizeof(struct ibv_send_wr) == 128 && offsetof(struct ibv_send_wr, wr) == 40 &&
                   offsetof(struct ibv_send_wr, qp_type_xrc) == 72,
               "ibv_send_wr");
_Static_assert(sizeof(struct ibv_wc) == 48, "ibv_wc");

enum { QPS_RESET, QPS_INIT, QPS_RTR, QPS_RTS, QPS_SQD, QPS_SQE, QPS_ERR };
enum { QPT_RC = 2 };
enum { ACCESS_LOCAL_WRITE = 1, ACCESS_REMOTE_WRITE = 2, ACCESS_REMOTE_READ = 4, ACCESS_REMOTE_ATOMIC = 8 };
enum { WR_RDMA_WRITE = 0, WR_RDMA_READ = 4 };
enum { SEND_SIGNALED = 2, SEND_INLINE = 8 };
enum { WC_RDMA_WRITE = 1, WC_RDMA_READ = 2 };
enum {
  WC_SUCCESS = 0,
  WC_LOC_LEN_ERR = 1,
  WC_LOC_QP_OP_ERR = 2,
  WC_LOC_PROT_ERR = 4,
  WC_WR_FLUSH_ERR = 5,
  WC_REM_INV_REQ_ERR = 9,
  WC_REM_ACCESS_ERR = 10,
  WC_REM_OP_ERR = 11,
  WC_RETRY_EXC_ERR = 12,
};
enum {
  M_STATE = 1 << 0,
  M_CUR_STATE = 1 << 1,
  M_EN_SQD_ASYNC_NOTIFY = 1 << 2,
  M_ACCESS_FLAGS = 1 << 3,
  M_PKEY_INDEX = 1 << 4,
  M_PORT = 1 << 5,
  M_QKEY = 1 << 6,
  M_AV = 1 << 7,
  M_PATH_MTU = 1 << 8,
  M_TIMEOUT = 1 << 9,
  M_RETRY_CNT = 1 << 10,
  M_RNR_RETRY = 1 << 11,
  M_RQ_PSN = 1 << 12,
  M_MAX_QP_RD_ATOMIC = 1 << 13,
  M_ALT_PATH = 1 << 14,
  M_MIN_RNR_TIMER = 1 << 15,
  M_SQ_PSN = 1 << 16,
  M_MAX_DEST_RD_ATOMIC = 1 << 17,
  M_PATH_MIG_STATE = 1 << 18,
  M_CAP = 1 << 19,
  M_DEST_QPN = 1 << 20,
};
enum { PORT_ACTIVE = 4, MTU_4096 = 5, LINK_LAYER_INFINIBAND = 1 };

#define MAX_DEVICES 4
#define SLOTS 1024
#define SLOT_BITS 10
#define MAX_MSG (1u << 31)
#define MAX_CQE (1 << 22)
#define MAX_WR 32768
#define MAX_SGE 30
#define MAX_INLINE 512
#define MAX_RD_ATOMIC 16

/* The table peers read with process_vm_readv; its address is in our GID. Entries are
 * written with atomic stores, `live` last when one appears and first when it goes. */
struct pub_mr {
  uint32_t rkey;
  uint32_t access;
  uint64_t addr;
  uint64_t length;
  uint32_t live;
  uint32_t pad;
};
struct pub_qp {
  uint32_t qp_num;
  uint32_t state;
  uint32_t access_flags;
  uint32_t live;
};
struct published {
  struct pub_mr mrs[SLOTS];
  struct pub_qp qps[SLOTS];
};
_Static_assert(sizeof(struct pub_mr) == 32 && sizeof(struct pub_qp) == 16, "published entries");

struct fdev {
  struct ibv_device dev;
  int index;
};

struct fctx {
  struct ibv_context ctx;
  int index;
  int pds, cqs; /* live on this context; under `lock` */
};

struct fpd {
  struct ibv_pd pd;
  int users; /* MRs and QPs; under `lock` */
};

struct fmr {
  struct ibv_mr mr;
  unsigned access;
};

struct fqp;

struct cq_entry {
  struct ibv_wc wc;
  struct fqp *qp;
  uint64_t seq; /* the wr's sequence number in its QP */
};

struct fcq {
  struct ibv_cq cq;
  pthread_mutex_t lock;
  int users; /* QPs; under the global `lock` */
  int overrun;
  int head, count, size;
  struct cq_entry *ring;
};

/* A wr accepted but not run (never_complete), or about to complete. */
struct work {
  uint64_t wr_id;
  uint64_t seq;
  int opcode;
  uint32_t byte_len;
};

struct fqp {
  struct ibv_qp qp;
  pthread_mutex_t lock; /* order: a QP's lock, then `lock`, then a CQ's lock */
  int slot;
  int sq_sig_all;
  struct ibv_qp_cap cap;
  unsigned access;
  int port;
  uint32_t dest_qpn;
  pid_t peer_pid;
  uint64_t peer_table;
  uint64_t posted;  /* wrs accepted since RESET */
  uint64_t retired; /* seq of the last completion polled; atomic */
  int stalled;      /* never_complete fired: wrs wait in `stuck` */
  uint32_t nstuck;
  struct work *stuck;
};

enum { F_NONE, F_QP_ERROR, F_REMOTE_ACCESS, F_CQ_OVERRUN, F_NEVER_COMPLETE, F_RETRY_EXCEEDED };
static const char *const fault_names[] = {
    [F_QP_ERROR] = "qp_error",
    [F_REMOTE_ACCESS] = "remote_access",
    [F_CQ_OVERRUN] = "cq_overrun",
    [F_NEVER_COMPLETE] = "never_complete",
    [F_RETRY_EXCEEDED] = "retry_exceeded",
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static struct published published;
static struct fmr *mrs[SLOTS];
static uint32_t mr_gen[SLOTS];
static struct fqp *qps[SLOTS];
static uint32_t qp_gen[SLOTS];
static struct fdev devices[MAX_DEVICES];
static int ndevices;
static uint32_t handles;
static int fault;
static unsigned long long fault_at;
static unsigned long long work_requests;

static int fail(int err) {
  errno = err;
  return err;
}

static void *fail_null(int err) {
  errno = err;
  return NULL;
}

static int fault_by_name(const char *name, size_t len) {
  for (int f = F_QP_ERROR; f <= F_RETRY_EXCEEDED; f++)
    if (strlen(fault_names[f]) == len && strncmp(fault_names[f], name, len) == 0) return f;
  return F_NONE;
}

static void setup(void) {
  ndevices = 1;
  const char *env = getenv("FAKE_VERBS_DEVICES");
  if (env && *env) {
    char *end;
    long n = strtol(env, &end, 10);
    if (*end == '\0' && n >= 0 && n <= MAX_DEVICES) ndevices = (int)n;
    else fprintf(stderr, "fake_verbs: FAKE_VERBS_DEVICES=%s is not 0..%d; using 1\n", env, MAX_DEVICES);
  }
  for (int i = 0; i < MAX_DEVICES; i++) {
    struct ibv_device *d = &devices[i].dev;
    devices[i].index = i;
    d->node_type = 1;      /* IBV_NODE_CA */
    d->transport_type = 0; /* IBV_TRANSPORT_IB */
    snprintf(d->name, sizeof d->name, "fake_rdma%d", i);
    snprintf(d->dev_name, sizeof d->dev_name, "uverbs%d", i);
    snprintf(d->dev_path, sizeof d->dev_path, "/sys/class/infiniband_verbs/uverbs%d", i);
    snprintf(d->ibdev_path, sizeof d->ibdev_path, "/sys/class/infiniband/fake_rdma%d", i);
  }
  env = getenv("FAKE_VERBS_FAULT");
  if (env && *env) {
    const char *at = strchr(env, '@');
    size_t len = at ? (size_t)(at - env) : strlen(env);
    unsigned long after = 0;
    char *end = NULL;
    if (at) after = strtoul(at + 1, &end, 10);
    int f = fault_by_name(env, len);
    if (f == F_NONE || (at && (end == at + 1 || *end != '\0'))) {
      fprintf(stderr, "fake_verbs: ignoring FAKE_VERBS_FAULT=%s\n", env);
    } else {
      pthread_mutex_lock(&lock);
      fault = f;
      fault_at = work_requests + after;
      pthread_mutex_unlock(&lock);
    }
  }
}

/* The fault that fires on the wr being accepted now, if any; counts the wr. */
static int take_fault(void) {
  pthread_mutex_lock(&lock);
  int f = F_NONE;
  if (fault != F_NONE && work_requests == fault_at) {
    f = fault;
    fault = F_NONE;
  }
  work_requests++;
  pthread_mutex_unlock(&lock);
  return f;
}

static void put_le(uint8_t *p, uint64_t v, int n) {
  for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* Whether [addr, addr + len) is all mapped readable, and writable when `write`. */
static int mapped(uintptr_t addr, size_t len, int write) {
  if (addr + len < addr) return 0;
  FILE *f = fopen("/proc/self/maps", "re");
  if (!f) return 1; /* cannot tell */
  uintptr_t cur = addr, end = addr + len;
  char *line = NULL;
  size_t cap = 0;
  while (cur < end && getline(&line, &cap, f) > 0) {
    unsigned long lo, hi;
    char perms[5];
    if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) != 3) continue;
    if (hi <= cur) continue;
    if (lo > cur) break;
    if (perms[0] != 'r' || (write && perms[1] != 'w')) break;
    cur = hi;
  }
  free(line);
  fclose(f);
  return cur >= end;
}

/* Devices and contexts. */

struct ibv_device **ibv_get_device_list(int *num) {
  pthread_once(&once, setup);
  struct ibv_device **list = calloc((size_t)ndevices + 1, sizeof *list);
  if (!list) return fail_null(ENOMEM);
  for (int i = 0; i < ndevices; i++) list[i] = &devices[i].dev;
  if (num) *num = ndevices;
  return list;
}

void ibv_free_device_list(struct ibv_device **list) { free(list); }

const char *ibv_get_device_name(struct ibv_device *device) {
  if (!device) return fail_null(EINVAL);
  return device->name;
}

static int poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
static int post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);

struct ibv_context *ibv_open_device(struct ibv_device *device) {
  pthread_once(&once, setup);
  struct fdev *d = (struct fdev *)device;
  if (d < &devices[0] || d >= &devices[MAX_DEVICES] || d != &devices[d->index]) return fail_null(ENODEV);
  struct fctx *c = calloc(1, sizeof *c);
  if (!c) return fail_null(ENOMEM);
  (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  c->index = d->index;
  c->ctx.device = device;
  c->ctx.ops.poll_cq = poll_cq;
  c->ctx.ops.post_send = post_send;
  c->ctx.cmd_fd = -1;
  c->ctx.async_fd = -1;
  c->ctx.num_comp_vectors = 1;
  pthread_mutex_init(&c->ctx.mutex, NULL);
  return &c->ctx;
}

int ibv_close_device(struct ibv_context *context) {
  struct fctx *c = (struct fctx *)context;
  if (!c) return fail(EINVAL);
  pthread_mutex_lock(&lock);
  int busy = c->pds || c->cqs;
  pthread_mutex_unlock(&lock);
  if (busy) return fail(EBUSY);
  pthread_mutex_destroy(&c->ctx.mutex);
  free(c);
  return 0;
}

/* Like rdma-core's exported ibv_query_port, writes only the fields of the old (compat)
 * struct, up to `flags`: callers built against older headers pass a smaller struct, and
 * newer ones zero it first (the inline ___ibv_query_port does). */
int ibv_query_port(struct ibv_context *context, uint8_t port, struct ibv_port_attr *out) {
  if (!context || !out || port != 1) return fail(EINVAL);
  struct fctx *c = (struct fctx *)context;
  struct ibv_port_attr a = {0}, *attr = &a;
  attr->state = PORT_ACTIVE;
  attr->max_mtu = MTU_4096;
  attr->active_mtu = MTU_4096;
  attr->gid_tbl_len = 1;
  attr->max_msg_sz = MAX_MSG;
  attr->pkey_tbl_len = 1;
  attr->lid = (uint16_t)(1 + c->index);
  attr->sm_lid = 1;
  attr->max_vl_num = 4;
  attr->subnet_timeout = 18;
  attr->active_width = 2;  /* 4X */
  attr->active_speed = 32; /* EDR */
  attr->phys_state = 5;    /* LinkUp */
  attr->link_layer = LINK_LAYER_INFINIBAND;
  memcpy(out, attr, offsetof(struct ibv_port_attr, port_cap_flags2));
  return 0;
}

int ibv_query_gid(struct ibv_context *context, uint8_t port, int index, union ibv_gid *gid) {
  if (!context || !gid || port != 1 || index != 0) return fail(EINVAL);
  struct fctx *c = (struct fctx *)context;
  put_le(gid->raw, (uint32_t)getpid(), 4);
  put_le(gid->raw + 4, (uint64_t)(uintptr_t)&published, 8);
  put_le(gid->raw + 12, (uint32_t)c->index, 4);
  return 0;
}

/* Protection domains and memory regions. */

struct ibv_pd *ibv_alloc_pd(struct ibv_context *context) {
  if (!context) return fail_null(EINVAL);
  struct fpd *p = calloc(1, sizeof *p);
  if (!p) return fail_null(ENOMEM);
  p->pd.context = context;
  pthread_mutex_lock(&lock);
  p->pd.handle = ++handles;
  ((struct fctx *)context)->pds++;
  pthread_mutex_unlock(&lock);
  return &p->pd;
}

int ibv_dealloc_pd(struct ibv_pd *pd) {
  struct fpd *p = (struct fpd *)pd;
  if (!p) return fail(EINVAL);
  pthread_mutex_lock(&lock);
  int busy = p->users != 0;
  if (!busy) ((struct fctx *)pd->context)->pds--;
  pthread_mutex_unlock(&lock);
  if (busy) return fail(EBUSY);
  free(p);
  return 0;
}

struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access) {
  if (!pd || !addr || length == 0) return fail_null(EINVAL);
  if ((access & (ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC)) && !(access & ACCESS_LOCAL_WRITE))
    return fail_null(EINVAL);
  int writes = (access & (ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC)) != 0;
  if (!mapped((uintptr_t)addr, length, writes)) return fail_null(EFAULT);
  struct fmr *m = calloc(1, sizeof *m);
  if (!m) return fail_null(ENOMEM);
  pthread_mutex_lock(&lock);
  int slot = 0;
  while (slot < SLOTS && mrs[slot]) slot++;
  if (slot == SLOTS) {
    pthread_mutex_unlock(&lock);
    free(m);
    return fail_null(ENOMEM);
  }
  mr_gen[slot] = (mr_gen[slot] + 1) & ((1u << (32 - SLOT_BITS)) - 1);
  if (mr_gen[slot] == 0) mr_gen[slot] = 1;
  uint32_t key = mr_gen[slot] << SLOT_BITS | (uint32_t)slot;
  m->mr = (struct ibv_mr){pd->context, pd, addr, length, (uint32_t)slot, key, key};
  m->access = (unsigned)access;
  mrs[slot] = m;
  ((struct fpd *)pd)->users++;
  struct pub_mr *e = &published.mrs[slot];
  __atomic_store_n(&e->rkey, key, __ATOMIC_RELAXED);
  __atomic_store_n(&e->access, (uint32_t)access, __ATOMIC_RELAXED);
  __atomic_store_n(&e->addr, (uint64_t)(uintptr_t)addr, __ATOMIC_RELAXED);
  __atomic_store_n(&e->length, (uint64_t)length, __ATOMIC_RELAXED);
  __atomic_store_n(&e->live, 1, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&lock);
  return &m->mr;
}

int ibv_dereg_mr(struct ibv_mr *mr) {
  if (!mr) return fail(EINVAL);
  pthread_mutex_lock(&lock);
  uint32_t slot = mr->lkey & (SLOTS - 1);
  if (mrs[slot] != (struct fmr *)mr) {
    pthread_mutex_unlock(&lock);
    return fail(EINVAL);
  }
  __atomic_store_n(&published.mrs[slot].live, 0, __ATOMIC_RELEASE);
  mrs[slot] = NULL;
  ((struct fpd *)mr->pd)->users--;
  pthread_mutex_unlock(&lock);
  free(mr);
  return 0;
}

/* Completion queues. */

struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context, void *channel,
                             int comp_vector) {
  if (!context || cqe < 1 || cqe > MAX_CQE || channel || comp_vector < 0 ||
      comp_vector >= context->num_comp_vectors)
    return fail_null(EINVAL);
  struct fcq *c = calloc(1, sizeof *c);
  struct cq_entry *ring = calloc((size_t)cqe, sizeof *ring);
  if (!c || !ring) {
    free(c);
    free(ring);
    return fail_null(ENOMEM);
  }
  c->ring = ring;
  c->size = cqe;
  pthread_mutex_init(&c->lock, NULL);
  c->cq.context = context;
  c->cq.cq_context = cq_context;
  c->cq.cqe = cqe;
  pthread_mutex_init(&c->cq.mutex, NULL);
  pthread_cond_init(&c->cq.cond, NULL);
  pthread_mutex_lock(&lock);
  c->cq.handle = ++handles;
  ((struct fctx *)context)->cqs++;
  pthread_mutex_unlock(&lock);
  return &c->cq;
}

int ibv_destroy_cq(struct ibv_cq *cq) {
  struct fcq *c = (struct fcq *)cq;
  if (!c) return fail(EINVAL);
  pthread_mutex_lock(&lock);
  int busy = c->users != 0;
  if (!busy) ((struct fctx *)cq->context)->cqs--;
  pthread_mutex_unlock(&lock);
  if (busy) return fail(EBUSY);
  pthread_mutex_destroy(&c->lock);
  pthread_mutex_destroy(&c->cq.mutex);
  pthread_cond_destroy(&c->cq.cond);
  free(c->ring);
  free(c);
  return 0;
}

/* Queues a completion; -1 when it does not fit (or `overrun`), leaving the CQ overrun. */
static int cq_push(struct fcq *c, const struct ibv_wc *wc, struct fqp *q, uint64_t seq, int overrun) {
  pthread_mutex_lock(&c->lock);
  int r = 0;
  if (overrun || c->overrun || c->count == c->size) {
    c->overrun = 1;
    r = -1;
  } else {
    c->ring[(c->head + c->count) % c->size] = (struct cq_entry){*wc, q, seq};
    c->count++;
  }
  pthread_mutex_unlock(&c->lock);
  return r;
}

/* Drops the completions of `q` still in the CQ. */
static void cq_purge(struct fcq *c, struct fqp *q) {
  pthread_mutex_lock(&c->lock);
  int kept = 0;
  for (int i = 0; i < c->count; i++) {
    struct cq_entry e = c->ring[(c->head + i) % c->size];
    if (e.qp != q) c->ring[(c->head + kept++) % c->size] = e;
  }
  c->count = kept;
  pthread_mutex_unlock(&c->lock);
}

static int poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc) {
  struct fcq *c = (struct fcq *)cq;
  if (!c || (num_entries > 0 && !wc)) return -1;
  pthread_mutex_lock(&c->lock);
  if (c->overrun) {
    pthread_mutex_unlock(&c->lock);
    return -1;
  }
  int n = 0;
  while (n < num_entries && c->count > 0) {
    struct cq_entry *e = &c->ring[c->head];
    wc[n++] = e->wc;
    __atomic_store_n(&e->qp->retired, e->seq, __ATOMIC_RELEASE);
    c->head = (c->head + 1) % c->size;
    c->count--;
  }
  pthread_mutex_unlock(&c->lock);
  return n;
}

/* Queue pairs. */

static void publish_qp(struct fqp *q) {
  struct pub_qp *e = &published.qps[q->slot];
  __atomic_store_n(&e->access_flags, q->access, __ATOMIC_RELAXED);
  __atomic_store_n(&e->state, (uint32_t)q->qp.state, __ATOMIC_RELEASE);
}

static void push_work(struct fqp *q, const struct work *w, int status, int overrun, int *failed) {
  struct ibv_wc wc = {0};
  wc.wr_id = w->wr_id;
  wc.status = status;
  wc.opcode = w->opcode == WR_RDMA_READ ? WC_RDMA_READ : WC_RDMA_WRITE;
  wc.byte_len = w->byte_len;
  wc.qp_num = q->qp.qp_num;
  int r = cq_push((struct fcq *)q->qp.send_cq, &wc, q, w->seq, overrun);
  if (failed) *failed = r != 0;
}

/* Moves the QP to ERR, flushing the wrs it held back. Caller holds the QP's lock. */
static void qp_to_error(struct fqp *q) {
  q->qp.state = QPS_ERR;
  publish_qp(q);
  for (uint32_t i = 0; i < q->nstuck; i++) push_work(q, &q->stuck[i], WC_WR_FLUSH_ERR, 0, NULL);
  q->nstuck = 0;
  q->stalled = 0;
}

/* Reports a wr's end: queues its completion when due; an error or a completion that did not
 * fit moves the QP to ERR. Caller holds the QP's lock. */
static void complete(struct fqp *q, const struct work *w, int status, int signaled, int overrun) {
  int failed = 0;
  if (status != WC_SUCCESS || signaled || q->sq_sig_all || overrun) push_work(q, w, status, overrun, &failed);
  if ((status != WC_SUCCESS || failed) && q->qp.state != QPS_ERR) qp_to_error(q);
}

struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init) {
  if (!pd || !init || init->qp_type != QPT_RC || !init->send_cq || !init->recv_cq || init->srq)
    return fail_null(EINVAL);
  if (init->send_cq->context != pd->context || init->recv_cq->context != pd->context) return fail_null(EINVAL);
  struct ibv_qp_cap cap = init->cap;
  if (cap.max_send_wr > MAX_WR || cap.max_recv_wr > MAX_WR || cap.max_send_sge > MAX_SGE ||
      cap.max_recv_sge > MAX_SGE || cap.max_inline_data > MAX_INLINE)
    return fail_null(EINVAL);
  if (cap.max_send_sge == 0) cap.max_send_sge = 1;
  if (cap.max_recv_sge == 0) cap.max_recv_sge = 1;
  struct fqp *q = calloc(1, sizeof *q);
  struct work *stuck = calloc(cap.max_send_wr ? cap.max_send_wr : 1, sizeof *stuck);
  if (!q || !stuck) {
    free(q);
    free(stuck);
    return fail_null(ENOMEM);
  }
  pthread_mutex_lock(&lock);
  int slot = 0;
  while (slot < SLOTS && qps[slot]) slot++;
  if (slot == SLOTS) {
    pthread_mutex_unlock(&lock);
    free(q);
    free(stuck);
    return fail_null(ENOMEM);
  }
  qp_gen[slot] = (qp_gen[slot] + 1) & ((1u << (24 - SLOT_BITS)) - 1);
  if (qp_gen[slot] == 0) qp_gen[slot] = 1;
  q->slot = slot;
  q->sq_sig_all = init->sq_sig_all != 0;
  q->cap = cap;
  q->stuck = stuck;
  pthread_mutex_init(&q->lock, NULL);
  q->qp.context = pd->context;
  q->qp.qp_context = init->qp_context;
  q->qp.pd = pd;
  q->qp.send_cq = init->send_cq;
  q->qp.recv_cq = init->recv_cq;
  q->qp.handle = (uint32_t)slot;
  q->qp.qp_num = qp_gen[slot] << SLOT_BITS | (uint32_t)slot;
  q->qp.state = QPS_RESET;
  q->qp.qp_type = QPT_RC;
  pthread_mutex_init(&q->qp.mutex, NULL);
  pthread_cond_init(&q->qp.cond, NULL);
  qps[slot] = q;
  ((struct fpd *)pd)->users++;
  ((struct fcq *)init->send_cq)->users++;
  ((struct fcq *)init->recv_cq)->users++;
  struct pub_qp *e = &published.qps[slot];
  __atomic_store_n(&e->qp_num, q->qp.qp_num, __ATOMIC_RELAXED);
  publish_qp(q);
  __atomic_store_n(&e->live, 1, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&lock);
  init->cap = cap;
  return &q->qp;
}

int ibv_destroy_qp(struct ibv_qp *qp) {
  struct fqp *q = (struct fqp *)qp;
  if (!q) return fail(EINVAL);
  pthread_mutex_lock(&lock);
  int ours = qps[qp->qp_num & (SLOTS - 1)] == q;
  pthread_mutex_unlock(&lock);
  if (!ours) return fail(EINVAL);
  pthread_mutex_lock(&q->lock); /* waits out a post_send in progress */
  pthread_mutex_lock(&lock);
  __atomic_store_n(&published.qps[q->slot].live, 0, __ATOMIC_RELEASE);
  qps[q->slot] = NULL;
  ((struct fpd *)qp->pd)->users--;
  ((struct fcq *)qp->send_cq)->users--;
  ((struct fcq *)qp->recv_cq)->users--;
  pthread_mutex_unlock(&lock);
  cq_purge((struct fcq *)qp->send_cq, q);
  pthread_mutex_unlock(&q->lock);
  pthread_mutex_destroy(&q->lock);
  pthread_mutex_destroy(&q->qp.mutex);
  pthread_cond_destroy(&q->qp.cond);
  free(q->stuck);
  free(q);
  return 0;
}

/* The attributes the transition cur -> next must have (*req) and may have (*opt); 0 when
 * the transition is not allowed. */
static int transition(int cur, int next, int *req, int *opt) {
  *req = *opt = 0;
  if (next == QPS_RESET || next == QPS_ERR) return 1;
  if (cur == QPS_RESET && next == QPS_INIT) {
    *req = M_PKEY_INDEX | M_PORT | M_ACCESS_FLAGS;
  } else if (cur == QPS_INIT && next == QPS_INIT) {
    *opt = M_PKEY_INDEX | M_PORT | M_ACCESS_FLAGS;
  } else if (cur == QPS_INIT && next == QPS_RTR) {
    *req = M_AV | M_PATH_MTU | M_DEST_QPN | M_RQ_PSN | M_MAX_DEST_RD_ATOMIC | M_MIN_RNR_TIMER;
    *opt = M_ALT_PATH | M_ACCESS_FLAGS | M_PKEY_INDEX;
  } else if (cur == QPS_RTR && next == QPS_RTS) {
    *req = M_TIMEOUT | M_RETRY_CNT | M_RNR_RETRY | M_SQ_PSN | M_MAX_QP_RD_ATOMIC;
    *opt = M_CUR_STATE | M_ALT_PATH | M_ACCESS_FLAGS | M_MIN_RNR_TIMER | M_PATH_MIG_STATE;
  } else if (cur == QPS_RTS && next == QPS_RTS) {
    *opt = M_CUR_STATE | M_ACCESS_FLAGS | M_ALT_PATH | M_PATH_MIG_STATE | M_MIN_RNR_TIMER;
  } else {
    return 0;
  }
  return 1;
}

int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask) {
  struct fqp *q = (struct fqp *)qp;
  if (!q || !attr) return fail(EINVAL);
  pthread_mutex_lock(&q->lock);
  int cur = q->qp.state;
  int next = (mask & M_STATE) ? attr->qp_state : cur;
  int req, opt, ok = next >= QPS_RESET && next <= QPS_ERR && transition(cur, next, &req, &opt);
  ok = ok && (mask & req) == req && (mask & ~(req | opt | M_STATE)) == 0;
  if (ok && (mask & M_CUR_STATE)) ok = attr->cur_qp_state == cur;
  if (ok && (mask & M_PORT)) ok = attr->port_num == 1;
  if (ok && (mask & M_PKEY_INDEX)) ok = attr->pkey_index == 0;
  if (ok && (mask & M_PATH_MTU)) ok = attr->path_mtu >= 1 && attr->path_mtu <= MTU_4096;
  if (ok && (mask & M_MAX_DEST_RD_ATOMIC)) ok = attr->max_dest_rd_atomic <= MAX_RD_ATOMIC;
  if (ok && (mask & M_MAX_QP_RD_ATOMIC)) ok = attr->max_rd_atomic <= MAX_RD_ATOMIC;
  if (ok && (mask & M_AV))
    ok = attr->ah_attr.is_global == 1 && attr->ah_attr.grh.sgid_index == 0 && attr->ah_attr.port_num == 1 &&
         q->port == 1;
  if (!ok) {
    pthread_mutex_unlock(&q->lock);
    return fail(EINVAL);
  }
  if (mask & M_PORT) q->port = attr->port_num;
  if (mask & M_ACCESS_FLAGS) q->access = attr->qp_access_flags;
  if (mask & M_DEST_QPN) q->dest_qpn = attr->dest_qp_num;
  if (mask & M_AV) {
    q->peer_pid = (pid_t)get_le(attr->ah_attr.grh.dgid.raw, 4);
    q->peer_table = get_le(attr->ah_attr.grh.dgid.raw + 4, 8);
  }
  if (next == QPS_ERR) {
    qp_to_error(q);
  } else if (next == QPS_RESET) {
    q->port = 0;
    q->access = 0;
    q->dest_qpn = 0;
    q->peer_pid = 0;
    q->peer_table = 0;
    q->nstuck = 0;
    q->stalled = 0;
    q->posted = 0;
    q->qp.state = QPS_RESET;
    publish_qp(q);
    cq_purge((struct fcq *)q->qp.send_cq, q);
    __atomic_store_n(&q->retired, 0, __ATOMIC_RELEASE);
  } else {
    q->qp.state = next;
    publish_qp(q);
  }
  pthread_mutex_unlock(&q->lock);
  return 0;
}

/* Work requests. */

/* Reads `len` bytes at `addr` in process `pid`; 0, or an errno value. */
static int peek(pid_t pid, uint64_t addr, void *out, size_t len) {
  struct iovec local = {out, len};
  struct iovec remote = {(void *)(uintptr_t)addr, len};
  ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (n == (ssize_t)len) return 0;
  int err = n < 0 ? errno : EFAULT;
  if (err == EPERM) {
    static int told;
    if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
      fprintf(stderr, "fake_verbs: process_vm_readv(%d): permission denied (ptrace restrictions?)\n", (int)pid);
  }
  return err;
}

/* Copies between the local iovecs and [raddr, raddr + total) of `pid`; 0 or -1. */
static int transfer(pid_t pid, int write, const struct iovec *iov, int n, uint64_t raddr, uint64_t total) {
  struct iovec local[MAX_SGE];
  int first = 0;
  size_t skip = 0; /* bytes of iov[first] already moved */
  uint64_t done = 0;
  while (done < total) {
    int k = 0;
    for (int i = first; i < n; i++) {
      local[k].iov_base = (char *)iov[i].iov_base + (i == first ? skip : 0);
      local[k].iov_len = iov[i].iov_len - (i == first ? skip : 0);
      k++;
    }
    struct iovec remote = {(void *)(uintptr_t)(raddr + done), (size_t)(total - done)};
    ssize_t got = write ? process_vm_writev(pid, local, (unsigned long)k, &remote, 1, 0)
                        : process_vm_readv(pid, local, (unsigned long)k, &remote, 1, 0);
    if (got <= 0) return -1;
    done += (uint64_t)got;
    size_t left = (size_t)got;
    while (left > 0 && first < n) {
      size_t here = iov[first].iov_len - skip;
      if (left >= here) {
        left -= here;
        first++;
        skip = 0;
      } else {
        skip += left;
        left = 0;
      }
    }
  }
  return 0;
}

/* Runs one wr; returns its completion status. Caller holds the QP's lock. */
static int execute(struct fqp *q, const struct ibv_send_wr *wr, uint64_t total, int injected) {
  int write = wr->opcode == WR_RDMA_WRITE;
  int inl = write && (wr->send_flags & SEND_INLINE);
  if (total > MAX_MSG) return WC_LOC_LEN_ERR;
  struct iovec iov[MAX_SGE];
  int status = WC_SUCCESS;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < wr->num_sge; i++) {
    const struct ibv_sge *s = &wr->sg_list[i];
    iov[i].iov_base = (void *)(uintptr_t)s->addr;
    iov[i].iov_len = s->length;
    if (inl) continue;
    struct fmr *m = mrs[s->lkey & (SLOTS - 1)];
    uintptr_t lo = m ? (uintptr_t)m->mr.addr : 0;
    int ok = m && m->mr.lkey == s->lkey && m->mr.pd == q->qp.pd && s->addr >= lo && s->addr - lo <= m->mr.length &&
             s->length <= m->mr.length - (s->addr - lo) && (write || (m->access & ACCESS_LOCAL_WRITE));
    if (!ok) status = WC_LOC_PROT_ERR;
  }
  pthread_mutex_unlock(&lock);
  if (status != WC_SUCCESS) return status;
  if (injected == F_REMOTE_ACCESS) return WC_REM_ACCESS_ERR;
  if (injected == F_RETRY_EXCEEDED) return WC_RETRY_EXC_ERR;

  struct pub_qp rq;
  uint64_t at = q->peer_table + offsetof(struct published, qps) + (q->dest_qpn & (SLOTS - 1)) * sizeof rq;
  if (peek(q->peer_pid, at, &rq, sizeof rq) != 0) return WC_RETRY_EXC_ERR;
  if (!rq.live || rq.qp_num != q->dest_qpn || (rq.state != QPS_RTR && rq.state != QPS_RTS)) return WC_RETRY_EXC_ERR;
  uint64_t raddr = wr->wr.rdma.remote_addr;
  if (total > 0) {
    struct pub_mr rm;
    at = q->peer_table + offsetof(struct published, mrs) + (wr->wr.rdma.rkey & (SLOTS - 1)) * sizeof rm;
    if (peek(q->peer_pid, at, &rm, sizeof rm) != 0) return WC_RETRY_EXC_ERR;
    uint32_t need = write ? ACCESS_REMOTE_WRITE : ACCESS_REMOTE_READ;
    int ok = rm.live && rm.rkey == wr->wr.rdma.rkey && (rm.access & need) && (rq.access_flags & need) &&
             raddr >= rm.addr && raddr - rm.addr <= rm.length && total <= rm.length - (raddr - rm.addr);
    if (!ok) return WC_REM_ACCESS_ERR;
  }
  if (transfer(q->peer_pid, write, iov, wr->num_sge, raddr, total) != 0) return WC_RETRY_EXC_ERR;
  return WC_SUCCESS;
}

static int post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr) {
  struct fqp *q = (struct fqp *)qp;
  int err = 0;
  pthread_mutex_lock(&q->lock);
  if (q->qp.state != QPS_RTS && q->qp.state != QPS_ERR) err = EINVAL;
  for (; wr && !err; wr = wr->next) {
    if ((wr->opcode != WR_RDMA_WRITE && wr->opcode != WR_RDMA_READ) || wr->num_sge < 1 ||
        (uint32_t)wr->num_sge > q->cap.max_send_sge || !wr->sg_list) {
      err = EINVAL;
      break;
    }
    uint64_t total = 0;
    for (int i = 0; i < wr->num_sge; i++) total += wr->sg_list[i].length;
    if (wr->send_flags & SEND_INLINE) {
      if (wr->opcode != WR_RDMA_WRITE) err = EINVAL;
      else if (total > q->cap.max_inline_data) err = ENOMEM;
      if (err) break;
    }
    if (q->posted - __atomic_load_n(&q->retired, __ATOMIC_ACQUIRE) >= q->cap.max_send_wr) {
      err = ENOMEM;
      break;
    }
    struct work w = {wr->wr_id, ++q->posted, wr->opcode, (uint32_t)total};
    int injected = take_fault();
    if (q->stalled) {
      q->stuck[q->nstuck++] = w;
    } else if (q->qp.state == QPS_ERR) {
      complete(q, &w, WC_WR_FLUSH_ERR, 1, injected == F_CQ_OVERRUN);
    } else if (injected == F_QP_ERROR) {
      qp_to_error(q);
      complete(q, &w, WC_WR_FLUSH_ERR, 1, 0);
    } else if (injected == F_NEVER_COMPLETE) {
      q->stalled = 1;
      q->stuck[q->nstuck++] = w;
    } else {
      int status = execute(q, wr, total, injected);
      complete(q, &w, status, (wr->send_flags & SEND_SIGNALED) != 0, injected == F_CQ_OVERRUN);
    }
  }
  pthread_mutex_unlock(&q->lock);
  if (err) {
    if (bad_wr) *bad_wr = wr;
    errno = err;
  }
  return err;
}

const char *ibv_wc_status_str(int status) {
  static const char *const names[] = {
      "success",
      "local length error",
      "local QP operation error",
      "local EE context operation error",
      "local protection error",
      "Work Request Flushed Error",
      "memory management operation error",
      "bad response error",
      "local access error",
      "remote invalid request error",
      "remote access error",
      "remote operation error",
      "transport retry counter exceeded",
      "RNR retry counter exceeded",
      "local RDD violation error",
      "remote invalid RD request",
      "aborted error",
      "invalid EE context number",
      "invalid EE context state",
      "fatal error",
      "response timeout error",
      "general error",
      "TM error",
      "TM software rendezvous",
  };
  if (status < 0 || status >= (int)(sizeof names / sizeof names[0])) return "unknown";
  return names[status];
}

/* Test hooks. */

/* Arms `name` (see the top of this file) for the wr `after` wrs from now; NULL, "" or
 * "none" disarms. 0, or -1 for an unknown name. */
int fake_verbs_inject(const char *name, unsigned after) {
  int f = F_NONE;
  if (name && *name && strcmp(name, "none") != 0) {
    f = fault_by_name(name, strlen(name));
    if (f == F_NONE) {
      errno = EINVAL;
      return -1;
    }
  }
  pthread_mutex_lock(&lock);
  fault = f;
  fault_at = work_requests + after;
  pthread_mutex_unlock(&lock);
  return 0;
}

/* QPs created and not destroyed, in this process. */
int fake_verbs_live_qps(void) {
  int n = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < SLOTS; i++) n += qps[i] != NULL;
  pthread_mutex_unlock(&lock);
  return n;
}

/* MRs registered and not deregistered, in this process. */
int fake_verbs_live_mrs(void) {
  int n = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < SLOTS; i++) n += mrs[i] != NULL;
  pthread_mutex_unlock(&lock);
  return n;
}

/* Work requests accepted by post_send since the library was loaded, in this process. */
unsigned long long fake_verbs_work_requests(void) {
  pthread_mutex_lock(&lock);
  unsigned long long n = work_requests;
  pthread_mutex_unlock(&lock);
  return n;
}

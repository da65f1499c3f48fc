// FHBN: fully host-bypassed network primitives for the RDMA data path.
//
// 1. Device-side polling: fhbn_wait_seq launches a one-thread kernel that spins on a
//    64-bit sequence number in GPU memory and returns when it reaches `expected`
//    (nothing writes one there today: rdma:// connections take chunks from receive
//    completions on the host, transports/rdma.py). Consumer kernels queued
//    behind it on the same stream are launched before the data arrives and start as soon
//    as it has landed: no host round trip.
// 2. GPU-initiated sends on mlx5: the NIC's user access region (UAR, holding the
//    BlueFlame doorbell register) and the send queue / doorbell record are mapped into the
//    GPU (cudaHostRegister(..., cudaHostRegisterIoMemory) for the UAR). A kernel builds the
//    RDMA WRITE WITH IMMEDIATE work request and rings the doorbell itself.
// 3. Host-proxy fallback: when the UAR mapping is refused (no GPUDirect-capable driver or
//    IOMMU), the kernel appends the same request to a ring in mapped pinned host memory
//    and a host thread posts it through ibv_post_send (transports.fhbn.HostProxyRing).
//
// C ABI only (loaded with ctypes); every function returns a cudaError_t value (0 = ok).

#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {

// ---------------------------------------------------------------- device-side polling
__global__ void fhbn_wait_seq_kernel(const volatile uint64_t* seq, uint64_t expected,
                                     volatile uint64_t* observed) {
    uint64_t v;
    while ((v = *seq) < expected) {
        __nanosleep(100);
    }
    __threadfence_system();
    if (observed) *observed = v;
}

int fhbn_wait_seq(const uint64_t* dev_seq, uint64_t expected, uint64_t* dev_observed,
                  cudaStream_t stream) {
    fhbn_wait_seq_kernel<<<1, 1, 0, stream>>>(dev_seq, expected, dev_observed);
    return (int)cudaGetLastError();
}

// Test helper: a kernel that publishes `value` into `seq` (as the NIC would).
__global__ void fhbn_store_seq_kernel(volatile uint64_t* seq, uint64_t value) {
    __threadfence_system();
    *seq = value;
}

int fhbn_store_seq(uint64_t* dev_seq, uint64_t value, cudaStream_t stream) {
    fhbn_store_seq_kernel<<<1, 1, 0, stream>>>(dev_seq, value);
    return (int)cudaGetLastError();
}

// ---------------------------------------------------------------- mlx5 work requests
// Layouts from the mlx5 PRM (all fields big-endian on the wire).
struct mlx5_ctrl_seg {
    uint32_t opmod_idx_opcode;  // wqe index << 8 | opcode
    uint32_t qpn_ds;            // qpn << 8 | size in 16-byte units
    uint8_t signature;
    uint8_t rsvd[2];
    uint8_t fm_ce_se;           // 0x08: generate a completion
    uint32_t imm;
};
struct mlx5_raddr_seg {
    uint64_t raddr;
    uint32_t rkey;
    uint32_t reserved;
};
struct mlx5_data_seg {
    uint32_t byte_count;
    uint32_t lkey;
    uint64_t addr;
};

#define FHBN_MLX5_OPCODE_RDMA_WRITE_IMM 0x09u
#define FHBN_MLX5_CQ_UPDATE 0x08u
#define FHBN_MLX5_SEND_WQE_BB 64u

__device__ __host__ static inline uint32_t bswap32(uint32_t x) {
    return ((x & 0xffu) << 24) | ((x & 0xff00u) << 8) | ((x >> 8) & 0xff00u) | (x >> 24);
}
__device__ __host__ static inline uint64_t bswap64(uint64_t x) {
    return ((uint64_t)bswap32((uint32_t)x) << 32) | bswap32((uint32_t)(x >> 32));
}

// Everything a kernel needs to post on one send queue; filled by the host from
// mlx5dv_init_obj (sq buffer, wqe count, doorbell record, BlueFlame register).
struct fhbn_sq {
    uint8_t* sq_buf;            // device-visible send queue buffer
    uint32_t wqe_cnt;           // number of 64-byte basic blocks (power of two)
    uint32_t qpn;
    volatile uint32_t* dbrec;   // doorbell record (send counter), device-visible
    volatile uint64_t* bf_reg;  // BlueFlame register in the UAR, mapped as IO memory
    uint32_t pi;                // producer index (owned by the posting thread)
};

// Build one RDMA WRITE WITH IMM (ctrl + raddr + data = 48 bytes, one basic block) at the
// producer index, publish it in the doorbell record, and ring the doorbell by writing the
// control segment's first 8 bytes to the BlueFlame register. Single thread per queue.
__device__ void fhbn_post_write_imm(fhbn_sq* sq, uint64_t laddr, uint32_t lkey, uint32_t len,
                                    uint64_t raddr, uint32_t rkey, uint32_t imm) {
    uint32_t idx = sq->pi & (sq->wqe_cnt - 1);
    uint8_t* wqe = sq->sq_buf + (size_t)idx * FHBN_MLX5_SEND_WQE_BB;
    mlx5_ctrl_seg* ctrl = (mlx5_ctrl_seg*)wqe;
    mlx5_raddr_seg* rseg = (mlx5_raddr_seg*)(wqe + sizeof(mlx5_ctrl_seg));
    mlx5_data_seg* dseg = (mlx5_data_seg*)(wqe + sizeof(mlx5_ctrl_seg) + sizeof(mlx5_raddr_seg));
    ctrl->opmod_idx_opcode = bswap32(((sq->pi & 0xffffu) << 8) | FHBN_MLX5_OPCODE_RDMA_WRITE_IMM);
    ctrl->qpn_ds = bswap32((sq->qpn << 8) | 3u);  // 3 x 16-byte segments
    ctrl->signature = 0;
    ctrl->rsvd[0] = ctrl->rsvd[1] = 0;
    ctrl->fm_ce_se = FHBN_MLX5_CQ_UPDATE;
    ctrl->imm = bswap32(imm);
    rseg->raddr = bswap64(raddr);
    rseg->rkey = bswap32(rkey);
    rseg->reserved = 0;
    dseg->byte_count = bswap32(len);
    dseg->lkey = bswap32(lkey);
    dseg->addr = bswap64(laddr);
    sq->pi += 1;
    __threadfence_system();  // WQE visible before the doorbell record
    *sq->dbrec = bswap32(sq->pi & 0xffffu);
    __threadfence_system();  // doorbell record before the doorbell
    *sq->bf_reg = *(uint64_t*)ctrl;
    __threadfence_system();
}

__global__ void fhbn_post_write_imm_kernel(fhbn_sq* sq, uint64_t laddr, uint32_t lkey,
                                           uint32_t len, uint64_t raddr, uint32_t rkey,
                                           uint32_t imm) {
    fhbn_post_write_imm(sq, laddr, lkey, len, raddr, rkey, imm);
}

int fhbn_launch_post_write_imm(fhbn_sq* dev_sq, uint64_t laddr, uint32_t lkey, uint32_t len,
                               uint64_t raddr, uint32_t rkey, uint32_t imm, cudaStream_t stream) {
    fhbn_post_write_imm_kernel<<<1, 1, 0, stream>>>(dev_sq, laddr, lkey, len, raddr, rkey, imm);
    return (int)cudaGetLastError();
}

// Map the NIC's UAR page into the GPU. Returns the CUDA error when the driver refuses
// (then use the host proxy); *dev_ptr receives the device address of the mapping.
int fhbn_map_uar(void* uar, size_t len, void** dev_ptr) {
    cudaError_t err = cudaHostRegister(uar, len, cudaHostRegisterIoMemory | cudaHostRegisterMapped);
    if (err != cudaSuccess) {
        cudaGetLastError();  // clear the sticky-free error so later calls are unaffected
        return (int)err;
    }
    err = cudaHostGetDevicePointer(dev_ptr, uar, 0);
    if (err != cudaSuccess) cudaHostUnregister(uar);
    return (int)err;
}

int fhbn_unmap_uar(void* uar) { return (int)cudaHostUnregister(uar); }

// ---------------------------------------------------------------- host-proxy fallback
// A ring of requests in mapped pinned host memory: the kernel waits until its slot is
// free (seq == 0), fills it and publishes it by writing its sequence number; the host
// thread (transports.fhbn.HostProxy) polls `seq` of the next slot, posts the work
// request with ibv_post_send, clears `seq` (freeing the slot) and advances.
struct fhbn_proxy_req {
    uint64_t laddr;
    uint64_t raddr;
    uint32_t lkey;
    uint32_t rkey;
    uint32_t len;
    uint32_t imm;
    volatile uint64_t seq;  // written last: 0 = empty, n+1 = request n
};

__device__ void fhbn_proxy_enqueue(fhbn_proxy_req* ring, uint32_t slots, uint64_t n,
                                   uint64_t laddr, uint32_t lkey, uint32_t len,
                                   uint64_t raddr, uint32_t rkey, uint32_t imm) {
    fhbn_proxy_req* r = &ring[n % slots];
    while (r->seq != 0) {  // the proxy clears seq once it has posted the slot's request
        __nanosleep(200);
    }
    __threadfence_system();
    r->laddr = laddr;
    r->raddr = raddr;
    r->lkey = lkey;
    r->rkey = rkey;
    r->len = len;
    r->imm = imm;
    __threadfence_system();
    r->seq = n + 1;
}

__global__ void fhbn_proxy_enqueue_kernel(fhbn_proxy_req* ring, uint32_t slots, uint64_t n,
                                          uint64_t laddr, uint32_t lkey, uint32_t len,
                                          uint64_t raddr, uint32_t rkey, uint32_t imm) {
    fhbn_proxy_enqueue(ring, slots, n, laddr, lkey, len, raddr, rkey, imm);
}

int fhbn_launch_proxy_enqueue(fhbn_proxy_req* ring, uint32_t slots, uint64_t n, uint64_t laddr,
                              uint32_t lkey, uint32_t len, uint64_t raddr, uint32_t rkey,
                              uint32_t imm, cudaStream_t stream) {
    fhbn_proxy_enqueue_kernel<<<1, 1, 0, stream>>>(ring, slots, n, laddr, lkey, len, raddr, rkey, imm);
    return (int)cudaGetLastError();
}

size_t fhbn_proxy_req_size(void) { return sizeof(fhbn_proxy_req); }
size_t fhbn_sq_size(void) { return sizeof(fhbn_sq); }

}  // extern "C"

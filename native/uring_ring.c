/*
 * io_uring ring for block reads and writes: setup, submission, completion, requeue.
 * See uring_ring.h for the contract. Everything here is plain C and never touches Python.
 */
#define _GNU_SOURCE
#include "uring_ring.h"

#include <errno.h>
#include <linux/io_uring.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

/* One SQE moves at most this much; larger requests continue like short transfers (bytes). */
#define MAX_SQE_BYTES (1u << 30)
#define WAKE_TAG UINT64_MAX

static int sys_setup(unsigned entries, struct io_uring_params *params)
{
    int fd = (int)syscall(__NR_io_uring_setup, entries, params);
    return fd < 0 ? -errno : fd;
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    int ret = (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
    return ret < 0 ? -errno : ret;
}

static int sys_register(int fd, unsigned opcode, const void *arg, unsigned nargs)
{
    int ret = (int)syscall(__NR_io_uring_register, fd, opcode, arg, nargs);
    return ret < 0 ? -errno : ret;
}

static unsigned round_up_pow2(unsigned n)
{
    unsigned p = 1;
    while (p < n)
        p <<= 1;
    return p;
}

static void unmap_rings(struct tba_ring *ring)
{
    if (ring->sqes && ring->sqes != MAP_FAILED)
        munmap(ring->sqes, ring->sqes_bytes);
    if (ring->cq_map && ring->cq_map != MAP_FAILED && ring->cq_map != ring->sq_map)
        munmap(ring->cq_map, ring->cq_map_bytes);
    if (ring->sq_map && ring->sq_map != MAP_FAILED)
        munmap(ring->sq_map, ring->sq_map_bytes);
    ring->sqes = NULL;
    ring->cq_map = ring->sq_map = NULL;
}

static int map_rings(struct tba_ring *ring, const struct io_uring_params *p)
{
    int single = (p->features & IORING_FEAT_SINGLE_MMAP) != 0;
    ring->sq_map_bytes = p->sq_off.array + p->sq_entries * sizeof(unsigned);
    ring->cq_map_bytes = p->cq_off.cqes + p->cq_entries * sizeof(struct io_uring_cqe);
    if (single && ring->cq_map_bytes > ring->sq_map_bytes)
        ring->sq_map_bytes = ring->cq_map_bytes;
    ring->sq_map = mmap(NULL, ring->sq_map_bytes, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_POPULATE, ring->fd, IORING_OFF_SQ_RING);
    if (ring->sq_map == MAP_FAILED)
        return -errno;
    ring->cq_map = single ? ring->sq_map
                          : mmap(NULL, ring->cq_map_bytes, PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_POPULATE, ring->fd, IORING_OFF_CQ_RING);
    if (ring->cq_map == MAP_FAILED)
        return -errno;
    ring->sqes_bytes = p->sq_entries * sizeof(struct io_uring_sqe);
    ring->sqes = mmap(NULL, ring->sqes_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                      ring->fd, IORING_OFF_SQES);
    if (ring->sqes == MAP_FAILED)
        return -errno;

    char *sq = ring->sq_map, *cq = ring->cq_map;
    ring->sq_head = (unsigned *)(sq + p->sq_off.head);
    ring->sq_tail = (unsigned *)(sq + p->sq_off.tail);
    ring->sq_mask = (unsigned *)(sq + p->sq_off.ring_mask);
    ring->sq_array = (unsigned *)(sq + p->sq_off.array);
    ring->cq_head = (unsigned *)(cq + p->cq_off.head);
    ring->cq_tail = (unsigned *)(cq + p->cq_off.tail);
    ring->cq_mask = (unsigned *)(cq + p->cq_off.ring_mask);
    ring->cqes = (struct io_uring_cqe *)(cq + p->cq_off.cqes);
    for (unsigned i = 0; i < p->sq_entries; i++)
        ring->sq_array[i] = i; /* SQE index i always sits in array slot i */
    return 0;
}

static int alloc_slots(struct tba_ring *ring, unsigned depth)
{
    ring->slots = calloc(depth, sizeof(*ring->slots));
    ring->free_stack = calloc(depth, sizeof(*ring->free_stack));
    if (!ring->slots || !ring->free_stack)
        return -ENOMEM;
    for (unsigned i = 0; i < depth; i++)
        ring->free_stack[i] = depth - 1 - i;
    ring->nslots = ring->free_count = depth;
    return 0;
}

int tba_ring_open(struct tba_ring *ring, unsigned depth)
{
    struct io_uring_params params;
    int err;

    memset(ring, 0, sizeof(*ring));
    ring->fd = -1;
    if (depth == 0 || depth > 4096)
        return -EINVAL;
    /* Twice the depth: room for every slot's SQE plus wake-ups, and a CQ that cannot overflow. */
    memset(&params, 0, sizeof(params));
    ring->fd = sys_setup(round_up_pow2(2 * depth), &params);
    if (ring->fd < 0) {
        err = ring->fd;
        ring->fd = -1;
        return err;
    }
    ring->sq_entries = params.sq_entries;
    ring->cq_entries = params.cq_entries;
    err = map_rings(ring, &params);
    if (!err)
        err = alloc_slots(ring, depth);
    if (!err) {
        err = -pthread_mutex_init(&ring->lock, NULL);
        ring->lock_ready = !err;
    }
    if (err)
        tba_ring_close(ring);
    return err;
}

void tba_ring_close(struct tba_ring *ring)
{
    unmap_rings(ring);
    if (ring->fd >= 0)
        close(ring->fd);
    ring->fd = -1;
    if (ring->lock_ready)
        pthread_mutex_destroy(&ring->lock);
    ring->lock_ready = 0;
    free(ring->slots);
    free(ring->free_stack);
    free(ring->bufs);
    ring->slots = NULL;
    ring->free_stack = NULL;
    ring->bufs = NULL;
    ring->nbufs = ring->nslots = ring->free_count = 0;
}

static unsigned sq_unsubmitted(struct tba_ring *ring)
{
    return __atomic_load_n(ring->sq_tail, __ATOMIC_ACQUIRE) -
           __atomic_load_n(ring->sq_head, __ATOMIC_ACQUIRE);
}

/* Hand every filled SQE to the kernel. Retries EINTR/EAGAIN/EBUSY, which only mean "not yet". */
static int flush_sq(struct tba_ring *ring)
{
    unsigned pending;
    while ((pending = sq_unsubmitted(ring)) > 0) {
        int ret = sys_enter(ring->fd, pending, 0, 0);
        if (ret == -EINTR || ret == -EAGAIN || ret == -EBUSY)
            sched_yield();
        else if (ret < 0)
            return ret;
    }
    return 0;
}

static int find_fixed_buffer(const struct tba_ring *ring, uint64_t addr, uint64_t len)
{
    for (unsigned i = 0; i < ring->nbufs; i++) {
        uint64_t base = (uint64_t)(uintptr_t)ring->bufs[i].iov_base;
        if (addr >= base && addr + len <= base + ring->bufs[i].iov_len)
            return (int)i;
    }
    return -1;
}

/* Fill the next SQE (caller holds the lock). Returns -EBUSY when the SQ is full. */
static int push_sqe_locked(struct tba_ring *ring, uint8_t opcode, int fd, uint64_t addr,
                           uint32_t len, uint64_t offset, uint64_t user_data, int buf_index)
{
    unsigned tail = *ring->sq_tail;
    if (tail - __atomic_load_n(ring->sq_head, __ATOMIC_ACQUIRE) >= ring->sq_entries)
        return -EBUSY;
    struct io_uring_sqe *sqe = &ring->sqes[tail & *ring->sq_mask];
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = opcode;
    sqe->fd = fd;
    sqe->addr = addr;
    sqe->len = len;
    sqe->off = offset;
    sqe->user_data = user_data;
    if (buf_index >= 0)
        sqe->buf_index = (uint16_t)buf_index;
    __atomic_store_n(ring->sq_tail, tail + 1, __ATOMIC_RELEASE);
    return 0;
}

/* Queue the not-yet-moved remainder of slot ``index`` (caller holds the lock). */
static int push_slot_locked(struct tba_ring *ring, unsigned index)
{
    const struct tba_req *req = &ring->slots[index];
    uint64_t addr = req->addr + req->done, left = req->len - req->done;
    uint32_t len = left > MAX_SQE_BYTES ? MAX_SQE_BYTES : (uint32_t)left;
    int buf = find_fixed_buffer(ring, addr, len);
    uint8_t opcode = req->is_write ? (buf >= 0 ? IORING_OP_WRITE_FIXED : IORING_OP_WRITE)
                                   : (buf >= 0 ? IORING_OP_READ_FIXED : IORING_OP_READ);
    return push_sqe_locked(ring, opcode, req->fd, addr, len, req->offset + req->done, index, buf);
}

/* Push slot ``index``, flushing the SQ (without the lock) whenever it is full. */
static int push_slot(struct tba_ring *ring, unsigned index)
{
    for (;;) {
        pthread_mutex_lock(&ring->lock);
        int err = push_slot_locked(ring, index);
        pthread_mutex_unlock(&ring->lock);
        if (err != -EBUSY)
            return err;
        err = flush_sq(ring);
        if (err)
            return err;
    }
}

int tba_ring_submit(struct tba_ring *ring, const struct tba_req *reqs, unsigned n,
                    unsigned *accepted)
{
    unsigned taken = 0;
    pthread_mutex_lock(&ring->lock);
    while (taken < n && ring->free_count > 0) {
        unsigned index = ring->free_stack[--ring->free_count];
        ring->slots[index] = reqs[taken];
        ring->slots[index].done = 0;
        if (push_slot_locked(ring, index) == -EBUSY) {
            ring->free_stack[ring->free_count++] = index;
            break;
        }
        taken++;
    }
    pthread_mutex_unlock(&ring->lock);
    *accepted = taken;
    return flush_sq(ring);
}

int tba_ring_wake(struct tba_ring *ring)
{
    int err;
    do {
        pthread_mutex_lock(&ring->lock);
        err = push_sqe_locked(ring, IORING_OP_NOP, -1, 0, 0, 0, WAKE_TAG, -1);
        pthread_mutex_unlock(&ring->lock);
    } while (err == -EBUSY && (err = flush_sq(ring)) == 0);
    return err ? err : flush_sq(ring);
}

static void finish_slot(struct tba_ring *ring, unsigned index, int64_t res, struct tba_done *out)
{
    const struct tba_req *req = &ring->slots[index];
    out->tag = req->tag;
    out->res = res;
    out->done = req->done;
    pthread_mutex_lock(&ring->lock);
    ring->free_stack[ring->free_count++] = index;
    pthread_mutex_unlock(&ring->lock);
}

/* Push slot ``index`` again for its remainder; a failure to do so finishes it with that error. */
static int requeue_slot(struct tba_ring *ring, unsigned index, struct tba_done *out)
{
    int err = push_slot(ring, index);
    if (!err)
        return 0;
    finish_slot(ring, index, err, out);
    return 1;
}

/* Apply one completion to its slot. Returns 1 when the request finished into ``out``, 0 when it
 * was resubmitted. */
static int complete_one(struct tba_ring *ring, unsigned index, int res, struct tba_done *out)
{
    struct tba_req *req = &ring->slots[index];
    if (res == -EAGAIN || res == -EINTR)
        return requeue_slot(ring, index, out);
    if (res <= 0) {
        finish_slot(ring, index, res < 0 ? res : TBA_RES_SHORT, out);
        return 1;
    }
    req->done += (uint64_t)res;
    if (req->done < req->len)
        return requeue_slot(ring, index, out);
    finish_slot(ring, index, (int64_t)req->done, out);
    return 1;
}

int tba_ring_reap(struct tba_ring *ring, struct tba_done *out, unsigned cap, unsigned *nout,
                  int *woke)
{
    unsigned n = 0;
    *woke = 0;
    for (;;) {
        unsigned head = *ring->cq_head;
        unsigned tail = __atomic_load_n(ring->cq_tail, __ATOMIC_ACQUIRE);
        while (head != tail && n < cap) {
            const struct io_uring_cqe *cqe = &ring->cqes[head & *ring->cq_mask];
            uint64_t user_data = cqe->user_data;
            int res = cqe->res;
            __atomic_store_n(ring->cq_head, ++head, __ATOMIC_RELEASE);
            if (user_data == WAKE_TAG)
                *woke = 1;
            else
                n += (unsigned)complete_one(ring, (unsigned)user_data, res, &out[n]);
        }
        *nout = n;
        if (n > 0 || *woke)
            return flush_sq(ring); /* resubmitted remainders go out before we return */
        int ret = sys_enter(ring->fd, sq_unsubmitted(ring), 1, IORING_ENTER_GETEVENTS);
        if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY)
            return ret;
    }
}

int tba_ring_register_buffers(struct tba_ring *ring, const struct iovec *iov, unsigned n)
{
    struct iovec *copy = NULL;
    int err = 0;

    pthread_mutex_lock(&ring->lock);
    if (ring->nbufs > 0 || ring->free_count != ring->nslots)
        err = -EBUSY; /* register once, while idle */
    else if (n == 0 || !(copy = malloc(n * sizeof(*copy))))
        err = n == 0 ? -EINVAL : -ENOMEM;
    if (!err) {
        memcpy(copy, iov, n * sizeof(*copy));
        err = sys_register(ring->fd, IORING_REGISTER_BUFFERS, copy, n);
    }
    if (err < 0) {
        free(copy);
    } else {
        err = 0;
        ring->bufs = copy;
        ring->nbufs = n;
    }
    pthread_mutex_unlock(&ring->lock);
    return err;
}

unsigned tba_ring_in_flight(struct tba_ring *ring)
{
    pthread_mutex_lock(&ring->lock);
    unsigned n = ring->nslots - ring->free_count;
    pthread_mutex_unlock(&ring->lock);
    return n;
}

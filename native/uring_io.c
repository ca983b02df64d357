/*
 * io_uring submission and completion: filling SQEs under the lock, flushing them to the kernel,
 * reaping CQEs and resubmitting the remainder of short or -EAGAIN transfers.
 * See uring_ring.h for the contract.
 */
#define _GNU_SOURCE
#include "uring_ring.h"

#include <errno.h>
#include <linux/io_uring.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* One SQE moves at most this many bytes; larger requests continue like short transfers. */
#define MAX_SQE_BYTES (1u << 30)
#define WAKE_TAG UINT64_MAX /* user_data of the NOP that wake() queues */

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    int ret = (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
    return ret < 0 ? -errno : ret;
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

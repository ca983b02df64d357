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
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* One SQE moves at most this many bytes; larger requests continue like short transfers. */
#define MAX_SQE_BYTES (1u << 30)
#define WAKE_TAG UINT64_MAX       /* user_data of the NOP that wake() queues */
#define KICK_TAG (UINT64_MAX - 1) /* user_data of the NOP that tells the reaper to refill */
#define DRAIN_POLL_NS 1000000L    /* how often a failed ring looks for its last completions (1 ms) */

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

/* Hand every filled SQE to the kernel (caller holds the lock, so the SQEs it filled are the only
 * ones in the queue and they become its thread's requests). Retries EINTR/EAGAIN/EBUSY, which only
 * mean "not yet". On failure the SQEs the kernel did not take stay queued: the caller takes them
 * back before it lets go of the lock, so that every critical section leaves the SQ empty. */
static int flush_sq_locked(struct tba_ring *ring)
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

/* Take back the SQEs the kernel did not take (caller holds the lock; they are all its own). */
static void take_back_locked(struct tba_ring *ring)
{
    __atomic_store_n(ring->sq_tail, __atomic_load_n(ring->sq_head, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
}

/* The reaper could not hand the kernel its entries: take back what the kernel did not take and
 * refuse every later submission, wake-up and resubmission (caller holds the lock). */
static void fail_locked(struct tba_ring *ring, int err)
{
    take_back_locked(ring);
    ring->failed = err;
    ring->reaper_waiting = 0;
}

/* Fill the next SQE (caller holds the lock). Returns -EBUSY when the SQ is full. */
static int push_sqe_locked(struct tba_ring *ring, uint8_t opcode, int fd, uint64_t addr,
                           uint32_t len, uint64_t offset, uint64_t user_data)
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
    __atomic_store_n(ring->sq_tail, tail + 1, __ATOMIC_RELEASE);
    return 0;
}

/* Queue the not-yet-moved remainder of slot ``index`` (caller holds the lock). */
static int push_slot_locked(struct tba_ring *ring, unsigned index)
{
    const struct tba_req *req = &ring->slots[index];
    if (req->iov) {
        uint8_t vop = req->is_write ? IORING_OP_WRITEV : IORING_OP_READV;
        return push_sqe_locked(ring, vop, req->fd, (uint64_t)(uintptr_t)&req->iov[req->iov_first],
                               req->iovcnt - req->iov_first, req->offset + req->done, index);
    }
    uint64_t addr = req->addr + req->done, left = req->len - req->done;
    uint32_t len = left > MAX_SQE_BYTES ? MAX_SQE_BYTES : (uint32_t)left;
    uint8_t opcode = req->is_write ? IORING_OP_WRITE : IORING_OP_READ;
    return push_sqe_locked(ring, opcode, req->fd, addr, len, req->offset + req->done, index);
}

/* Push slot ``index`` and hand it to the kernel at once (the reaper's resubmission). When the kernel
 * does not take it, the SQE is taken back and the ring fails: the caller finishes the slot with the
 * error and frees its pieces, which a later flush must not hand to the kernel. */
static int push_slot(struct tba_ring *ring, unsigned index)
{
    pthread_mutex_lock(&ring->lock);
    int err = ring->failed;
    if (!err && (err = push_slot_locked(ring, index)) == -EBUSY && !(err = flush_sq_locked(ring)))
        err = push_slot_locked(ring, index);
    if (!err)
        err = flush_sq_locked(ring);
    if (err && !ring->failed)
        fail_locked(ring, err);
    pthread_mutex_unlock(&ring->lock);
    return err;
}

/* Submit a no-op carrying ``tag``; its completion makes a blocked reaper return from the kernel. */
static int push_nop_locked(struct tba_ring *ring, uint64_t tag)
{
    int err = push_sqe_locked(ring, IORING_OP_NOP, -1, 0, 0, 0, tag);
    if (err == -EBUSY && !(err = flush_sq_locked(ring)))
        err = push_sqe_locked(ring, IORING_OP_NOP, -1, 0, 0, 0, tag);
    if (!err && (err = flush_sq_locked(ring)))
        take_back_locked(ring);
    return err;
}

/* Put the requests whose SQEs the kernel did not take back at the front of the queue, in their
 * order, and free their slots (caller holds the lock, and queued nothing but refilled slots since
 * the SQ was last empty; the queue has room, as they came out of it). Each request's pieces go with
 * it: the queue owns them again, and the slot holds none. */
static void unrefill_locked(struct tba_ring *ring)
{
    unsigned head = __atomic_load_n(ring->sq_head, __ATOMIC_ACQUIRE);
    for (unsigned tail = *ring->sq_tail; tail != head; tail--) {
        unsigned index = (unsigned)ring->sqes[(tail - 1) & *ring->sq_mask].user_data;
        ring->queue_head = (ring->queue_head + ring->queue_cap - 1) % ring->queue_cap;
        ring->queue[ring->queue_head] = ring->slots[index];
        ring->queue_count++;
        ring->slots[index].iov = NULL;
        ring->free_stack[ring->free_count++] = index;
    }
    take_back_locked(ring);
}

/* Move waiting requests into free slots and hand them to the kernel (caller holds the lock). On
 * failure the requests the kernel did not take wait in the queue again. */
static int refill_locked(struct tba_ring *ring)
{
    if (ring->failed)
        return ring->failed;
    while (ring->queue_count > 0 && ring->free_count > 0) {
        unsigned index = ring->free_stack[ring->free_count - 1];
        ring->slots[index] = ring->queue[ring->queue_head];
        ring->slots[index].done = 0;
        int err = push_slot_locked(ring, index);
        if (err == -EBUSY && !(err = flush_sq_locked(ring)))
            continue;
        if (err) {
            ring->slots[index].iov = NULL; /* still the waiting request's, which keeps its place */
            unrefill_locked(ring);
            return err;
        }
        ring->free_count--;
        ring->queue_head = (ring->queue_head + 1) % ring->queue_cap;
        ring->queue_count--;
    }
    int err = flush_sq_locked(ring);
    if (err)
        unrefill_locked(ring);
    return err;
}

int tba_ring_submit(struct tba_ring *ring, const struct tba_req *reqs, unsigned n)
{
    pthread_mutex_lock(&ring->lock);
    int err = ring->failed;
    if (!err)
        err = tba_ring_grow_queue_locked(ring, n);
    if (!err) {
        for (unsigned i = 0; i < n; i++)
            ring->queue[(ring->queue_head + ring->queue_count + i) % ring->queue_cap] = reqs[i];
        ring->queue_count += n;
        if (ring->reaper_waiting && n > 0) {
            err = push_nop_locked(ring, KICK_TAG);
            if (err)
                ring->queue_count -= n; /* all or nothing: the reaper cannot have taken them */
            else
                ring->reaper_waiting = 0;
        }
    }
    pthread_mutex_unlock(&ring->lock);
    return err;
}

int tba_ring_wake(struct tba_ring *ring)
{
    pthread_mutex_lock(&ring->lock);
    /* A failed ring's reaper never blocks on a wake-up (see tba_ring_reap): nothing to hand over. */
    int err = ring->failed ? 0 : push_nop_locked(ring, WAKE_TAG);
    pthread_mutex_unlock(&ring->lock);
    return err;
}

static void finish_slot(struct tba_ring *ring, unsigned index, int64_t res, struct tba_done *out)
{
    struct tba_req *req = &ring->slots[index];
    out->tag = req->tag;
    out->res = res;
    out->done = req->done;
    tba_req_free(req);
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
    if (req->done < req->len) {
        if (req->iov)
            tba_req_advance(req, (uint64_t)res);
        return requeue_slot(ring, index, out);
    }
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
            else if (user_data != KICK_TAG)
                n += (unsigned)complete_one(ring, (unsigned)user_data, res, &out[n]);
        }
        *nout = n;
        pthread_mutex_lock(&ring->lock);
        int err = refill_locked(ring); /* freed slots go straight back to work, GIL or not */
        if (err)
            fail_locked(ring, err);
        int in_kernel = ring->free_count < ring->nslots; /* every taken slot's SQE is the kernel's */
        int done = n > 0 || *woke || (err && !in_kernel);
        ring->reaper_waiting = !done && !err;
        pthread_mutex_unlock(&ring->lock);
        if (done)
            return n > 0 || *woke ? 0 : err;
        if (err) { /* the kernel may still write to or read from their memory: wait for them */
            const struct timespec poll = {0, DRAIN_POLL_NS};
            nanosleep(&poll, NULL);
            continue;
        }
        int ret = sys_enter(ring->fd, 0, 1, IORING_ENTER_GETEVENTS);
        if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
            pthread_mutex_lock(&ring->lock);
            fail_locked(ring, ret);
            pthread_mutex_unlock(&ring->lock);
        }
    }
}

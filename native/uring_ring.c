/*
 * io_uring ring lifetime: setup, mapping of the shared rings, request slots, the waiting queue, close.
 * See uring_ring.h for the contract; submission and completion live in uring_io.c.
 */
#define _GNU_SOURCE
#include "uring_ring.h"

#include <errno.h>
#include <linux/io_uring.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

static int sys_setup(unsigned entries, struct io_uring_params *params)
{
    int fd = (int)syscall(__NR_io_uring_setup, entries, params);
    return fd < 0 ? -errno : fd;
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

void tba_req_free(struct tba_req *req)
{
    free(req->iov);
    req->iov = NULL;
    req->iovcnt = req->iov_first = 0;
}

/* Cut ``moved`` bytes off the front of a vectored request's pieces (it has more than that left). */
void tba_req_advance(struct tba_req *req, uint64_t moved)
{
    while (moved > 0 && req->iov_first < req->iovcnt) {
        struct iovec *piece = &req->iov[req->iov_first];
        if (moved < piece->iov_len) {
            piece->iov_base = (char *)piece->iov_base + moved;
            piece->iov_len -= moved;
            return;
        }
        moved -= piece->iov_len;
        req->iov_first++;
    }
}

/* Make room in the waiting queue for ``more`` requests (caller holds the lock). */
int tba_ring_grow_queue_locked(struct tba_ring *ring, size_t more)
{
    size_t need = ring->queue_count + more, cap = ring->queue_cap ? ring->queue_cap : 64;
    if (need <= ring->queue_cap)
        return 0;
    while (cap < need)
        cap *= 2;
    struct tba_req *queue = malloc(cap * sizeof(*queue));
    if (!queue)
        return -ENOMEM;
    for (size_t i = 0; i < ring->queue_count; i++)
        queue[i] = ring->queue[(ring->queue_head + i) % ring->queue_cap];
    free(ring->queue);
    ring->queue = queue;
    ring->queue_cap = cap;
    ring->queue_head = 0;
    return 0;
}

void tba_ring_mark_inherited(struct tba_ring *ring)
{
    ring->inherited = 1;
}

void tba_ring_close(struct tba_ring *ring)
{
    unmap_rings(ring);
    if (ring->fd >= 0)
        close(ring->fd);
    ring->fd = -1;
    if (!ring->inherited) {
        /* Requests that never finished (a ring closed after its reaper failed) still own their pieces. */
        for (unsigned i = 0; ring->slots && i < ring->nslots; i++)
            tba_req_free(&ring->slots[i]);
        for (size_t i = 0; ring->queue && i < ring->queue_count; i++)
            tba_req_free(&ring->queue[(ring->queue_head + i) % ring->queue_cap]);
        free(ring->queue);
    }
    ring->inherited = 0;
    if (ring->lock_ready)
        pthread_mutex_destroy(&ring->lock);
    ring->lock_ready = 0;
    free(ring->slots);
    free(ring->free_stack);
    ring->queue = NULL;
    ring->queue_head = ring->queue_count = ring->queue_cap = 0;
    ring->slots = NULL;
    ring->free_stack = NULL;
    ring->nslots = ring->free_count = 0;
}

unsigned tba_ring_in_flight(struct tba_ring *ring)
{
    pthread_mutex_lock(&ring->lock);
    unsigned n = ring->nslots - ring->free_count + (unsigned)ring->queue_count;
    pthread_mutex_unlock(&ring->lock);
    return n;
}

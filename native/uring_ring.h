/*
 * A minimal io_uring ring for block reads and writes, on raw syscalls (no liburing).
 *
 * The ring owns a fixed table of request slots (the queue depth). A slot holds one caller request
 * until every byte of it has moved: short transfers and -EAGAIN/-EINTR completions are resubmitted
 * from the slot by the reaper, so callers only ever see a request finish once, with its full byte
 * count, a negative errno, or TBA_RES_SHORT when a read met end of file (or a write moved nothing).
 *
 * Submitting only queues requests (all or none) and, when the reaper is blocked, kicks it with a
 * no-op; the reaper moves queued requests into free slots and hands them to the kernel, so all
 * data I/O is issued by the reaping thread and the ring stays full without the caller's help.
 *
 * Threading: any number of threads may submit; exactly one thread reaps. The submission queue,
 * and the slot table are guarded by one mutex; the completion queue is
 * touched only by the reaper. Every SQE is handed to the kernel (io_uring_enter) by the thread that
 * filled it, inside the same critical section, because io_uring ties a request to the thread that
 * submitted it: retries of that request run as task work of that thread, and a request whose
 * thread has exited can fail with -ECANCELED. Reads and writes are therefore only ever issued by
 * the long-lived reaper; other threads only issue no-ops. Reaping waits without the mutex. All
 * functions return 0 or a negative errno.
 *
 * A failure of the reaper to hand the kernel its entries, or to wait for completions, fails the ring
 * for good: under the lock, the entries the kernel did not take are taken back (their requests wait
 * in the queue again, untouched) and every later submit, resubmission and refill refuses with that
 * error, so no thread can hand them over afterwards. Reap goes on reporting the requests the kernel
 * does hold, as they complete (polling the completion queue, since io_uring_enter may be what
 * failed), and returns the error only once none is left: from then on the kernel touches no
 * request's memory, and the caller may fail and release every request it has not heard of.
 *
 * A vectored request (iov set: pieces of memory that fill one contiguous file range, Note [Adjacent
 * storages, one request] in tba/runtime/_host_requests.py) goes out as READV/WRITEV; a short transfer cuts
 * the moved bytes off the front of its pieces and goes out again. The ring frees the iov when the
 * request finishes, and at close for requests that never did.
 */
#ifndef TBA_URING_RING_H
#define TBA_URING_RING_H

#include <pthread.h>
#include <stdint.h>
#include <sys/uio.h>

#define TBA_RES_SHORT INT64_MIN

struct tba_req {
    uint64_t tag;    /* caller's identifier, handed back on completion */
    uint64_t addr;   /* memory address of the first byte (unused when iov is set) */
    uint64_t len;    /* bytes to move */
    uint64_t offset; /* file offset of the first byte */
    uint64_t done;   /* bytes moved so far */
    int fd;
    int is_write;
    struct iovec *iov; /* a vectored request's pieces (malloc'd, owned by the request), else NULL */
    unsigned iovcnt;   /* pieces in iov */
    unsigned iov_first; /* the first piece not wholly moved; moved bytes of it are cut off its front */
};

struct tba_done {
    uint64_t tag;
    int64_t res;   /* len on success, -errno on failure, TBA_RES_SHORT at early end of file */
    uint64_t done; /* bytes moved before the request finished */
};

struct tba_ring {
    int fd;
    unsigned sq_entries, cq_entries;
    void *sq_map, *cq_map;
    size_t sq_map_bytes, cq_map_bytes;
    struct io_uring_sqe *sqes;
    size_t sqes_bytes;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;

    pthread_mutex_t lock;
    int lock_ready;
    struct tba_req *slots;
    unsigned *free_stack;
    unsigned free_count, nslots;
    struct tba_req *queue; /* requests waiting for a free slot: a circular buffer */
    size_t queue_head, queue_count, queue_cap;
    int reaper_waiting; /* the reaper is blocked (or about to block) in io_uring_enter */
    int failed;         /* 0, or the negative errno that failed the reaper: sticky */
    int inherited;      /* a forked child's copy: close frees no request's pieces nor the queue */
};

int tba_ring_open(struct tba_ring *ring, unsigned depth);
void tba_ring_close(struct tba_ring *ring);
void tba_req_free(struct tba_req *req);
/* Cut ``moved`` bytes off the front of a vectored request's pieces (it has more than that left). */
void tba_req_advance(struct tba_req *req, uint64_t moved);
/* Make room in the waiting queue for ``more`` requests (caller holds the lock). */
int tba_ring_grow_queue_locked(struct tba_ring *ring, size_t more);
/* Note: [A forked child leaks what the parent's threads were changing]
 * In a forked child the parent's submitters and reaper are gone, and a fork can land anywhere inside
 * their work under the ring's lock: while the reaper moves a request from the queue to a slot (both
 * then hold the same pieces), inside tba_req_free, or inside tba_ring_grow_queue_locked between freeing
 * the old queue and storing the new one (the queue's pointer, head and capacity then disagree). So
 * tba_ring_mark_inherited marks the ring inherited, and tba_ring_close then neither reads the queue nor
 * frees any request's pieces or the queue itself: the child leaks them (at most the queue's requests
 * and one queue array) rather than free anything twice or walk a queue half replaced. The slots and the
 * free stack, sized once at open, are freed as usual. */
void tba_ring_mark_inherited(struct tba_ring *ring);
int tba_ring_submit(struct tba_ring *ring, const struct tba_req *reqs, unsigned n);
int tba_ring_wake(struct tba_ring *ring);
int tba_ring_reap(struct tba_ring *ring, struct tba_done *out, unsigned cap, unsigned *nout,
                  int *woke);
unsigned tba_ring_in_flight(struct tba_ring *ring);

#endif

/* Real symbols for the static-inline fast-path verbs (see wrapper.h): Rust cannot call a
 * `static inline` C function, and re-implementing them would mean reading provider ops tables
 * from Rust. Each is one call; the compiler inlines the verbs.h body here. */
#include "wrapper.h"

int rdsd_ibv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr)
{
    return ibv_post_send(qp, wr, bad_wr);
}

int rdsd_ibv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr)
{
    return ibv_post_recv(qp, wr, bad_wr);
}

int rdsd_ibv_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)
{
    return ibv_poll_cq(cq, num_entries, wc);
}

int rdsd_ibv_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    return ibv_req_notify_cq(cq, solicited_only);
}

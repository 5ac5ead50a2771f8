/* What bindgen sees: the verbs and rdma_cm headers, and our wrappers of their inline functions. */
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

/* ibv_post_send, ibv_post_recv, ibv_poll_cq and ibv_req_notify_cq are `static inline` in
 * verbs.h (they jump through the provider's ops table in struct ibv_context), so there is no
 * symbol to link against: these real functions call them. */
int rdsd_ibv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
int rdsd_ibv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
int rdsd_ibv_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
int rdsd_ibv_req_notify_cq(struct ibv_cq *cq, int solicited_only);

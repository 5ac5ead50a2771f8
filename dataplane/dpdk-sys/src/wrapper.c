/*
 * Hand-written C wrappers for the parts of DPDK's API that are not exported symbols.
 *
 * DPDK puts its fast path in headers: `static inline` functions (rte_eth_rx_burst,
 * rte_pktmbuf_alloc, ...) and macros (rte_pktmbuf_mtod, rte_errno). They have no symbol in
 * librte_*.so, so Rust cannot call them through `extern "C"`; bindgen skips them. Each
 * wrapper below is a real function that calls the inline one, compiled by build.rs with the
 * `cc` crate and the same `pkg-config --cflags libdpdk` as the bindings, so the inline code
 * is the one of the installed DPDK (no re-implementation in Rust that could drift from
 * 22.11's struct layouts or its rte_eth_fp_ops table).
 *
 * The cost is one extra (non-inlined) call per burst or per mbuf operation. rdsd calls
 * them per burst on the poll core, where that is small; cross-language LTO could remove it.
 */
#include "wrapper.h"

/* static inline: dispatches through rte_eth_fp_ops[port_id] (PMD's rx function). */
uint16_t rdsd_rte_eth_rx_burst(uint16_t port_id, uint16_t queue_id,
                               struct rte_mbuf **rx_pkts, uint16_t nb_pkts)
{
	return rte_eth_rx_burst(port_id, queue_id, rx_pkts, nb_pkts);
}

/* static inline: dispatches through rte_eth_fp_ops[port_id] (PMD's tx function). */
uint16_t rdsd_rte_eth_tx_burst(uint16_t port_id, uint16_t queue_id,
                               struct rte_mbuf **tx_pkts, uint16_t nb_pkts)
{
	return rte_eth_tx_burst(port_id, queue_id, tx_pkts, nb_pkts);
}

/* static inline: takes one mbuf from the pool's per-lcore cache and resets it. */
struct rte_mbuf *rdsd_rte_pktmbuf_alloc(struct rte_mempool *mp)
{
	return rte_pktmbuf_alloc(mp);
}

/* static inline: all-or-nothing allocation of `count` mbufs; 0 or -ENOENT. */
int rdsd_rte_pktmbuf_alloc_bulk(struct rte_mempool *pool, struct rte_mbuf **mbufs,
                                unsigned int count)
{
	return rte_pktmbuf_alloc_bulk(pool, mbufs, count);
}

/* static inline: frees a whole chain (NULL is accepted). */
void rdsd_rte_pktmbuf_free(struct rte_mbuf *m)
{
	rte_pktmbuf_free(m);
}

/* exported in 22.11, wrapped anyway so the Rust side has one naming scheme for mbuf ops. */
void rdsd_rte_pktmbuf_free_bulk(struct rte_mbuf **mbufs, unsigned int count)
{
	rte_pktmbuf_free_bulk(mbufs, count);
}

/* macro rte_pktmbuf_mtod(m, void *): buf_addr + data_off. */
void *rdsd_rte_pktmbuf_mtod(struct rte_mbuf *m)
{
	return rte_pktmbuf_mtod(m, void *);
}

/* macro rte_pktmbuf_mtod_offset(m, void *, off). */
void *rdsd_rte_pktmbuf_mtod_offset(struct rte_mbuf *m, uint32_t off)
{
	return rte_pktmbuf_mtod_offset(m, void *, off);
}

/* macro rte_pktmbuf_data_len(m): this segment's length. The field sits in anonymous
 * unions/structs whose bindgen names (__bindgen_anon_N) are not stable across versions. */
uint16_t rdsd_rte_pktmbuf_data_len(const struct rte_mbuf *m)
{
	return rte_pktmbuf_data_len(m);
}

/* macro rte_pktmbuf_pkt_len(m): the whole chain's length (same reason as data_len). */
uint32_t rdsd_rte_pktmbuf_pkt_len(const struct rte_mbuf *m)
{
	return rte_pktmbuf_pkt_len(m);
}

/* field in an anonymous union; see data_len. */
uint16_t rdsd_rte_pktmbuf_nb_segs(const struct rte_mbuf *m)
{
	return m->nb_segs;
}

/* field in an anonymous union; see data_len. */
struct rte_mbuf *rdsd_rte_pktmbuf_next(const struct rte_mbuf *m)
{
	return m->next;
}

/* static inline. */
uint16_t rdsd_rte_pktmbuf_headroom(const struct rte_mbuf *m)
{
	return rte_pktmbuf_headroom(m);
}

/* static inline. */
uint16_t rdsd_rte_pktmbuf_tailroom(const struct rte_mbuf *m)
{
	return rte_pktmbuf_tailroom(m);
}

/* static inline: reads the pool's private area. */
uint16_t rdsd_rte_pktmbuf_data_room_size(struct rte_mempool *mp)
{
	return rte_pktmbuf_data_room_size(mp);
}

/* static inline: grows the last segment; NULL if the tailroom is too small. */
char *rdsd_rte_pktmbuf_append(struct rte_mbuf *m, uint16_t len)
{
	return rte_pktmbuf_append(m, len);
}

/* static inline: grows the first segment into the headroom; NULL if too small. */
char *rdsd_rte_pktmbuf_prepend(struct rte_mbuf *m, uint16_t len)
{
	return rte_pktmbuf_prepend(m, len);
}

/* static inline: removes `len` bytes at the start; NULL if longer than the segment. */
char *rdsd_rte_pktmbuf_adj(struct rte_mbuf *m, uint16_t len)
{
	return rte_pktmbuf_adj(m, len);
}

/* static inline: removes `len` bytes at the end; 0 or -1. */
int rdsd_rte_pktmbuf_trim(struct rte_mbuf *m, uint16_t len)
{
	return rte_pktmbuf_trim(m, len);
}

/* static inline. */
void rdsd_rte_pktmbuf_reset(struct rte_mbuf *m)
{
	rte_pktmbuf_reset(m);
}

/* static inline: reads the thread-local per_lcore__lcore_id (LCORE_ID_ANY off EAL threads).
 * Rust cannot name a C thread-local variable portably. */
unsigned int rdsd_rte_lcore_id(void)
{
	return rte_lcore_id();
}

/* macro rte_errno: a thread-local (RTE_PER_LCORE(_rte_errno)) set by EAL/ethdev/mempool on
 * failure, e.g. by rte_eal_init and rte_pktmbuf_pool_create. */
int rdsd_rte_errno(void)
{
	return rte_errno;
}

/* lets tests and callers clear rte_errno before a call. */
void rdsd_rte_errno_set(int value)
{
	rte_errno = value;
}

/*
 * What bindgen reads: the DPDK headers rdsd needs, plus the prototypes of the hand-written
 * wrappers in wrapper.c (see there for why each one exists).
 *
 * Compiled with the raw `pkg-config --cflags libdpdk` (minus -march=), which carries
 * `-include rte_config.h`: DPDK's headers depend on the RTE_* macros defined there.
 */
#ifndef RDSD_DPDK_SYS_WRAPPER_H
#define RDSD_DPDK_SYS_WRAPPER_H

#include <stdint.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>

/* ethdev fast path (static inline in rte_ethdev.h) */
uint16_t rdsd_rte_eth_rx_burst(uint16_t port_id, uint16_t queue_id,
                               struct rte_mbuf **rx_pkts, uint16_t nb_pkts);
uint16_t rdsd_rte_eth_tx_burst(uint16_t port_id, uint16_t queue_id,
                               struct rte_mbuf **tx_pkts, uint16_t nb_pkts);

/* mbuf allocation and release (static inline in rte_mbuf.h) */
struct rte_mbuf *rdsd_rte_pktmbuf_alloc(struct rte_mempool *mp);
int rdsd_rte_pktmbuf_alloc_bulk(struct rte_mempool *pool, struct rte_mbuf **mbufs,
                                unsigned int count);
void rdsd_rte_pktmbuf_free(struct rte_mbuf *m);
void rdsd_rte_pktmbuf_free_bulk(struct rte_mbuf **mbufs, unsigned int count);

/* mbuf data accessors (macros and static inline functions) */
void *rdsd_rte_pktmbuf_mtod(struct rte_mbuf *m);
void *rdsd_rte_pktmbuf_mtod_offset(struct rte_mbuf *m, uint32_t off);
uint16_t rdsd_rte_pktmbuf_data_len(const struct rte_mbuf *m);
uint32_t rdsd_rte_pktmbuf_pkt_len(const struct rte_mbuf *m);
uint16_t rdsd_rte_pktmbuf_nb_segs(const struct rte_mbuf *m);
struct rte_mbuf *rdsd_rte_pktmbuf_next(const struct rte_mbuf *m);
uint16_t rdsd_rte_pktmbuf_headroom(const struct rte_mbuf *m);
uint16_t rdsd_rte_pktmbuf_tailroom(const struct rte_mbuf *m);
uint16_t rdsd_rte_pktmbuf_data_room_size(struct rte_mempool *mp);
char *rdsd_rte_pktmbuf_append(struct rte_mbuf *m, uint16_t len);
char *rdsd_rte_pktmbuf_prepend(struct rte_mbuf *m, uint16_t len);
char *rdsd_rte_pktmbuf_adj(struct rte_mbuf *m, uint16_t len);
int rdsd_rte_pktmbuf_trim(struct rte_mbuf *m, uint16_t len);
void rdsd_rte_pktmbuf_reset(struct rte_mbuf *m);

/* per-lcore thread-local state */
unsigned int rdsd_rte_lcore_id(void);
int rdsd_rte_errno(void);
void rdsd_rte_errno_set(int value);

#endif

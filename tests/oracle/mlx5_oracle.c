/* The mlx5 wire-format oracle: rdma-core's own header, not gpunet's reading of it.
 *
 * Built by tests/test_mlx5_oracle.py against the system's <infiniband/mlx5dv.h> (Debian package
 * libibverbs-dev). It never includes anything of gpunet's; every layout fact comes from the
 * header's structs (offsetof/sizeof), enums and inline helpers (mlx5dv_set_ctrl_seg,
 * mlx5dv_set_data_seg, mlx5dv_get_cqe_opcode/owner). Segments the header has no helper for (raddr,
 * atomic, inline header, doorbell records) are filled field by field with htobe* on the header's
 * struct types, the way rdma-core's post path fills them.
 *
 *   mlx5_oracle layout    print "NAME VALUE" lines: offsets, sizes and constants, then exit.
 *   mlx5_oracle           serve requests from stdin, one per line, one answer line each (flushed):
 *     fill  B                     pre-fill byte for the next builders (default 0): bytes a builder
 *                                 does not write keep it, so "writes nothing else" is checked too
 *     ctrl  pi opcode opmod qpn fm_ce_se ds signature imm      -> 16 bytes hex
 *     data  byte_count lkey addr                               -> 16 bytes hex
 *     raddr raddr rkey                                         -> 16 bytes hex
 *     atom  swap_add compare                                   -> 16 bytes hex
 *     inl   nbytes                                             -> 4 bytes hex
 *     rdma  pi qpn opcode fm_ce_se raddr rkey laddr lkey nbytes imm   -> 64 bytes hex (one WQEBB)
 *     amo   pi qpn opcode fm_ce_se raddr rkey laddr lkey swap_add compare -> 64 bytes hex
 *     nop   pi qpn fm_ce_se                                    -> 64 bytes hex
 *     cqe   HEX128                     -> the fields of that CQE as struct mlx5_cqe64 and
 *                                         struct mlx5_err_cqe read them (decimal, space separated)
 *     valid op_own ci cqe_cnt          -> 1 if the CQE is the consumer's new entry, else 0
 *     sqdb  sq_pi                      -> 8 bytes hex: a QP doorbell record after ringing sq_pi
 *     cqdb  ci                         -> 8 bytes hex: a CQ doorbell record after consuming to ci
 *     dbw   HEX16                      -> the 64-bit word a doorbell store of these 8 ctrl bytes
 *                                         carries (a host-order load of them), decimal
 *   Numbers are decimal or 0x-hex. An unknown request answers "ERR ...".
 */
#include <endian.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/mlx5dv.h>

static unsigned char fill_byte;

static void print_hex(const void *p, size_t n)
{
	const unsigned char *b = p;
	for (size_t i = 0; i < n; i++)
		printf("%02x", b[i]);
	printf("\n");
}

static int parse_hex(const char *s, unsigned char *out, size_t n)
{
	if (strlen(s) < 2 * n)
		return -1;
	for (size_t i = 0; i < n; i++) {
		unsigned int v;
		if (sscanf(s + 2 * i, "%2x", &v) != 1)
			return -1;
		out[i] = (unsigned char)v;
	}
	return 0;
}

/* rdma-core's post path: remote address segment. */
static void fill_raddr(struct mlx5_wqe_raddr_seg *r, uint64_t raddr, uint32_t rkey)
{
	r->raddr = htobe64(raddr);
	r->rkey = htobe32(rkey);
	r->reserved = 0;
}

/* rdma-core's post path: atomic segment with both operands given (compare-swap layout; a
 * fetch-add puts its addend in swap_add). */
static void fill_atomic(struct mlx5_wqe_atomic_seg *a, uint64_t swap_add, uint64_t compare)
{
	a->swap_add = htobe64(swap_add);
	a->compare = htobe64(compare);
}

/* The owner-bit rule of FACTS.md (rdma-core's CQ poll): the CQE at consumer index ci of a CQ of
 * cqe_cnt entries (a power of two) is new iff its opcode is not INVALID and its owner bit equals
 * the parity of the consumer's pass over the ring, !!(ci & cqe_cnt). */
static int cqe_is_new(struct mlx5_cqe64 *cqe, uint32_t ci, uint32_t cqe_cnt)
{
	return mlx5dv_get_cqe_opcode(cqe) != MLX5_CQE_INVALID &&
	       (cqe->op_own & MLX5_CQE_OWNER_MASK) == !!(ci & cqe_cnt);
}

#define P(name, value) printf("%s %llu\n", name, (unsigned long long)(value))
#define OFF(type, field) P(#type "." #field, offsetof(struct type, field))
#define SZ(type) P("sizeof." #type, sizeof(struct type))

static void layout(void)
{
	SZ(mlx5_wqe_ctrl_seg);
	OFF(mlx5_wqe_ctrl_seg, opmod_idx_opcode);
	OFF(mlx5_wqe_ctrl_seg, qpn_ds);
	OFF(mlx5_wqe_ctrl_seg, signature);
	OFF(mlx5_wqe_ctrl_seg, dci_stream_channel_id);
	OFF(mlx5_wqe_ctrl_seg, fm_ce_se);
	OFF(mlx5_wqe_ctrl_seg, imm);

	SZ(mlx5_wqe_raddr_seg);
	OFF(mlx5_wqe_raddr_seg, raddr);
	OFF(mlx5_wqe_raddr_seg, rkey);
	OFF(mlx5_wqe_raddr_seg, reserved);

	SZ(mlx5_wqe_data_seg);
	OFF(mlx5_wqe_data_seg, byte_count);
	OFF(mlx5_wqe_data_seg, lkey);
	OFF(mlx5_wqe_data_seg, addr);

	SZ(mlx5_wqe_atomic_seg);
	OFF(mlx5_wqe_atomic_seg, swap_add);
	OFF(mlx5_wqe_atomic_seg, compare);

	SZ(mlx5_wqe_inl_data_seg);
	OFF(mlx5_wqe_inl_data_seg, byte_count);

	SZ(mlx5_cqe64);
	OFF(mlx5_cqe64, srqn_uidx);
	OFF(mlx5_cqe64, imm_inval_pkey);
	OFF(mlx5_cqe64, byte_cnt);
	OFF(mlx5_cqe64, timestamp);
	OFF(mlx5_cqe64, sop_drop_qpn);
	OFF(mlx5_cqe64, wqe_counter);
	OFF(mlx5_cqe64, signature);
	OFF(mlx5_cqe64, op_own);

	SZ(mlx5_err_cqe);
	OFF(mlx5_err_cqe, vendor_err_synd);
	OFF(mlx5_err_cqe, syndrome);
	OFF(mlx5_err_cqe, s_wqe_opcode_qpn);
	OFF(mlx5_err_cqe, wqe_counter);
	OFF(mlx5_err_cqe, signature);
	OFF(mlx5_err_cqe, op_own);

	P("MLX5_SEND_WQE_BB", MLX5_SEND_WQE_BB);
	P("MLX5_INLINE_SEG", MLX5_INLINE_SEG);
	P("MLX5_RCV_DBR", MLX5_RCV_DBR);
	P("MLX5_SND_DBR", MLX5_SND_DBR);

	P("MLX5_OPCODE_NOP", MLX5_OPCODE_NOP);
	P("MLX5_OPCODE_RDMA_WRITE", MLX5_OPCODE_RDMA_WRITE);
	P("MLX5_OPCODE_RDMA_WRITE_IMM", MLX5_OPCODE_RDMA_WRITE_IMM);
	P("MLX5_OPCODE_SEND", MLX5_OPCODE_SEND);
	P("MLX5_OPCODE_SEND_IMM", MLX5_OPCODE_SEND_IMM);
	P("MLX5_OPCODE_RDMA_READ", MLX5_OPCODE_RDMA_READ);
	P("MLX5_OPCODE_ATOMIC_CS", MLX5_OPCODE_ATOMIC_CS);
	P("MLX5_OPCODE_ATOMIC_FA", MLX5_OPCODE_ATOMIC_FA);
	P("MLX5_OPCODE_ATOMIC_MASKED_CS", MLX5_OPCODE_ATOMIC_MASKED_CS);
	P("MLX5_OPCODE_ATOMIC_MASKED_FA", MLX5_OPCODE_ATOMIC_MASKED_FA);

	P("MLX5_WQE_CTRL_CQ_UPDATE", MLX5_WQE_CTRL_CQ_UPDATE);
	P("MLX5_WQE_CTRL_SOLICITED", MLX5_WQE_CTRL_SOLICITED);
	P("MLX5_WQE_CTRL_FENCE", MLX5_WQE_CTRL_FENCE);
	P("MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE", MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE);

	P("MLX5_CQE_OWNER_MASK", MLX5_CQE_OWNER_MASK);
	P("MLX5_CQE_REQ", MLX5_CQE_REQ);
	P("MLX5_CQE_RESP_WR_IMM", MLX5_CQE_RESP_WR_IMM);
	P("MLX5_CQE_RESP_SEND", MLX5_CQE_RESP_SEND);
	P("MLX5_CQE_RESP_SEND_IMM", MLX5_CQE_RESP_SEND_IMM);
	P("MLX5_CQE_REQ_ERR", MLX5_CQE_REQ_ERR);
	P("MLX5_CQE_RESP_ERR", MLX5_CQE_RESP_ERR);
	P("MLX5_CQE_INVALID", MLX5_CQE_INVALID);

	P("MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR", MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR);
	P("MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR", MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR);
	P("MLX5_CQE_SYNDROME_LOCAL_PROT_ERR", MLX5_CQE_SYNDROME_LOCAL_PROT_ERR);
	P("MLX5_CQE_SYNDROME_WR_FLUSH_ERR", MLX5_CQE_SYNDROME_WR_FLUSH_ERR);
	P("MLX5_CQE_SYNDROME_MW_BIND_ERR", MLX5_CQE_SYNDROME_MW_BIND_ERR);
	P("MLX5_CQE_SYNDROME_BAD_RESP_ERR", MLX5_CQE_SYNDROME_BAD_RESP_ERR);
	P("MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR", MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR);
	P("MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR", MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR);
	P("MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR", MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR);
	P("MLX5_CQE_SYNDROME_REMOTE_OP_ERR", MLX5_CQE_SYNDROME_REMOTE_OP_ERR);
	P("MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR", MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR);
	P("MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR", MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR);
	P("MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR", MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR);
}

#define MAXARGS 12

static int serve(char *line)
{
	char *tok[MAXARGS + 1];
	unsigned long long a[MAXARGS];
	int n = 0;
	for (char *t = strtok(line, " \t\r\n"); t && n <= MAXARGS; t = strtok(NULL, " \t\r\n"))
		tok[n++] = t;
	if (n == 0)
		return printf("ERR empty request\n");
	for (int i = 1; i < n; i++)
		a[i - 1] = strtoull(tok[i], NULL, 0);
	const char *cmd = tok[0];
	int argc = n - 1;
	unsigned char wqe[MLX5_SEND_WQE_BB];
	memset(wqe, fill_byte, sizeof(wqe));
	struct mlx5_wqe_ctrl_seg *ctrl = (void *)wqe;
	struct mlx5_wqe_raddr_seg *raddr = (void *)(wqe + sizeof(*ctrl));

#define NEED(k) do { if (argc != (k)) return printf("ERR %s wants %d arguments\n", cmd, (k)); } while (0)
	if (!strcmp(cmd, "fill")) {
		NEED(1);
		fill_byte = (unsigned char)a[0];
		return printf("ok\n");
	} else if (!strcmp(cmd, "ctrl")) {
		NEED(8);
		mlx5dv_set_ctrl_seg(ctrl, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
		print_hex(wqe, sizeof(struct mlx5_wqe_ctrl_seg));
	} else if (!strcmp(cmd, "data")) {
		NEED(3);
		mlx5dv_set_data_seg((void *)wqe, a[0], a[1], a[2]);
		print_hex(wqe, sizeof(struct mlx5_wqe_data_seg));
	} else if (!strcmp(cmd, "raddr")) {
		NEED(2);
		fill_raddr((void *)wqe, a[0], a[1]);
		print_hex(wqe, sizeof(struct mlx5_wqe_raddr_seg));
	} else if (!strcmp(cmd, "atom")) {
		NEED(2);
		fill_atomic((void *)wqe, a[0], a[1]);
		print_hex(wqe, sizeof(struct mlx5_wqe_atomic_seg));
	} else if (!strcmp(cmd, "inl")) {
		NEED(1);
		struct mlx5_wqe_inl_data_seg *inl = (void *)wqe;
		/* the header declares byte_count uint32_t, not __be32: the caller swaps it */
		inl->byte_count = htobe32((uint32_t)a[0] | MLX5_INLINE_SEG);
		print_hex(wqe, sizeof(*inl));
	} else if (!strcmp(cmd, "rdma")) {
		/* pi qpn opcode fm_ce_se raddr rkey laddr lkey nbytes imm: ctrl + raddr + data, ds 3 */
		NEED(10);
		size_t ds = (sizeof(*ctrl) + sizeof(*raddr) + sizeof(struct mlx5_wqe_data_seg)) / 16;
		mlx5dv_set_ctrl_seg(ctrl, a[0], a[2], 0, a[1], a[3], ds, 0, a[9]);
		fill_raddr(raddr, a[4], a[5]);
		mlx5dv_set_data_seg((void *)(raddr + 1), a[8], a[7], a[6]);
		print_hex(wqe, sizeof(wqe));
	} else if (!strcmp(cmd, "amo")) {
		/* pi qpn opcode fm_ce_se raddr rkey laddr lkey swap_add compare:
		 * ctrl + raddr + atomic + data (8 bytes of result), ds 4 */
		NEED(10);
		struct mlx5_wqe_atomic_seg *aseg = (void *)(raddr + 1);
		size_t ds = (sizeof(*ctrl) + sizeof(*raddr) + sizeof(*aseg) +
			     sizeof(struct mlx5_wqe_data_seg)) / 16;
		mlx5dv_set_ctrl_seg(ctrl, a[0], a[2], 0, a[1], a[3], ds, 0, 0);
		fill_raddr(raddr, a[4], a[5]);
		fill_atomic(aseg, a[8], a[9]);
		mlx5dv_set_data_seg((void *)(aseg + 1), sizeof(uint64_t), a[7], a[6]);
		print_hex(wqe, sizeof(wqe));
	} else if (!strcmp(cmd, "nop")) {
		NEED(3);
		mlx5dv_set_ctrl_seg(ctrl, a[0], MLX5_OPCODE_NOP, 0, a[1], a[2], sizeof(*ctrl) / 16, 0, 0);
		print_hex(wqe, sizeof(wqe));
	} else if (!strcmp(cmd, "cqe")) {
		if (argc != 1)
			return printf("ERR cqe wants 1 argument\n");
		unsigned char buf[sizeof(struct mlx5_cqe64)];
		if (parse_hex(tok[1], buf, sizeof(buf)))
			return printf("ERR cqe wants %zu hex bytes\n", sizeof(buf));
		struct mlx5_cqe64 cqe;
		struct mlx5_err_cqe ecqe;
		memcpy(&cqe, buf, sizeof(cqe));
		memcpy(&ecqe, buf, sizeof(ecqe));
		printf("opcode=%u owner=%u qpn=%u wqe_counter=%u byte_cnt=%u imm_raw=%u "
		       "timestamp=%llu signature=%u srqn_uidx=%u "
		       "syndrome=%u vendor_err_synd=%u err_wqe_opcode=%u err_qpn=%u err_wqe_counter=%u "
		       "err_op_own=%u\n",
		       mlx5dv_get_cqe_opcode(&cqe), mlx5dv_get_cqe_owner(&cqe),
		       be32toh(cqe.sop_drop_qpn) & 0xffffff, be16toh(cqe.wqe_counter),
		       be32toh(cqe.byte_cnt), cqe.imm_inval_pkey,
		       (unsigned long long)be64toh(cqe.timestamp), cqe.signature,
		       be32toh(cqe.srqn_uidx),
		       ecqe.syndrome, ecqe.vendor_err_synd, be32toh(ecqe.s_wqe_opcode_qpn) >> 24,
		       be32toh(ecqe.s_wqe_opcode_qpn) & 0xffffff, be16toh(ecqe.wqe_counter),
		       ecqe.op_own);
	} else if (!strcmp(cmd, "valid")) {
		NEED(3);
		struct mlx5_cqe64 cqe;
		memset(&cqe, 0, sizeof(cqe));
		cqe.op_own = (uint8_t)a[0];
		printf("%d\n", cqe_is_new(&cqe, (uint32_t)a[1], (uint32_t)a[2]));
	} else if (!strcmp(cmd, "sqdb")) {
		NEED(1);
		uint32_t dbrec[2];
		memset(dbrec, fill_byte, sizeof(dbrec));
		dbrec[MLX5_SND_DBR] = htobe32((uint32_t)a[0] & 0xffff);
		print_hex(dbrec, sizeof(dbrec));
	} else if (!strcmp(cmd, "cqdb")) {
		NEED(1);
		uint32_t dbrec[2];
		memset(dbrec, fill_byte, sizeof(dbrec));
		dbrec[MLX5_RCV_DBR] = htobe32((uint32_t)a[0] & 0xffffff);
		print_hex(dbrec, sizeof(dbrec));
	} else if (!strcmp(cmd, "dbw")) {
		if (argc != 1)
			return printf("ERR dbw wants 1 argument\n");
		unsigned char b[8];
		uint64_t w;
		if (parse_hex(tok[1], b, sizeof(b)))
			return printf("ERR dbw wants 8 hex bytes\n");
		memcpy(&w, b, sizeof(w));
		printf("%llu\n", (unsigned long long)w);
	} else {
		return printf("ERR unknown request %s\n", cmd);
	}
	return 0;
}

int main(int argc, char **argv)
{
	if (argc > 1 && !strcmp(argv[1], "layout")) {
		layout();
		return 0;
	}
	char line[4096];
	while (fgets(line, sizeof(line), stdin)) {
		serve(line);
		fflush(stdout);
	}
	return 0;
}

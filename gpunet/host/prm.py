"""mlx5 PRM command layouts as data, and the command buffers the DevX NIC sends (the DEVX_SET idea).

The mlx5 firmware commands (CREATE_CQ, CREATE_QP, the QP state moves, QUERY_HCA_CAP, ...) are
big-endian bit layouts. The Linux kernel's ``include/linux/mlx5/mlx5_ifc.h`` writes each as a
pseudo-struct ``struct mlx5_ifc_<name>_bits`` of ``u8 field[bits]`` members, so ``offsetof`` is a
field's BIT offset and ``sizeof`` its bit width; bit 0 is the most significant bit of dword 0.

- ``FIELDS[(struct, field)] -> (bit_offset, bit_width)``: struct names as in mlx5_ifc.h without the
  ``mlx5_ifc_`` prefix and ``_bits`` suffix, field names as the PRM spells them. One line per field,
  grouped by struct. ``SIZES[struct] -> bits`` (the struct's sizeof; a trailing flexible ``pas[]``
  array is not counted). ``NESTED[(struct, field)] -> struct`` names the layout of an embedded
  struct (``create_qp_in.qpc`` is a ``qpc``; ``qpc.primary_address_path`` an ``ads``).
  ``RDMA_CORE_ONLY[(struct, field)] -> kernel reserved field``: the few DevX fields (UMEM ids and
  offsets) the kernel leaves reserved because the kernel driver never uses UMEM; their layout is
  rdma-core's (tests/mlx5_prm_structs.py, shipped by python3-pyverbs) and lies inside that
  reserved field. tests/test_prm_oracle.py checks every entry, size and constant here against the
  kernel header compiled by gcc, and the RDMA_CORE_ONLY ones against rdma-core's structs.
- Opcodes ``MLX5_CMD_OP_*`` and the enum values the commands use (``MLX5_QPC_*``, ...), named as
  in the kernel headers.
- Access over a bytearray / bytes / np.uint8 buffer: ``alloc(struct)`` (zeroed, SIZES/8 bytes),
  ``set(buf, struct, field, value, base_bits=0)``, ``get(buf, struct, field, base_bits=0)``,
  ``set_bytes`` / ``get_bytes`` for byte arrays (``ads.rgid_rip``, 16 bytes), ``offset(struct,
  path)`` -> (bit_offset, bit_width, struct_of_field). ``field`` / ``path`` may be a dotted path
  through NESTED fields: ``set(buf, "create_qp_in", "qpc.primary_address_path.rlid", 7)``.
  ``fill(buf, struct, values, base_bits=0)`` sets many at once: a dict value fills a nested
  struct, bytes fill a byte array. Out-of-range values and unknown names raise ConfigError.
- Command builders returning a ready input buffer (bytearray): ``cmd_create_cq``,
  ``cmd_create_qp``, ``cmd_modify_qp(op, qpn, ...)`` (RST2INIT / INIT2RTR / RTR2RTS / 2ERR / 2RST),
  ``cmd_query_hca_cap(op_mod)``, ``cmd_query_qp``, ``cmd_query_cq``, ``cmd_destroy_cq``,
  ``cmd_destroy_qp``, ``cmd_alloc_pd``, ``cmd_dealloc_pd``; ``out_size(opcode)`` -> bytes of the
  command's output; ``cmd_status(out)`` -> (status, syndrome) of any output buffer;
  ``hca_cap_op_mod(cap_type, current)``.

Wire level: imports only the floor, the stdlib and numpy (tests/test_layers.py).
"""
from gpunet.errors import ConfigError

# --- layouts: (bit_offset, bit_width), from mlx5_ifc.h (tests/test_prm_oracle.py checks each) ----
FIELDS = {
    # cqc (0x200 bits)
    ('cqc', 'status'):                                   (0x0000, 0x4),
    ('cqc', 'dbr_umem_valid'):                           (0x0006, 0x1),
    ('cqc', 'cqe_sz'):                                   (0x0008, 0x3),
    ('cqc', 'cc'):                                       (0x000b, 0x1),
    ('cqc', 'oi'):                                       (0x000e, 0x1),
    ('cqc', 'cq_period_mode'):                           (0x000f, 0x2),
    ('cqc', 'st'):                                       (0x0014, 0x4),
    ('cqc', 'dbr_umem_id'):                              (0x0020, 0x20),  # rdma-core; kernel: reserved_at_20
    ('cqc', 'page_offset'):                              (0x0054, 0x6),
    ('cqc', 'log_cq_size'):                              (0x0063, 0x5),
    ('cqc', 'uar_page'):                                 (0x0068, 0x18),
    ('cqc', 'cq_period'):                                (0x0084, 0xc),
    ('cqc', 'cq_max_count'):                             (0x0090, 0x10),
    ('cqc', 'c_eqn_or_apu_element'):                     (0x00a0, 0x20),
    ('cqc', 'log_page_size'):                            (0x00c3, 0x5),
    ('cqc', 'last_notified_index'):                      (0x0108, 0x18),
    ('cqc', 'last_solicit_index'):                       (0x0128, 0x18),
    ('cqc', 'consumer_counter'):                         (0x0148, 0x18),
    ('cqc', 'producer_counter'):                         (0x0168, 0x18),
    ('cqc', 'dbr_addr'):                                 (0x01c0, 0x40),
    # create_cq_in (0x880 bits)
    ('create_cq_in', 'opcode'):                          (0x0000, 0x10),
    ('create_cq_in', 'uid'):                             (0x0010, 0x10),
    ('create_cq_in', 'op_mod'):                          (0x0030, 0x10),
    ('create_cq_in', 'cq_context'):                      (0x0080, 0x200),
    ('create_cq_in', 'cq_umem_offset'):                  (0x0280, 0x40),  # rdma-core; kernel: reserved_at_280
    ('create_cq_in', 'cq_umem_id'):                      (0x02c0, 0x20),  # rdma-core; kernel: reserved_at_280
    ('create_cq_in', 'cq_umem_valid'):                   (0x02e0, 0x1),
    # create_cq_out (0x80 bits)
    ('create_cq_out', 'status'):                         (0x0000, 0x8),
    ('create_cq_out', 'syndrome'):                       (0x0020, 0x20),
    ('create_cq_out', 'cqn'):                            (0x0048, 0x18),
    # destroy_cq_in (0x80 bits)
    ('destroy_cq_in', 'opcode'):                         (0x0000, 0x10),
    ('destroy_cq_in', 'uid'):                            (0x0010, 0x10),
    ('destroy_cq_in', 'op_mod'):                         (0x0030, 0x10),
    ('destroy_cq_in', 'cqn'):                            (0x0048, 0x18),
    # destroy_cq_out (0x80 bits)
    ('destroy_cq_out', 'status'):                        (0x0000, 0x8),
    ('destroy_cq_out', 'syndrome'):                      (0x0020, 0x20),
    # query_cq_in (0x80 bits)
    ('query_cq_in', 'opcode'):                           (0x0000, 0x10),
    ('query_cq_in', 'op_mod'):                           (0x0030, 0x10),
    ('query_cq_in', 'cqn'):                              (0x0048, 0x18),
    # query_cq_out (0x880 bits)
    ('query_cq_out', 'status'):                          (0x0000, 0x8),
    ('query_cq_out', 'syndrome'):                        (0x0020, 0x20),
    ('query_cq_out', 'cq_context'):                      (0x0080, 0x200),
    # ads (0x160 bits)
    ('ads', 'fl'):                                       (0x0000, 0x1),
    ('ads', 'free_ar'):                                  (0x0001, 0x1),
    ('ads', 'pkey_index'):                               (0x0010, 0x10),
    ('ads', 'plane_index'):                              (0x0020, 0x8),
    ('ads', 'grh'):                                      (0x0028, 0x1),
    ('ads', 'mlid'):                                     (0x0029, 0x7),
    ('ads', 'rlid'):                                     (0x0030, 0x10),
    ('ads', 'ack_timeout'):                              (0x0040, 0x5),
    ('ads', 'src_addr_index'):                           (0x0048, 0x8),
    ('ads', 'stat_rate'):                                (0x0054, 0x4),
    ('ads', 'hop_limit'):                                (0x0058, 0x8),
    ('ads', 'tclass'):                                   (0x0064, 0x8),
    ('ads', 'flow_label'):                               (0x006c, 0x14),
    ('ads', 'rgid_rip'):                                 (0x0080, 0x80),
    ('ads', 'f_dscp'):                                   (0x0104, 0x1),
    ('ads', 'f_ecn'):                                    (0x0105, 0x1),
    ('ads', 'f_eth_prio'):                               (0x0107, 0x1),
    ('ads', 'ecn'):                                      (0x0108, 0x2),
    ('ads', 'dscp'):                                     (0x010a, 0x6),
    ('ads', 'udp_sport'):                                (0x0110, 0x10),
    ('ads', 'dei_cfi'):                                  (0x0120, 0x1),
    ('ads', 'eth_prio'):                                 (0x0121, 0x3),
    ('ads', 'sl'):                                       (0x0124, 0x4),
    ('ads', 'vhca_port_num'):                            (0x0128, 0x8),
    ('ads', 'rmac_47_32'):                               (0x0130, 0x10),
    ('ads', 'rmac_31_0'):                                (0x0140, 0x20),
    # qpc (0x740 bits)
    ('qpc', 'state'):                                    (0x0000, 0x4),
    ('qpc', 'lag_tx_port_affinity'):                     (0x0004, 0x4),
    ('qpc', 'st'):                                       (0x0008, 0x8),
    ('qpc', 'pm_state'):                                 (0x0013, 0x2),
    ('qpc', 'offload_type'):                             (0x0018, 0x4),
    ('qpc', 'end_padding_mode'):                         (0x001c, 0x2),
    ('qpc', 'wq_signature'):                             (0x0020, 0x1),
    ('qpc', 'block_lb_mc'):                              (0x0021, 0x1),
    ('qpc', 'atomic_like_write_en'):                     (0x0022, 0x1),
    ('qpc', 'latency_sensitive'):                        (0x0023, 0x1),
    ('qpc', 'drain_sigerr'):                             (0x0025, 0x1),
    ('qpc', 'pd'):                                       (0x0028, 0x18),
    ('qpc', 'mtu'):                                      (0x0040, 0x3),
    ('qpc', 'log_msg_max'):                              (0x0043, 0x5),
    ('qpc', 'log_rq_size'):                              (0x0049, 0x4),
    ('qpc', 'log_rq_stride'):                            (0x004d, 0x3),
    ('qpc', 'no_sq'):                                    (0x0050, 0x1),
    ('qpc', 'log_sq_size'):                              (0x0051, 0x4),
    ('qpc', 'retry_mode'):                               (0x0056, 0x2),
    ('qpc', 'ts_format'):                                (0x0058, 0x2),
    ('qpc', 'rlky'):                                     (0x005b, 0x1),
    ('qpc', 'counter_set_id'):                           (0x0060, 0x8),
    ('qpc', 'uar_page'):                                 (0x0068, 0x18),
    ('qpc', 'user_index'):                               (0x0088, 0x18),
    ('qpc', 'log_page_size'):                            (0x00a3, 0x5),
    ('qpc', 'remote_qpn'):                               (0x00a8, 0x18),
    ('qpc', 'primary_address_path'):                     (0x00c0, 0x160),
    ('qpc', 'secondary_address_path'):                   (0x0220, 0x160),
    ('qpc', 'log_ack_req_freq'):                         (0x0380, 0x4),
    ('qpc', 'log_sra_max'):                              (0x0388, 0x3),
    ('qpc', 'retry_count'):                              (0x038d, 0x3),
    ('qpc', 'rnr_retry'):                                (0x0390, 0x3),
    ('qpc', 'fre'):                                      (0x0394, 0x1),
    ('qpc', 'cur_rnr_retry'):                            (0x0395, 0x3),
    ('qpc', 'cur_retry_count'):                          (0x0398, 0x3),
    ('qpc', 'next_send_psn'):                            (0x03c8, 0x18),
    ('qpc', 'cqn_snd'):                                  (0x03e8, 0x18),
    ('qpc', 'deth_sqpn'):                                (0x0408, 0x18),
    ('qpc', 'last_acked_psn'):                           (0x0448, 0x18),
    ('qpc', 'ssn'):                                      (0x0468, 0x18),
    ('qpc', 'log_rra_max'):                              (0x0488, 0x3),
    ('qpc', 'atomic_mode'):                              (0x048c, 0x4),
    ('qpc', 'rre'):                                      (0x0490, 0x1),
    ('qpc', 'rwe'):                                      (0x0491, 0x1),
    ('qpc', 'rae'):                                      (0x0492, 0x1),
    ('qpc', 'page_offset'):                              (0x0494, 0x6),
    ('qpc', 'min_rnr_nak'):                              (0x04a3, 0x5),
    ('qpc', 'next_rcv_psn'):                             (0x04a8, 0x18),
    ('qpc', 'xrcd'):                                     (0x04c8, 0x18),
    ('qpc', 'cqn_rcv'):                                  (0x04e8, 0x18),
    ('qpc', 'dbr_addr'):                                 (0x0500, 0x40),
    ('qpc', 'q_key'):                                    (0x0540, 0x20),
    ('qpc', 'rq_type'):                                  (0x0565, 0x3),
    ('qpc', 'srqn_rmpn_xrqn'):                           (0x0568, 0x18),
    ('qpc', 'rmsn'):                                     (0x0588, 0x18),
    ('qpc', 'hw_sq_wqebb_counter'):                      (0x05a0, 0x10),
    ('qpc', 'sw_sq_wqebb_counter'):                      (0x05b0, 0x10),
    ('qpc', 'hw_rq_counter'):                            (0x05c0, 0x20),
    ('qpc', 'sw_rq_counter'):                            (0x05e0, 0x20),
    ('qpc', 'dbr_umem_valid'):                           (0x0683, 0x1),
    ('qpc', 'dbr_umem_id'):                              (0x0720, 0x20),  # rdma-core; kernel: reserved_at_684
    # create_qp_in (0x880 bits)
    ('create_qp_in', 'opcode'):                          (0x0000, 0x10),
    ('create_qp_in', 'uid'):                             (0x0010, 0x10),
    ('create_qp_in', 'op_mod'):                          (0x0030, 0x10),
    ('create_qp_in', 'qpc_ext'):                         (0x0040, 0x1),
    ('create_qp_in', 'input_qpn'):                       (0x0048, 0x18),
    ('create_qp_in', 'opt_param_mask'):                  (0x0080, 0x20),
    ('create_qp_in', 'ece'):                             (0x00a0, 0x20),
    ('create_qp_in', 'qpc'):                             (0x00c0, 0x740),
    ('create_qp_in', 'wq_umem_offset'):                  (0x0800, 0x40),
    ('create_qp_in', 'wq_umem_id'):                      (0x0840, 0x20),
    ('create_qp_in', 'wq_umem_valid'):                   (0x0860, 0x1),
    # create_qp_out (0x80 bits)
    ('create_qp_out', 'status'):                         (0x0000, 0x8),
    ('create_qp_out', 'syndrome'):                       (0x0020, 0x20),
    ('create_qp_out', 'qpn'):                            (0x0048, 0x18),
    ('create_qp_out', 'ece'):                            (0x0060, 0x20),
    # rst2init_qp_in (0x880 bits)
    ('rst2init_qp_in', 'opcode'):                        (0x0000, 0x10),
    ('rst2init_qp_in', 'uid'):                           (0x0010, 0x10),
    ('rst2init_qp_in', 'op_mod'):                        (0x0030, 0x10),
    ('rst2init_qp_in', 'qpn'):                           (0x0048, 0x18),
    ('rst2init_qp_in', 'opt_param_mask'):                (0x0080, 0x20),
    ('rst2init_qp_in', 'ece'):                           (0x00a0, 0x20),
    ('rst2init_qp_in', 'qpc'):                           (0x00c0, 0x740),
    # rst2init_qp_out (0x80 bits)
    ('rst2init_qp_out', 'status'):                       (0x0000, 0x8),
    ('rst2init_qp_out', 'syndrome'):                     (0x0020, 0x20),
    # init2rtr_qp_in (0x880 bits)
    ('init2rtr_qp_in', 'opcode'):                        (0x0000, 0x10),
    ('init2rtr_qp_in', 'uid'):                           (0x0010, 0x10),
    ('init2rtr_qp_in', 'op_mod'):                        (0x0030, 0x10),
    ('init2rtr_qp_in', 'qpn'):                           (0x0048, 0x18),
    ('init2rtr_qp_in', 'opt_param_mask'):                (0x0080, 0x20),
    ('init2rtr_qp_in', 'ece'):                           (0x00a0, 0x20),
    ('init2rtr_qp_in', 'qpc'):                           (0x00c0, 0x740),
    # init2rtr_qp_out (0x80 bits)
    ('init2rtr_qp_out', 'status'):                       (0x0000, 0x8),
    ('init2rtr_qp_out', 'syndrome'):                     (0x0020, 0x20),
    # rtr2rts_qp_in (0x880 bits)
    ('rtr2rts_qp_in', 'opcode'):                         (0x0000, 0x10),
    ('rtr2rts_qp_in', 'uid'):                            (0x0010, 0x10),
    ('rtr2rts_qp_in', 'op_mod'):                         (0x0030, 0x10),
    ('rtr2rts_qp_in', 'qpn'):                            (0x0048, 0x18),
    ('rtr2rts_qp_in', 'opt_param_mask'):                 (0x0080, 0x20),
    ('rtr2rts_qp_in', 'ece'):                            (0x00a0, 0x20),
    ('rtr2rts_qp_in', 'qpc'):                            (0x00c0, 0x740),
    # rtr2rts_qp_out (0x80 bits)
    ('rtr2rts_qp_out', 'status'):                        (0x0000, 0x8),
    ('rtr2rts_qp_out', 'syndrome'):                      (0x0020, 0x20),
    # qp_2err_in (0x80 bits)
    ('qp_2err_in', 'opcode'):                            (0x0000, 0x10),
    ('qp_2err_in', 'uid'):                               (0x0010, 0x10),
    ('qp_2err_in', 'op_mod'):                            (0x0030, 0x10),
    ('qp_2err_in', 'qpn'):                               (0x0048, 0x18),
    # qp_2err_out (0x80 bits)
    ('qp_2err_out', 'status'):                           (0x0000, 0x8),
    ('qp_2err_out', 'syndrome'):                         (0x0020, 0x20),
    # qp_2rst_in (0x80 bits)
    ('qp_2rst_in', 'opcode'):                            (0x0000, 0x10),
    ('qp_2rst_in', 'uid'):                               (0x0010, 0x10),
    ('qp_2rst_in', 'op_mod'):                            (0x0030, 0x10),
    ('qp_2rst_in', 'qpn'):                               (0x0048, 0x18),
    # qp_2rst_out (0x80 bits)
    ('qp_2rst_out', 'status'):                           (0x0000, 0x8),
    ('qp_2rst_out', 'syndrome'):                         (0x0020, 0x20),
    # destroy_qp_in (0x80 bits)
    ('destroy_qp_in', 'opcode'):                         (0x0000, 0x10),
    ('destroy_qp_in', 'uid'):                            (0x0010, 0x10),
    ('destroy_qp_in', 'op_mod'):                         (0x0030, 0x10),
    ('destroy_qp_in', 'qpn'):                            (0x0048, 0x18),
    # destroy_qp_out (0x80 bits)
    ('destroy_qp_out', 'status'):                        (0x0000, 0x8),
    ('destroy_qp_out', 'syndrome'):                      (0x0020, 0x20),
    # query_qp_in (0x80 bits)
    ('query_qp_in', 'opcode'):                           (0x0000, 0x10),
    ('query_qp_in', 'op_mod'):                           (0x0030, 0x10),
    ('query_qp_in', 'qpc_ext'):                          (0x0040, 0x1),
    ('query_qp_in', 'qpn'):                              (0x0048, 0x18),
    # query_qp_out (0xe80 bits)
    ('query_qp_out', 'status'):                          (0x0000, 0x8),
    ('query_qp_out', 'syndrome'):                        (0x0020, 0x20),
    ('query_qp_out', 'opt_param_mask'):                  (0x0080, 0x20),
    ('query_qp_out', 'ece'):                             (0x00a0, 0x20),
    ('query_qp_out', 'qpc'):                             (0x00c0, 0x740),
    # alloc_pd_in (0x80 bits)
    ('alloc_pd_in', 'opcode'):                           (0x0000, 0x10),
    ('alloc_pd_in', 'uid'):                              (0x0010, 0x10),
    ('alloc_pd_in', 'op_mod'):                           (0x0030, 0x10),
    # alloc_pd_out (0x80 bits)
    ('alloc_pd_out', 'status'):                          (0x0000, 0x8),
    ('alloc_pd_out', 'syndrome'):                        (0x0020, 0x20),
    ('alloc_pd_out', 'pd'):                              (0x0048, 0x18),
    # dealloc_pd_in (0x80 bits)
    ('dealloc_pd_in', 'opcode'):                         (0x0000, 0x10),
    ('dealloc_pd_in', 'uid'):                            (0x0010, 0x10),
    ('dealloc_pd_in', 'op_mod'):                         (0x0030, 0x10),
    ('dealloc_pd_in', 'pd'):                             (0x0048, 0x18),
    # query_hca_cap_in (0x80 bits)
    ('query_hca_cap_in', 'opcode'):                      (0x0000, 0x10),
    ('query_hca_cap_in', 'op_mod'):                      (0x0030, 0x10),
    ('query_hca_cap_in', 'other_function'):              (0x0040, 0x1),
    ('query_hca_cap_in', 'function_id'):                 (0x0050, 0x10),
    # query_hca_cap_out (0x8080 bits)
    ('query_hca_cap_out', 'status'):                     (0x0000, 0x8),
    ('query_hca_cap_out', 'syndrome'):                   (0x0020, 0x20),
    ('query_hca_cap_out', 'capability'):                 (0x0080, 0x8000),
    # hca_cap_union (0x8000 bits)
    ('hca_cap_union', 'cmd_hca_cap'):                    (0x0000, 0x800),
    ('hca_cap_union', 'atomic_caps'):                    (0x0000, 0x800),
    ('hca_cap_union', 'roce_cap'):                       (0x0000, 0x800),
    # cmd_hca_cap (0x800 bits)
    ('cmd_hca_cap', 'vhca_id'):                          (0x0030, 0x10),
    ('cmd_hca_cap', 'log_max_qp_sz'):                    (0x0088, 0x8),
    ('cmd_hca_cap', 'log_max_qp'):                       (0x009b, 0x5),
    ('cmd_hca_cap', 'log_max_cq_sz'):                    (0x00c8, 0x8),
    ('cmd_hca_cap', 'log_max_cq'):                       (0x00db, 0x5),
    ('cmd_hca_cap', 'log_max_eq'):                       (0x00fc, 0x4),
    ('cmd_hca_cap', 'log_max_ra_req_qp'):                (0x014a, 0x6),
    ('cmd_hca_cap', 'log_max_ra_res_qp'):                (0x015a, 0x6),
    ('cmd_hca_cap', 'end_pad'):                          (0x0160, 0x1),
    ('cmd_hca_cap', 'ib_virt'):                          (0x01a2, 0x1),
    ('cmd_hca_cap', 'port_type'):                        (0x01b6, 0x2),
    ('cmd_hca_cap', 'num_ports'):                        (0x01b8, 0x8),
    ('cmd_hca_cap', 'log_max_msg'):                      (0x01c3, 0x5),
    ('cmd_hca_cap', 'cqe_version'):                      (0x01fc, 0x4),
    ('cmd_hca_cap', 'dct'):                              (0x021a, 0x1),
    ('cmd_hca_cap', 'roce'):                             (0x021d, 0x1),
    ('cmd_hca_cap', 'atomic'):                           (0x021e, 0x1),
    ('cmd_hca_cap', 'cq_oi'):                            (0x0220, 0x1),
    ('cmd_hca_cap', 'cq_resize'):                        (0x0221, 0x1),
    ('cmd_hca_cap', 'cq_eq_remap'):                      (0x0226, 0x1),
    ('cmd_hca_cap', 'pg'):                               (0x0227, 0x1),
    ('cmd_hca_cap', 'uar_4k'):                           (0x0240, 0x1),
    ('cmd_hca_cap', 'uar_sz'):                           (0x024a, 0x6),
    ('cmd_hca_cap', 'umem_uid_0'):                       (0x0252, 0x1),
    ('cmd_hca_cap', 'log_pg_sz'):                        (0x0258, 0x8),
    ('cmd_hca_cap', 'bf'):                               (0x0260, 0x1),
    ('cmd_hca_cap', 'log_bf_reg_size'):                  (0x026b, 0x5),
    ('cmd_hca_cap', 'log_max_pd'):                       (0x032b, 0x5),
    ('cmd_hca_cap', 'sq_ts_format'):                     (0x0440, 0x2),
    ('cmd_hca_cap', 'rq_ts_format'):                     (0x0442, 0x2),
    ('cmd_hca_cap', 'log_max_umem'):                     (0x046b, 0x5),
    ('cmd_hca_cap', 'log_uar_page_sz'):                  (0x0490, 0x10),
    ('cmd_hca_cap', 'num_of_uars_per_page'):             (0x0520, 0x20),
    # atomic_caps (0x800 bits)
    ('atomic_caps', 'atomic_req_8B_endianness_mode'):    (0x0040, 0x2),
    ('atomic_caps', 'supported_atomic_req_8B_endianness_mode_1'): (0x0046, 0x1),
    ('atomic_caps', 'atomic_operations'):                (0x0090, 0x10),
    ('atomic_caps', 'atomic_size_qp'):                   (0x00b0, 0x10),
    ('atomic_caps', 'atomic_size_dc'):                   (0x00d0, 0x10),
    # roce_cap (0x800 bits)
    ('roce_cap', 'roce_apm'):                            (0x0000, 0x1),
    ('roce_cap', 'fl_rc_qp_when_roce_disabled'):         (0x0005, 0x1),
    ('roce_cap', 'fl_rc_qp_when_roce_enabled'):          (0x0006, 0x1),
    ('roce_cap', 'qp_ts_format'):                        (0x001e, 0x2),
    ('roce_cap', 'l3_type'):                             (0x008c, 0x4),
    ('roce_cap', 'roce_version'):                        (0x0098, 0x8),
    ('roce_cap', 'r_roce_dest_udp_port'):                (0x00b0, 0x10),
    ('roce_cap', 'r_roce_max_src_udp_port'):             (0x00c0, 0x10),
    ('roce_cap', 'r_roce_min_src_udp_port'):             (0x00d0, 0x10),
    ('roce_cap', 'roce_address_table_size'):             (0x00f0, 0x10),
}

SIZES = {
    'cqc': 0x200,
    'create_cq_in': 0x880,
    'create_cq_out': 0x80,
    'destroy_cq_in': 0x80,
    'destroy_cq_out': 0x80,
    'query_cq_in': 0x80,
    'query_cq_out': 0x880,
    'ads': 0x160,
    'qpc': 0x740,
    'create_qp_in': 0x880,
    'create_qp_out': 0x80,
    'rst2init_qp_in': 0x880,
    'rst2init_qp_out': 0x80,
    'init2rtr_qp_in': 0x880,
    'init2rtr_qp_out': 0x80,
    'rtr2rts_qp_in': 0x880,
    'rtr2rts_qp_out': 0x80,
    'qp_2err_in': 0x80,
    'qp_2err_out': 0x80,
    'qp_2rst_in': 0x80,
    'qp_2rst_out': 0x80,
    'destroy_qp_in': 0x80,
    'destroy_qp_out': 0x80,
    'query_qp_in': 0x80,
    'query_qp_out': 0xe80,
    'alloc_pd_in': 0x80,
    'alloc_pd_out': 0x80,
    'dealloc_pd_in': 0x80,
    'query_hca_cap_in': 0x80,
    'query_hca_cap_out': 0x8080,
    'hca_cap_union': 0x8000,
    'cmd_hca_cap': 0x800,
    'atomic_caps': 0x800,
    'roce_cap': 0x800,
}

# The kernel writes these as unions (``union mlx5_ifc_<name>_bits``): every member starts at bit 0.
UNIONS = frozenset({"hca_cap_union"})

NESTED = {
    ("create_cq_in", "cq_context"): "cqc",
    ("query_cq_out", "cq_context"): "cqc",
    ("qpc", "primary_address_path"): "ads",
    ("qpc", "secondary_address_path"): "ads",
    ("create_qp_in", "qpc"): "qpc",
    ("rst2init_qp_in", "qpc"): "qpc",
    ("init2rtr_qp_in", "qpc"): "qpc",
    ("rtr2rts_qp_in", "qpc"): "qpc",
    ("query_qp_out", "qpc"): "qpc",
    ("query_hca_cap_out", "capability"): "hca_cap_union",
    ("hca_cap_union", "cmd_hca_cap"): "cmd_hca_cap",
    ("hca_cap_union", "atomic_caps"): "atomic_caps",
    ("hca_cap_union", "roce_cap"): "roce_cap",
}

# Byte arrays (``u8 name[n][0x8]``): set_bytes / get_bytes move them whole, in wire order.
BYTE_ARRAYS = frozenset({("ads", "rgid_rip")})

# DevX-only fields: the kernel header leaves them reserved (the kernel driver never passes UMEM);
# layout from rdma-core's tests/mlx5_prm_structs.py. Value: the kernel reserved field they lie in.
RDMA_CORE_ONLY = {
    ("cqc", "dbr_umem_id"): "reserved_at_20",
    ("create_cq_in", "cq_umem_offset"): "reserved_at_280",
    ("create_cq_in", "cq_umem_id"): "reserved_at_280",
    ("qpc", "dbr_umem_id"): "reserved_at_684",
}

# --- constants, named as in the kernel headers (tests/test_prm_oracle.py checks each) -----------
# mlx5_ifc.h: command opcodes.
MLX5_CMD_OP_QUERY_HCA_CAP = 0x100
MLX5_CMD_OP_CREATE_CQ = 0x400
MLX5_CMD_OP_DESTROY_CQ = 0x401
MLX5_CMD_OP_QUERY_CQ = 0x402
MLX5_CMD_OP_CREATE_QP = 0x500
MLX5_CMD_OP_DESTROY_QP = 0x501
MLX5_CMD_OP_RST2INIT_QP = 0x502
MLX5_CMD_OP_INIT2RTR_QP = 0x503
MLX5_CMD_OP_RTR2RTS_QP = 0x504
MLX5_CMD_OP_RTS2RTS_QP = 0x505
MLX5_CMD_OP_2ERR_QP = 0x507
MLX5_CMD_OP_2RST_QP = 0x50a
MLX5_CMD_OP_QUERY_QP = 0x50b
MLX5_CMD_OP_ALLOC_PD = 0x800
MLX5_CMD_OP_DEALLOC_PD = 0x801
# mlx5_ifc.h: QUERY_HCA_CAP capability types (op_mod bits 15:1; hca_cap_op_mod below).
MLX5_SET_HCA_CAP_OP_MOD_GENERAL_DEVICE = 0x0
MLX5_SET_HCA_CAP_OP_MOD_ATOMIC = 0x3
MLX5_SET_HCA_CAP_OP_MOD_ROCE = 0x4
# mlx5_ifc.h: qpc values.
MLX5_QPC_STATE_RST = 0x0
MLX5_QPC_STATE_INIT = 0x1
MLX5_QPC_STATE_RTR = 0x2
MLX5_QPC_STATE_RTS = 0x3
MLX5_QPC_STATE_SQER = 0x4
MLX5_QPC_STATE_ERR = 0x6
MLX5_QPC_STATE_SQD = 0x7
MLX5_QPC_ST_RC = 0x0
MLX5_QPC_PM_STATE_MIGRATED = 0x3
MLX5_QPC_MTU_256_BYTES = 0x1
MLX5_QPC_MTU_512_BYTES = 0x2
MLX5_QPC_MTU_1K_BYTES = 0x3
MLX5_QPC_MTU_2K_BYTES = 0x4
MLX5_QPC_MTU_4K_BYTES = 0x5
MLX5_TIMESTAMP_FORMAT_FREE_RUNNING = 0x0
MLX5_TIMESTAMP_FORMAT_DEFAULT = 0x1
# mlx5_ifc.h: cqc values.
MLX5_CQC_CQE_SZ_64_BYTES = 0x0
MLX5_CQC_CQE_SZ_128_BYTES = 0x1
# device.h
HCA_CAP_OPMOD_GET_MAX = 0
HCA_CAP_OPMOD_GET_CUR = 1
MLX5_CMD_STAT_OK = 0x0
# driver.h: qpc.atomic_mode values (the kernel's MLX5_SET(qpc, ..., atomic_mode, ...)).
MLX5_ATOMIC_MODE_IB_COMP = 1
MLX5_ATOMIC_MODE_CX = 2
MLX5_ATOMIC_MODE_8B = 3
# driver.h: atomic_caps.atomic_operations bits.
MLX5_ATOMIC_OPS_CMP_SWAP = 1 << 0
MLX5_ATOMIC_OPS_FETCH_ADD = 1 << 1
MLX5_ATOMIC_OPS_EXTENDED_CMP_SWAP = 1 << 2
MLX5_ATOMIC_OPS_EXTENDED_FETCH_ADD = 1 << 3
# mlx5_ifc.h: atomic_caps.atomic_size_qp bits.
MLX5_ATOMIC_CAPS_ATOMIC_SIZE_QP_8_BYTES = 0x8
# qp.h: qpc.rq_type (a QP with no receive queue).
MLX5_ZERO_LEN_RQ = 0x3
# atomic_caps.atomic_req_8B_endianness_mode: 0 big-endian (the IB wire order), 1 host endianness.
# Not in the installed headers (the kernel names them in mlx5_core's main.c), so not
# oracle-checked; FACTS.md ("mlx5 facts for the real-NIC path") gives the source.
ATOMIC_REQ_8B_ENDIANNESS_BIG = 0
ATOMIC_REQ_8B_ENDIANNESS_HOST = 1

# Constants tests/test_prm_oracle.py checks, by the header that defines them.
CONSTANT_HEADERS = {
    "mlx5_ifc.h": [n for n in list(globals()) if n.startswith(("MLX5_CMD_OP_", "MLX5_SET_HCA_CAP_",
                                                              "MLX5_QPC_", "MLX5_CQC_",
                                                              "MLX5_TIMESTAMP_FORMAT_",
                                                              "MLX5_ATOMIC_CAPS_"))],
    "device.h": ["HCA_CAP_OPMOD_GET_MAX", "HCA_CAP_OPMOD_GET_CUR", "MLX5_CMD_STAT_OK"],
    "driver.h": ["MLX5_ATOMIC_MODE_IB_COMP", "MLX5_ATOMIC_MODE_CX", "MLX5_ATOMIC_MODE_8B",
                 "MLX5_ATOMIC_OPS_CMP_SWAP", "MLX5_ATOMIC_OPS_FETCH_ADD",
                 "MLX5_ATOMIC_OPS_EXTENDED_CMP_SWAP", "MLX5_ATOMIC_OPS_EXTENDED_FETCH_ADD"],
    "qp.h": ["MLX5_ZERO_LEN_RQ"],
}


# --- access ------------------------------------------------------------------------------------
def _split(path):
    if isinstance(path, str):
        return path.split(".")
    return list(path)


def offset(struct, path):
    """(bit_offset, bit_width, struct_of_field) of ``path`` (a field name, a dotted path through
    NESTED fields, or a sequence of names) inside ``struct``. struct_of_field is the NESTED struct
    the last name holds, or None for a plain field. Unknown names raise ConfigError."""
    names = _split(path)
    if struct not in SIZES:
        raise ConfigError("unknown PRM struct %r (known: %s)" % (struct, ", ".join(sorted(SIZES))))
    if not names or any(not n for n in names):
        raise ConfigError("empty PRM field path %r in %s" % (path, struct))
    base = 0
    cur = struct
    for i, name in enumerate(names):
        key = (cur, name)
        if key not in FIELDS:
            raise ConfigError("unknown PRM field %r in struct %s (path %r)" % (name, cur, path))
        off, width = FIELDS[key]
        inner = NESTED.get(key)
        if i < len(names) - 1:
            if inner is None:
                raise ConfigError("PRM field %s.%s is not a nested struct (path %r)"
                                  % (cur, name, path))
            base += off
            cur = inner
        else:
            return base + off, width, inner
    raise AssertionError("unreachable")


def alloc(struct):
    """A zeroed command buffer for ``struct``: bytearray of SIZES[struct] / 8 bytes."""
    if struct not in SIZES:
        raise ConfigError("unknown PRM struct %r" % (struct,))
    return bytearray(SIZES[struct] // 8)


def _span(buf, bit_off, width):
    """(first byte, end byte, shift) of the bits [bit_off, bit_off + width) in ``buf``."""
    first = bit_off // 8
    end = (bit_off + width + 7) // 8
    if bit_off < 0 or end > len(buf):
        raise ConfigError("PRM field bits [%d, %d) lie outside the %d-byte buffer"
                          % (bit_off, bit_off + width, len(buf)))
    return first, end, end * 8 - (bit_off + width)


def set(buf, struct, field, value, base_bits=0):  # noqa: A001 - the DEVX_SET verb
    """Write ``value`` (an int in 0 .. 2**width - 1) into ``field`` of the ``struct`` that starts at
    bit ``base_bits`` of ``buf`` (big-endian bit order, as DEVX_SET); other bits are untouched."""
    off, width, inner = offset(struct, field)
    if inner is not None:
        raise ConfigError("PRM field %s.%s is a nested %s: set its fields (or use fill)"
                          % (struct, field, inner))
    if isinstance(value, bool):
        value = int(value)
    if not isinstance(value, int) or not 0 <= value < (1 << width):
        raise ConfigError("PRM field %s.%s is %d bits wide: %r does not fit"
                          % (struct, field, width, value))
    first, end, shift = _span(buf, base_bits + off, width)
    word = int.from_bytes(bytes(buf[first:end]), "big")
    mask = ((1 << width) - 1) << shift
    word = (word & ~mask) | (value << shift)
    buf[first:end] = word.to_bytes(end - first, "big")


def get(buf, struct, field, base_bits=0):
    """The unsigned value of ``field`` of the ``struct`` at bit ``base_bits`` of ``buf``."""
    off, width, inner = offset(struct, field)
    if inner is not None:
        raise ConfigError("PRM field %s.%s is a nested %s: get its fields"
                          % (struct, field, inner))
    first, end, shift = _span(buf, base_bits + off, width)
    return (int.from_bytes(bytes(buf[first:end]), "big") >> shift) & ((1 << width) - 1)


def _byte_field(struct, field, base_bits):
    off, width, inner = offset(struct, field)
    if inner is not None or (base_bits + off) % 8 or width % 8:
        raise ConfigError("PRM field %s.%s is not a byte array" % (struct, field))
    return (base_bits + off) // 8, width // 8


def set_bytes(buf, struct, field, data, base_bits=0):
    """Copy ``data`` (exactly the field's byte length, wire order) into a byte-aligned field, e.g.
    ``ads.rgid_rip`` (the 16-byte GID as ibv_gid.raw holds it)."""
    start, n = _byte_field(struct, field, base_bits)
    data = bytes(data)
    if len(data) != n:
        raise ConfigError("PRM field %s.%s holds %d bytes, got %d" % (struct, field, n, len(data)))
    if start + n > len(buf):
        raise ConfigError("PRM field %s.%s lies outside the %d-byte buffer"
                          % (struct, field, len(buf)))
    buf[start:start + n] = data


def get_bytes(buf, struct, field, base_bits=0):
    """The bytes of a byte-aligned field, in wire order."""
    start, n = _byte_field(struct, field, base_bits)
    if start + n > len(buf):
        raise ConfigError("PRM field %s.%s lies outside the %d-byte buffer"
                          % (struct, field, len(buf)))
    return bytes(buf[start:start + n])


def fill(buf, struct, values, base_bits=0):
    """Set every ``{field: value}`` of ``values`` in the ``struct`` at bit ``base_bits``: a dict
    fills a NESTED struct, bytes / bytearray a byte array, an int a plain field."""
    for name, value in values.items():
        off, width, inner = offset(struct, name)
        if inner is not None:
            if not isinstance(value, dict):
                raise ConfigError("PRM field %s.%s is a nested %s: give a dict of its fields"
                                  % (struct, name, inner))
            fill(buf, inner, value, base_bits + off)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            set_bytes(buf, struct, name, value, base_bits)
        else:
            set(buf, struct, name, value, base_bits)
    return buf


# --- command builders --------------------------------------------------------------------------
def _command(struct, opcode, uid=0, op_mod=0):
    buf = alloc(struct)
    set(buf, struct, "opcode", opcode)
    if (struct, "uid") in FIELDS:
        set(buf, struct, "uid", uid)
    elif uid:
        raise ConfigError("PRM command %s has no uid field" % struct)
    set(buf, struct, "op_mod", op_mod)
    return buf


def cmd_create_cq(*, log_cq_size, uar_page, c_eqn, cq_umem_id, dbr_umem_id, cq_umem_offset=0,
                  dbr_addr=0, collapsed=False, oi=False, cqe_sz=MLX5_CQC_CQE_SZ_64_BYTES,
                  log_page_size=0, uid=0, **cqc):
    """CREATE_CQ on a CQE ring and doorbell record in UMEM that gpunet allocated.

    log_cq_size: log2 of the CQE count; uar_page: the UAR page index (Mlx5UAR.page_id); c_eqn: the
    completion EQ (mlx5dv_devx_query_eqn); cq_umem_id / cq_umem_offset: the ring's UMEM and byte
    offset in it; dbr_umem_id / dbr_addr: the doorbell record's UMEM and byte offset in it;
    collapsed: ``cqc.cc`` (every CQE lands in entry 0); oi: overrun ignore; log_page_size: log2 of
    the UMEM page size minus 12 (0: 4 KiB pages); uid: the DevX context's uid. Further ``cqc``
    fields by name in ``cqc``. Returns the create_cq_in bytearray."""
    buf = _command("create_cq_in", MLX5_CMD_OP_CREATE_CQ, uid)
    ctx = dict(log_cq_size=log_cq_size, uar_page=uar_page, c_eqn_or_apu_element=c_eqn,
               cc=int(bool(collapsed)), oi=int(bool(oi)), cqe_sz=cqe_sz,
               log_page_size=log_page_size, dbr_umem_valid=1, dbr_umem_id=dbr_umem_id,
               dbr_addr=dbr_addr)
    ctx.update(cqc)
    fill(buf, "create_cq_in", {"cq_context": ctx, "cq_umem_valid": 1,
                               "cq_umem_id": cq_umem_id, "cq_umem_offset": cq_umem_offset})
    return buf


def cmd_create_qp(*, pd, uar_page, cqn_snd, cqn_rcv, log_sq_size, wq_umem_id, dbr_umem_id,
                  wq_umem_offset=0, dbr_addr=0, user_index=0, log_page_size=0, uid=0, **qpc):
    """CREATE_QP: an RC QP (migrated path state) whose send queue is gpunet's ring in UMEM and
    which has no receive queue (``rq_type`` MLX5_ZERO_LEN_RQ).

    pd: the protection domain number; uar_page: the UAR page index; cqn_snd / cqn_rcv: the CQs;
    log_sq_size: log2 of the SQ's WQEBB count; wq_umem_id / wq_umem_offset: the ring's UMEM and
    byte offset; dbr_umem_id / dbr_addr: the doorbell record's UMEM and byte offset;
    log_page_size: log2 of the UMEM page size minus 12. Further ``qpc`` fields by name in ``qpc``
    (a dict for ``primary_address_path``). Returns the create_qp_in bytearray."""
    buf = _command("create_qp_in", MLX5_CMD_OP_CREATE_QP, uid)
    ctx = dict(st=MLX5_QPC_ST_RC, pm_state=MLX5_QPC_PM_STATE_MIGRATED, pd=pd, uar_page=uar_page,
               cqn_snd=cqn_snd, cqn_rcv=cqn_rcv, log_sq_size=log_sq_size, no_sq=0,
               rq_type=MLX5_ZERO_LEN_RQ, user_index=user_index, log_page_size=log_page_size,
               dbr_umem_valid=1, dbr_umem_id=dbr_umem_id, dbr_addr=dbr_addr)
    ctx.update(qpc)
    fill(buf, "create_qp_in", {"qpc": ctx, "wq_umem_valid": 1, "wq_umem_id": wq_umem_id,
                               "wq_umem_offset": wq_umem_offset})
    return buf


# The QP state moves: opcode -> its input struct. 2ERR and 2RST carry no qpc.
MODIFY_QP = {
    MLX5_CMD_OP_RST2INIT_QP: "rst2init_qp_in",
    MLX5_CMD_OP_INIT2RTR_QP: "init2rtr_qp_in",
    MLX5_CMD_OP_RTR2RTS_QP: "rtr2rts_qp_in",
    MLX5_CMD_OP_2ERR_QP: "qp_2err_in",
    MLX5_CMD_OP_2RST_QP: "qp_2rst_in",
}
_MODIFY_NAMES = {"RST2INIT": MLX5_CMD_OP_RST2INIT_QP, "INIT2RTR": MLX5_CMD_OP_INIT2RTR_QP,
                 "RTR2RTS": MLX5_CMD_OP_RTR2RTS_QP, "2ERR": MLX5_CMD_OP_2ERR_QP,
                 "2RST": MLX5_CMD_OP_2RST_QP}


def cmd_modify_qp(op, qpn, opt_param_mask=0, uid=0, **qpc):
    """A QP state move. op: an opcode of MODIFY_QP or its name ("RST2INIT", "INIT2RTR",
    "RTR2RTS", "2ERR", "2RST"); qpn: the QP; ``qpc`` fields by name (a dict for
    ``primary_address_path``), allowed only for the three moves that carry a qpc. Returns the
    <op>_in bytearray."""
    opcode = _MODIFY_NAMES.get(op, op) if isinstance(op, str) else op
    if opcode not in MODIFY_QP:
        raise ConfigError("not a QP state move: %r (known: %s)" % (op, ", ".join(_MODIFY_NAMES)))
    struct = MODIFY_QP[opcode]
    buf = _command(struct, opcode, uid)
    set(buf, struct, "qpn", qpn)
    if qpc or opt_param_mask:
        if (struct, "qpc") not in FIELDS:
            raise ConfigError("%s carries no qpc: got %s" % (struct, sorted(qpc) or
                                                             "opt_param_mask"))
        set(buf, struct, "opt_param_mask", opt_param_mask)
        fill(buf, struct, {"qpc": qpc})
    return buf


def hca_cap_op_mod(cap_type, current=True):
    """QUERY_HCA_CAP's op_mod: the capability type (MLX5_SET_HCA_CAP_OP_MOD_*) in bits 15:1 and
    bit 0 = HCA_CAP_OPMOD_GET_CUR (current values) or GET_MAX (the device's maxima)."""
    return (cap_type << 1) | (HCA_CAP_OPMOD_GET_CUR if current else HCA_CAP_OPMOD_GET_MAX)


def cmd_query_hca_cap(op_mod):
    """QUERY_HCA_CAP with ``op_mod`` (hca_cap_op_mod(...)); the answer is query_hca_cap_out, its
    ``capability`` a hca_cap_union (``capability.cmd_hca_cap.log_max_qp_sz``, ...)."""
    return _command("query_hca_cap_in", MLX5_CMD_OP_QUERY_HCA_CAP, op_mod=op_mod)


def cmd_query_qp(qpn):
    """QUERY_QP; the answer's ``qpc.state`` is MLX5_QPC_STATE_*."""
    buf = _command("query_qp_in", MLX5_CMD_OP_QUERY_QP)
    set(buf, "query_qp_in", "qpn", qpn)
    return buf


def cmd_query_cq(cqn):
    """QUERY_CQ; the answer holds the cq_context (``cq_context.status``, counters)."""
    buf = _command("query_cq_in", MLX5_CMD_OP_QUERY_CQ)
    set(buf, "query_cq_in", "cqn", cqn)
    return buf


def cmd_destroy_qp(qpn, uid=0):
    buf = _command("destroy_qp_in", MLX5_CMD_OP_DESTROY_QP, uid)
    set(buf, "destroy_qp_in", "qpn", qpn)
    return buf


def cmd_destroy_cq(cqn, uid=0):
    buf = _command("destroy_cq_in", MLX5_CMD_OP_DESTROY_CQ, uid)
    set(buf, "destroy_cq_in", "cqn", cqn)
    return buf


def cmd_alloc_pd(uid=0):
    return _command("alloc_pd_in", MLX5_CMD_OP_ALLOC_PD, uid)


def cmd_dealloc_pd(pd, uid=0):
    buf = _command("dealloc_pd_in", MLX5_CMD_OP_DEALLOC_PD, uid)
    set(buf, "dealloc_pd_in", "pd", pd)
    return buf


# opcode -> its output struct (the outlen a DevX call must pass: out_size).
OUT_STRUCT = {
    MLX5_CMD_OP_QUERY_HCA_CAP: "query_hca_cap_out",
    MLX5_CMD_OP_CREATE_CQ: "create_cq_out",
    MLX5_CMD_OP_DESTROY_CQ: "destroy_cq_out",
    MLX5_CMD_OP_QUERY_CQ: "query_cq_out",
    MLX5_CMD_OP_CREATE_QP: "create_qp_out",
    MLX5_CMD_OP_DESTROY_QP: "destroy_qp_out",
    MLX5_CMD_OP_RST2INIT_QP: "rst2init_qp_out",
    MLX5_CMD_OP_INIT2RTR_QP: "init2rtr_qp_out",
    MLX5_CMD_OP_RTR2RTS_QP: "rtr2rts_qp_out",
    MLX5_CMD_OP_2ERR_QP: "qp_2err_out",
    MLX5_CMD_OP_2RST_QP: "qp_2rst_out",
    MLX5_CMD_OP_QUERY_QP: "query_qp_out",
    MLX5_CMD_OP_ALLOC_PD: "alloc_pd_out",
}


def out_size(opcode):
    """Bytes of the output of command ``opcode``."""
    if opcode not in OUT_STRUCT:
        raise ConfigError("no output layout for command opcode %#x" % (opcode,))
    return SIZES[OUT_STRUCT[opcode]] // 8


def cmd_status(out):
    """(status, syndrome) of any command output: every *_out starts with status (8 bits) and
    syndrome (32 bits at bit 0x20); status MLX5_CMD_STAT_OK (0) means success."""
    return get(out, "create_cq_out", "status"), get(out, "create_cq_out", "syndrome")

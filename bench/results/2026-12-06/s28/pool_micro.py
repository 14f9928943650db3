# Host time of the HT dispatch's receive-tensor allocation (Buffer._ht_recv_tensors), with the GPU
# kept busy (a sleep kernel first: an allocation that synchronises the device shows as ~its length)
import statistics, time, torch
from gpunet.ep import Buffer, Config
cfg = Config(64, 48, 128)
rows, H, K = 8192, 7168, 8
for pool_mib in (0, 483, 2048):
    b = Buffer(None, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(H * 2, 1), explicitly_destroy=True,
               timeout_s=10.0, transport="ibgda", recv_pool_bytes=pool_mib << 20)
    held, ts = [], {"bf16": [], "fp8": [], "worst": []}
    for it in range(40):
        for op, fp8, r in (("bf16", False, rows), ("fp8", True, rows), ("worst", False, rows + 100)):
            torch.cuda._sleep(2_000_000)
            t0 = time.perf_counter()
            got = b._ht_recv_tensors(fp8, r, H, K)
            ts[op].append((time.perf_counter() - t0) * 1e6)
            held.append(got)
            held = held[-4:]          # the bench keeps a few calls' outputs alive
    torch.cuda.synchronize()
    for op, v in ts.items():
        v = v[5:]
        print("pool %4d MiB %-6s alloc median %8.1f us max %8.1f  in pool: %s" % (
            pool_mib, op, statistics.median(v), max(v), bool(held[-1][-1])))
    del held, got
    b.destroy()

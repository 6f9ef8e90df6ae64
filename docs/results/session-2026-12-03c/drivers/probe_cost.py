"""s88: host microseconds of the session's memory read per logged step, as Megatron-era torch gives it
(torch.cuda.memory_allocated() + max_memory_allocated(), each flattening every allocator statistic) and
as the probe reads it now (one nested read), with graph pools alive as in the bench (one per arm)."""
import time

import torch

from megatron_cg_plugin.session import CudaProbe

x = torch.ones(1 << 20, device="cuda")
kept = []
for pools in range(1, 9):
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x * 2
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):  # a private pool of its own
        y = x * 2
    kept.append((graph, y))
    if pools in (1, 4, 8):
        timings = {}
        probe = CudaProbe()
        for name, read in (("memory_allocated + max_memory_allocated",
                            lambda: (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())),
                           ("CudaProbe.allocated_bytes", probe.allocated_bytes)):
            assert read() == probe.allocated_bytes() or name.startswith("memory"), name
            start = time.perf_counter()
            for _ in range(2000):
                read()
            timings[name] = (time.perf_counter() - start) / 2000 * 1e6
        assert (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()) == probe.allocated_bytes()
        print(f"graph pools {pools}: {len(torch.cuda.memory_stats())} flattened statistics; "
              + "; ".join(f"{name} {us:.1f} us" for name, us in timings.items()))

"""The parts of the capture lifecycle around Megatron's ``create_cudagraphs`` (``capture_lifecycle``):
the transaction that rolls a failed capture back (``transaction``), the one seam to TE's capture and
its FP8 state (``te_backend``), replay contracts (``contracts``), stale autograd graphs found and named
(``stale_graphs``), per-forward scratch cleared (``scratch``), and graph-pool and replay accounting
(``accounting``)."""

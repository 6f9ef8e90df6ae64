"""Fixed-capacity MoE: the capacity plan from the flags (``capacity``) and the routers' dropped-token
counters of ``--cg-moe-drop-stats`` (``drop_stats``)."""

"""Capture machinery: the transaction, the one seam to TE (``backend``), slot-shared capture
(``slot_shared``, in Megatron's lifecycle through ``slot_backend``), graph banks (``graph_banks``),
replay contracts, branch checks, stale-graph hygiene, scratch clearing and offload-group names."""

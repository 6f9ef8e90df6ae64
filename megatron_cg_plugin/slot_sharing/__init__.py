"""Slot-shared graph memory (``--cg-slot-capture``): mutually exclusive variants captured into one pool
(``capture``) by the slot plan (``plan``), inside Megatron's lifecycle (``megatron_backend``); each
slot's saved-tensor arenas (``saved_tensors``), shared parameter-gradient buffers (``param_grads``),
branch checks (``branches``), the slot debug guard (``guard``) and a strided tensor's span (``layout``)."""

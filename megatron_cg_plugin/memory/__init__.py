"""Graph memory outside the pool, for slot-shared capture and graph banks: per-slot arenas for what
a forward saves for its backward (``saved_tensors``), parameter-gradient buffers shared by layers
(``param_grads``), activation offload to pinned host arenas inside the graphs (``offload``) or
between replays through a staging ring (``staging``); with a strided tensor's span (``layout``),
an autograd-graph walk (``autograd_graph``) and the slot debug guard (``guard``)."""

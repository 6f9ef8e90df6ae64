"""The planner behind ``megatron-cg plan`` and the run's memory prediction: the capture plan from the
flags (``capture_plan``) and the graph pool replayed through a caching-allocator model
(``graph_memory``, ``allocator``, ``reduction``). Pure Python, no CUDA."""

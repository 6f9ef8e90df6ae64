"""Which CUDA-graph setups a model can train with: each built from the run's settings, checked by the rules and
predicted by the planner (``graph_setups``), and the memory guard before capture that names those that fit
(``memory_guard``). Above ``planner`` and ``rules``, which it reads."""

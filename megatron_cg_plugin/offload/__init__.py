"""Activation offload inside graphs: which saves go to pinned host arenas (``plan``), the arenas and
their copies (``host_arenas``), the staging ring for copies between replays (``staging``) and
Megatron's fine-grained offload groups as names during capture (``groups``)."""

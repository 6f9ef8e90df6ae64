"""The support matrix (``megatron-cg matrix``): an all-pairs design of cells (``covering``), each run
eager against graphed (``runner``) and benched against Megatron's own graphs (``bench``)."""

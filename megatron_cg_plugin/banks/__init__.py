"""Graph banks for hybrid context parallelism (``--cg-graph-banks``): one bank of graphs per CP size for
every layer (``capture``), the sizes that get one (``sizes``), the router that picks a microbatch's bank
at replay (``router``), Megatron's layers adapted to dynamic CP (``dynamic_cp``), what a pack hands them
(``cp_packs``) and the public hybrid-CP batch function (``hybrid_cp_batch``)."""
